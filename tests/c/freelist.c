/* The baseline for Weft's freelist micro-benchmarks: the smallest intrusive
 * freelist in C (the link lives in the free element itself, as in most C
 * net plugins), over one malloc'd array. The loops are here too, so a
 * measurement counts the list operations and the loop, not a call from Rust
 * per operation. */
#include <stdint.h>
#include <stdlib.h>

struct cfl_elem {
    struct cfl_elem *next;
};

struct cfl {
    struct cfl_elem *head;
    void *mem;
};

struct cfl *cfl_new(size_t elem_size, size_t n)
{
    struct cfl *l = calloc(1, sizeof(*l));
    if (!l)
        return NULL;
    if (elem_size < sizeof(struct cfl_elem))
        elem_size = sizeof(struct cfl_elem);
    char *mem = malloc(elem_size * n);
    if (!mem) {
        free(l);
        return NULL;
    }
    l->mem = mem;
    for (size_t i = n; i-- > 0;) {
        struct cfl_elem *e = (struct cfl_elem *)(mem + i * elem_size);
        e->next = l->head;
        l->head = e;
    }
    return l;
}

void cfl_delete(struct cfl *l)
{
    if (l) {
        free(l->mem);
        free(l);
    }
}

static inline void *cfl_alloc(struct cfl *l)
{
    struct cfl_elem *e = l->head;
    if (e)
        l->head = e->next;
    return e;
}

static inline void cfl_free(struct cfl *l, void *p)
{
    struct cfl_elem *e = p;
    e->next = l->head;
    l->head = e;
}

/* Keeps the compiler from fusing an alloc with the free that follows it (it
 * would otherwise see that the pair leaves the list unchanged and drop the
 * loop): `p` must exist in a register and memory must be up to date. */
#define BARRIER(p) __asm__ __volatile__("" : : "r"(p) : "memory")

/* n x (alloc, free). Returns a value that depends on every pointer. */
uint64_t cfl_bench_pair(struct cfl *l, uint64_t n)
{
    uint64_t sum = 0;
    for (uint64_t i = 0; i < n; i++) {
        void *p = cfl_alloc(l);
        sum += (uintptr_t)p;
        BARRIER(p);
        cfl_free(l, p);
    }
    return sum;
}

/* rounds x (256 allocs, then 256 frees). */
uint64_t cfl_bench_burst(struct cfl *l, uint64_t rounds)
{
    void *held[256];
    uint64_t sum = 0;
    for (uint64_t r = 0; r < rounds; r++) {
        for (int i = 0; i < 256; i++) {
            held[i] = cfl_alloc(l);
            sum += (uintptr_t)held[i];
            BARRIER(held[i]);
        }
        for (int i = 0; i < 256; i++)
            cfl_free(l, held[i]);
    }
    return sum;
}
