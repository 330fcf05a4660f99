// Linear layers over weights kept in GGML's block formats, as a GGUF file stores them (kernels/quant_linear.py holds
// the torch reference and the dispatch): out[M, N] = x[M, K] . W[N, K]^T (+ bias), x and out float32 (weight-only
// quantization: float32 products of x with the dequantized weights, summed in float32).
//
// Shapes (row-major, strides in elements unless named bytes):
//   x    [M, K]  float32, row stride x_row
//   w    [N, K / QK blocks]  uint8, row n at w + n * w_row_bytes, each row its blocks in order (ggml's block_q4_0 ..
//        block_q8_K, QK = 32 or 256; or lightserve's LS_Q8_0F / LS_Q4_1F, kernels.h: Q8_0 and Q4_1 with float32
//        scales, into which HF int8 and 4-bit checkpoints are repacked)
//   bias [N]     float32 or NULL
//   out  [M, N]  float32, row stride out_row
//
// Every block decodes to values q * s + o in float32, with q the block's integer quant, s and o per group of 16 or 32
// quants (o = -8 s for Q4_0, the min for Q4_1, -32 s for Q6_K, ...). In each format the product q * s is exact in
// float32 (at most 22 significant bits: an fp16 scale times a 6-bit sub-scale times a 5-bit quant), so one FMA gives
// the value ggml's dequantize_row_* rounds, bit for bit (Q8_K's float32 scale: one multiply, as there). LS_Q8_0F and
// LS_Q4_1F hold an fp16 or bf16 checkpoint scale widened to float32 (and o = -s * zero, exact): q * s is exact there
// too, and q * s + o is the checkpoint's s * (q - zero) exactly.
//
// Two paths:
// - M <= GEMV_MAX_M (decode): a stream of the packed rows. Each group of quants is widened to int32 lanes, converted,
//   scaled by one FMA and multiplied into accumulators in registers, two output rows at a time (one for the K-quants
//   at M = 1, gemv_rows says why); nothing is written but the outputs, so the bytes read are the packed weights'
//   (0.56 to 1.14 bytes a weight).
// - Larger M: NR output features at a time, a K chunk of KC at a time, are dequantized into a small L1 buffer in
//   linear.c's panel order ([KC][NR]), and gemm_tile.h's float32 register tile runs every row of x over it: the
//   dequantization is paid once per panel for all M rows.
// Work split: output rows (GEMV) or panels (tiles) shared among the threads (share.h), as in linear.c.
// With int8 activations (QuantLinear.int8_dot) the same weights run quant_linear_q8.c instead; both read the blocks
// through ggml_blocks.h.
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__F16C__) || defined(__SSE4_1__)
#include <immintrin.h>
#endif

#include "gemm_tile.h"
#include "ggml_blocks.h"
#include "kernels.h"
#include "share.h"
#include "vec.h"

#define KC 256        // K chunk of a dequantized panel: a super-block, [KC][NR] floats (16 KB with AVX2)

typedef int32_t int32_u __attribute__((aligned(1)));

// VL bytes widened to int32 lanes: vpmovzxbd / vpmovsxbd from memory with AVX2 and AVX-512, two pmovzxbd with
// SSE4.1. gcc 12 compiles __builtin_convertvector's widening of bytes to a byte-by-byte scalar gather, so the vector
// builds use intrinsics; the generic loop is the same values.
// widen_u8 -> vu (vpmovzxbd) and widen_s8 -> vi (vpmovsxbd): X is u or i, as in the intrinsics' names; ELEM the
// byte's C type.
#if VL == 16 && defined(__AVX512F__)
#define WIDEN_BODY(X, V, ELEM) return (V)_mm512_cvtep##X##8_epi32(_mm_loadu_si128((const __m128i *)p));
#elif VL == 8 && defined(__AVX2__)
#define WIDEN_BODY(X, V, ELEM) return (V)_mm256_cvtep##X##8_epi32(_mm_loadl_epi64((const __m128i *)p));
#elif VL == 8 && defined(__SSE4_1__)
#define WIDEN_BODY(X, V, ELEM)                                                                                   \
    const __m128i lo = _mm_cvtep##X##8_epi32(_mm_cvtsi32_si128(*(const int32_u *)p)),                           \
                  hi = _mm_cvtep##X##8_epi32(_mm_cvtsi32_si128(*(const int32_u *)(p + 4)));                     \
    V v;                                                                                                         \
    memcpy(&v, &lo, 16);                                                                                         \
    memcpy((char *)&v + 16, &hi, 16);                                                                            \
    return v;
#else
#define WIDEN_BODY(X, V, ELEM)                                                                                   \
    V v;                                                                                                         \
    for (int i = 0; i < VL; i++) v[i] = (ELEM)p[i];                                                              \
    return v;
#endif
static inline vu widen_u8(const uint8_t *p) { WIDEN_BODY(u, vu, uint8_t) }
static inline vi widen_s8(const uint8_t *p) { WIDEN_BODY(i, vi, int8_t) }
#undef WIDEN_BODY

static inline vf to_float(vu q) { return __builtin_convertvector((vi)q, vf); }


// A block's value = q * s[g] + o[g] for the quants of group g (one group in the 32-element formats and Q8_K, one a
// sub-block of 32 in Q4_K and Q5_K, of 16 in Q6_K).
typedef struct {
    float s[16], o[16];
} Scales;


// The block's scales and offsets, as ggml's dequantize_row_* forms them (d * sc and dmin * m rounded to float32).
static inline __attribute__((always_inline)) void block_scales(const int qtype, const uint8_t *blk, Scales *p) {
    switch (qtype) {
        case GGML_Q4_0: p->s[0] = half_to_float(blk), p->o[0] = -8 * p->s[0]; break;
        case GGML_Q5_0: p->s[0] = half_to_float(blk), p->o[0] = -16 * p->s[0]; break;
        case GGML_Q4_1: case GGML_Q5_1: p->s[0] = half_to_float(blk), p->o[0] = half_to_float(blk + 2); break;
        case GGML_Q8_0: p->s[0] = half_to_float(blk); break;
        case GGML_Q8_K: case LS_Q8_0F: memcpy(p->s, blk, 4); break;
        case LS_Q4_1F: memcpy(p->s, blk, 4), memcpy(p->o, blk + 4, 4); break;
        case GGML_Q4_K: case GGML_Q5_K: {  // o = -(dmin * m), as (-dmin) * m: negation is exact
            uint64_t sc, mn;
            scales_mins_k4(blk + 4, &sc, &mn);
            scales8(sc, half_to_float(blk), p->s);
            scales8(mn, -half_to_float(blk + 2), p->o);
            break;
        }
        case GGML_Q6_K: {  // the 16 groups' int8 scales a vector at a time
            const vf d = vbroadcast(half_to_float(blk + 208));
            for (int i = 0; i < 16 / VL; i++) {
                const vf s = __builtin_convertvector(widen_s8(blk + 192 + i * VL), vf) * d;
                vstore(p->s + i * VL, s);
                vstore(p->o + i * VL, s * -32.0f);
            }
            break;
        }
    }
}

// Steps of 2 * VL values a block decodes in (decode_step).
static inline int block_steps(int qtype) { return block_elems(qtype) / (2 * VL); }

// Step u of a block: two vectors of VL dequantized values each, w[i] being elements k[i] .. k[i] + VL - 1 of the
// block. Written after ggml's dequantize_row_* (the layouts are in ggml-common.h).
static inline __attribute__((always_inline)) void decode_step(const int qtype, const uint8_t *blk, const Scales *p,
                                                              int u, vf w[2], int k[2]) {
    const vu lane = widen_u8((const uint8_t *)"\0\1\2\3\4\5\6\7\10\11\12\13\14\15\16\17");
    vu q[2];
    int g[2] = {0, 0};
    k[0] = k[1] = 0;
    switch (qtype) {
        case GGML_Q4_0: case GGML_Q4_1: case GGML_Q5_0: case GGML_Q5_1: case LS_Q4_1F: {
            // Byte l holds quant l in its low nibble and quant l + 16 in its high one; Q5's fifth bits are bit l
            // of the 32-bit qh.
            const int l0 = u * VL,
                      head = qtype == GGML_Q4_0 ? 2 : qtype == GGML_Q4_1 ? 4 : qtype == GGML_Q5_0 ? 6 : 8;  // Q5_1, Q4_1F
            const vu b = widen_u8(blk + head + l0);
            q[0] = b & 15, q[1] = b >> 4;
            if (qtype == GGML_Q5_0 || qtype == GGML_Q5_1) {
                uint32_t qh;
                memcpy(&qh, blk + head - 4, 4);
                const vu h = (vu){0} + qh;
                q[0] |= (h >> (lane + l0) & 1) << 4;
                q[1] |= (h >> (lane + (16 + l0)) & 1) << 4;
            }
            k[0] = l0, k[1] = 16 + l0;
            break;
        }
        case GGML_Q4_K: case GGML_Q5_K: {
            // 64 values per 32 bytes of qs: sub-block 2j in the low nibbles, 2j + 1 in the high ones; Q5_K's fifth
            // bits are bits 2j and 2j + 1 of qh[l].
            const int j = u / (32 / VL), l0 = u % (32 / VL) * VL, qs = qtype == GGML_Q4_K ? 16 : 48;
            const vu b = widen_u8(blk + qs + 32 * j + l0);
            q[0] = b & 15, q[1] = b >> 4;
            if (qtype == GGML_Q5_K) {
                const vu h = widen_u8(blk + 16 + l0);
                q[0] |= (h >> (2 * j) & 1) << 4;
                q[1] |= (h >> (2 * j + 1) & 1) << 4;
            }
            k[0] = 64 * j + l0, k[1] = 64 * j + 32 + l0;
            g[0] = 2 * j, g[1] = 2 * j + 1;
            break;
        }
        case GGML_Q6_K: {
            // Each half of 128: ql[l + 32 pair] gives values l + 32 pair (low nibble) and l + 64 + 32 pair (high),
            // their top two bits in qh[l] at bits 2 pair and 4 + 2 pair.
            const int per = 32 / VL, half = u / (2 * per), pair = u / per % 2, l0 = u % per * VL;
            const vu a = widen_u8(blk + 64 * half + 32 * pair + l0);
            const vu h = widen_u8(blk + 128 + 32 * half + l0) >> (2 * pair);
            q[0] = (a & 15) | (h & 3) << 4;
            q[1] = (a >> 4) | (h >> 4 & 3) << 4;
            k[0] = 128 * half + 32 * pair + l0, k[1] = k[0] + 64;
            g[0] = k[0] / 16, g[1] = k[1] / 16;
            break;
        }
        case GGML_Q8_0: case GGML_Q8_K: case LS_Q8_0F: {
            const int head = qtype == GGML_Q8_0 ? 2 : 4, l0 = qtype == GGML_Q8_K ? 2 * u * VL : u * VL;
            const int step = qtype == GGML_Q8_K ? VL : 16;
            const vf s = vbroadcast(p->s[0]);
            k[0] = l0, k[1] = l0 + step;
            w[0] = __builtin_convertvector(widen_s8(blk + head + k[0]), vf) * s;
            w[1] = __builtin_convertvector(widen_s8(blk + head + k[1]), vf) * s;
            return;
        }
    }
    for (int i = 0; i < 2; i++) w[i] = to_float(q[i]) * vbroadcast(p->s[g[i]]) + vbroadcast(p->o[g[i]]);
}

// Runs BODY for every step of the block at blk, with w[2] (the step's values) and k[2] (their offsets in the block)
// in scope. The steps are unrolled whole, so that each one's offsets and scale indices are constants (and a caller's
// accumulators stay in registers).
#define FOR_EACH_STEP(qtype, blk, ...)                                                                           \
    {                                                                                                            \
        Scales scales_;                                                                                          \
        block_scales(qtype, blk, &scales_);                                                                      \
        _Pragma("GCC unroll 16") for (int u_ = 0; u_ < block_steps(qtype); u_++) {                              \
            vf w[2];                                                                                             \
            int k[2];                                                                                            \
            decode_step(qtype, blk, &scales_, u_, w, k);                                                         \
            __VA_ARGS__                                                                                          \
        }                                                                                                        \
    }

// Elements [k0, k0 + len) of one row (k0 and len whole blocks) dequantized into dst.
static inline __attribute__((always_inline)) void dequant_range(const int qtype, const uint8_t *row, int k0, int len,
                                                                float *dst) {
    const int qk = block_elems(qtype), nb = block_bytes(qtype);
    for (int b = 0; b < len / qk; b++) {
        const uint8_t *blk = row + (int64_t)(k0 / qk + b) * nb;
        FOR_EACH_STEP(qtype, blk, vstore(dst + b * qk + k[0], w[0]); vstore(dst + b * qk + k[1], w[1]);)
    }
}

// ---------------------------------------------------------------------------------------------------------------
// GEMV: rows 0 .. mt-1 of x by output rows 0 .. nr-1 of w (nr <= R; the rows past nr repeat the last, their results
// dropped), all K. mt and R are constants at each call site. Per step of 2 * VL quants of a row: one widening load,
// the nibble split (and the fifth or sixth bits), two conversions, two FMAs to dequantize, 2 * mt FMAs against x.
#define GEMV_ROWS 4  // output rows a thread takes at once, streamed two at a time (gemv_rows)
static inline __attribute__((always_inline)) void gemv_tile(const int qtype, const float *x, int64_t x_row,
                                                            const int mt, int K, const uint8_t *w,
                                                            int64_t w_row_bytes, int nr, const int R, float *out,
                                                            int64_t out_row, const float *bias, Ahead ahead) {
    const int qk = block_elems(qtype), nb = block_bytes(qtype);
    vf acc[2][GEMV_ROWS][2];  // mt <= 2
    const uint8_t *wr[GEMV_ROWS];
    for (int r = 0; r < R; r++) {
        wr[r] = w + (int64_t)(r < nr ? r : nr - 1) * w_row_bytes;
        for (int m = 0; m < mt; m++) acc[m][r][0] = acc[m][r][1] = (vf){0};
    }
    for (int b = 0; b < K / qk; b++) {
        const float *xb = x + b * qk;
        ahead_step(&ahead, K / qk);
#pragma GCC unroll 4  // unrolled whole, so that the accumulators stay in registers
        for (int r = 0; r < R; r++)
            FOR_EACH_STEP(qtype, wr[r] + (int64_t)b * nb,
                for (int m = 0; m < mt; m++)
                    for (int i = 0; i < 2; i++) acc[m][r][i] += w[i] * vload(xb + m * x_row + k[i]);)
    }
    for (int m = 0; m < mt; m++)
        for (int r = 0; r < nr; r++) {
            float lanes[VL], sum = 0.0f;
            vstore(lanes, acc[m][r][0] + acc[m][r][1]);
            for (int i = 0; i < VL; i++) sum += lanes[i];
            out[m * out_row + r] = sum + (bias ? bias[r] : 0.0f);
        }
}

// Output rows n .. n + nr - 1 (nr <= GEMV_ROWS) for every row of x.
static inline __attribute__((always_inline)) void gemv_rows(const int qtype, const float *x, int64_t x_row, int M,
                                                            int K, const uint8_t *w, int64_t w_row_bytes, int nr,
                                                            const float *bias, float *out, int64_t out_row,
                                                            const uint8_t *w_end) {
    // Two output rows at a time by pairs of rows of x (8 accumulators; the two rows' bytes stay in L1 for the next
    // pair). Four rows at once ran M = 1 slower (Zen 3, 2 threads, 2048 x 2048 Q6_K: 0.93 ms against 0.65), and for
    // the K-quants a single row of x goes one output row at a time: their blocks carry 8 or 16 scales each, and
    // two rows at once ran a Llama-3.2-1B's shapes at 1.2-1.9x the time of one (Zen 3, 2 threads, weights from
    // memory, scripts/bench_quant_linear.py --models llama1b --rows 1, the two forms alternated twice: Q4_K
    // [8192, 2048] 1.66 ms against 0.99-1.03, Q6_K 2.75-2.82 against 1.51-1.57, Q6_K [2048, 8192] 2.12-2.26 against
    // 1.39-1.71).
    for (int r = 0; r < nr; r += 2)
        for (int m = 0; m < M; m += 2) {
            const float *xm = x + m * x_row, *br = bias ? bias + r : NULL;
            float *om = out + m * out_row + r;
            const int rr = nr - r < 2 ? nr - r : 2;
            // The first pair of x rows fetches ahead; the rows after it read the same weight rows from L1.
            const Ahead ahead = m ? (Ahead){w, 0, 0} : ahead_of(w + r * w_row_bytes, rr * w_row_bytes, w_end);
            if (M - m >= 2)
                gemv_tile(qtype, xm, x_row, 2, K, w + r * w_row_bytes, w_row_bytes, rr, 2, om, out_row, br, ahead);
            else if (one_row_gemv(qtype))
                for (int i = 0; i < rr; i++)
                    gemv_tile(qtype, xm, x_row, 1, K, w + (r + i) * w_row_bytes, w_row_bytes, 1, 1, om + i, out_row,
                              br ? br + i : NULL,
                              m ? (Ahead){w, 0, 0} : ahead_of(w + (r + i) * w_row_bytes, w_row_bytes, w_end));
            else
                gemv_tile(qtype, xm, x_row, 1, K, w + r * w_row_bytes, w_row_bytes, rr, 2, om, out_row, br, ahead);
        }
}

// ---------------------------------------------------------------------------------------------------------------
// Tiles: dequantize NR features by KC of K into panel order, then gemm_tile.h's tile over all M rows.

// Interleaves of two vectors (lanes 0, VL, 1, VL + 1, ... of the pair, low and high halves): applied log2(VL) times
// to VL rows, the perfect shuffle transposes them.
#if VL == 16
#define ZIP_LO 0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23
#define ZIP_HI 8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31
#else
#define ZIP_LO 0, 8, 1, 9, 2, 10, 3, 11
#define ZIP_HI 4, 12, 5, 13, 6, 14, 7, 15
#endif

// src [NR][KC] (row f: feature f's values) -> dst [kc][NR] (row k: the NR features' values at k); kc a multiple of VL.
static void to_panel(const float *src, float *dst, int kc) {
    for (int f0 = 0; f0 < NR; f0 += VL)
        for (int k0 = 0; k0 < kc; k0 += VL) {
            vf r[VL], t[VL];
            for (int i = 0; i < VL; i++) r[i] = vload(src + (f0 + i) * KC + k0);
            for (int level = VL; level > 1; level /= 2) {
                for (int i = 0; i < VL / 2; i++) {
                    t[2 * i] = __builtin_shufflevector(r[i], r[i + VL / 2], ZIP_LO);
                    t[2 * i + 1] = __builtin_shufflevector(r[i], r[i + VL / 2], ZIP_HI);
                }
                memcpy(r, t, sizeof r);
            }
            for (int i = 0; i < VL; i++) vstore(dst + (k0 + i) * NR + f0, r[i]);
        }
}

// Panel p (output features p * NR ..) for every row of x: K chunk by K chunk, the NR rows dequantized into
// `rowwise` [NR][KC], laid out in panel order in `panel` [KC][NR], and the register tile run over all M rows.
static inline __attribute__((always_inline)) void gemm_panel(const int qtype, const float *x, int64_t x_row, int M,
                                                             int K, const uint8_t *w, int64_t w_row_bytes, int N,
                                                             const float *bias, float *out, int64_t out_row,
                                                             int64_t p, float *rowwise, float *panel) {
    const int rows = tile_rows(M);
    const int64_t n = p * NR;
    const int ncols = N - n < NR ? (int)(N - n) : NR;
    for (int k0 = 0; k0 < K; k0 += KC) {
        const int kc = K - k0 < KC ? K - k0 : KC;
        for (int f = 0; f < ncols; f++) dequant_range(qtype, w + (n + f) * w_row_bytes, k0, kc, rowwise + f * KC);
        for (int f = ncols; f < NR; f++) memset(rowwise + f * KC, 0, sizeof(float) * KC);  // features past N
        to_panel(rowwise, panel, kc);
        for (int i = 0; i < M; i += rows) {
            const int mr = M - i < rows ? M - i : rows;
            tile_of(rows, x + (int64_t)i * x_row + k0, x_row, mr, panel, kc, out + (int64_t)i * out_row + n, out_row,
                    ncols, bias ? bias + n : NULL, NULL, 1, k0 > 0);
        }
    }
}

// Each format's kernel compiled on its own (qtype a constant inside).
#define FOR_EACH_TYPE(CASE)                                                                                      \
    CASE(GGML_Q4_0) CASE(GGML_Q4_1) CASE(GGML_Q5_0) CASE(GGML_Q5_1) CASE(GGML_Q8_0) CASE(GGML_Q4_K)           \
    CASE(GGML_Q5_K) CASE(GGML_Q6_K) CASE(GGML_Q8_K) CASE(LS_Q8_0F) CASE(LS_Q4_1F)

// The OpenMP regions sit here and switch on qtype per item, so that each format's loops are compiled with qtype a
// constant (a region inside an inlined function is outlined once, with qtype a variable).
int quant_linear_f32(const float *x, int64_t x_row, int M, int K, const uint8_t *w, int64_t w_row_bytes, int qtype,
                     int N, const float *bias, float *out, int64_t out_row, int threads) {
    const int qk = block_elems(qtype);
    if (qk == 0 || M < 1 || N < 1 || K < qk || K % qk || w_row_bytes < (int64_t)K / qk * block_bytes(qtype))
        return -1;
    Shares shares;
    if (M <= GEMV_MAX_M) {
        shares_init(&shares, ((int64_t)N + GEMV_ROWS - 1) / GEMV_ROWS, threads);
        #pragma omp parallel num_threads(threads)
        for (int64_t g; (g = shares_take(&shares)) >= 0;) {
            const int64_t n = g * GEMV_ROWS;
            const int nr = N - n < GEMV_ROWS ? (int)(N - n) : GEMV_ROWS;
#define GEMV_CASE(T)                                                                                             \
    case T: gemv_rows(T, x, x_row, M, K, w + n * w_row_bytes, w_row_bytes, nr, bias ? bias + n : NULL, out + n,    \
                      out_row, w + N * w_row_bytes); break;
            switch (qtype) { FOR_EACH_TYPE(GEMV_CASE) }
#undef GEMV_CASE
        }
        return 0;
    }
    shares_init(&shares, ((int64_t)N + NR - 1) / NR, threads);
    #pragma omp parallel num_threads(threads)
    {
        float rowwise[NR * KC] __attribute__((aligned(64))), panel[KC * NR] __attribute__((aligned(64)));
        for (int64_t p; (p = shares_take(&shares)) >= 0;) {
#define GEMM_CASE(T)                                                                                             \
    case T: gemm_panel(T, x, x_row, M, K, w, w_row_bytes, N, bias, out, out_row, p, rowwise, panel); break;
            switch (qtype) { FOR_EACH_TYPE(GEMM_CASE) }
#undef GEMM_CASE
        }
    }
    return 0;
}

int quant_dequant_rows(const uint8_t *w, int64_t w_row_bytes, int qtype, int K, const int64_t *rows, int n,
                       float *out, int64_t out_row) {
    const int qk = block_elems(qtype);
    if (qk == 0 || K < qk || K % qk) return -1;
#define RUN(T)                                                                                                   \
    case T:                                                                                                      \
        for (int i = 0; i < n; i++) dequant_range(T, w + rows[i] * w_row_bytes, 0, K, out + i * out_row);      \
        return 0;
    switch (qtype) { FOR_EACH_TYPE(RUN) }
#undef RUN
    return -1;
}
