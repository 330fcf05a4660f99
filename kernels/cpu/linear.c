// Linear layer on CPU: out[M, N] = x[M, K] . w[N, K]^T (+ bias), float32, for every M (one row
// per decoding request, or thousands of prompt tokens in a prefill chunk).
//
// Why C: on this kind of CPU MKL's sgemm reaches about half the machine's read bandwidth when M is
// a handful of rows (decode), and 70-115 GFLOP/s when M is large (prefill). This kernel runs one
// register tile for all M: it streams the weights once per 48 rows of x, which is bandwidth-bound
// at small M and near the FMA ceiling at large M (measured in kernels/linear.py's docstring).
//
// Weight layout: packed once at load time (kernels/linear.py, pack_linear_weight) into panels of
// NR output features (two vectors: 32 on AVX-512 CPUs, 16 on AVX2 ones), k-major inside a panel:
//   wp   [Np / NR, K, NR]  float32, Np = N rounded up to NR (padding rows are zero)
// so a panel is one contiguous stream, and each k gives the NR weights one FMA pair needs.
// Other shapes (row-major, strides in elements):
//   x    [M, K]  float32, row stride x_row
//   bias [N]     float32 or NULL
//   out  [M, N]  float32, row stride out_row
//
// Register tile: MR = 6 rows of x by the NR features of one panel, 12 vector accumulators (the
// classic AVX2 6x16 shape, and 6x32 where vectors are twice as wide).
// Work split: OpenMP splits the panels (static, so each thread streams one contiguous part of wp),
// and each panel meets every row of x before the next is read: the weights, hundreds of MB per step
// and never cache-resident, stream from memory once per call. x stays in cache (L2, or L3 for prefill
// chunks). Only an x over X_BLOCK_BYTES is cut into row blocks, each streaming the weights again.
// Measured over SmolLM2's 30 layers (424 MB of weights, far past the 32 MB L3): 48-row blocks, which
// read the weights once per 48 rows, ran 95-114 GFLOP/s at M = 64..576; one block 120-142.
#include <stdint.h>

#include "vec.h"

#define NR (2 * VL)  // panel width: two vectors, 32 features on AVX-512 CPUs, 16 on AVX2 ones
#define MR 6
#define X_BLOCK_BYTES (4 << 20)

// The panel width this build packs for (kernels/linear.py packs weights to match the library it calls).
int linear_panel_width(void) { return NR; }

// One tile: rows 0 .. mr-1 of x (mr <= MR) by one panel; writes ncols (<= NR) columns of out.
// Per k: two vector loads of the panel, MR broadcasts of x, 2*MR FMAs into MR x 2 accumulators that
// stay in registers (12 of AVX-512's 32, or of AVX2's 16). One source for every vector width.
static void tile(const float *x, int64_t x_row, int mr, const float *b, int K, float *out,
                 int64_t out_row, int ncols, const float *bias) {
    vf c[MR][2];
    const float *xr[MR];
    for (int i = 0; i < MR; i++) {
        c[i][0] = c[i][1] = (vf){0};
        // Rows past mr repeat the last row (valid memory; their results are dropped): one code path
        // for partial tiles, and at small M the spare FMAs are free (the loop waits on memory).
        xr[i] = x + (int64_t)(i < mr ? i : mr - 1) * x_row;
    }
    for (int k = 0; k < K; k++, b += NR) {
        vf b0 = vload(b), b1 = vload(b + VL);
        for (int i = 0; i < MR; i++) {
            vf a = vbroadcast(xr[i][k]);
            c[i][0] += a * b0;
            c[i][1] += a * b1;
        }
    }
    for (int m = 0; m < mr; m++) {
        float acc[NR];
        vstore(acc, c[m][0]);
        vstore(acc + VL, c[m][1]);
        for (int j = 0; j < ncols; j++) out[m * out_row + j] = acc[j] + (bias ? bias[j] : 0.0f);
    }
}

// num_threads: torch's (the OpenMP pool is shared). Returns 0, or -1 for arguments this kernel
// does not take (the caller then runs the torch path).
int linear_packed(const float *x, int64_t x_row, int M, int K, const float *wp, int N,
                  const float *bias, float *out, int64_t out_row, int num_threads) {
    if (M < 1 || N < 1 || K < 1) return -1;
    int64_t panels = ((int64_t)N + NR - 1) / NR;
    // Row blocks of equal size (a multiple of MR) of at most X_BLOCK_BYTES each.
    int64_t max_rows = X_BLOCK_BYTES / ((int64_t)K * 4);
    int64_t blocks = max_rows < MR ? (M + MR - 1) / MR : (M + max_rows - 1) / max_rows;
    int MC = (int)(((M + blocks - 1) / blocks + MR - 1) / MR * MR);
    for (int m0 = 0; m0 < M; m0 += MC) {
        int mc = M - m0 < MC ? M - m0 : MC;
        const float *xb = x + (int64_t)m0 * x_row;
        float *ob = out + (int64_t)m0 * out_row;
        #pragma omp parallel for schedule(static) num_threads(num_threads)
        for (int64_t p = 0; p < panels; p++) {
            int64_t n = p * NR;
            int ncols = N - n < NR ? (int)(N - n) : NR;
            const float *b = wp + p * (int64_t)K * NR;
            for (int i = 0; i < mc; i += MR)
                tile(xb + (int64_t)i * x_row, x_row, mc - i < MR ? mc - i : MR, b, K,
                     ob + (int64_t)i * out_row + n, out_row, ncols, bias ? bias + n : 0);
        }
    }
    return 0;
}
