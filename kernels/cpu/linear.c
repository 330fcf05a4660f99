// Skinny linear on CPU: out[M, N] = x[M, K] . w[N, K]^T (+ bias), for the few-row case of decode.
//
// Why C: at M = 1..8 (one token per running request) the projections are memory-bound, the
// weights stream from DRAM once per step and the FLOPs are nearly free. MKL's sgemm treats the
// call as a GEMM (packing, blocking for reuse that is not there) and reaches about half the
// machine's read bandwidth; this kernel reads each weight row once, straight, on every thread.
// Weights may be float32 or bfloat16 (bf16 halves the bytes read; each value is widened to
// float32 exactly, a 16-bit shift, so the math is float32 on bf16-rounded weights).
//
// Shapes (row-major, strides in elements):
//   x     [M, K]  float32, row stride x_row
//   w     [N, K]  float32 or bfloat16, contiguous (K must be a multiple of 8)
//   bias  [N]     float32 or NULL
//   out   [M, N]  float32, row stride out_row
//
// Work split: OpenMP over blocks of ROWS weight rows (static, so each thread streams one
// contiguous half of w). Inside a block the ROWS rows stay in L1 while every tile of up to
// MTILE x rows passes over them: ROWS x MTILE = 12 accumulators, plus MTILE x loads and one
// weight vector, fit AVX2's 16 registers.
#include <stdint.h>
#include <string.h>

#ifdef __AVX2__
#include <immintrin.h>
#endif

#define ROWS 4
#define MTILE 3
#ifndef MPANEL
#define MPANEL 96
#endif

static inline float bf16_to_f32(uint16_t v) {
    uint32_t bits = (uint32_t)v << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

#if defined(__AVX2__) && defined(__FMA__)

static inline __m256 load8_f32(const float *p) { return _mm256_loadu_ps(p); }

static inline __m256 load8_bf16(const uint16_t *p) {
    __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

// One tile: `mt` (1..MTILE) x rows against `rows` (1..ROWS) weight rows starting at row n.
// always_inline with literal mt/rows at the call sites: the loops unroll and acc stays in registers.
#define DEFINE_TILE(NAME, T, LOAD)                                                                 \
static inline __attribute__((always_inline)) void NAME(                                           \
        const float *x, int64_t x_row, int mt, const T *w, int64_t n, int rows, int K,             \
        const float *bias, float *out, int64_t out_row, const T *prefetch) {                       \
    __m256 acc[MTILE][ROWS];                                                                       \
    for (int m = 0; m < mt; m++)                                                                   \
        for (int r = 0; r < rows; r++) acc[m][r] = _mm256_setzero_ps();                            \
    const T *wn = w + n * K;                                                                       \
    const int line = 64 / (int)sizeof(T);                                                          \
    for (int k = 0; k < K; k += 8) {                                                               \
        if (prefetch && k % line == 0)                                                             \
            for (int r = 0; r < rows; r++)                                                         \
                _mm_prefetch((const char *)(prefetch + (int64_t)r * K + k), _MM_HINT_T0);          \
        __m256 xv[MTILE];                                                                          \
        for (int m = 0; m < mt; m++) xv[m] = _mm256_loadu_ps(x + m * x_row + k);                   \
        for (int r = 0; r < rows; r++) {                                                           \
            __m256 wv = LOAD(wn + (int64_t)r * K + k);                                             \
            for (int m = 0; m < mt; m++) acc[m][r] = _mm256_fmadd_ps(xv[m], wv, acc[m][r]);        \
        }                                                                                          \
    }                                                                                              \
    for (int m = 0; m < mt; m++)                                                                   \
        for (int r = 0; r < rows; r++)                                                             \
            out[m * out_row + n + r] = hsum8(acc[m][r]) + (bias ? bias[n + r] : 0.0f);             \
}
DEFINE_TILE(tile_f32, float, load8_f32)
DEFINE_TILE(tile_bf16, uint16_t, load8_bf16)

// A block of `rows` weight rows against all M x rows, MTILE at a time. The first tile also
// prefetches the next block's rows (the weights stream from DRAM once per call: without it the
// loads of a block and the FMAs of the previous one do not overlap).
#define DEFINE_BLOCK(NAME, TILE, T)                                                                \
static void NAME(const float *x, int64_t x_row, int M, const T *w, int64_t n, int rows, int K,     \
                 const float *bias, float *out, int64_t out_row, const T *next) {                  \
    if (rows == ROWS) {                                                                            \
        int m0 = 0;                                                                                \
        if (M == 1) { TILE(x, x_row, 1, w, n, ROWS, K, bias, out, out_row, next); return; }        \
        if (M == 2) { TILE(x, x_row, 2, w, n, ROWS, K, bias, out, out_row, next); return; }        \
        TILE(x, x_row, 3, w, n, ROWS, K, bias, out, out_row, next);                                \
        for (m0 = 3; m0 + 3 <= M; m0 += 3)                                                         \
            TILE(x + m0 * x_row, x_row, 3, w, n, ROWS, K, bias, out + m0 * out_row, out_row, NULL); \
        if (M - m0 == 2) TILE(x + m0 * x_row, x_row, 2, w, n, ROWS, K, bias, out + m0 * out_row, out_row, NULL); \
        if (M - m0 == 1) TILE(x + m0 * x_row, x_row, 1, w, n, ROWS, K, bias, out + m0 * out_row, out_row, NULL); \
        return;                                                                                    \
    }                                                                                              \
    for (int r = 0; r < rows; r++)  /* the last, partial block: one row at a time */               \
        for (int m = 0; m < M; m++)                                                                \
            TILE(x + m * x_row, x_row, 1, w, n + r, 1, K, bias, out + m * out_row, out_row, NULL); \
}
DEFINE_BLOCK(block_f32, tile_f32, float)
DEFINE_BLOCK(block_bf16, tile_bf16, uint16_t)

#else  // portable C: the same loop order, left to the compiler's vectorizer

#define DEFINE_BLOCK(NAME, T, LOAD)                                                                \
static void NAME(const float *x, int64_t x_row, int M, const T *w, int64_t n, int rows, int K,     \
                 const float *bias, float *out, int64_t out_row, const T *next) {                  \
    (void)next;                                                                                    \
    for (int r = 0; r < rows; r++) {                                                               \
        const T *wr = w + (n + r) * K;                                                             \
        for (int m = 0; m < M; m++) {                                                              \
            const float *xm = x + m * x_row;                                                       \
            float part[8] = {0};                                                                   \
            for (int k = 0; k < K; k += 8)                                                         \
                for (int j = 0; j < 8; j++) part[j] += xm[k + j] * LOAD(wr[k + j]);                \
            float s = 0.0f;                                                                        \
            for (int j = 0; j < 8; j++) s += part[j];                                              \
            out[m * out_row + n + r] = s + (bias ? bias[n + r] : 0.0f);                            \
        }                                                                                          \
    }                                                                                              \
}
#define LOAD_F32(v) (v)
DEFINE_BLOCK(block_f32, float, LOAD_F32)
DEFINE_BLOCK(block_bf16, uint16_t, bf16_to_f32)

#endif

// w_dtype: 0 float32, 1 bfloat16; num_threads: torch's (the pool is shared). Returns 0, or -1 for arguments this kernel does not take
// (the caller then runs the torch path).
int linear_skinny(const float *x, int64_t x_row, int M, int K, const void *w, int w_dtype, int N,
                  const float *bias, float *out, int64_t out_row, int num_threads) {
    if (M < 1 || N < 1 || K < 8 || K % 8 != 0 || (w_dtype != 0 && w_dtype != 1)) return -1;
    int64_t blocks = ((int64_t)N + ROWS - 1) / ROWS;
    // Panels of MPANEL x rows: a panel stays in L2 while all of w streams past it once.
    for (int m0 = 0; m0 < M; m0 += MPANEL) {
        int mp = M - m0 < MPANEL ? M - m0 : MPANEL;
        const float *xp = x + (int64_t)m0 * x_row;
        float *op = out + (int64_t)m0 * out_row;
        #pragma omp parallel for schedule(static) num_threads(num_threads)
        for (int64_t b = 0; b < blocks; b++) {
            int64_t n = b * ROWS;
            int rows = N - n < ROWS ? (int)(N - n) : ROWS;
            int64_t next = n + ROWS < N - ROWS ? n + ROWS : n;  // prefetch only whole blocks
            if (w_dtype == 0) {
                const float *wf = (const float *)w;
                block_f32(xp, x_row, mp, wf, n, rows, K, bias, op, out_row, wf + next * K);
            } else {
                const uint16_t *wb = (const uint16_t *)w;
                block_bf16(xp, x_row, mp, wb, n, rows, K, bias, op, out_row, wb + next * K);
            }
        }
    }
    return 0;
}
