// Row-wise elementwise ops of the forward on CPU, float32 or bfloat16: SiLU-and-mul, (add +) RMSNorm
// and rotary.
//
// Why C: in torch each is 4-6 ops with a temporary between each (F.silu, mul; pow, mean, rsqrt,
// mul, mul, add_), and on 2 cores a 256-token prefill spent ~50 ms in them against ~550 ms of
// GEMMs (scripts/profile_step.py --prefill); in bfloat16 the torch ops took a third of the prefill
// step. Here each row is read once and written once. The references (kernels/activation.py,
// kernels/rmsnorm.py, kernels/rotary.py) are the spec. In bfloat16 these round where the reference
// rounds (each torch op computes in float32 and rounds its result to bfloat16), so the only
// differences are RMSNorm's sum order and SiLU's exp, a bf16 ulp at most.
//
// Every pointer to activations or weights is float32, or bfloat16 when `bf16` is set (one dtype per
// call: a bf16 model keeps its activations, norm weights and KV in bf16). Strides are in elements.
//   silu_and_mul: x [T, 2I] (gate | up), row stride x_row -> out [T, I] contiguous
//   rmsnorm:      x [T, H], row stride x_row; weight [H]; out [T, H] contiguous;
//                 residual [T, H] contiguous or NULL: when given, residual += x first (in place)
//                 and the norm is of the updated residual.
//   rotary:       x [T, H, D] in place, token stride x_tok, head stride x_head (q or k, views of qkv);
//                 positions [T] int64; cos_sin [max_pos, D] float32 (cos | sin halves), row stride cs_row.
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "fastmath.h"

// exp(x) for any float x: clamped to [-87, 88], where expf underflows / overflows anyway.
static inline float exp_any(float x) {
    x = x < -87.0f ? -87.0f : x;
    x = x > 88.0f ? 88.0f : x;
    return exp_in_range(x);
}

// Element i of a float32 or bfloat16 array, as float; and a float stored back in that dtype. With
// `bf16` a constant (every caller below passes one), each loop compiles to one vectorized dtype.
static inline __attribute__((always_inline)) float ld(const void *p, int64_t i, int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}
static inline __attribute__((always_inline)) void st(void *p, int64_t i, float v, int bf16) {
    if (bf16)
        ((uint16_t *)p)[i] = f32_to_bf16(v);
    else
        ((float *)p)[i] = v;
}
// A value rounded to the activation dtype, as a float (the rounding each torch op does on its result).
static inline __attribute__((always_inline)) float rnd(float v, int bf16) {
    return bf16 ? bf16_to_f32(f32_to_bf16(v)) : v;
}

// Parallel only when the op is big enough to pay for waking the second thread (decode rows are few).
#define PAR_MIN_ELEMS 65536

// One row of each op, with `bf16` a constant at each call: the dtype branch sits outside the loops.
// (The OpenMP loops live in the public functions: a parallel loop inside an inlined helper is outlined
// before inlining, and its dtype would then be a run-time value in the inner loop.)
static inline __attribute__((always_inline)) void silu_and_mul_row(const void *gate, const void *up, void *o,
                                                                   int64_t inter, const int bf16) {
    for (int64_t i = 0; i < inter; i++) {
        float g = ld(gate, i, bf16);
        st(o, i, rnd(g / (1.0f + exp_any(-g)), bf16) * ld(up, i, bf16), bf16);  // silu rounded, then the product
    }
}

void silu_and_mul(const void *x, int64_t x_row, int64_t rows, int64_t inter, void *out, int bf16, int num_threads) {
    const int es = bf16 ? 2 : 4;
    #pragma omp parallel for schedule(static) num_threads(num_threads) if (rows * inter >= PAR_MIN_ELEMS)
    for (int64_t r = 0; r < rows; r++) {
        const char *gate = (const char *)x + r * x_row * es;
        char *o = (char *)out + r * inter * es;
        if (bf16)
            silu_and_mul_row(gate, gate + inter * es, o, inter, 1);
        else
            silu_and_mul_row(gate, gate + inter * es, o, inter, 0);
    }
}

static inline __attribute__((always_inline)) void rmsnorm_row(const void *x, void *res, const void *weight,
                                                              int64_t hidden, float eps, void *o, const int bf16) {
    if (res) {  // residual += x (rounded to the dtype), then normalize the sum
        for (int64_t i = 0; i < hidden; i++) st(res, i, ld(res, i, bf16) + ld(x, i, bf16), bf16);
        x = res;
    }
    float part[16] = {0};  // 16 partial sums: vectorizes without -ffast-math
    int64_t i = 0;
    for (; i + 16 <= hidden; i += 16)
        for (int j = 0; j < 16; j++) {
            float v = ld(x, i + j, bf16);
            part[j] += v * v;
        }
    float sum = 0.0f;
    for (; i < hidden; i++) sum += ld(x, i, bf16) * ld(x, i, bf16);
    for (int j = 0; j < 16; j++) sum += part[j];
    float inv = 1.0f / sqrtf(sum / (float)hidden + eps);
    // HF rounds the normalized row to the dtype before the weight multiply.
    for (int64_t k = 0; k < hidden; k++) st(o, k, ld(weight, k, bf16) * rnd(ld(x, k, bf16) * inv, bf16), bf16);
}

void rmsnorm(const void *x, int64_t x_row, void *residual, const void *weight, int64_t rows, int64_t hidden,
             float eps, void *out, int bf16, int num_threads) {
    const int es = bf16 ? 2 : 4;
    #pragma omp parallel for schedule(static) num_threads(num_threads) if (rows * hidden >= PAR_MIN_ELEMS)
    for (int64_t r = 0; r < rows; r++) {
        const char *xr = (const char *)x + r * x_row * es;
        char *res = residual ? (char *)residual + r * hidden * es : NULL, *o = (char *)out + r * hidden * es;
        if (bf16)
            rmsnorm_row(xr, res, weight, hidden, eps, o, 1);
        else
            rmsnorm_row(xr, res, weight, hidden, eps, o, 0);
    }
}

// HF's rotate-half rotary, to its exact roundings: x1*c - x2*s and x2*c + x1*s, each product rounded
// before the add (fp-contract off: an FMA would round once and differ from the reference in the last
// bit). In bfloat16 the reference also rounds cos and sin to bf16 first, and every product and sum.
static inline __attribute__((always_inline, optimize("fp-contract=off"))) void rotary_head(
    void *x1, void *x2, const float *c, const float *s, int64_t half, const int bf16) {
    for (int64_t i = 0; i < half; i++) {
        float a = ld(x1, i, bf16), b = ld(x2, i, bf16), ci = rnd(c[i], bf16), si = rnd(s[i], bf16);
        float p = rnd(a * ci, bf16), q = rnd(b * si, bf16), u = rnd(b * ci, bf16), v = rnd(a * si, bf16);
        st(x1, i, p - q, bf16);
        st(x2, i, u + v, bf16);
    }
}

__attribute__((optimize("fp-contract=off")))
void rotary(void *x, int64_t x_tok, int64_t x_head, int64_t tokens, int64_t heads, int64_t dim,
            const int64_t *positions, const float *cos_sin, int64_t cs_row, int bf16, int num_threads) {
    const int64_t half = dim / 2;
    const int es = bf16 ? 2 : 4;
    #pragma omp parallel for schedule(static) num_threads(num_threads) if (tokens * heads * dim >= PAR_MIN_ELEMS)
    for (int64_t t = 0; t < tokens; t++) {
        const float *c = cos_sin + positions[t] * cs_row, *s = c + half;
        for (int64_t h = 0; h < heads; h++) {
            char *x1 = (char *)x + (t * x_tok + h * x_head) * es, *x2 = x1 + half * es;
            if (bf16)
                rotary_head(x1, x2, c, s, half, 1);
            else
                rotary_head(x1, x2, c, s, half, 0);
        }
    }
}
