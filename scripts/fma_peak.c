// The CPU's float32 FMA peak on `threads` threads, for scripts/bench_cpu_kernels.py --linears: each thread runs
// 12 independent chains of vector multiply-adds (vec.h's vector, as wide as the kernel build's: 16 floats with
// AVX-512, 8 with AVX2), enough chains to cover the FMA latency on the CPUs seen so far. Prints GFLOP/s, the best
// of 5 passes. Built by the benchmark with the kernels' flags (-O3 -march=native -fopenmp).
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>

#include "../kernels/cpu/vec.h"

#define CHAINS 12

int main(int argc, char **argv) {
    const int threads = argc > 1 ? atoi(argv[1]) : 1;
    const long steps = 20000000;  // per thread and chain
    double best = 0.0;
    float sink = 0.0f;
    for (int pass = 0; pass < 5; pass++) {
        const double t0 = omp_get_wtime();
#pragma omp parallel num_threads(threads) reduction(+ : sink)
        {
            vf c[CHAINS];
            const vf a = vbroadcast(0.999999f), b = vbroadcast(1e-7f);
            for (int i = 0; i < CHAINS; i++) c[i] = vbroadcast((float)(i + omp_get_thread_num()));
            for (long s = 0; s < steps; s++)
#pragma GCC unroll 12
                for (int i = 0; i < CHAINS; i++) c[i] = c[i] * a + b;
            for (int i = 0; i < CHAINS; i++)
                for (int l = 0; l < VL; l++) sink += c[i][l];
        }
        const double gflops = 2.0 * VL * CHAINS * steps * threads / (omp_get_wtime() - t0) / 1e9;
        best = gflops > best ? gflops : best;
    }
    printf("%.2f %d %g\n", best, VL, sink);  // sink keeps the chains live
    return 0;
}
