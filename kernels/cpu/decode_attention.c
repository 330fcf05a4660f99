// Decode attention on CPU, straight over the token-level KV cache (no gather).
//
// Why C: the torch path (kernels/decode_attention.py, decode_attention_ref) first gathers every
// request's K/V rows into a padded [B, L, Hk, D] copy, then runs SDPA over it. At batch 64 and 384
// tokens of context that copy alone is 1.1 GB of writes per step over 30 layers, and it dominates
// the decode step. Here each (request, KV head) task streams its rows once, in place: the step
// reads the KV it needs and nothing more (memory-bound, as decode attention is).
//
// Shapes (row-major, strides in elements):
//   q            [B, Hq, D]            float32 (the query; always float32 here, see the Python side)
//   k_cache      [rows, Hk, D]         float32 or bfloat16, row stride kc_row
//   v_cache      [rows, Hk, D]         same dtype as k_cache, row stride vc_row
//   req_to_token [num_rows, max_len]   int32, KV row of token t of a request, row stride r2t_row
//   req_rows     [B]                   int32, each request's row in req_to_token
//   seq_lens     [B]                   int32, tokens to attend to (>= 1)
//   out          [B, Hq, D]            float32
// Query heads h*G .. h*G+G-1 share KV head h (G = Hq / Hk, grouped-query attention).
//
// One task per (request, KV head): its G query heads share every K/V row it loads. Online
// softmax over blocks of BLOCK tokens: scores for the block, one rescale of the accumulator per
// block rather than per token.
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "fastmath.h"

#define BLOCK 32
#define MAX_GROUP 16
#define MAX_DIM 128
#define LANES 16  // head_dim must be a multiple (64, 128, 256 are)

// One (request, KV head) task, for KV elements of type T loaded through LOAD.
// DIM is a compile-time constant: with it gcc drops the runtime trip counts and vector epilogues
// (measured 1.5x faster than a runtime head_dim).
#define DEFINE_TASK(NAME, T, LOAD, DIM)                                                            \
static void NAME(const float *q, const T *k_cache, const T *v_cache, const int32_t *locs, int len,  \
                 float *out, int group, int64_t kc_row, int64_t vc_row, int64_t head_off,          \
                 float scale) {                                                                    \
    const int dim = DIM;                                                                           \
    float m[MAX_GROUP], l[MAX_GROUP], s[MAX_GROUP][BLOCK];                                         \
    float acc[MAX_GROUP][MAX_DIM];                                                                 \
    float kv[MAX_DIM];                                                                             \
    for (int g = 0; g < group; g++) {                                                              \
        m[g] = -INFINITY;                                                                          \
        l[g] = 0.0f;                                                                               \
        for (int d = 0; d < dim; d++) acc[g][d] = 0.0f;                                            \
    }                                                                                              \
    for (int t0 = 0; t0 < len; t0 += BLOCK) {                                                      \
        int n = len - t0 < BLOCK ? len - t0 : BLOCK;                                               \
        for (int j = 0; j < n; j++) {                                                              \
            const T *k = k_cache + (int64_t)locs[t0 + j] * kc_row + head_off;                      \
            for (int d = 0; d < dim; d++) kv[d] = LOAD(k[d]);                                      \
            for (int g = 0; g < group; g++) {                                                      \
                /* LANES independent partial sums: vectorizes without reassociating the sum */    \
                const float *qg = q + (int64_t)g * dim;                                            \
                float part[LANES] = {0};                                                           \
                for (int d = 0; d < dim; d += LANES)                                               \
                    for (int i = 0; i < LANES; i++) part[i] += qg[d + i] * kv[d + i];              \
                /* a tree, not a chain of LANES dependent adds (that chain was the kernel's cost) */ \
                for (int w = LANES / 2; w > 0; w /= 2)                                             \
                    for (int i = 0; i < w; i++) part[i] += part[i + w];                            \
                s[g][j] = part[0] * scale;                                                         \
            }                                                                                      \
        }                                                                                          \
        for (int g = 0; g < group; g++) {                                                          \
            float mx = m[g];                                                                       \
            for (int j = 0; j < n; j++) mx = s[g][j] > mx ? s[g][j] : mx;                          \
            float alpha = expf(m[g] - mx); /* 0 on the first block: m is -inf */                  \
            l[g] *= alpha;                                                                         \
            for (int d = 0; d < dim; d++) acc[g][d] *= alpha;                                      \
            for (int j = 0; j < n; j++) {                                                          \
                s[g][j] = exp_neg(s[g][j] - mx);                                                   \
            }                                                                                      \
            for (int j = 0; j < n; j++) l[g] += s[g][j];                                           \
            m[g] = mx;                                                                             \
        }                                                                                          \
        for (int j = 0; j < n; j++) {                                                              \
            const T *v = v_cache + (int64_t)locs[t0 + j] * vc_row + head_off;                      \
            for (int d = 0; d < dim; d++) kv[d] = LOAD(v[d]);                                      \
            for (int g = 0; g < group; g++) {                                                      \
                float p = s[g][j];                                                                 \
                for (int d = 0; d < dim; d++) acc[g][d] += p * kv[d];                              \
            }                                                                                      \
        }                                                                                          \
    }                                                                                              \
    for (int g = 0; g < group; g++) {                                                              \
        float inv = 1.0f / l[g];                                                                   \
        for (int d = 0; d < dim; d++) out[(int64_t)g * dim + d] = acc[g][d] * inv;                 \
    }                                                                                              \
}

#define LOAD_F32(x) (x)
#define LOAD_BF16(x) bf16_to_f32(x)

#ifdef __AVX2__
#include <immintrin.h>

// AVX2 version of the task. The portable one above computes each score as a dot product ending
// in a horizontal sum, which costs more than the dot itself; here 8 tokens' dot products are
// reduced together (hsum8: 6 hadds and a lane swap for 8 sums), and each query head's output
// row stays in registers while the block's V rows stream past.
static inline __m256 load8_f32(const float *p) { return _mm256_loadu_ps(p); }
static inline __m256 load8_bf16(const uint16_t *p) {
    __m128i h = _mm_loadu_si128((const __m128i *)p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// [sum(a0), sum(a1), ..., sum(a7)]
static inline __m256 hsum8(const __m256 a[8]) {
    __m256 h01 = _mm256_hadd_ps(a[0], a[1]), h23 = _mm256_hadd_ps(a[2], a[3]);
    __m256 h45 = _mm256_hadd_ps(a[4], a[5]), h67 = _mm256_hadd_ps(a[6], a[7]);
    __m256 h0123 = _mm256_hadd_ps(h01, h23), h4567 = _mm256_hadd_ps(h45, h67);
    return _mm256_add_ps(_mm256_permute2f128_ps(h0123, h4567, 0x20), _mm256_permute2f128_ps(h0123, h4567, 0x31));
}

#define DEFINE_TASK_AVX2(NAME, T, LOAD8, DIM)                                                      \
static void NAME(const float *q, const T *k_cache, const T *v_cache, const int32_t *locs, int len,  \
                 float *out, int group, int64_t kc_row, int64_t vc_row, int64_t head_off,          \
                 float scale) {                                                                    \
    enum { DV = DIM / 8 };                                                                         \
    float m[MAX_GROUP], l[MAX_GROUP], alpha[MAX_GROUP];                                            \
    float s[MAX_GROUP][BLOCK] __attribute__((aligned(32)));                                        \
    float acc[MAX_GROUP][DIM] __attribute__((aligned(32)));                                        \
    const T *kr[BLOCK], *vr[BLOCK];                                                                \
    for (int g = 0; g < group; g++) {                                                              \
        m[g] = -INFINITY;                                                                          \
        l[g] = 0.0f;                                                                               \
        for (int d = 0; d < DIM; d++) acc[g][d] = 0.0f;                                            \
    }                                                                                              \
    const __m256 sc = _mm256_set1_ps(scale);                                                       \
    for (int t0 = 0; t0 < len; t0 += BLOCK) {                                                      \
        int n = len - t0 < BLOCK ? len - t0 : BLOCK;                                               \
        int n8 = (n + 7) & ~7; /* rows past n repeat the last one: scored, never used */           \
        for (int j = 0; j < n8; j++) {                                                             \
            int64_t loc = locs[t0 + (j < n ? j : n - 1)];                                          \
            kr[j] = k_cache + loc * kc_row + head_off;                                             \
            vr[j] = v_cache + loc * vc_row + head_off;                                             \
        }                                                                                          \
        for (int g = 0; g < group; g++) {                                                          \
            const float *qg = q + (int64_t)g * DIM;                                                \
            for (int j0 = 0; j0 < n8; j0 += 8) {                                                   \
                __m256 a[8];                                                                       \
                for (int u = 0; u < 8; u++) a[u] = _mm256_setzero_ps();                            \
                for (int i = 0; i < DV; i++) {                                                     \
                    __m256 qi = _mm256_loadu_ps(qg + 8 * i);                                       \
                    for (int u = 0; u < 8; u++) a[u] = _mm256_fmadd_ps(qi, LOAD8(kr[j0 + u] + 8 * i), a[u]); \
                }                                                                                  \
                _mm256_store_ps(&s[g][j0], _mm256_mul_ps(hsum8(a), sc));                           \
            }                                                                                      \
            float mx = m[g];                                                                       \
            for (int j = 0; j < n; j++) mx = s[g][j] > mx ? s[g][j] : mx;                          \
            alpha[g] = expf(m[g] - mx); /* 0 on the first block: m is -inf */                     \
            float sum = 0.0f;                                                                      \
            for (int j = 0; j < n; j++) {                                                          \
                s[g][j] = exp_neg(s[g][j] - mx);                                                   \
                sum += s[g][j];                                                                    \
            }                                                                                      \
            l[g] = l[g] * alpha[g] + sum;                                                          \
            m[g] = mx;                                                                             \
        }                                                                                          \
        for (int g = 0; g < group; g++) {                                                          \
            __m256 o[DV];                                                                          \
            __m256 al = _mm256_set1_ps(alpha[g]);                                                  \
            for (int i = 0; i < DV; i++) o[i] = _mm256_mul_ps(_mm256_load_ps(&acc[g][8 * i]), al); \
            for (int j = 0; j < n; j++) {                                                          \
                __m256 p = _mm256_set1_ps(s[g][j]);                                                \
                for (int i = 0; i < DV; i++) o[i] = _mm256_fmadd_ps(p, LOAD8(vr[j] + 8 * i), o[i]); \
            }                                                                                      \
            for (int i = 0; i < DV; i++) _mm256_store_ps(&acc[g][8 * i], o[i]);                    \
        }                                                                                          \
    }                                                                                              \
    for (int g = 0; g < group; g++) {                                                              \
        float inv = 1.0f / l[g];                                                                   \
        for (int d = 0; d < DIM; d++) out[(int64_t)g * DIM + d] = acc[g][d] * inv;                 \
    }                                                                                              \
}

DEFINE_TASK_AVX2(task_f32_64, float, load8_f32, 64)
DEFINE_TASK_AVX2(task_f32_128, float, load8_f32, 128)
DEFINE_TASK_AVX2(task_bf16_64, uint16_t, load8_bf16, 64)
DEFINE_TASK_AVX2(task_bf16_128, uint16_t, load8_bf16, 128)
#else
DEFINE_TASK(task_f32_64, float, LOAD_F32, 64)
DEFINE_TASK(task_f32_128, float, LOAD_F32, 128)
DEFINE_TASK(task_bf16_64, uint16_t, LOAD_BF16, 64)
DEFINE_TASK(task_bf16_128, uint16_t, LOAD_BF16, 128)
#endif

// Returns 0, or -1 when the shape exceeds the fixed per-task buffers (the caller falls back).
int decode_attention(const float *q, const void *k_cache, const void *v_cache, int kv_is_bf16,
                     const int32_t *req_to_token, const int32_t *req_rows, const int32_t *seq_lens,
                     float *out, int batch, int num_heads, int num_kv_heads, int dim,
                     int64_t kc_row, int64_t vc_row, int64_t r2t_row, float scale, int num_threads) {
    int group = num_heads / num_kv_heads;
    if (group > MAX_GROUP || (dim != 64 && dim != 128)) return -1;
    int tasks = batch * num_kv_heads;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int task = 0; task < tasks; task++) {
        int b = task / num_kv_heads, h = task % num_kv_heads;
        const int32_t *locs = req_to_token + (int64_t)req_rows[b] * r2t_row;
        const float *qb = q + ((int64_t)b * num_heads + (int64_t)h * group) * dim;
        float *ob = out + ((int64_t)b * num_heads + (int64_t)h * group) * dim;
        int64_t head_off = (int64_t)h * dim;
        int len = seq_lens[b];
        const void *kc = k_cache, *vc = v_cache;
        if (kv_is_bf16 && dim == 64)
            task_bf16_64(qb, kc, vc, locs, len, ob, group, kc_row, vc_row, head_off, scale);
        else if (kv_is_bf16)
            task_bf16_128(qb, kc, vc, locs, len, ob, group, kc_row, vc_row, head_off, scale);
        else if (dim == 64)
            task_f32_64(qb, kc, vc, locs, len, ob, group, kc_row, vc_row, head_off, scale);
        else
            task_f32_128(qb, kc, vc, locs, len, ob, group, kc_row, vc_row, head_off, scale);
    }
    return 0;
}
