// Linear layers over weights kept in GGML's block formats with int8 activations (quant_linear_q8), llama.cpp's scheme,
// chosen per weight (QuantLinear.int8_dot; kernels/quant_linear.py's quant_linear_q8_ref is the spec): the shapes and
// block layouts of quant_linear.c, which runs the float32 activations (weight-only) and here Q8_K weights and
// lightserve's own formats, which have no integer path. Two paths: a GEMV of the packed rows at M <= GEMV_MAX_M, and
// above it a GEMM over panels decoded once per call into bytes that vpmaddubsw multiplies (each described where it
// starts below). Both share the activations' quantizer (quant_activations_q8 runs it alone for the tests) and the
// byte-level decoding of the blocks; together past 400 lines for that reason.
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__F16C__) || defined(__SSE4_1__)
#include <immintrin.h>
#endif

#include "amx.h"
#include "ggml_blocks.h"
#include "kernels.h"
#include "share.h"

// The quantizer and the GEMV (M <= GEMV_MAX_M). Each row of x is quantized once per
// call to int8, per block of 32 elements, with a float32 scale (ggml's quantize_row_q8_0 with the scale kept in
// float32): d = amax / 127, q = rint(x * (1 / d)), round half to even (kernels/quant_linear.py's
// quantize_activations_ref is the same operations). A weight block's quants then meet the activation's as integer
// dot products of 32 (exact), and one float FMA a chunk scales them by the weight's scale times the activation's:
//   y += d_x * (s * sum(q_w q_x)) + o * (d_x * sum(q_x))
// with s and o the value = q * s + o of each group of the weight block (o = -8 s for Q4_0, the min for Q4_1 and Q4_K,
// -32 s for Q6_K, ...): the offsets meet the activation blocks' sums (precomputed, per 16 for Q6_K's groups) rather
// than every quant. Per 32 weights: the decode to bytes (a mask, a shift, the fifth or sixth bits or'd in), one
// vpmaddubsw + vpmaddwd (or one vpdpbusd with VNNI), one conversion and one FMA, where quant_linear.c's float GEMV
// widens, converts and FMAs every weight. Q8_0's signed weights take the sign trick (|w| by x with w's sign).
// The result is the float product of the dequantized activations with the dequantized weights, up to float32
// summation order: not the float32 activations' product (quant_linear_f32), an error of about 1/254 of each block's
// largest |x| per element. That is the GEMV here (M <= GEMV_MAX_M); the GEMM for larger M follows it. Q8_K weights
// run quant_linear_f32.

typedef float f8 __attribute__((vector_size(32)));
typedef int32_t i8 __attribute__((vector_size(32)));
typedef uint8_t b32 __attribute__((vector_size(32)));
typedef uint8_t b32_u __attribute__((vector_size(32), aligned(1)));
typedef float f8_u __attribute__((vector_size(32), aligned(4)));

static inline b32 load32(const void *p) { return *(const b32_u *)p; }
static inline f8 load8f(const float *p) { return *(const f8_u *)p; }
static inline f8 bcast8(float x) { return x - (f8){0}; }

// Lane j of the result: the sum of the products of bytes 4j .. 4j + 3 of w (unsigned, at most 127: no vpmaddubsw
// saturation) and of x (signed, |x| <= 127). Every path gives the same integers.
static inline i8 dot_u8s8(b32 w, const int8_t *x) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return (i8)_mm256_dpbusd_epi32(_mm256_setzero_si256(), (__m256i)w, _mm256_loadu_si256((const __m256i *)x));
#elif defined(__AVXVNNI__)
    return (i8)_mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), (__m256i)w, _mm256_loadu_si256((const __m256i *)x));
#elif defined(__AVX2__)
    const __m256i p = _mm256_maddubs_epi16((__m256i)w, _mm256_loadu_si256((const __m256i *)x));
    return (i8)_mm256_madd_epi16(p, _mm256_set1_epi16(1));
#elif defined(__SSSE3__)
    const __m128i one = _mm_set1_epi16(1);
    __m128i w2[2];
    memcpy(w2, &w, 32);
    const __m128i lo = _mm_madd_epi16(_mm_maddubs_epi16(w2[0], _mm_loadu_si128((const __m128i *)x)), one);
    const __m128i hi = _mm_madd_epi16(_mm_maddubs_epi16(w2[1], _mm_loadu_si128((const __m128i *)(x + 16))), one);
    i8 r;
    memcpy(&r, &lo, 16);
    memcpy((char *)&r + 16, &hi, 16);
    return r;
#else
    i8 r;
    for (int j = 0; j < 8; j++) {
        int s = 0;
        for (int i = 4 * j; i < 4 * j + 4; i++) s += (int)w[i] * (int)x[i];
        r[j] = s;
    }
    return r;
#endif
}

// The same for signed weights (Q8_0): |w| by x with w's sign (vpsignb), as ggml's mul_sum_i8_pairs.
static inline i8 dot_s8s8(b32 w, const int8_t *x) {
#if defined(__AVX2__)
    const __m256i xv = _mm256_loadu_si256((const __m256i *)x);
    const __m256i aw = _mm256_sign_epi8((__m256i)w, (__m256i)w), sx = _mm256_sign_epi8(xv, (__m256i)w);
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return (i8)_mm256_dpbusd_epi32(_mm256_setzero_si256(), aw, sx);
#elif defined(__AVXVNNI__)
    return (i8)_mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), aw, sx);
#else
    return (i8)_mm256_madd_epi16(_mm256_maddubs_epi16(aw, sx), _mm256_set1_epi16(1));
#endif
#else
    i8 r;
    for (int j = 0; j < 8; j++) {
        int s = 0;
        for (int i = 4 * j; i < 4 * j + 4; i++) s += (int)(int8_t)w[i] * (int)x[i];
        r[j] = s;
    }
    return r;
#endif
}

// 16 bytes -> 32: the low nibbles (elements 0-15 of a Q4_0 .. Q5_1 block), then the high ones (16-31).
static inline b32 nibbles16(const uint8_t *p) {
#if defined(__AVX2__)
    const __m128i t = _mm_loadu_si128((const __m128i *)p);
    const __m256i v = _mm256_inserti128_si256(_mm256_castsi128_si256(t), _mm_srli_epi16(t, 4), 1);
    return (b32)_mm256_and_si256(v, _mm256_set1_epi8(15));
#else
    b32 r;
    for (int i = 0; i < 16; i++) r[i] = p[i] & 15, r[i + 16] = p[i] >> 4;
    return r;
#endif
}

// Byte i = 16 where bit i of the little-endian 32 bits at p is set, else 0 (Q5_0 / Q5_1's fifth bits), as ggml's
// bytes_from_bits_32.
static inline b32 bits16(const uint8_t *p) {
    uint32_t x;
    memcpy(&x, p, 4);
#if defined(__AVX2__)
    const __m256i shuf = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
    __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32((int)x), shuf);
    bytes = _mm256_or_si256(bytes, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
    return (b32)_mm256_and_si256(_mm256_cmpeq_epi8(bytes, _mm256_set1_epi64x(-1)), _mm256_set1_epi8(16));
#else
    b32 r;
    for (int i = 0; i < 32; i++) r[i] = (x >> i & 1) << 4;
    return r;
#endif
}

// 8 bytes (unsigned, or signed with `sign`) as 8 floats.
static inline f8 bytes8_to_f(const uint8_t *p, const int sign) {
#if defined(__AVX2__)
    const __m128i b = _mm_loadl_epi64((const __m128i *)p);
    return (f8)_mm256_cvtepi32_ps(sign ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b));
#else
    f8 r;
    for (int i = 0; i < 8; i++) r[i] = sign ? (float)(int8_t)p[i] : (float)p[i];
    return r;
#endif
}

static inline f8 lane8(f8 v, const int j) { return __builtin_shuffle(v, (i8){j, j, j, j, j, j, j, j}); }
static inline f8 to_f8(i8 v) { return __builtin_convertvector(v, f8); }

// One call's quantized activations: M rows of K int8 quants (row stride K), and per row per block of 32 the scale
// d, d * (the block's quant sum), and per half block d * (the half's sum).
typedef struct {
    int8_t *q;
    float *d, *s32, *s16;
    int K;
} Act;

#if defined(__AVX2__)
static inline int hsum_i8(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return _mm_cvtsi128_si32(s);
}
#endif

// One block of 32: its quants into q, its scale and sums (ggml's quantize_row_q8_0; the AVX2 path rounds by
// vcvtps2dq, half to even as rint).
static inline void quantize_block(const float *xb, int8_t *q, float *d_out, float *s32, float *s16) {
    int sum[2] = {0, 0};
    float d;
#if defined(__AVX2__)
    __m256 v[4], a = _mm256_setzero_ps();
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (int i = 0; i < 4; i++) v[i] = _mm256_loadu_ps(xb + 8 * i), a = _mm256_max_ps(a, _mm256_and_ps(v[i], abs_mask));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float amax = _mm_cvtss_f32(m4);
    d = amax / 127.0f;
    const __m256 id = _mm256_set1_ps(d != 0.0f ? 1.0f / d : 0.0f);
    __m256i qi[4];
    for (int i = 0; i < 4; i++) qi[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], id));
    sum[0] = hsum_i8(_mm256_add_epi32(qi[0], qi[1]));
    sum[1] = hsum_i8(_mm256_add_epi32(qi[2], qi[3]));
    const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]), _mm256_packs_epi32(qi[2], qi[3]));
    _mm256_storeu_si256((__m256i *)q, _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
#else
    float amax = 0.0f;
    for (int i = 0; i < 32; i++) {
        const float v = __builtin_fabsf(xb[i]);
        amax = v > amax ? v : amax;
    }
    d = amax / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    for (int h = 0; h < 2; h++)
        for (int i = 16 * h; i < 16 * h + 16; i++) {
            q[i] = (int8_t)__builtin_rintf(xb[i] * id);
            sum[h] += q[i];
        }
#endif
    *d_out = d;
    *s32 = d * (float)(sum[0] + sum[1]);
    s16[0] = d * (float)sum[0];
    s16[1] = d * (float)sum[1];
}

static void quantize_act(const float *x, int64_t x_row, int M, int K, const Act *a) {
    const int nb = K / 32;
    for (int m = 0; m < M; m++)
        for (int b = 0; b < nb; b++)
            quantize_block(x + m * x_row + 32 * b, a->q + (int64_t)m * K + 32 * b, a->d + m * nb + b,
                           a->s32 + m * nb + b, a->s16 + 2 * (m * nb + b));
}

// Rows m0 .. m0 + mt - 1 of the activations by output rows 0 .. nr - 1 of w (nr <= R; the rows past nr repeat the
// last, their results dropped). mt and R constants at each call site; acc[m][r] the float sums by lane, off[m][r]
// the 32-element formats' offset terms.
#define Q8_ROWS 4
static inline __attribute__((always_inline)) void q8_tile(const int qtype, const Act *a, int m0, const int mt,
                                                          const uint8_t *w, int64_t w_row_bytes, int nr, const int R,
                                                          const float *bias, float *out, int64_t out_row,
                                                          Ahead ahead) {
    const int K = a->K, nc = K / 32, qk = block_elems(qtype), nbytes = block_bytes(qtype), nb = K / qk;
    f8 acc[2][Q8_ROWS];
    float off[2][Q8_ROWS];
    const uint8_t *wr[Q8_ROWS];
    for (int r = 0; r < R; r++) {
        wr[r] = w + (int64_t)(r < nr ? r : nr - 1) * w_row_bytes;
        for (int m = 0; m < mt; m++) acc[m][r] = (f8){0}, off[m][r] = 0.0f;
    }
    const int8_t *xq = a->q + (int64_t)m0 * K;
    const float *xd = a->d + (int64_t)m0 * nc, *xs = a->s32 + (int64_t)m0 * nc, *xh = a->s16 + (int64_t)m0 * 2 * nc;
    for (int b = 0; b < nb; b++) {
        const int c0 = b * qk / 32;  // the block's first chunk of 32
        ahead_step(&ahead, nb);
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            const uint8_t *blk = wr[r] + (int64_t)b * nbytes;
            switch (qtype) {
                case GGML_Q4_0: case GGML_Q4_1: case GGML_Q5_0: case GGML_Q5_1: case GGML_Q8_0: {
                    const float s = half_to_float(blk);
                    float o = 0.0f;
                    b32 q;
                    if (qtype == GGML_Q4_0) o = -8.0f * s, q = nibbles16(blk + 2);
                    if (qtype == GGML_Q4_1) o = half_to_float(blk + 2), q = nibbles16(blk + 4);
                    if (qtype == GGML_Q5_0) o = -16.0f * s, q = nibbles16(blk + 6) | bits16(blk + 2);
                    if (qtype == GGML_Q5_1) o = half_to_float(blk + 2), q = nibbles16(blk + 8) | bits16(blk + 4);
                    if (qtype == GGML_Q8_0) q = load32(blk + 2);
                    for (int m = 0; m < mt; m++) {
                        const int8_t *x = xq + m * K + 32 * c0;
                        const i8 dot = qtype == GGML_Q8_0 ? dot_s8s8(q, x) : dot_u8s8(q, x);
                        acc[m][r] += to_f8(dot) * bcast8(s * xd[m * nc + c0]);
                        if (qtype != GGML_Q8_0) off[m][r] += o * xs[m * nc + c0];
                    }
                    break;
                }
                case GGML_Q4_K: case GGML_Q5_K: {
                    uint64_t scales, mins;  // the 8 sub-blocks' 6-bit scales and mins, a byte each
                    scales_mins_k4(blk + 4, &scales, &mins);
                    const f8 sv = bcast8(half_to_float(blk)) * u64_bytes_to_f(scales);
                    const f8 ov = -(bcast8(half_to_float(blk + 2)) * u64_bytes_to_f(mins));
                    f8 sdx[2];
                    for (int m = 0; m < mt; m++) {
                        acc[m][r] += ov * load8f(xs + m * nc + c0);  // lane j: sub-block j's min term
                        sdx[m] = sv * load8f(xd + m * nc + c0);      // lane j: its scale times the chunk's d
                    }
                    const uint8_t *qs = blk + (qtype == GGML_Q4_K ? 16 : 48);
                    const b32 h = load32(blk + 16);
#pragma GCC unroll 4
                    for (int j = 0; j < 4; j++) {
                        const b32 v = load32(qs + 32 * j);
                        b32 lo = v & 15, hi = v >> 4;
                        if (qtype == GGML_Q5_K) {
                            lo |= (h >> (2 * j) & 1) << 4;
                            hi |= (h >> (2 * j + 1) & 1) << 4;
                        }
                        for (int m = 0; m < mt; m++) {
                            const int8_t *x = xq + m * K + 32 * (c0 + 2 * j);
                            acc[m][r] += to_f8(dot_u8s8(lo, x)) * lane8(sdx[m], 2 * j);
                            acc[m][r] += to_f8(dot_u8s8(hi, x + 32)) * lane8(sdx[m], 2 * j + 1);
                        }
                    }
                    break;
                }
                case GGML_Q6_K: {
                    const f8 d = bcast8(half_to_float(blk + 208));
                    const f8 s_lo = d * bytes8_to_f(blk + 192, 1), s_hi = d * bytes8_to_f(blk + 200, 1);
                    for (int m = 0; m < mt; m++)  // groups of 16: -32 s each, by the halves' sums
                        acc[m][r] -= 32.0f * (s_lo * load8f(xh + m * 2 * nc + 2 * c0)
                                              + s_hi * load8f(xh + m * 2 * nc + 2 * c0 + 8));
#pragma GCC unroll 2
                    for (int half = 0; half < 2; half++) {
                        const b32 a0 = load32(blk + 64 * half), a1 = load32(blk + 64 * half + 32);
                        const b32 h = load32(blk + 128 + 32 * half);
                        const b32 q[4] = {(a0 & 15) | (h & 3) << 4, (a1 & 15) | (h >> 2 & 3) << 4,
                                          (a0 >> 4) | (h >> 4 & 3) << 4, (a1 >> 4) | (h >> 6) << 4};
                        const f8 sh = half ? s_hi : s_lo;
#pragma GCC unroll 4
                        for (int c = 0; c < 4; c++) {
                            // chunk 4 half + c: groups 8 half + 2c and + 1, lanes 2c, 2c + 1 of this half's scales
                            const f8 sc = __builtin_shuffle(sh, (i8){2 * c, 2 * c, 2 * c, 2 * c, 2 * c + 1, 2 * c + 1,
                                                                     2 * c + 1, 2 * c + 1});
                            for (int m = 0; m < mt; m++) {
                                const int cc = c0 + 4 * half + c;
                                acc[m][r] += to_f8(dot_u8s8(q[c], xq + m * K + 32 * cc)) * (sc * xd[m * nc + cc]);
                            }
                        }
                    }
                    break;
                }
            }
        }
    }
    for (int m = 0; m < mt; m++)
        for (int r = 0; r < nr; r++) {
            float sum = 0.0f;
            for (int i = 0; i < 8; i++) sum += acc[m][r][i];
            out[(int64_t)m * out_row + r] = sum + off[m][r] + (bias ? bias[r] : 0.0f);
        }
}

// Output rows n .. n + nr - 1 (nr <= Q8_ROWS) for every row of the activations: two rows at a time by pairs of rows
// of x; a single row of x by four rows at a time for the 32-element formats, by one for the K-quants. Zen 3, 2 threads,
// weights from memory, a Llama-3.2-1B's shapes (scripts/bench_quant_linear.py --models llama1b --rows 1, the two forms
// alternated twice): one K-quant row at a time ran Q4_K's [8192, 2048] in 0.60 ms against 1.16-1.25 with four, Q6_K's
// in 0.80-0.82 against 2.30-2.65, its [2048, 8192] in 0.75-0.80 against 1.22-1.40; Q8_0 went the other way (its
// [2048, 8192] 1.00 ms against 0.70).
static inline __attribute__((always_inline)) void q8_rows(const int qtype, const Act *a, int M, const uint8_t *w,
                                                          int64_t w_row_bytes, int nr, const float *bias, float *out,
                                                          int64_t out_row, const uint8_t *w_end) {
    const Ahead none = {w, 0, 0};  // rows already read by the pass for the rows of x before
    for (int m = 0; m < M;) {
        if (M - m >= 2) {
            for (int r = 0; r < nr; r += 2)
                q8_tile(qtype, a, m, 2, w + r * w_row_bytes, w_row_bytes, nr - r < 2 ? nr - r : 2, 2,
                        bias ? bias + r : NULL, out + m * out_row + r, out_row,
                        m ? none : ahead_of(w + r * w_row_bytes, 2 * w_row_bytes, w_end));
            m += 2;
        } else if (one_row_gemv(qtype)) {
            for (int r = 0; r < nr; r++)
                q8_tile(qtype, a, m, 1, w + r * w_row_bytes, w_row_bytes, 1, 1, bias ? bias + r : NULL,
                        out + m * out_row + r, out_row, m ? none : ahead_of(w + r * w_row_bytes, w_row_bytes, w_end));
            m += 1;
        } else {
            q8_tile(qtype, a, m, 1, w, w_row_bytes, nr, Q8_ROWS, bias, out + m * out_row, out_row,
                    m ? none : ahead_of(w, nr * w_row_bytes, w_end));
            m += 1;
        }
    }
}

// ---------------------------------------------------------------------------------------------------------------
// int8 activations at larger M (prefill, batched decode): the weights decoded once per call into panels of 8 output
// features, interleaved so that a vector's 8 int32 lanes are 8 features. Per chunk c of 32 (one block of the
// 32-element formats, a sub-block of the K-quants):
//   p.q[c][g]  32 bytes: bytes 4g .. 4g + 3 of the chunk's quants for each of the 8 features (feature f at 4f)
//   p.s[c][h]  the 8 features' float scales (h: the two 16-element halves, which differ only in Q6_K)
//   p.o[c][h]  their offsets (o of value = q * s + o; zero for Q8_0)
// A row m of x then meets 8 features at once: its 4 quants at 4g broadcast to every lane, one vpmaddubsw by p.q[c][g]
// gives 16 int16 pair sums, and the runs of them that cannot overflow int16 (8 for 4-bit quants, 4 for 5-bit, 2 for
// Q6_K's 6 bits, 1 for Q8_0's sign trick: |w| 15 * |x| 127 * 2 = 3,810 a pair, 8 of them 30,480) are added before one
// vpmaddwd widens them to int32: the chunk's 8 dot products, exact. A conversion, a multiply and an FMA a chunk
// scale them:
//   acc[m][f] += d_x[m][c] * s[c][f] * dot[m][f] + o[c][f] * d_x[m][c] * sum(q_x[m][c])
// which is quant_linear_q8_ref's product up to float32 summation order, as the GEMV path's. For 4-bit quants that
// is 1.1 vector integer multiplies per 32 multiply-adds of a feature, where the float32 register tile spends four
// FMAs. Work item: QG_SUB panels (32 output features) over every row of x, K in pieces of QG_KC (the decoded panels,
// 48 KB, stay in L2; a tile's 4 rows of x, 6 KB, in L1 across the 4 panels); the accumulators go to `out` after
// each piece (lanes are features: no horizontal sums).
// Zen 3, 2 threads, a Llama-3.2-1B's shapes at M = 256 (scripts/bench_quant_linear.py --rows 8 64 256): Q4_1 and
// Q4_K 0.57-0.64x the float32 GEMM's time (which runs at 93-99% of the FMA peak) and 0.45-0.58x the float tiles
// over dequantized panels; Q6_K 0.81-0.90x (two halves a chunk, runs of two), Q8_0 0.89-0.99x (the sign trick and
// a widening every group). At M = 8 the decoding is paid for few rows and still 0.55-0.79x for 4-bit (Q6_K 1.0-1.1x).

// With VNNI (AVX512-VNNI with VL, or AVX-VNNI) the tile runs vpdpbusd: acc + the sums of four products of w's bytes
// (unsigned) by x's (signed) per int32 lane, the same integers as maddubs then madd_ones, without the int16 step. With
// no int16 sums to keep from saturating, Q8_0 is decoded there as unsigned bytes w + 128 and an offset of -128 d, as
// the 4-bit formats carry theirs, so its groups skip the sign trick: Intel Xeon (AMX), 2 threads, a Llama-3.2-1B's
// shapes at M = 64 and 256, 0.70-0.79x the time of the sign trick, level with Q4_1 (scripts/bench_quant_linear.py
// --rows 64 256).
#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
#define QG_VNNI 1
static inline i8 dpbusd(i8 acc, b32 w, b32 x) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return (i8)_mm256_dpbusd_epi32((__m256i)acc, (__m256i)w, (__m256i)x);
#else
    return (i8)_mm256_dpbusd_avx_epi32((__m256i)acc, (__m256i)w, (__m256i)x);
#endif
}
#else
#define QG_VNNI 0
#endif
#define QG_MT 4      // rows of x a tile: 4 float accumulators, 4 int16 partial sums, the weights and a broadcast
#define QG_SUB 4     // panels of 8 features a work item
#define QG_KC 1024   // K a decoded piece covers (a multiple of 256: whole K-quant super-blocks)

typedef int16_t h16 __attribute__((vector_size(32)));
typedef struct {
    b32 q[QG_KC / 32][8];
    f8 s[QG_KC / 32][2], o[QG_KC / 32][2];
} QPanel;

// Chunk j of a weight block (elements 32 j .. 32 j + 31; j a constant where the caller unrolls): its 32 quants
// (unsigned; Q8_0's signed), the scale and offset of each 16-element half (values = q * s + o, as dequantize_ref).
static inline __attribute__((always_inline)) void decode_chunk(const int qtype, const uint8_t *blk, const int j,
                                                                b32 *q, float s[2], float o[2]) {
    switch (qtype) {
        case GGML_Q4_0: case GGML_Q4_1: case GGML_Q5_0: case GGML_Q5_1: case GGML_Q8_0: {
            const float d = half_to_float(blk);
            s[0] = s[1] = d;
            if (qtype == GGML_Q4_0) o[0] = -8.0f * d, *q = nibbles16(blk + 2);
            if (qtype == GGML_Q4_1) o[0] = half_to_float(blk + 2), *q = nibbles16(blk + 4);
            if (qtype == GGML_Q5_0) o[0] = -16.0f * d, *q = nibbles16(blk + 6) | bits16(blk + 2);
            if (qtype == GGML_Q5_1) o[0] = half_to_float(blk + 2), *q = nibbles16(blk + 8) | bits16(blk + 4);
            // Q8_0 with VNNI: as unsigned bytes w + 128, whose extra 128 * sum(x) the offset -128 d takes back (the
            // signed bytes would need the sign trick in every group of the tile).
            if (qtype == GGML_Q8_0) o[0] = QG_VNNI ? -128.0f * d : 0.0f, *q = load32(blk + 2) ^ (QG_VNNI ? 0x80 : 0);
            o[1] = o[0];
            break;
        }
        case GGML_Q4_K: case GGML_Q5_K: {
            int sc, m;
            scale_min_k4(j, blk + 4, &sc, &m);
            s[0] = s[1] = half_to_float(blk) * (float)sc;
            o[0] = o[1] = -half_to_float(blk + 2) * (float)m;
            const b32 v = load32(blk + (qtype == GGML_Q4_K ? 16 : 48) + 32 * (j / 2));
            *q = j & 1 ? v >> 4 : v & 15;
            if (qtype == GGML_Q5_K) *q |= (load32(blk + 16) >> j & 1) << 4;
            break;
        }
        case GGML_Q6_K: {
            const int half = j / 4, c = j % 4;
            const b32 a = load32(blk + 64 * half + 32 * (c & 1)), h = load32(blk + 128 + 32 * half);
            *q = (c < 2 ? a & 15 : a >> 4) | (h >> (2 * c) & 3) << 4;
            const float d = half_to_float(blk + 208);
            for (int i = 0; i < 2; i++) {
                s[i] = d * (float)(int8_t)blk[192 + 8 * half + 2 * c + i];
                o[i] = -32.0f * s[i];
            }
            break;
        }
    }
}

// Features n0 .. n0 + nf - 1 (nf <= 8; the lanes past nf zero) over chunks gc0 .. gc0 + nc - 1 (whole blocks) into
// p: each chunk's 8 rows of 32 bytes transposed as an 8 x 8 matrix of 4-byte words (three levels of interleaves, as
// to_panel).
static inline __attribute__((always_inline)) void decode_panel(const int qtype, const uint8_t *w, int64_t w_row_bytes,
                                                                int nf, int gc0, int nc, QPanel *p) {
    const int per_block = block_elems(qtype) / 32;
    for (int c0 = 0; c0 < nc; c0 += per_block) {
        const int64_t blk = (int64_t)(gc0 + c0) / per_block * block_bytes(qtype);
#pragma GCC unroll 8
        for (int j = 0; j < per_block; j++) {  // unrolled: the shifts by j are constants
            const int c = c0 + j;
            i8 r[8], t[8];
            f8 s[2] = {}, o[2] = {};
            for (int f = 0; f < 8; f++) {
                b32 q = {};
                float sf[2] = {0.0f, 0.0f}, of[2] = {0.0f, 0.0f};
                if (f < nf) decode_chunk(qtype, w + f * w_row_bytes + blk, j, &q, sf, of);
                r[f] = (i8)q;
                for (int h = 0; h < 2; h++) s[h][f] = sf[h], o[h][f] = of[h];
            }
            for (int level = 0; level < 3; level++) {
                for (int i = 0; i < 4; i++) {
                    t[2 * i] = __builtin_shufflevector(r[i], r[i + 4], 0, 8, 1, 9, 2, 10, 3, 11);
                    t[2 * i + 1] = __builtin_shufflevector(r[i], r[i + 4], 4, 12, 5, 13, 6, 14, 7, 15);
                }
                memcpy(r, t, sizeof r);
            }
            for (int g = 0; g < 8; g++) p->q[c][g] = (b32)r[g];
            for (int h = 0; h < 2; h++) p->s[c][h] = s[h], p->o[c][h] = o[h];
        }
    }
}

// 4 bytes of x broadcast to 8 lanes, and the vpmaddubsw / vpmaddwd the tile runs (the generic loops give the same
// integers: the pair sums stay inside int16 by the runs above).
static inline b32 bcast4(const int8_t *x) {
    int32_t v;
    memcpy(&v, x, 4);
    return (b32)(i8){v, v, v, v, v, v, v, v};
}
static inline h16 maddubs(b32 w, b32 x) {
#if defined(__AVX2__)
    return (h16)_mm256_maddubs_epi16((__m256i)w, (__m256i)x);
#else
    h16 r;
    for (int i = 0; i < 16; i++) r[i] = (int16_t)(w[2 * i] * (int8_t)x[2 * i] + w[2 * i + 1] * (int8_t)x[2 * i + 1]);
    return r;
#endif
}
static inline i8 madd_ones(h16 p) {
#if defined(__AVX2__)
    return (i8)_mm256_madd_epi16((__m256i)p, _mm256_set1_epi16(1));
#else
    i8 r;
    for (int i = 0; i < 8; i++) r[i] = p[2 * i] + p[2 * i + 1];
    return r;
#endif
}
// x's bytes with w's signs (zero where w is zero), and |w|: Q8_0's signed weights as unsigned ones (vpsignb).
static inline b32 sign8(b32 x, b32 w) {
#if defined(__AVX2__)
    return (b32)_mm256_sign_epi8((__m256i)x, (__m256i)w);
#else
    b32 r;
    for (int i = 0; i < 32; i++) r[i] = (int8_t)w[i] < 0 ? (uint8_t)-(int8_t)x[i] : w[i] ? x[i] : 0;
    return r;
#endif
}

// Rows 4t .. 4t + 3 of the quantized x at chunk c, the layout the GEMM's tiles read (one pointer walks it): their
// quants, scales d, d * (the chunk's quant sum) and d * (each half's sum); rows past M are zeros.
typedef struct {
    int8_t q[QG_MT][32];
    float d[QG_MT], s32[QG_MT], s16[QG_MT][2];
} XChunk;

static void quantize_tiles(const float *x, int64_t x_row, int M, int K, XChunk *xt) {
    const int nc = K / 32, tiles = (M + QG_MT - 1) / QG_MT;
    memset(xt + (int64_t)(tiles - 1) * nc, 0, sizeof(XChunk) * nc);  // the last tile's rows past M
    for (int m = 0; m < M; m++)
        for (int c = 0; c < nc; c++) {
            XChunk *t = xt + (int64_t)(m / QG_MT) * nc + c;
            const int r = m % QG_MT;
            quantize_block(x + m * x_row + 32 * c, t->q[r], &t->d[r], &t->s32[r], t->s16[r]);
        }
}

// A tile of 4 rows of x (xt: its chunk gc0) by the panel's 8 features over the panel's nc chunks, added to acc[4]
// (lanes: features). Each run of groups adds its vpmaddubsw results in int16 and widens them once.
static inline __attribute__((always_inline)) void qg_tile(const int qtype, const QPanel *p, int nc, const XChunk *xt,
                                                          f8 *acc_io) {
    const int q6 = qtype == GGML_Q6_K, q8 = qtype == GGML_Q8_0 && !QG_VNNI;  // q8: signed bytes (decode_chunk)
    const int run = q8 ? 1 : q6 ? 2 : (qtype == GGML_Q5_0 || qtype == GGML_Q5_1 || qtype == GGML_Q5_K) ? 4 : 8;
    f8 acc[QG_MT];
    for (int m = 0; m < QG_MT; m++) acc[m] = acc_io[m];
    for (int c = 0; c < nc; c++) {
        const XChunk *x = xt + c;
        for (int h = 0; h < (q6 ? 2 : 1); h++) {
            const int g_first = q6 ? 4 * h : 0, g_end = q6 ? 4 * h + 4 : 8;
            i8 dot[QG_MT];
#if QG_VNNI
            (void)run;
            // One vpdpbusd a group: the products summed four at a time straight into int32, no int16 runs.
            for (int g = g_first; g < g_end; g++) {
                const b32 w = p->q[c][g], uw = q8 ? sign8(w, w) : w;
                for (int m = 0; m < QG_MT; m++) {
                    b32 xb = bcast4(x->q[m] + 4 * g);
                    if (q8) xb = sign8(xb, w);
                    dot[m] = dpbusd(g == g_first ? (i8){0} : dot[m], uw, xb);
                }
            }
#else
            for (int g0 = g_first; g0 < g_end; g0 += run) {
                h16 part[QG_MT];
                for (int g = g0; g < g0 + run; g++) {
                    const b32 w = p->q[c][g], uw = q8 ? sign8(w, w) : w;
                    for (int m = 0; m < QG_MT; m++) {
                        b32 xb = bcast4(x->q[m] + 4 * g);
                        if (q8) xb = sign8(xb, w);
                        const h16 t = maddubs(uw, xb);
                        part[m] = g == g0 ? t : part[m] + t;
                        __asm__("" : "+x"(part[m]));  // the sums in order: gcc's reassociated trees spilled
                    }
                }
                for (int m = 0; m < QG_MT; m++)
                    dot[m] = g0 == g_first ? madd_ones(part[m]) : dot[m] + madd_ones(part[m]);
            }
#endif
            for (int m = 0; m < QG_MT; m++) acc[m] += to_f8(dot[m]) * (p->s[c][h] * bcast8(x->d[m]));
        }
        if (!q8)
            for (int m = 0; m < QG_MT; m++)
                acc[m] += q6 ? p->o[c][0] * bcast8(x->s16[m][0]) + p->o[c][1] * bcast8(x->s16[m][1])
                             : p->o[c][0] * bcast8(x->s32[m]);
    }
    for (int m = 0; m < QG_MT; m++) acc_io[m] = acc[m];
}

// Work item `item`: output features item * 32 .. + 31 for every row of x (xt: quantize_tiles' layout).
static inline __attribute__((always_inline)) void qg_item(const int qtype, const XChunk *xt, int M, int K,
                                                          const uint8_t *w, int64_t w_row_bytes, int N,
                                                          const float *bias, float *out, int64_t out_row,
                                                          int64_t item, QPanel *panels) {
    const int64_t n0 = item * 8 * QG_SUB;
    const int nf_all = N - n0 < 8 * QG_SUB ? (int)(N - n0) : 8 * QG_SUB, nsub = (nf_all + 7) / 8;
    for (int k0 = 0; k0 < K; k0 += QG_KC) {
        const int nc = (K - k0 < QG_KC ? K - k0 : QG_KC) / 32;
        for (int sp = 0; sp < nsub; sp++) {
            const int nf = nf_all - 8 * sp < 8 ? nf_all - 8 * sp : 8;
            decode_panel(qtype, w + (n0 + 8 * sp) * w_row_bytes, w_row_bytes, nf, k0 / 32, nc, panels + sp);
        }
        for (int m0 = 0; m0 < M; m0 += QG_MT) {
            const int mt = M - m0 < QG_MT ? M - m0 : QG_MT;
            for (int sp = 0; sp < nsub; sp++) {
                const int64_t n = n0 + 8 * sp;
                const int nf = nf_all - 8 * sp < 8 ? nf_all - 8 * sp : 8;
                f8 acc[QG_MT] = {};
                for (int m = 0; m < mt; m++) {
                    const float *src = k0 ? out + (int64_t)(m0 + m) * out_row + n : bias ? bias + n : NULL;
                    if (src && nf == 8) acc[m] = load8f(src);
                    else if (src) for (int f = 0; f < nf; f++) acc[m][f] = src[f];
                }
                qg_tile(qtype, panels + sp, nc, xt + (int64_t)(m0 / QG_MT) * (K / 32) + k0 / 32, acc);
                for (int m = 0; m < mt; m++) {
                    float *dst = out + (int64_t)(m0 + m) * out_row + n;
                    if (nf == 8) *(f8_u *)dst = acc[m];
                    else for (int f = 0; f < nf; f++) dst[f] = acc[m][f];
                }
            }
        }
    }
}

#define FOR_EACH_Q8_TYPE(CASE)                                                                                   \
    CASE(GGML_Q4_0) CASE(GGML_Q4_1) CASE(GGML_Q5_0) CASE(GGML_Q5_1) CASE(GGML_Q8_0) CASE(GGML_Q4_K)           \
    CASE(GGML_Q5_K) CASE(GGML_Q6_K)

int quant_activations_q8(const float *x, int64_t x_row, int M, int K, int8_t *q, float *d) {
    if (M < 1 || K < 32 || K % 32) return -1;
    float *sums = malloc(sizeof(float) * 3 * (size_t)M * (K / 32));
    if (!sums) return -1;
    const Act a = {q, d, sums, sums + (size_t)M * (K / 32), K};
    quantize_act(x, x_row, M, K, &a);
    free(sums);
    return 0;
}

// M <= GEMV_MAX_M: the packed rows streamed, Q8_ROWS output rows an item.
static int q8_gemv(const float *x, int64_t x_row, int M, int K, const uint8_t *w, int64_t w_row_bytes, int qtype,
                   int N, const float *bias, float *out, int64_t out_row, int threads) {
    const size_t nc = (size_t)M * (K / 32);
    const size_t qbytes = ((size_t)M * K + 63) / 64 * 64;  // the quants, then the floats: d, s32, s16 (2 nc)
    char *mem = malloc(qbytes + sizeof(float) * 4 * nc);
    if (!mem) return -1;
    float *f = (float *)(mem + qbytes);
    const Act a = {(int8_t *)mem, f, f + nc, f + 2 * nc, K};
    quantize_act(x, x_row, M, K, &a);
    Shares shares;
    shares_init(&shares, ((int64_t)N + Q8_ROWS - 1) / Q8_ROWS, threads);
    #pragma omp parallel num_threads(threads)
    for (int64_t g; (g = shares_take(&shares)) >= 0;) {
        const int64_t n = g * Q8_ROWS;
        const int nr = N - n < Q8_ROWS ? (int)(N - n) : Q8_ROWS;
#define Q8_CASE(T)                                                                                               \
    case T: q8_rows(T, &a, M, w + n * w_row_bytes, w_row_bytes, nr, bias ? bias + n : NULL, out + n, out_row,    \
                    w + N * w_row_bytes);                                                                        \
        break;
        switch (qtype) { FOR_EACH_Q8_TYPE(Q8_CASE) }
#undef Q8_CASE
    }
    free(mem);
    return 0;
}

// Larger M: work items of 8 * QG_SUB output features, each thread its own decoded panels.
static int q8_gemm(const float *x, int64_t x_row, int M, int K, const uint8_t *w, int64_t w_row_bytes, int qtype,
                   int N, const float *bias, float *out, int64_t out_row, int threads) {
    XChunk *xt = aligned_alloc(64, sizeof(XChunk) * (size_t)((M + QG_MT - 1) / QG_MT) * (K / 32));
    if (!xt) return -1;
    quantize_tiles(x, x_row, M, K, xt);
    int failed = 0;
    Shares shares;
    shares_init(&shares, ((int64_t)N + 8 * QG_SUB - 1) / (8 * QG_SUB), threads);
    #pragma omp parallel num_threads(threads)
    {
        QPanel *panels = aligned_alloc(64, sizeof(QPanel) * QG_SUB);
        if (!panels) {
            #pragma omp atomic write
            failed = 1;
        }
        for (int64_t item; panels && (item = shares_take(&shares)) >= 0;) {
#define QG_CASE(T)                                                                                               \
    case T: qg_item(T, xt, M, K, w, w_row_bytes, N, bias, out, out_row, item, panels); break;
            switch (qtype) { FOR_EACH_Q8_TYPE(QG_CASE) }
#undef QG_CASE
        }
        free(panels);
    }
    free(xt);
    return failed ? -1 : 0;  // a thread without its panels left items undone: the caller falls back
}

#if HAS_AMX_INT8 && QG_VNNI
// ---------------------------------------------------------------------------------------------------------------
// The same GEMM on AMX tiles (M >= amx_min_m where the process may use them), with the weights as the A operand: a
// weight block's chunk of 32 quants is a row of an A tile as it lies in memory, so 16 features' Q8_0 blocks load into
// an A tile in place (rows w_row_bytes apart), never decoded; the other formats' chunks are decoded to 32 bytes a
// feature (decode_chunk, no transposition). x is the B operand, quantized once per call into B tiles: per 16 rows of
// x and chunk, 8 k quads by 16 rows by 4 bytes (512 bytes). One tdpbssd (tdpbusd for the unsigned formats with mins)
// gives a chunk's 16 features x 16 rows of exact int32 dots; they are scaled in float32 registers (lanes: rows of x):
//   acc[f][m] += dot[f][m] * (s[c][f] * d_x[m][c]) + o[c][f] * (d_x[m][c] * sum(q_x[m][c]))
// The formats whose offset is a multiple of the scale (Q4_0's -8 s, Q5_0's -16 s, Q6_K's -32 s; Q8_0 has none) are
// decoded as signed bytes q - 8, - 16, - 32 instead and skip the offset term. Each chunk's dots go through memory
// (tilestored, 1 KB in L1; amx_q8_block keeps four in flight). Q6_K's chunks are two steps of 16 k (a scale each
// half). After each K piece a 16 x 16 transposition turns acc into rows of out.
// Per 8,192 multiply-adds: one tile multiply and 16 x 3 vector instructions (4 with mins), where the VNNI tile spends
// 256 vpdpbusd and their broadcasts, and Q8_0 spends nothing on decoding. Intel Xeon (AMX), 2 threads, time against
// the VNNI tile (scripts/bench_quant_linear.py --no_amx_too, SmolLM2's and a Llama-3.2-1B's projections, weights
// cycled through 64 MB): at M = 256 0.54-0.72x, at 64 0.62-0.92x; at 16 Q8_0 0.72-0.86x, the decoded formats
// 0.83-1.28x, so below amx_min_m rows the VNNI tile stays (x padded to 16 rows, the decoding paid for few rows).
// The batch-64 decode step of SmolLM2's Q8_0 file (float32 activations, bf16 KV) fell from 99.2 to 82.0 ms, its
// linears from 52.9 to 34.3 ms. Where the time goes at M = 256, Q8_0, a [3,072, 576] weight in cache: 45% in the
// tile loads and the loop around them, a fifth in the stores, a third in the scaling.
static inline int amx_min_m(const int qtype) { return qtype == GGML_Q8_0 ? 16 : 32; }
typedef struct {
    int8_t q[QG_KC / 32][16][32];                      // chunk c, feature f: its 32 quants (an A tile row)
    float s[QG_KC / 32][2][16], o[QG_KC / 32][2][16];  // per chunk and half: the 16 features' scales and offsets
} ATiles;

// The zero point of the formats decoded as signed bytes q - z (o = -z s), or 0 where the offset is a minimum.
static inline int amx_zero(const int qtype) {
    return qtype == GGML_Q4_0 ? 8 : qtype == GGML_Q5_0 ? 16 : qtype == GGML_Q6_K ? 32 : 0;
}
static inline int amx_signed(const int qtype) { return qtype == GGML_Q8_0 || amx_zero(qtype); }

// Features 0 .. nf - 1 of w (nf <= 16; the rest zero) over chunks gc0 .. gc0 + nc - 1 into t; `scales_only`: Q8_0
// loaded in place, its scales alone.
static inline __attribute__((always_inline)) void amx_decode(const int qtype, const uint8_t *w, int64_t w_row_bytes,
                                                              int nf, int gc0, int nc, int scales_only, ATiles *t) {
    const int per_block = block_elems(qtype) / 32, z = amx_zero(qtype);
    for (int c = 0; c < nc; c++) {
        const int j = (gc0 + c) % per_block;
        for (int f = 0; f < 16; f++) {
            float sf[2] = {0.0f, 0.0f}, of[2] = {0.0f, 0.0f};
            b32 q = {};
            if (f < nf) {
                const uint8_t *blk = w + f * w_row_bytes + (int64_t)((gc0 + c) / per_block) * block_bytes(qtype);
                if (qtype == GGML_Q8_0) {
                    sf[0] = sf[1] = half_to_float(blk);
                    if (!scales_only) q = load32(blk + 2);
                } else {
                    switch (j) {  // constant shifts in decode_chunk
#define DEC_J(J) case J: decode_chunk(qtype, blk, J, &q, sf, of); break;
                        DEC_J(0) DEC_J(1) DEC_J(2) DEC_J(3) DEC_J(4) DEC_J(5) DEC_J(6) DEC_J(7)
#undef DEC_J
                    }
                    if (z) q -= (uint8_t)z, of[0] = of[1] = 0.0f;
                }
            }
            if (!scales_only) memcpy(t->q[c][f], &q, 32);
            for (int h = 0; h < 2; h++) t->s[c][h][f] = sf[h], t->o[c][h][f] = of[h];
        }
    }
}

// x quantized as B tiles: rows of x in blocks of 16 (Mp = M rounded up; rows past M zero), per block and chunk c
//   q   [8][16][4]  k quad g, row m: its 4 quants
//   d, s32 [16]     the rows' scales d and d * (the chunk's quant sum); s16 [2][16] d * (each half's sum)
typedef struct {
    int8_t *q;
    float *d, *s32, *s16;
    int nck;  // chunks of 32 in K
} XTiles;

// On one thread: split across two by chunks (a B tile's lines hold 16 rows), it took 1.00-1.16x the GEMM's time.
static void amx_quantize_x(const float *x, int64_t x_row, int M, const XTiles *xt) {
    const int nck = xt->nck;
    for (int m = 0; m < M; m++)
        for (int c = 0; c < nck; c++) {
            const int64_t at = (int64_t)(m / 16) * nck + c, r = m % 16;
            int8_t q[32];
            float s16[2];
            quantize_block(x + m * x_row + 32 * c, q, xt->d + 16 * at + r, xt->s32 + 16 * at + r, s16);
            xt->s16[32 * at + r] = s16[0];
            xt->s16[32 * at + 16 + r] = s16[1];
            for (int g = 0; g < 8; g++) memcpy(xt->q + 512 * at + 64 * g + 4 * r, q + 4 * g, 4);
        }
}

// The 16 x 16 floats r transposed in registers (unpacks within 128-bit lanes, then the lanes as a 4 x 4 matrix).
static inline __attribute__((always_inline)) void transpose16(__m512 r[16]) {
    __m512 t[16];
#pragma GCC unroll 8
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++) {  // r[4i + q], lane L: column 4L + q of rows 4i .. 4i + 3
        r[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
        r[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0xee);
        r[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
        r[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xee);
    }
#pragma GCC unroll 4
    for (int q = 0; q < 4; q++) {
        const __m512 p0 = _mm512_shuffle_f32x4(r[q], r[4 + q], 0x44), p1 = _mm512_shuffle_f32x4(r[q], r[4 + q], 0xee);
        const __m512 p2 = _mm512_shuffle_f32x4(r[8 + q], r[12 + q], 0x44);
        const __m512 p3 = _mm512_shuffle_f32x4(r[8 + q], r[12 + q], 0xee);
        t[q] = _mm512_shuffle_f32x4(p0, p2, 0x88);
        t[4 + q] = _mm512_shuffle_f32x4(p0, p2, 0xdd);
        t[8 + q] = _mm512_shuffle_f32x4(p1, p3, 0x88);
        t[12 + q] = _mm512_shuffle_f32x4(p1, p3, 0xdd);
    }
#pragma GCC unroll 16
    for (int i = 0; i < 16; i++) r[i] = t[i];
}

// acc[f] (lanes: the 16 rows of x) += the int32 dots of feature f (dots [16][16]) times s[f] * dx, plus o[f] * xs
// where the format has offsets.
static inline __attribute__((always_inline)) void amx_scale(const int offsets, const int32_t *dots, const float *s,
                                                             const float *o, const float *dx, const float *xs,
                                                             __m512 acc[16]) {
    const __m512 dv = _mm512_load_ps(dx), xv = offsets ? _mm512_load_ps(xs) : _mm512_setzero_ps();
#pragma GCC unroll 16
    for (int f = 0; f < 16; f++) {
        const __m512 dot = _mm512_cvtepi32_ps(_mm512_load_si512(dots + 16 * f));
        acc[f] = _mm512_fmadd_ps(dot, _mm512_mul_ps(dv, _mm512_set1_ps(s[f])), acc[f]);
        if (offsets) acc[f] = _mm512_fmadd_ps(_mm512_set1_ps(o[f]), xv, acc[f]);
    }
}

// A 16 x 16 output block: features a0 (rows a_stride bytes apart: w in place, or t's decoded quants) by rows
// 16 mb .. 16 mb + 15 of x over the piece's nc chunks from chunk gc0, added to acc. Steps of kq = 32 k (16 for
// Q6_K), four at a time in C tiles 0-3 (A tiles 4-5 and B tiles 6-7 alternating, as amx_q8_configure sets them): a
// tile's dots reach the vector unit through a store and its latency, so four products are in flight while the
// previous four are scaled. The vector loads of stored tile rows wait until the store retires (tilestored does not
// forward), so a group's dots are scaled after the next group's tiles are issued.
static inline __attribute__((always_inline)) void amx_q8_block(const int qtype, const uint8_t *a0, int64_t a_stride,
                                                               int64_t a_chunk, const XTiles *xt, int64_t mb,
                                                               int gc0, int nc, const ATiles *t, int32_t *dots,
                                                               __m512 acc[16]) {
    const int q6 = qtype == GGML_Q6_K, sgn = amx_signed(qtype), steps = q6 ? 2 * nc : nc;
    const int64_t at = mb * xt->nck + gc0;  // the x block's first chunk of the piece
    const int8_t *xq = xt->q + 512 * at;
    const float *dx = xt->d + 16 * at, *xs = q6 ? xt->s16 + 32 * at : xt->s32 + 16 * at;
#define AMX_STEP(C, A, B, st)                                                                                    \
    do {                                                                                                         \
        const int c_ = q6 ? (st) / 2 : (st), h_ = q6 ? (st) % 2 : 0;                                             \
        _tile_loadd(A, a0 + c_ * a_chunk + 16 * h_, a_stride);                                                   \
        _tile_loadd(B, xq + 512 * c_ + 256 * h_, 64);                                                            \
        _tile_zero(C);                                                                                           \
        if (sgn) _tile_dpbssd(C, A, B);                                                                          \
        else _tile_dpbusd(C, A, B);                                                                              \
        _tile_stored(C, dots + 256 * (4 * ring + (C)), 64);                                                      \
    } while (0)
    // Steps g0 .. g0 + n - 1, stored in dots' half `half`, scaled into acc.
#define AMX_SCALE_GROUP(half, g0, n)                                                                             \
    for (int i_ = 0; i_ < (n); i_++) {                                                                           \
        const int st_ = (g0) + i_, c_ = q6 ? st_ / 2 : st_, h_ = q6 ? st_ % 2 : 0;                               \
        amx_scale(!sgn, dots + 256 * (4 * (half) + i_), t->s[c_][h_], t->o[c_][h_], dx + 16 * c_, xs + 16 * st_, \
                  acc);                                                                                          \
    }
    int ring = 0, prev = -1, prev_n = 0;
    for (int g0 = 0; g0 < steps; g0 += 4) {
        const int n = steps - g0 < 4 ? steps - g0 : 4;
        AMX_STEP(0, 4, 6, g0);
        if (n > 1) AMX_STEP(1, 5, 7, g0 + 1);
        if (n > 2) AMX_STEP(2, 4, 6, g0 + 2);
        if (n > 3) AMX_STEP(3, 5, 7, g0 + 3);
        if (prev >= 0) AMX_SCALE_GROUP(1 - ring, prev, prev_n);
        prev = g0, prev_n = n, ring = 1 - ring;
    }
    AMX_SCALE_GROUP(1 - ring, prev, prev_n);
#undef AMX_STEP
#undef AMX_SCALE_GROUP
}

// The tile shapes of amx_q8_block: C 0-3 16 x 64 bytes, A 4-5 16 x kq bytes, B 6-7 kq / 4 x 64 (kq: k a step).
static void amx_q8_configure(const int q6) {
    const int kq = q6 ? 16 : 32;
    const uint8_t rows[8] = {16, 16, 16, 16, 16, 16, kq / 4, kq / 4};
    const uint16_t colsb[8] = {64, 64, 64, 64, kq, kq, 64, 64};
    amx_configure_shapes(rows, colsb);
}

// Work item `item`: output features item * 32 .. + 31 (two groups of 16) for every row of x, K in pieces of QG_KC.
static inline __attribute__((always_inline)) void amx_q8_item(const int qtype, const XTiles *xt, int M, int K,
                                                              const uint8_t *w, int64_t w_row_bytes, int N,
                                                              const float *bias, float *out, int64_t out_row,
                                                              int64_t item, ATiles *tiles, int32_t *dots) {
    const int64_t n0 = item * 32;
    const int nf_all = N - n0 < 32 ? (int)(N - n0) : 32, groups = (nf_all + 15) / 16;
    const int qk = block_elems(qtype), bb = block_bytes(qtype), calls = (M + 15) / 16 * groups;
    for (int k0 = 0; k0 < K; k0 += QG_KC) {
        const int nc = (K - k0 < QG_KC ? K - k0 : QG_KC) / 32;
        // The piece this thread decodes next, the same features' next QG_KC of K or else the next item's first
        // (which shares_take hands its owner next), is fetched into L2 while this one computes, a slice of its rows
        // before each 16 x 16 block below: its rows are 32 streams, more than the hardware prefetchers follow. Two
        // alternations of the builds (scripts/bench_quant_linear.py --models smollm2 llama1b --types Q8_0 Q4_K Q6_K
        // --rows 16 64 256, weights cycled through 960 MB): a Llama-3.2-1B's Q4_K and Q6_K at 64 rows 0.80-0.96x
        // the time, at 256 0.89-1.04x (the Q6_K lm_head 0.88-0.98x). Q8_0, loaded in place, ran 1.01-1.15x: not for
        // it.
        const uint8_t *next = w;
        int next_rows = 0, next_k = 0, call = 0;
        if (qtype != GGML_Q8_0 && k0 + QG_KC < K) {
            next = w + n0 * w_row_bytes + (int64_t)(k0 + QG_KC) / qk * bb, next_rows = nf_all, next_k = K - k0 - QG_KC;
        } else if (qtype != GGML_Q8_0 && n0 + 32 < N) {
            next = w + (n0 + 32) * w_row_bytes, next_rows = N - n0 - 32 < 32 ? (int)(N - n0 - 32) : 32, next_k = K;
        }
        const int next_lines = ((next_k < QG_KC ? next_k : QG_KC) / qk * bb + 63) / 64 + 1;  // +1: rows start anywhere
        for (int gi = 0; gi < groups; gi++) {
            const int nf = nf_all - 16 * gi < 16 ? nf_all - 16 * gi : 16;
            amx_decode(qtype, w + (n0 + 16 * gi) * w_row_bytes, w_row_bytes, nf, k0 / 32, nc,
                       qtype == GGML_Q8_0 && nf == 16, tiles + gi);
        }
        for (int m0 = 0; m0 < M; m0 += 16) {
            const int mt = M - m0 < 16 ? M - m0 : 16;
            for (int gi = 0; gi < groups; gi++) {
                const int64_t n = n0 + 16 * gi;
                const int nf = nf_all - 16 * gi < 16 ? nf_all - 16 * gi : 16;
                const __mmask16 cols = (__mmask16)((1u << nf) - 1);
                for (int r = call * next_rows / calls; r < (call + 1) * next_rows / calls; r++)
                    for (int l = 0; l < next_lines; l++) __builtin_prefetch(next + r * w_row_bytes + 64 * l, 0, 2);
                call++;
                __m512 acc[16];
#pragma GCC unroll 16
                for (int f = 0; f < 16; f++) acc[f] = _mm512_set1_ps(!k0 && bias && f < nf ? bias[n + f] : 0.0f);
                if (qtype == GGML_Q8_0 && nf == 16)  // in place: 16 rows of the blocks, a chunk 34 bytes on
                    amx_q8_block(qtype, w + n * w_row_bytes + (int64_t)(k0 / 32) * 34 + 2, w_row_bytes, 34, xt,
                                 m0 / 16, k0 / 32, nc, tiles + gi, dots, acc);
                else
                    amx_q8_block(qtype, (const uint8_t *)tiles[gi].q, 32, 16 * 32, xt, m0 / 16, k0 / 32, nc,
                                 tiles + gi, dots, acc);
                transpose16(acc);  // acc[m]: row m0 + m's 16 features
#pragma GCC unroll 16
                for (int m = 0; m < 16; m++) {  // unrolled, so that acc stays in registers
                    if (m >= mt) break;
                    float *dst = out + (int64_t)(m0 + m) * out_row + n;
                    __m512 v = acc[m];
                    if (k0) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(cols, dst));
                    _mm512_mask_storeu_ps(dst, cols, v);
                }
            }
        }
    }
}

// M >= amx_min_m(qtype) on AMX tiles: x quantized as B tiles once, work items of 32 features.
static int q8_amx(const float *x, int64_t x_row, int M, int K, const uint8_t *w, int64_t w_row_bytes, int qtype,
                  int N, const float *bias, float *out, int64_t out_row, int threads) {
    const int64_t chunks = (int64_t)(M + 15) / 16 * (K / 32);  // x's (16-row block, chunk) pairs
    const size_t bytes = (size_t)chunks * (512 + 4 * 16 * sizeof(float));
    char *mem = aligned_alloc(64, bytes);
    if (!mem) return -1;
    memset(mem, 0, bytes);  // the rows past M
    float *f = (float *)(mem + 512 * chunks);
    const XTiles xt = {(int8_t *)mem, f, f + 16 * chunks, f + 32 * chunks, K / 32};
    amx_quantize_x(x, x_row, M, &xt);
    int failed = 0;
    Shares shares;
    shares_init(&shares, ((int64_t)N + 31) / 32, threads);
    #pragma omp parallel num_threads(threads)
    {
        ATiles *tiles = aligned_alloc(64, sizeof(ATiles) * 2);
        int32_t *dots = aligned_alloc(64, sizeof(int32_t) * 8 * 256);  // two groups of four C tiles
        if (!tiles || !dots) {
            #pragma omp atomic write
            failed = 1;
        } else {
            amx_q8_configure(qtype == GGML_Q6_K);
            for (int64_t item; (item = shares_take(&shares)) >= 0;) {
#define QA_CASE(T)                                                                                               \
    case T: amx_q8_item(T, &xt, M, K, w, w_row_bytes, N, bias, out, out_row, item, tiles, dots); break;
                switch (qtype) { FOR_EACH_Q8_TYPE(QA_CASE) }
#undef QA_CASE
            }
            _tile_release();
        }
        free(tiles);
        free(dots);
    }
    free(mem);
    return failed ? -1 : 0;
}
#endif

int quant_linear_q8(const float *x, int64_t x_row, int M, int K, const uint8_t *w, int64_t w_row_bytes, int qtype,
                    int N, const float *bias, float *out, int64_t out_row, int threads) {
    const int qk = block_elems(qtype);
    if (qk == 0 || M < 1 || N < 1 || K < qk || K % qk || w_row_bytes < (int64_t)K / qk * block_bytes(qtype))
        return -1;
    // Q8_K and lightserve's own formats have no integer path (kernels/quant_linear.py's INT8_DOT_TYPES)
    if (qtype == GGML_Q8_K || qtype == LS_Q8_0F || qtype == LS_Q4_1F)
        return quant_linear_f32(x, x_row, M, K, w, w_row_bytes, qtype, N, bias, out, out_row, threads);
    if (M <= GEMV_MAX_M) return q8_gemv(x, x_row, M, K, w, w_row_bytes, qtype, N, bias, out, out_row, threads);
#if HAS_AMX_INT8 && QG_VNNI
    if (M >= amx_min_m(qtype) && amx_permitted())
        return q8_amx(x, x_row, M, K, w, w_row_bytes, qtype, N, bias, out, out_row, threads);
#endif
    return q8_gemm(x, x_row, M, K, w, w_row_bytes, qtype, N, bias, out, out_row, threads);
}
