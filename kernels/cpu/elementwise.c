// Row-wise elementwise ops of the forward on CPU, float32: SiLU-and-mul, (add +) RMSNorm and rotary.
//
// Why C: in torch each is 4-6 ops with a temporary between each (F.silu, mul; pow, mean, rsqrt,
// mul, mul, add_), and on 2 cores a 256-token prefill spent ~50 ms in them against ~550 ms of
// GEMMs (scripts/profile_step.py --prefill). Here each row is read once and written once.
// The references (kernels/activation.py, kernels/rmsnorm.py) are the spec; these match them to
// float32 rounding (the sums run in another order).
//
// Shapes (row-major, strides in elements):
//   silu_and_mul: x [T, 2I] (gate | up), row stride x_row -> out [T, I] contiguous
//   rmsnorm:      x [T, H], row stride x_row; weight [H]; out [T, H] contiguous;
//                 residual [T, H] contiguous or NULL: when given, residual += x first (in place)
//                 and the norm is of the updated residual.
//   rotary:       x [T, H, D] in place, token stride x_tok, head stride x_head (q or k, views of qkv);
//                 positions [T] int64; cos_sin [max_pos, D] (cos | sin halves), row stride cs_row.
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

// Parallel only when the op is big enough to pay for waking the second thread (decode rows are few).
#define PAR_MIN_ELEMS 65536

void silu_and_mul(const float *x, int64_t x_row, int64_t rows, int64_t inter, float *out, int num_threads) {
    #pragma omp parallel for schedule(static) num_threads(num_threads) if (rows * inter >= PAR_MIN_ELEMS)
    for (int64_t r = 0; r < rows; r++) {
        const float *gate = x + r * x_row, *up = gate + inter;
        float *o = out + r * inter;
        for (int64_t i = 0; i < inter; i++) {
            float g = gate[i];
            o[i] = g / (1.0f + exp_any(-g)) * up[i];
        }
    }
}

void rmsnorm(const float *x, int64_t x_row, float *residual, const float *weight, int64_t rows, int64_t hidden,
             float eps, float *out, int num_threads) {
    #pragma omp parallel for schedule(static) num_threads(num_threads) if (rows * hidden >= PAR_MIN_ELEMS)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * x_row;
        if (residual) {  // residual += x, then normalize the sum
            float *res = residual + r * hidden;
            for (int64_t i = 0; i < hidden; i++) res[i] += xr[i];
            xr = res;
        }
        float part[16] = {0};  // 16 partial sums: vectorizes without -ffast-math
        int64_t i = 0;
        for (; i + 16 <= hidden; i += 16)
            for (int j = 0; j < 16; j++) part[j] += xr[i + j] * xr[i + j];
        float sum = 0.0f;
        for (; i < hidden; i++) sum += xr[i] * xr[i];
        for (int j = 0; j < 16; j++) sum += part[j];
        float inv = 1.0f / sqrtf(sum / (float)hidden + eps);
        float *o = out + r * hidden;
        for (int64_t k = 0; k < hidden; k++) o[k] = weight[k] * (xr[k] * inv);
    }
}

// HF's rotate-half rotary, to its exact roundings: x1*c - x2*s and x2*c + x1*s, each product rounded
// before the add (fp-contract off: an FMA would round once and differ from the reference in the last bit).
__attribute__((optimize("fp-contract=off")))
void rotary(float *x, int64_t x_tok, int64_t x_head, int64_t tokens, int64_t heads, int64_t dim,
            const int64_t *positions, const float *cos_sin, int64_t cs_row, int num_threads) {
    const int64_t half = dim / 2;
    #pragma omp parallel for schedule(static) num_threads(num_threads) if (tokens * heads * dim >= PAR_MIN_ELEMS)
    for (int64_t t = 0; t < tokens; t++) {
        const float *c = cos_sin + positions[t] * cs_row, *s = c + half;
        for (int64_t h = 0; h < heads; h++) {
            float *x1 = x + t * x_tok + h * x_head, *x2 = x1 + half;
            for (int64_t i = 0; i < half; i++) {
                float a = x1[i], b = x2[i];
                float p = a * c[i], q = b * s[i], u = b * c[i], v = a * s[i];
                x1[i] = p - q;
                x2[i] = u + v;
            }
        }
    }
}
