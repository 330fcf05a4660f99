// Items [0, n) of a parallel loop, shared out as a static schedule would (each thread a contiguous share, taken from
// its front), except that a thread whose share is done takes items from the back of another thread's share.
//
// Why: the worker's threads share the cores with the server's other processes (HTTP front, detokenizer, router) and
// the benchmark client. Under a static schedule a thread the OS preempts in the middle of a GEMM leaves the others
// waiting at the end of the loop for its whole share; here they take what it has not started. Each thread still
// walks its own share front to back, so the GEMMs' next-panel prefetch (linear.c, next_panel) keeps fetching what the
// thread computes next until a share runs dry. Zen 5, 2 threads, the W1 load served (scripts/bench_server.py, one
// run a build, the builds alternated): float32 1.011x and 1.030x the output tokens/s of the static schedule, bf16
// 1.067x and 1.046x. A form that also took a share's last item, which its owner is already prefetching, cost bf16
// W1 4-7%; in float32 it cut OpenMP's waiting in the worker's samples from 6.3% to 5.1%.
//
// Use: `Shares s; shares_init(&s, n, num_threads);` before `#pragma omp parallel num_threads(num_threads)`, then in
// the region `for (int64_t i; (i = shares_take(&s)) >= 0;)`. A thread past s.count (a team larger than MAX_SHARES)
// owns nothing and only takes from the back of the others; a team smaller than asked for (OMP_THREAD_LIMIT, a nested
// region) leaves the shares past it unowned, and the threads it has take all of them from the back.
#pragma once
#include <omp.h>
#include <stdint.h>

#define MAX_SHARES 64

typedef struct {
    // Share t as (end << 32) | next: the owner moves next up, the others move end down, one compare-and-swap each,
    // so every item is taken exactly once. A cache line each: the owner's updates do not contend with the others'.
    struct {
        uint64_t range __attribute__((aligned(64)));
    } share[MAX_SHARES];
    int count;
} Shares;

static inline void shares_init(Shares *s, int64_t n, int threads) {
    const int count = threads < 1 ? 1 : threads > MAX_SHARES ? MAX_SHARES : threads;
    s->count = count;
    for (int t = 0; t < count; t++) {
        const uint64_t lo = (uint64_t)(n * t / count), hi = (uint64_t)(n * (t + 1) / count);
        s->share[t].range = hi << 32 | lo;
    }
}

// The calling thread's next item, or -1 when every item is taken. n must be below 2^31.
static inline int64_t shares_take(Shares *s) {
    const int me = omp_get_thread_num(), team = omp_get_num_threads();
    if (me < s->count) {
        uint64_t *r = &s->share[me].range, old = __atomic_load_n(r, __ATOMIC_RELAXED);
        while ((uint32_t)old < (uint32_t)(old >> 32))
            if (__atomic_compare_exchange_n(r, &old, old + 1, 1, __ATOMIC_RELAXED, __ATOMIC_RELAXED))
                return (uint32_t)old;
    }
    // From an owned share only while it holds two items or more: its owner has already started fetching the next
    // one (linear.c's next-panel prefetch), which would reach this thread cold. An unowned share gives every item.
    for (int d = 1; d <= s->count; d++) {
        const int t = (me + d) % s->count, keep = t < team;
        uint64_t *r = &s->share[t].range, old = __atomic_load_n(r, __ATOMIC_RELAXED);
        while ((uint32_t)old + keep < (uint32_t)(old >> 32))
            if (__atomic_compare_exchange_n(r, &old, old - ((uint64_t)1 << 32), 1, __ATOMIC_RELAXED,
                                            __ATOMIC_RELAXED))
                return (uint32_t)(old >> 32) - 1;
    }
    return -1;
}
