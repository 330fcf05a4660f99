// Linear layer on CPU: out[M, N] = x[M, K] . w[N, K]^T (+ bias), float32, for every M (one row
// per decoding request, or thousands of prompt tokens in a prefill chunk).
//
// Why C: on this kind of CPU MKL's sgemm reaches about half the machine's read bandwidth when M is
// a handful of rows (decode), and 70-115 GFLOP/s when M is large (prefill). This kernel runs one
// register tile for all M: it streams the weights once per 48 rows of x, which is bandwidth-bound
// at small M and near the FMA ceiling at large M (measured in kernels/linear.py's docstring).
//
// Weight layout: packed once at load time (kernels/linear.py, pack_linear_weight) into panels of
// NR = 16 output features, k-major inside a panel:
//   wp   [Np / 16, K, 16]  float32, Np = N rounded up to 16 (padding rows are zero)
// so a panel is one contiguous stream, and each k gives the 16 weights one FMA pair needs.
// Other shapes (row-major, strides in elements):
//   x    [M, K]  float32, row stride x_row
//   bias [N]     float32 or NULL
//   out  [M, N]  float32, row stride out_row
//
// Register tile: MR = 6 rows of x by the 16 features of one panel, 12 accumulators. Per k: two
// loads of the panel, six broadcasts of x, twelve FMAs (the classic AVX2 6x16 shape).
// Work split: OpenMP splits the panels (static, so each thread streams one contiguous part of wp),
// and each panel meets every row of x before the next is read: the weights, hundreds of MB per step
// and never cache-resident, stream from memory once per call. x stays in cache (L2, or L3 for prefill
// chunks). Only an x over X_BLOCK_BYTES is cut into row blocks, each streaming the weights again.
// Measured over SmolLM2's 30 layers (424 MB of weights, far past the 32 MB L3): 48-row blocks, which
// read the weights once per 48 rows, ran 95-114 GFLOP/s at M = 64..576; one block 120-142.
#include <stdint.h>

#include "tile.h"

#define NR 16
#define MR 6
#define X_BLOCK_BYTES (4 << 20)

#if defined(__AVX2__) && defined(__FMA__)

// One tile: rows 0 .. mr-1 of x (mr <= MR) by one panel; writes ncols (<= NR) columns of out.
// Accumulators are named variables: as an array, gcc stored them to the stack on every k.
static void tile(const float *x, int64_t x_row, int mr, const float *b, int K, float *out,
                 int64_t out_row, int ncols, const float *bias) {
    __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00,
           c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
    // Rows past mr repeat the last row (valid memory; their results are dropped): one code path
    // for partial tiles, and at small M the spare FMAs are free (the loop waits on memory).
#define ROW(i) (x + (int64_t)((i) < mr ? (i) : mr - 1) * x_row)
    const float *x0 = ROW(0), *x1 = ROW(1), *x2 = ROW(2), *x3 = ROW(3), *x4 = ROW(4), *x5 = ROW(5);
#undef ROW
    for (int k = 0; k < K; k++, b += NR) {
        __m256 b0 = _mm256_loadu_ps(b), b1 = _mm256_loadu_ps(b + 8);
        TILE_ROW_FMA(x0 + k, b0, b1, c00, c01);
        TILE_ROW_FMA(x1 + k, b0, b1, c10, c11);
        TILE_ROW_FMA(x2 + k, b0, b1, c20, c21);
        TILE_ROW_FMA(x3 + k, b0, b1, c30, c31);
        TILE_ROW_FMA(x4 + k, b0, b1, c40, c41);
        TILE_ROW_FMA(x5 + k, b0, b1, c50, c51);
    }
    float acc[MR][NR];
    _mm256_storeu_ps(acc[0], c00); _mm256_storeu_ps(acc[0] + 8, c01);
    _mm256_storeu_ps(acc[1], c10); _mm256_storeu_ps(acc[1] + 8, c11);
    _mm256_storeu_ps(acc[2], c20); _mm256_storeu_ps(acc[2] + 8, c21);
    _mm256_storeu_ps(acc[3], c30); _mm256_storeu_ps(acc[3] + 8, c31);
    _mm256_storeu_ps(acc[4], c40); _mm256_storeu_ps(acc[4] + 8, c41);
    _mm256_storeu_ps(acc[5], c50); _mm256_storeu_ps(acc[5] + 8, c51);
    for (int m = 0; m < mr; m++)
        for (int j = 0; j < ncols; j++) out[m * out_row + j] = acc[m][j] + (bias ? bias[j] : 0.0f);
}

#else  // portable C: the same tile, left to the compiler's vectorizer

static void tile(const float *x, int64_t x_row, int mr, const float *b, int K, float *out,
                 int64_t out_row, int ncols, const float *bias) {
    for (int m = 0; m < mr; m++) {
        float acc[NR] = {0};
        const float *xm = x + m * x_row;
        for (int k = 0; k < K; k++)
            for (int j = 0; j < NR; j++) acc[j] += xm[k] * b[(int64_t)k * NR + j];
        for (int j = 0; j < ncols; j++) out[m * out_row + j] = acc[j] + (bias ? bias[j] : 0.0f);
    }
}

#endif

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
