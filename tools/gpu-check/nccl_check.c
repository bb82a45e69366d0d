/* One rank of Weft's real-NCCL GPU check (tools/gpu-check/run.sh).
 *
 *   nccl_check RANK NRANKS ID_FILE
 *
 * Rank 0 writes ncclGetUniqueId to ID_FILE; the others read it. Every rank
 * uses GPU 0 (the check runs two ranks on one GPU; run.sh gives each its
 * own NCCL_HOSTID and disables P2P and SHM, so NCCL must use the net
 * plugin). For each size from 4 B to 256 MiB it runs all-reduce (fp32 sum),
 * all-gather and a send/recv exchange with the peer, checks every element
 * against the value it must have, and prints one line per size and
 * collective: bytes, median time of 5, bus bandwidth (NCCL's convention)
 * and PASS/FAIL. Exit status 1 if anything failed.
 *
 * Built by tools/gpu-check/stage.sh against nccl.h from the NCCL wheel and
 * the CUDA runtime from its wheel; our own code.
 */
#include <cuda_runtime.h>
#include <nccl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/time.h>
#include <unistd.h>

#define CK(cmd)                                                                    \
	do {                                                                       \
		cudaError_t e_ = (cmd);                                            \
		if (e_ != cudaSuccess) {                                           \
			fprintf(stderr, "rank %d: %s: %s\n", rank, #cmd,           \
				cudaGetErrorString(e_));                           \
			exit(2);                                                   \
		}                                                                  \
	} while (0)
#define NK(cmd)                                                                    \
	do {                                                                       \
		ncclResult_t r_ = (cmd);                                           \
		if (r_ != ncclSuccess) {                                           \
			fprintf(stderr, "rank %d: %s: %s\n", rank, #cmd,           \
				ncclGetErrorString(r_));                           \
			exit(2);                                                   \
		}                                                                  \
	} while (0)

static int rank;

static double now(void)
{
	struct timeval tv;
	gettimeofday(&tv, NULL);
	return tv.tv_sec + tv.tv_usec * 1e-6;
}

static int cmp(const void *a, const void *b)
{
	double x = *(const double *)a, y = *(const double *)b;
	return x < y ? -1 : x > y;
}

/* Element i of rank r's input: small integers, so fp32 sums are exact. */
static float val(int r, size_t i)
{
	return (float)((r + 1) * (int)(i % 97));
}

int main(int argc, char **argv)
{
	if (argc != 4) {
		fprintf(stderr, "usage: nccl_check RANK NRANKS ID_FILE\n");
		return 2;
	}
	rank = atoi(argv[1]);
	int n = atoi(argv[2]);
	const char *idfile = argv[3];
	ncclUniqueId id;
	if (rank == 0) {
		NK(ncclGetUniqueId(&id));
		char tmp[4096];
		snprintf(tmp, sizeof tmp, "%s.tmp", idfile);
		FILE *f = fopen(tmp, "wb");
		if (!f || fwrite(&id, sizeof id, 1, f) != 1 || fclose(f) || rename(tmp, idfile)) {
			perror("writing the unique id");
			return 2;
		}
	} else {
		FILE *f = NULL;
		for (int i = 0; i < 600 && !(f = fopen(idfile, "rb")); i++)
			usleep(100000);
		if (!f || fread(&id, sizeof id, 1, f) != 1) {
			fprintf(stderr, "rank %d: no unique id in %s\n", rank, idfile);
			return 2;
		}
		fclose(f);
	}
	CK(cudaSetDevice(0));
	ncclComm_t comm;
	NK(ncclCommInitRank(&comm, n, id, rank));
	cudaStream_t s;
	CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
	const size_t max = 256u << 20;
	float *send, *recv, *host;
	CK(cudaMalloc((void **)&send, max));
	CK(cudaMalloc((void **)&recv, max * (size_t)n));
	host = malloc(max * ((size_t)n + 1));
	if (!host)
		return 2;
	int failed = 0;
	if (rank == 0)
		printf("%-10s %12s %12s %10s  %s\n", "collective", "bytes", "median us", "busbw GB/s", "result");
	for (size_t bytes = 4; bytes <= max; bytes *= 4) {
		size_t count = bytes / 4;
		for (size_t i = 0; i < count; i++)
			host[i] = val(rank, i);
		for (int coll = 0; coll < 3; coll++) {
			double t[5];
			for (int rep = 0; rep < 5; rep++) {
				CK(cudaMemcpy(send, host, bytes, cudaMemcpyHostToDevice));
				CK(cudaMemset(recv, 0, bytes * (size_t)n));
				CK(cudaDeviceSynchronize());
				double t0 = now();
				if (coll == 0) {
					NK(ncclAllReduce(send, recv, count, ncclFloat, ncclSum, comm, s));
				} else if (coll == 1) {
					NK(ncclAllGather(send, recv, count, ncclFloat, comm, s));
				} else {
					int peer = rank ^ 1;
					NK(ncclGroupStart());
					NK(ncclSend(send, count, ncclFloat, peer, comm, s));
					NK(ncclRecv(recv, count, ncclFloat, peer, comm, s));
					NK(ncclGroupEnd());
				}
				CK(cudaStreamSynchronize(s));
				t[rep] = now() - t0;
			}
			qsort(t, 5, sizeof t[0], cmp);
			size_t out = coll == 1 ? bytes * (size_t)n : bytes;
			CK(cudaMemcpy(host + count, recv, out, cudaMemcpyDeviceToHost));
			float *got = host + count;
			int ok = 1;
			for (size_t i = 0; i < out / 4 && ok; i++) {
				float want;
				if (coll == 0) {
					want = 0;
					for (int r = 0; r < n; r++)
						want += val(r, i);
				} else if (coll == 1) {
					want = val((int)(i / count), i % count);
				} else {
					want = val(rank ^ 1, i);
				}
				if (got[i] != want) {
					fprintf(stderr, "rank %d: %s %zu bytes: element %zu is %g, not %g\n", rank,
						coll == 0 ? "all-reduce" : coll == 1 ? "all-gather" : "send/recv",
						bytes, i, got[i], want);
					ok = 0;
				}
			}
			failed |= !ok;
			/* NCCL's bus bandwidth: all-reduce 2(n-1)/n, all-gather (n-1)/n of
			 * the total, send/recv 1. */
			double algbw = (coll == 1 ? (double)out : (double)bytes) / t[2] / 1e9;
			double bus = coll == 0 ? 2.0 * (n - 1) / n : coll == 1 ? (double)(n - 1) / n : 1.0;
			if (rank == 0)
				printf("%-10s %12zu %12.1f %10.3f  %s\n",
				       coll == 0 ? "allreduce" : coll == 1 ? "allgather" : "sendrecv", bytes,
				       t[2] * 1e6, algbw * bus, ok ? "PASS" : "FAIL");
			fflush(stdout);
		}
	}
	NK(ncclCommDestroy(comm));
	if (rank == 0)
		printf("%s\n", failed ? "FAIL" : "PASS");
	return failed;
}
