// Shared by the C kernels: a vectorizable expf and the bfloat16 -> float32 widening.
#pragma once
#include <stdint.h>
#include <string.h>

// exp(x) for x in [-87, 88] (callers clamp): 2^(x log2 e) as 2^n * 2^f with f in [-0.5, 0.5] and a
// degree-6 polynomial for 2^f (relative error ~2e-7, like expf's last bits). rint, not round, so
// gcc vectorizes it (vroundps); the callers' clamps vectorize under -fno-trapping-math.
static inline float exp_in_range(float x) {
    float t = x * 1.44269504088896341f;
    float n = __builtin_rintf(t);
    float f = t - n;
    float p = 1.5403530e-4f;
    p = p * f + 1.3333558e-3f;
    p = p * f + 9.6181291e-3f;
    p = p * f + 5.5504109e-2f;
    p = p * f + 2.4022651e-1f;
    p = p * f + 6.9314718e-1f;
    p = p * f + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

// exp(x) for x <= 0 (scores minus their running max); below -87 it is expf's underflow, clamped.
static inline float exp_neg(float x) { return exp_in_range(x < -87.0f ? -87.0f : x); }

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
