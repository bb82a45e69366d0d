/* A stand-in CUDA driver (libcuda.so.1) for tests on hosts without a GPU.
 *
 * It implements the driver calls Weft makes, with host memory behind its
 * "device" pointers: an allocation table answers cuPointerGetAttribute, so
 * a pointer from cuMemAlloc is device memory of the current context's
 * device and anything else is unknown to the driver (host memory).
 *
 * Behaviour is steered by the environment, read at each call:
 *   FAKE_CUDA_INIT_FAIL=1       cuInit fails (CUDA_ERROR_NO_DEVICE, 100)
 *   FAKE_CUDA_DEVICES=N         devices listed (default 1)
 *   FAKE_CUDA_ALLOC_LIMIT=N     the N+1th cuMemAlloc fails (out of memory)
 *   FAKE_CUDA_NO_DMABUF=1       devices say they cannot export DMA-BUFs
 * and by calls a test makes through dlsym:
 *   fake_cuda_set_ordinal(ptr, dev)   pretend an allocation is on device dev
 *   fake_cuda_flushes()               cuFlushGPUDirectRDMAWrites calls so far
 *   fake_cuda_live()                  allocations not yet freed
 *   fake_cuda_dmabufs()               DMA-BUF fds handed out so far
 * A "DMA-BUF" is a memfd (the kernel here has no exporter of real ones): an
 * fd to pass on, which a libfabric without a real NIC never reads.
 * Built twice: as is, and with -DFAKE_CUDA_NO_ALLOC (no cuMemAlloc_v2) to
 * stand for a driver that lacks a symbol.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef void *CUcontext;

enum {
	SUCCESS = 0,
	INVALID_VALUE = 1,
	OUT_OF_MEMORY = 2,
	NOT_INITIALIZED = 3,
	NO_DEVICE = 100,
	INVALID_DEVICE = 101,
	INVALID_CONTEXT = 201,
};

#define MAX_ALLOCS 4096

static struct {
	unsigned long long start, len;
	int dev;
} allocs[MAX_ALLOCS];
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static int initialized, nallocs, flushes, live, dmabufs;
static CUdevice contexts[16];
static __thread int ctx_depth;
static __thread CUdevice ctx_stack[16];

static int env_int(const char *name, int dflt)
{
	const char *v = getenv(name);
	return v && *v ? atoi(v) : dflt;
}

static int ndevices(void)
{
	return env_int("FAKE_CUDA_DEVICES", 1);
}

CUresult cuInit(unsigned int flags)
{
	(void)flags;
	if (env_int("FAKE_CUDA_INIT_FAIL", 0))
		return NO_DEVICE;
	initialized = 1;
	return SUCCESS;
}

CUresult cuDeviceGetCount(int *count)
{
	if (!initialized)
		return NOT_INITIALIZED;
	*count = ndevices();
	return SUCCESS;
}

CUresult cuDeviceGet(CUdevice *d, int ordinal)
{
	if (ordinal < 0 || ordinal >= ndevices())
		return INVALID_DEVICE;
	*d = ordinal;
	return SUCCESS;
}

CUresult cuGetErrorName(CUresult r, const char **s)
{
	switch (r) {
	case SUCCESS: *s = "CUDA_SUCCESS"; break;
	case INVALID_VALUE: *s = "CUDA_ERROR_INVALID_VALUE"; break;
	case OUT_OF_MEMORY: *s = "CUDA_ERROR_OUT_OF_MEMORY"; break;
	case NOT_INITIALIZED: *s = "CUDA_ERROR_NOT_INITIALIZED"; break;
	case NO_DEVICE: *s = "CUDA_ERROR_NO_DEVICE"; break;
	case INVALID_DEVICE: *s = "CUDA_ERROR_INVALID_DEVICE"; break;
	case INVALID_CONTEXT: *s = "CUDA_ERROR_INVALID_CONTEXT"; break;
	default: *s = 0; return INVALID_VALUE;
	}
	return SUCCESS;
}

CUresult cuDevicePrimaryCtxRetain(CUcontext *ctx, CUdevice d)
{
	if (d < 0 || d >= ndevices() || d >= 16)
		return INVALID_DEVICE;
	contexts[d] = d;
	*ctx = &contexts[d];
	return SUCCESS;
}

CUresult cuCtxPushCurrent_v2(CUcontext ctx)
{
	if (!ctx || ctx_depth == 16)
		return INVALID_CONTEXT;
	ctx_stack[ctx_depth++] = *(CUdevice *)ctx;
	return SUCCESS;
}

CUresult cuCtxPopCurrent_v2(CUcontext *ctx)
{
	if (ctx_depth == 0)
		return INVALID_CONTEXT;
	ctx_depth--;
	if (ctx)
		*ctx = &contexts[ctx_stack[ctx_depth]];
	return SUCCESS;
}

CUresult cuThreadExchangeStreamCaptureMode(int *mode)
{
	static __thread int current;
	int old = current;
	current = *mode;
	*mode = old;
	return SUCCESS;
}

#ifndef FAKE_CUDA_NO_ALLOC
CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t bytes)
{
	void *mem;
	int i, limit = env_int("FAKE_CUDA_ALLOC_LIMIT", -1);
	if (ctx_depth == 0)
		return INVALID_CONTEXT;
	pthread_mutex_lock(&lock);
	if ((limit >= 0 && nallocs >= limit) || posix_memalign(&mem, 4096, bytes ? bytes : 1)) {
		pthread_mutex_unlock(&lock);
		return OUT_OF_MEMORY;
	}
	nallocs++;
	for (i = 0; i < MAX_ALLOCS && allocs[i].len; i++)
		;
	if (i == MAX_ALLOCS) {
		pthread_mutex_unlock(&lock);
		free(mem);
		return OUT_OF_MEMORY;
	}
	allocs[i].start = (unsigned long long)mem;
	allocs[i].len = bytes ? bytes : 1;
	allocs[i].dev = ctx_stack[ctx_depth - 1];
	live++;
	pthread_mutex_unlock(&lock);
	*p = (CUdeviceptr)mem;
	return SUCCESS;
}
#endif

CUresult cuMemFree_v2(CUdeviceptr p)
{
	int i;
	pthread_mutex_lock(&lock);
	for (i = 0; i < MAX_ALLOCS; i++) {
		if (allocs[i].len && allocs[i].start == p) {
			allocs[i].len = 0;
			live--;
			pthread_mutex_unlock(&lock);
			free((void *)p);
			return SUCCESS;
		}
	}
	pthread_mutex_unlock(&lock);
	return INVALID_VALUE;
}

/* CU_POINTER_ATTRIBUTE_MEMORY_TYPE = 2, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL = 9 */
CUresult cuPointerGetAttribute(void *data, int attribute, CUdeviceptr p)
{
	int i;
	pthread_mutex_lock(&lock);
	for (i = 0; i < MAX_ALLOCS; i++) {
		if (allocs[i].len && p >= allocs[i].start && p < allocs[i].start + allocs[i].len) {
			if (attribute == 2)
				*(unsigned int *)data = 2; /* CU_MEMORYTYPE_DEVICE */
			else if (attribute == 9)
				*(int *)data = allocs[i].dev;
			else {
				pthread_mutex_unlock(&lock);
				return INVALID_VALUE;
			}
			pthread_mutex_unlock(&lock);
			return SUCCESS;
		}
	}
	pthread_mutex_unlock(&lock);
	return INVALID_VALUE; /* not driver memory: what the real driver says of malloc'd memory */
}

CUresult cuFlushGPUDirectRDMAWrites(int target, int scope)
{
	(void)target;
	(void)scope;
	if (ctx_depth == 0)
		return INVALID_CONTEXT;
	__atomic_add_fetch(&flushes, 1, __ATOMIC_SEQ_CST);
	return SUCCESS;
}

/* Device memory is host memory here: copies are memcpy, counted. */
static int copies;
CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void *src, size_t bytes)
{
	if (ctx_depth == 0)
		return INVALID_CONTEXT;
	memcpy((void *)dst, src, bytes);
	__atomic_add_fetch(&copies, 1, __ATOMIC_SEQ_CST);
	return SUCCESS;
}

CUresult cuMemcpyDtoH_v2(void *dst, CUdeviceptr src, size_t bytes)
{
	if (ctx_depth == 0)
		return INVALID_CONTEXT;
	memcpy(dst, (const void *)src, bytes);
	__atomic_add_fetch(&copies, 1, __ATOMIC_SEQ_CST);
	return SUCCESS;
}

int fake_cuda_copies(void)
{
	return __atomic_load_n(&copies, __ATOMIC_SEQ_CST);
}

/* CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED = 124; nothing else is asked. */
CUresult cuDeviceGetAttribute(int *value, int attribute, CUdevice d)
{
	if (!initialized)
		return NOT_INITIALIZED;
	if (d < 0 || d >= ndevices())
		return INVALID_DEVICE;
	if (attribute != 124)
		return INVALID_VALUE;
	*value = !env_int("FAKE_CUDA_NO_DMABUF", 0);
	return SUCCESS;
}

/* CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD = 1: an fd for a range inside one allocation. */
CUresult cuMemGetHandleForAddressRange(void *handle, CUdeviceptr p, size_t size, int type,
				       unsigned long long flags)
{
	int i, fd;
	if (type != 1 || flags != 0 || env_int("FAKE_CUDA_NO_DMABUF", 0))
		return INVALID_VALUE;
	pthread_mutex_lock(&lock);
	for (i = 0; i < MAX_ALLOCS; i++)
		if (allocs[i].len && p >= allocs[i].start && p + size <= allocs[i].start + allocs[i].len)
			break;
	pthread_mutex_unlock(&lock);
	if (i == MAX_ALLOCS)
		return INVALID_VALUE;
	fd = memfd_create("fake-cuda-dmabuf", MFD_CLOEXEC);
	if (fd < 0)
		return OUT_OF_MEMORY;
	__atomic_add_fetch(&dmabufs, 1, __ATOMIC_SEQ_CST);
	*(int *)handle = fd;
	return SUCCESS;
}

int fake_cuda_dmabufs(void)
{
	return __atomic_load_n(&dmabufs, __ATOMIC_SEQ_CST);
}

int fake_cuda_set_ordinal(void *p, int dev)
{
	int i;
	pthread_mutex_lock(&lock);
	for (i = 0; i < MAX_ALLOCS; i++) {
		if (allocs[i].len && allocs[i].start == (unsigned long long)p) {
			allocs[i].dev = dev;
			pthread_mutex_unlock(&lock);
			return 0;
		}
	}
	pthread_mutex_unlock(&lock);
	return -1;
}

int fake_cuda_flushes(void)
{
	return __atomic_load_n(&flushes, __ATOMIC_SEQ_CST);
}

int fake_cuda_live(void)
{
	return live;
}
