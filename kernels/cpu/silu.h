// One row of SiLU-and-mul, shared by elementwise.c's silu_and_mul and linear.c's float32 gate_up GEMM, whose epilogue
// runs it on the tile it has just computed: the same function on the same values gives the same bits either way.
#pragma once
#include <stdint.h>

#include "fastmath.h"

// exp(x) for any float x: clamped to [-87, 88], where expf underflows / overflows anyway.
static inline float exp_any(float x) {
    x = x < -87.0f ? -87.0f : x;
    x = x > 88.0f ? 88.0f : x;
    return exp_in_range(x);
}

// bf16 rows go through a float buffer of this many elements (L1-resident): see CHUNK in elementwise.c.
#define SILU_CHUNK 256

// o[i] = silu(gate[i]) * up[i] for i < inter; float32, or bfloat16 with `bf16` (a constant at each call site):
// then silu is rounded to bf16, as torch's F.silu rounds its result, and so is the product.
static inline __attribute__((always_inline)) void silu_and_mul_row(const void *gate, const void *up, void *o,
                                                                   int64_t inter, const int bf16) {
    if (!bf16) {
        for (int64_t i = 0; i < inter; i++) {
            float g = ((const float *)gate)[i];
            ((float *)o)[i] = g / (1.0f + exp_any(-g)) * ((const float *)up)[i];
        }
        return;
    }
    const uint16_t *g = gate, *u = up;
    float t[SILU_CHUNK];
    for (int64_t c = 0; c < inter; c += SILU_CHUNK) {
        const int n = inter - c < SILU_CHUNK ? (int)(inter - c) : SILU_CHUNK;
        for (int i = 0; i < n; i++) {
            float x = bf16_to_f32(g[c + i]);
            t[i] = x / (1.0f + exp_any(-x));
        }
        bf16_round_array(t, n);
        for (int i = 0; i < n; i++) t[i] *= bf16_to_f32(u[c + i]);
        f32_to_bf16_array(t, (uint16_t *)o + c, n);
    }
}
