// One portable SIMD vector for the C kernels, as wide as the CPU the build targets (-march=native):
// 16 floats where AVX-512 is there, 8 elsewhere. Written with GCC vector extensions, so the same
// source is the AVX-512, the AVX2 and the plain-SSE kernel: the compiler picks the instructions, and
// the code CI tests on one CPU is the code that runs on another (built for it).
#pragma once
#include <stdint.h>
#include <string.h>
#if defined(__AVX2__)
#include <immintrin.h>  // vload_fp8's widening and fp16 conversion
#endif

#include "fastmath.h"

#if defined(__AVX512F__)
#define VL 16
#else
#define VL 8
#endif

typedef float vf __attribute__((vector_size(VL * 4)));
typedef uint32_t vu __attribute__((vector_size(VL * 4)));
// Element-aligned twins, for loads and stores at any float / bf16-pair address.
typedef float vf_u __attribute__((vector_size(VL * 4), aligned(4)));
typedef uint32_t vu_u __attribute__((vector_size(VL * 4), aligned(2)));
typedef int32_t vi __attribute__((vector_size(VL * 4)));

static inline vf vload(const float *p) { return *(const vf_u *)p; }
static inline void vstore(float *p, vf x) { *(vf_u *)p = x; }
// x - (+0) is x for every x (signed zeros included), so gcc folds it to a plain broadcast; (vf){0} + x
// is not (-0 + +0 = +0), and cost a vector add per broadcast.
static inline vf vbroadcast(float x) { return x - (vf){0}; }
// Lane-wise a > b ? a : b (b where either is NaN), as a vector compare and select. gcc compiled the same
// select written per lane on a float array as scalar maxss (the greedy sampler's max ran that way).
static inline vf vmax(vf a, vf b) {
    vu gt = (vu)(a > b);
    return (vf)(((vu)a & gt) | ((vu)b & ~gt));
}

// Each lane's index: 0, 1, ..., VL - 1.
static inline vi vlane_index(void) {
#if VL == 16
    return (vi){0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
#else
    return (vi){0, 1, 2, 3, 4, 5, 6, 7};
#endif
}

// fastmath.h's exp_neg a vector at a time, the same polynomial and rounding, so each finite lane equals exp_neg of it: gcc
// leaves the scalar one unvectorized inside the attention kernels' large loops (scalar vfmadd...ss in perf annotate).
// Adding and subtracting 1.5 * 2^23 rounds t to the nearest integer (ties to even) for |t| < 2^22, as rintf does.
static inline vf vexp_neg(vf x) {
    const vf t = vmax(x, vbroadcast(-87.0f)) * 1.44269504088896341f;
    const vf n = (t + 0x1.8p23f) - 0x1.8p23f;
    const vf f = t - n;
    return EXP2_POLY(f) * (vf)((__builtin_convertvector(n, vi) + 127) << 23);
}

// The largest lane of x: log2(VL) shuffle-and-max levels instead of a chain of VL scalar maxes.
static inline float vhmax(vf x) {
#if VL == 16
    x = vmax(x, __builtin_shuffle(x, (vu){8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7}));
    x = vmax(x, __builtin_shuffle(x, (vu){4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11}));
    x = vmax(x, __builtin_shuffle(x, (vu){2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13}));
    x = vmax(x, __builtin_shuffle(x, (vu){1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14}));
#else
    x = vmax(x, __builtin_shuffle(x, (vu){4, 5, 6, 7, 0, 1, 2, 3}));
    x = vmax(x, __builtin_shuffle(x, (vu){2, 3, 0, 1, 6, 7, 4, 5}));
    x = vmax(x, __builtin_shuffle(x, (vu){1, 0, 3, 2, 5, 4, 7, 6}));
#endif
    return x[0];
}

// 2*VL bfloat16 values as two float vectors, de-interleaved: *even gets elements 0, 2, 4, ..., *odd
// gets 1, 3, 5, .... A bf16 is the top half of a float, so each is one shift or one mask of the
// loaded pairs: no widening shuffle. Callers keep their float operands in the same even/odd order
// (bf16_order below); a dot product does not care about the order, and an output row is put back
// in order once at the end.
static inline void vload_bf16_pairs(const uint16_t *p, vf *even, vf *odd) {
    vu bits = *(const vu_u *)p;
    *even = (vf)(bits << 16);
    *odd = (vf)(bits & 0xffff0000u);
}

// dst = src in the order vload_bf16_pairs gives, chunk by chunk of 2*VL (n a multiple of 2*VL).
static inline void bf16_order(const float *src, float *dst, int n) {
    for (int c = 0; c < n; c += 2 * VL)
        for (int i = 0; i < VL; i++) {
            dst[c + i] = src[c + 2 * i];
            dst[c + VL + i] = src[c + 2 * i + 1];
        }
}

// The inverse of bf16_order.
static inline void bf16_unorder(const float *src, float *dst, int n) {
    for (int c = 0; c < n; c += 2 * VL)
        for (int i = 0; i < VL; i++) {
            dst[c + 2 * i] = src[c + i];
            dst[c + 2 * i + 1] = src[c + VL + i];
        }
}

// VL fp8 bytes at any address (e4m3, or e5m2 where e5m2 is set) as floats: e5m2 its value, e4m3 2^-8 times its
// value, through the fp16 each byte makes (fastmath.h's fp8_to_half_bits, here a sign-extend, a shift and a mask a
// vector) and vcvtph2ps. The conversion takes fp16 subnormals in hardware and turns them into normal float32s, so no
// subnormal operand reaches a multiply: each would be a microcode assist on Intel cores, where decoding the bits
// straight into a float32 (an fp8 subnormal becomes a float32 subnormal there) measured 5x slower than a bf16 cache.
// Exact for every byte; NaN and inf codes decode as the fp16 ones (store_kv never writes them, it saturates).
static inline vf vload_fp8(const uint8_t *p, int e5m2) {
#if VL == 16
    const __m256i s = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p));
    const __m256i h = e5m2 ? _mm256_slli_epi16(s, 8) : _mm256_and_si256(_mm256_slli_epi16(s, 7),
                                                                          _mm256_set1_epi16((short)0xBFFF));
    return (vf)_mm512_cvtph_ps(h);
#elif defined(__AVX2__) && defined(__F16C__)
    const __m128i s = _mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)p));
    const __m128i h = e5m2 ? _mm_slli_epi16(s, 8) : _mm_and_si128(_mm_slli_epi16(s, 7), _mm_set1_epi16((short)0xBFFF));
    return (vf)_mm256_cvtph_ps(h);
#else
    vf r;
    for (int k = 0; k < VL; k++) r[k] = half_bits_to_f32(fp8_to_half_bits(p[k], e5m2));
    return r;
#endif
}

// Lane j of the result = the sum of a[j]'s lanes, for VL vectors: log2(VL) levels, each folding pairs
// of vectors with two two-source shuffles and one add (VL - 1 of each per level pair), instead of VL
// separate horizontal sums. At each level every vector holds blocks of partial sums, one block per
// source vector; LO/HI take the first/second half of each block from both inputs, interleaved.
// LO and HI are index lists (macros, so that each is one macro argument).
#define VFOLD(a, b, LO, HI) (__builtin_shufflevector(a, b, LO) + __builtin_shufflevector(a, b, HI))
#if VL == 16
#define B8_LO 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23
#define B8_HI 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31
#define B4_LO 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27
#define B4_HI 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31
#define B2_LO 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29
#define B2_HI 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31
#define B1_LO 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30
#define B1_HI 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31
static inline vf vreduce_lanes(const vf a[16]) {
    vf b[8], c[4], d[2];
    for (int k = 0; k < 8; k++) b[k] = VFOLD(a[k], a[k + 8], B8_LO, B8_HI);  // a[k] | a[k+8]
    for (int k = 0; k < 4; k++) c[k] = VFOLD(b[k], b[k + 4], B4_LO, B4_HI);  // a[k] | a[k+4] | a[k+8] | a[k+12]
    for (int k = 0; k < 2; k++) d[k] = VFOLD(c[k], c[k + 2], B2_LO, B2_HI);  // a[k] | a[k+2] | ... | a[k+14]
    return VFOLD(d[0], d[1], B1_LO, B1_HI);                                   // a[0] | a[1] | ... | a[15]
}
#else
#define B4_LO 0, 1, 2, 3, 8, 9, 10, 11
#define B4_HI 4, 5, 6, 7, 12, 13, 14, 15
#define B2_LO 0, 1, 8, 9, 4, 5, 12, 13
#define B2_HI 2, 3, 10, 11, 6, 7, 14, 15
#define B1_LO 0, 8, 2, 10, 4, 12, 6, 14
#define B1_HI 1, 9, 3, 11, 5, 13, 7, 15
static inline vf vreduce_lanes(const vf a[8]) {
    vf b[4], c[2];
    for (int k = 0; k < 4; k++) b[k] = VFOLD(a[k], a[k + 4], B4_LO, B4_HI);  // a[k] | a[k+4]
    for (int k = 0; k < 2; k++) c[k] = VFOLD(b[k], b[k + 2], B2_LO, B2_HI);  // a[k] | a[k+2] | a[k+4] | a[k+6]
    return VFOLD(c[0], c[1], B1_LO, B1_HI);                                   // a[0] | a[1] | ... | a[7]
}
#endif
