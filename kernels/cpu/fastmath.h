// Shared by the C kernels: a vectorizable expf, the bfloat16 <-> float32 conversions and fp16's and fp8's bits.
#pragma once
#include <stdint.h>
#include <string.h>
#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

// exp(x) for x in [-87, 88] (callers clamp): 2^(x log2 e) as 2^n * 2^f with f in [-0.5, 0.5] and a
// degree-6 polynomial for 2^f (relative error ~2e-7, like expf's last bits). rint, not round, so
// gcc vectorizes it (vroundps); the callers' clamps vectorize under -fno-trapping-math.
// EXP2_POLY(f): that polynomial by Horner's rule, for a float f or a vec.h vector (vexp_neg).
#define EXP2_POLY(f)                                                                                        \
    ((((((1.5403530e-4f * (f) + 1.3333558e-3f) * (f) + 9.6181291e-3f) * (f) + 5.5504109e-2f) * (f) +       \
       2.4022651e-1f) * (f) + 6.9314718e-1f) * (f) + 1.0f)
static inline float exp_in_range(float x) {
    float t = x * 1.44269504088896341f;
    float n = __builtin_rintf(t);
    float f = t - n;
    float p = EXP2_POLY(f);
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

// exp(x) for x <= 0 (scores minus their running max); below -87 it is expf's underflow, clamped.
static inline float exp_neg(float x) { return exp_in_range(x < -87.0f ? -87.0f : x); }

// An fp16 (its bits) as float32, exact; subnormals (exponent 0) are man * 2^-24, normal floats.
static inline float half_bits_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = h >> 10 & 0x1f, man = h & 0x3ffu;
    if (exp == 0) {
        const float f = (float)man * 0x1p-24f;
        return sign ? -f : f;
    }
    const uint32_t bits = sign | (exp == 31 ? 0x7f800000u : (exp + 112) << 23) | man << 13;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

// An fp8 byte (e4m3 or e5m2) as the fp16 bits vload_fp8 (vec.h) converts: e5m2 is an fp16's top byte, its value;
// e4m3's seven bits below the sign go one place lower, into the fp16's exponent and mantissa, 2^-8 times its value.
static inline uint16_t fp8_to_half_bits(uint8_t b, int e5m2) {
    return e5m2 ? (uint16_t)(b << 8) : (uint16_t)((b & 0x80u) << 8 | (b & 0x7fu) << 7);
}

// A bfloat16 (its bits) as float32: the top half of the float's bits.
static inline float bf16_to_f32(uint16_t x) {
    uint32_t bits = (uint32_t)x << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

// float32 -> bfloat16 bits, rounded to nearest even (as torch rounds); NaN stays NaN.
static inline uint16_t f32_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40u);  // quiet NaN
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

// f32_to_bf16 over n floats. Builds for CPUs with AVX512-BF16 convert 16 at a time with vcvtneps2bf16,
// which rounds the same way but reads float32 denormals (below 1.2e-38) as zero; other builds run the loop
// above, which gcc vectorizes.
static inline void f32_to_bf16_array(const float *src, uint16_t *dst, int64_t n) {
    int64_t i = 0;
#if defined(__AVX512BF16__)
    for (; i + 16 <= n; i += 16)
        _mm256_storeu_si256((__m256i *)(dst + i), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(src + i)));
#endif
    for (; i < n; i++) dst[i] = f32_to_bf16(src[i]);
}

// x[i] = x[i] rounded to bfloat16 (as bf16_to_f32(f32_to_bf16(x[i]))), in place: the rounding a torch op
// applies to its bf16 result, for kernels that compute a chain of such ops in float. vcvtneps2bf16 and a widen
// where the CPU has AVX512-BF16 (as above); elsewhere one integer pass, 5% faster in an AVX2 build than the
// round trip through uint16.
static inline void bf16_round_array(float *x, int64_t n) {
    int64_t i = 0;
#if defined(__AVX512BF16__)
    for (; i + 16 <= n; i += 16) {
        __m256i h = (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x + i));
        _mm512_storeu_si512((void *)(x + i), _mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
#endif
    for (; i < n; i++) {
        uint32_t bits;
        memcpy(&bits, &x[i], sizeof bits);
        bits = (bits & 0x7fffffffu) > 0x7f800000u ? (bits | 0x400000u) & 0xffff0000u  // quiet NaN
                                                  : (bits + 0x7fffu + ((bits >> 16) & 1u)) & 0xffff0000u;
        memcpy(&x[i], &bits, sizeof bits);
    }
}
