// y = x @ w^T for few rows of x (a decode step of a small batch), float32, on CPU.
//
// Why: with M <= 16 rows the GEMM is a matrix-vector product in disguise. It must stream the
// weight from memory once (memory-bound: ~7 ms for SmolLM2's 113 MB lm_head at 16 GB/s), but
// MKL's sgemm (F.linear) and oneDNN take 15-41 ms for M = 1..8 there, since they pack and
// block for large M. Here each weight row is read once and used for all M rows of x.
//
// Shapes (row-major, contiguous):
//   x [M, K] float32    w [N, K] float32 (nn.Linear's layout)    y [M, N] float32
//
// Work split: tiles of NT weight rows, spread over the threads. Within a tile, rows of x in
// groups of MT: MT x NT dot products at once, each with LANES independent partial sums so the
// K loop vectorizes (FMA) without reassociating a sum; the tile's weight rows stay in L1 while
// the groups of x pass over them.
#include <stdint.h>

#define NT 4
#define MT 2
#define LANES 8

// One MT x NT block of outputs; mt <= MT rows of x and nt <= NT weight rows are real. Missing
// ones repeat the last real one (computed, never stored), so the loops keep fixed trip counts.
static inline void block(const float *x, const float *w, float *y, int mt, int nt, int K, int64_t N) {
    const float *xr[MT], *wr[NT];
    for (int i = 0; i < MT; i++) xr[i] = x + (int64_t)(i < mt ? i : mt - 1) * K;
    for (int j = 0; j < NT; j++) wr[j] = w + (int64_t)(j < nt ? j : nt - 1) * K;
    float acc[MT][NT][LANES] = {{{0}}};
    int k = 0;
    for (; k + LANES <= K; k += LANES)
        for (int i = 0; i < MT; i++)
            for (int j = 0; j < NT; j++)
                for (int l = 0; l < LANES; l++) acc[i][j][l] += xr[i][k + l] * wr[j][k + l];
    for (int i = 0; i < mt; i++)
        for (int j = 0; j < nt; j++) {
            for (int half = LANES / 2; half > 0; half /= 2)
                for (int l = 0; l < half; l++) acc[i][j][l] += acc[i][j][l + half];
            float s = acc[i][j][0];
            for (int kk = k; kk < K; kk++) s += xr[i][kk] * wr[j][kk];
            y[(int64_t)i * N + j] = s;
        }
}

void small_m_linear(const float *x, const float *w, float *y, int M, int K, int64_t N, int num_threads) {
    int64_t tiles = (N + NT - 1) / NT;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t t = 0; t < tiles; t++) {
        int64_t n0 = t * NT;
        int nt = N - n0 < NT ? (int)(N - n0) : NT;
        for (int m0 = 0; m0 < M; m0 += MT) {
            int mt = M - m0 < MT ? M - m0 : MT;
            block(x + (int64_t)m0 * K, w + n0 * K, y + (int64_t)m0 * N + n0, mt, nt, K, N);
        }
    }
}
