// The float32 register tile of the CPU GEMMs: x [rows, K] times one panel of NR output features laid out k-major
// ([K][NR] floats), the accumulators in registers. linear.c runs it over panels packed at load; quant_linear.c over
// panels it dequantizes from GGML blocks into a small buffer, a K chunk at a time (hence `add`).
#pragma once
#include <stdint.h>

#include "vec.h"

#define NR (2 * VL)  // panel width: two vectors, 32 features on AVX-512 CPUs, 16 on AVX2 ones
#define MR 6           // tile rows everywhere: 12 accumulators, of AVX2's 16 vector registers
#if VL == 16
#define MR_TALL 8      // and where the vectors are 16 floats: 16 accumulators, of AVX-512's 32 registers
#else
#define MR_TALL MR
#endif

// One tile: rows 0 .. mr-1 of x (mr <= rows) by one panel; writes ncols (<= NR) columns of out. `rows` (MR or
// MR_TALL) is a constant at each call site. Per k: two vector loads of the panel, `rows` broadcasts of x, 2 * rows
// FMAs into rows x 2 accumulators that stay in registers. One source for every vector width.
// next: NULL, or rows of the next panel to prefetch into L2, one row (NR floats) every `every` k (linear.c's
// next_panel). add: 0 writes the sums (+ bias), 1 adds them to what out holds (a later K chunk of quant_linear.c).
static inline __attribute__((always_inline)) void tile(const float *x, int64_t x_row, int mr, const float *b, int K,
                                                        float *out, int64_t out_row, int ncols, const float *bias,
                                                        const float *next, int every, int add, const int rows) {
    vf c[MR_TALL][2];
    const float *xr[MR_TALL];
    for (int i = 0; i < rows; i++) {
        c[i][0] = c[i][1] = (vf){0};
        // Rows past mr repeat the last row (valid memory; their results are dropped): one code path
        // for partial tiles, and at small M the spare FMAs are free (the loop waits on memory).
        xr[i] = x + (int64_t)(i < mr ? i : mr - 1) * x_row;
    }
    for (int k = 0, wait = 1; k < K; k++, b += NR) {
        if (next && --wait == 0) {
            for (int o = 0; o < NR; o += 64 / 4) __builtin_prefetch(next + o, 0, 2);
            next += NR;
            wait = every;
        }
        vf b0 = vload(b), b1 = vload(b + VL);
        for (int i = 0; i < rows; i++) {
            vf a = vbroadcast(xr[i][k]);
            c[i][0] += a * b0;
            c[i][1] += a * b1;
        }
    }
    for (int m = 0; m < mr; m++) {
        float acc[NR];
        vstore(acc, c[m][0]);
        vstore(acc + VL, c[m][1]);
        for (int j = 0; j < ncols; j++)
            out[m * out_row + j] = acc[j] + (add ? out[m * out_row + j] : bias ? bias[j] : 0.0f);
    }
}

// tile() at the height tile_rows chose (MR_TALL or MR), each height its own compiled instance.
static inline __attribute__((always_inline)) void tile_of(int rows, const float *x, int64_t x_row, int mr,
                                                           const float *b, int K, float *out, int64_t out_row,
                                                           int ncols, const float *bias, const float *next,
                                                           int every, int add) {
    if (rows == MR_TALL)
        tile(x, x_row, mr, b, K, out, out_row, ncols, bias, next, every, add, MR_TALL);
    else
        tile(x, x_row, mr, b, K, out, out_row, ncols, bias, next, every, add, MR);
}

// The tile height for M rows: MR_TALL where it pads M's last tile no more than MR does (fewer broadcasts per
// FMA), else MR. A decode batch of 64 then runs eight 8-row tiles, not ten 6-row tiles and a 4-row one computed
// as 6. Zen 4, 2 threads, SmolLM2's four projections over 30 layers and its lm_head from memory, GFLOP/s with
// 6-row tiles against 8-row ones alternated in one process, three passes: M = 64: 170 / 185, 170 / 181, 186 / 195;
// M = 16: 120 / 136, 123 / 131; at M = 100, 200 and 390 the two were within 4% either way.
static inline int tile_rows(int M) {
    return (M + MR_TALL - 1) / MR_TALL * MR_TALL <= (M + MR - 1) / MR * MR ? MR_TALL : MR;
}
