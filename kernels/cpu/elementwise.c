// Row-wise elementwise ops of the forward on CPU, float32 or bfloat16: SiLU-and-mul, (add +) RMSNorm,
// rotary, and the KV write (a row copy).
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
//                 positions [T] int64; cos_sin [max_pos, D] float32 (cos | sin halves), row stride cs_row;
//                 hadamard: 0, or the block (hadamard_block(D)) of the Walsh-Hadamard transform each rotated head
//                 then goes through (q and k ahead of an int8 KV cache; kernels/rotary.py says why).
//   store_kv:     k, v [T, H, D] (views of qkv), token strides k_tok / v_tok, head strides k_head / v_head;
//                 k_cache, v_cache [rows, H, D], row strides kc_row / vc_row, head strides kc_head / vc_head;
//                 locs [T] int32 or int64: k_cache[locs[t]] = k[t], v_cache[locs[t]] = v[t]. The cache's
//                 kv_kind (kernels.h) is the source's dtype, or an 8-bit format the rows are quantized to:
//                 int8 also writes k_scales / v_scales [rows, H] float32 at each loc; fp8 divides by the
//                 per-tensor k_scale / v_scale. Cache strides are in the cache's elements (bytes for 8 bits).
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "fastmath.h"
#include "kernels.h"
#include "silu.h"
#include "vec.h"

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

// Parallel only when the op is big enough to pay for waking the second thread (decode rows are few). At 16,384 a
// batch-64 decode step of SmolLM2 (64 x 576 per norm, 64 x 12 x 64 rotated) splits its norms and rotary across both
// threads, whose GEMM just wrote the rows they read. Zen 4, profile_step.py at 64 x 384 in bf16, against 65,536 in
// three alternated pairs of runs: norms 1.36 / 1.36 / 1.55 -> 0.90 / 0.72 / 0.89 ms a step, rotary 0.60 / 0.60 / 0.71
// -> 0.61 / 0.46 / 0.60. Batches of 8 (4,608 elements a norm) stay on one thread.
#define PAR_MIN_ELEMS 16384

// bf16 rows go through a float buffer of CHUNK elements (L1-resident): the float math is one loop and each
// rounding to bf16 one array pass (fastmath.h: vcvtneps2bf16 where the CPU has AVX512-BF16). gcc vectorizes
// that better than one loop that widens, computes and rounds per element. The results are the same bits.
// 512 rows of SmolLM2's shapes, one thread, Zen 4, per element loop -> array passes:
//   silu_and_mul [512, 3,072] 521 -> 341 us; rmsnorm with the residual add [512, 576] 169 -> 117 us;
//   rotary of q and k (9 + 3 heads x 64) 200 -> 135 us. An AVX2 build (-march=x86-64-v3): 995 -> 559,
//   241 -> 205, 283 -> 220 us.
#define CHUNK 256

// Its row, silu_and_mul_row, is in silu.h: linear.c's float32 gate_up GEMM runs it as its epilogue.
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

// One row of each op, with `bf16` a constant at each call: the dtype branch sits outside the loops.
// (The OpenMP loops live in the public functions: a parallel loop inside an inlined helper is outlined
// before inlining, and its dtype would then be a run-time value in the inner loop.)
static inline __attribute__((always_inline)) void rmsnorm_row(const void *x, void *res, const void *weight,
                                                              int64_t hidden, float eps, void *o, const int bf16) {
    float t[CHUNK];  // bf16 only
    if (res) {  // residual += x (rounded to the dtype), then normalize the sum
        if (bf16) {
            for (int64_t c = 0; c < hidden; c += CHUNK) {
                const int n = hidden - c < CHUNK ? (int)(hidden - c) : CHUNK;
                for (int i = 0; i < n; i++) t[i] = ld(res, c + i, 1) + ld(x, c + i, 1);
                f32_to_bf16_array(t, (uint16_t *)res + c, n);
            }
        } else {
            for (int64_t i = 0; i < hidden; i++) st(res, i, ld(res, i, 0) + ld(x, i, 0), 0);
        }
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
    if (!bf16) {
        for (int64_t k = 0; k < hidden; k++) st(o, k, ld(weight, k, 0) * (ld(x, k, 0) * inv), 0);
        return;
    }
    for (int64_t c = 0; c < hidden; c += CHUNK) {
        const int n = hidden - c < CHUNK ? (int)(hidden - c) : CHUNK;
        for (int i = 0; i < n; i++) t[i] = ld(x, c + i, 1) * inv;
        bf16_round_array(t, n);
        for (int i = 0; i < n; i++) t[i] *= ld(weight, c + i, 1);
        f32_to_bf16_array(t, (uint16_t *)o + c, n);
    }
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

// The same in bfloat16 for half <= ROT_MAX_HALF, as array passes (see CHUNK): cs holds cos | sin already
// rounded to bf16 (once per token, for all its heads); the four products are one rounding pass.
#define ROT_MAX_HALF 128
static inline __attribute__((always_inline, optimize("fp-contract=off"))) void rotary_head_bf16(
    uint16_t *x1, uint16_t *x2, const float *cs, int64_t half) {
    const float *c = cs, *s = cs + half;
    float t[4 * ROT_MAX_HALF];  // a*c | b*s | b*c | a*s, each [half]
    float *ac = t, *bs = t + half, *bc = t + 2 * half, *as = t + 3 * half;
    for (int64_t i = 0; i < half; i++) {
        float a = bf16_to_f32(x1[i]), b = bf16_to_f32(x2[i]);
        ac[i] = a * c[i];
        bs[i] = b * s[i];
        bc[i] = b * c[i];
        as[i] = a * s[i];
    }
    bf16_round_array(t, 4 * half);
    for (int64_t i = 0; i < half; i++) {
        ac[i] -= bs[i];
        bc[i] += as[i];
    }
    f32_to_bf16_array(ac, x1, half);
    f32_to_bf16_array(bc, x2, half);
}

// The Walsh-Hadamard block of a head of `dim` for an int8 KV cache: the largest power of two dividing dim, at most
// HADAMARD_MAX (kernels/rotary.py hadamard_block is the same rule).
#define HADAMARD_MAX 64
int64_t hadamard_block(int64_t dim) {
    const int64_t block = dim & -dim;
    return block < HADAMARD_MAX ? block : HADAMARD_MAX;
}

// x's lanes paired across bit h of their index (h < VL): lane j becomes x[j] + x[j ^ h] where bit h of j is clear,
// x[j ^ h] - x[j] where it is set. As partner + x * (+-1): the product is exact and addition commutes, so each lane
// is the scalar butterfly's a + c or a - c to the bit.
static inline vf butterfly_in_vector(vf x, const int h) {
    const vi lane = vlane_index();
    return __builtin_shuffle(x, (vu)(lane ^ h)) + x * __builtin_convertvector(1 + 2 * ((lane & h) != 0), vf);
}

// One block of a head row, float32 in place, multiplied by the normalized Walsh-Hadamard matrix: butterflies of
// span 1, 2, .., block / 2, then one multiply by `scale` = 1 / sqrt(block). kernels/rotary.py hadamard_ref does the
// same operations in the same order, so the float32 bits agree. Spans below VL pair lanes of one vector (one
// shuffle, one FMA a vector), larger ones whole vectors; a block narrower than a vector (head_dim 24) runs scalar.
// SmolLM2's batch-64 bf16 step (profile_step.py, AMX Xeon): rotary 0.81 ms with a bf16 cache, 1.27-1.34 ms with an
// int8 one (2.87 ms when every span ran scalar).
static inline void hadamard_block_f32(float *t, int64_t block, float scale) {
    if (block % VL) {
        for (int64_t h = 1; h < block; h *= 2)
            for (int64_t i = 0; i < block; i += 2 * h)
                for (int64_t j = i; j < i + h; j++) {
                    const float a = t[j], c = t[j + h];
                    t[j] = a + c;
                    t[j + h] = a - c;
                }
        for (int64_t j = 0; j < block; j++) t[j] *= scale;
        return;
    }
    for (int64_t i = 0; i < block; i += VL) {
        vf x = butterfly_in_vector(butterfly_in_vector(butterfly_in_vector(vload(t + i), 1), 2), 4);
#if VL == 16
        x = butterfly_in_vector(x, 8);
#endif
        vstore(t + i, x);
    }
    for (int64_t h = VL; h < block; h *= 2)
        for (int64_t i = 0; i < block; i += 2 * h)
            for (int64_t j = i; j < i + h; j += VL) {
                const vf a = vload(t + j), c = vload(t + j + h);
                vstore(t + j, a + c);
                vstore(t + j + h, a - c);
            }
    const vf sv = vbroadcast(scale);
    for (int64_t j = 0; j < block; j += VL) vstore(t + j, vload(t + j) * sv);
}

// A head row [dim] (float32 or bf16) through hadamard_block_f32 block by block; bf16 rows are widened, transformed
// and rounded once, as the reference computes in float32 and rounds its result.
static inline void hadamard_head(void *x, int64_t dim, int64_t block, float scale, const int bf16) {
    float t[HADAMARD_MAX];
    for (int64_t b = 0; b < dim; b += block) {
        if (bf16) {
            for (int64_t j = 0; j < block; j++) t[j] = bf16_to_f32(((const uint16_t *)x)[b + j]);
            hadamard_block_f32(t, block, scale);
            f32_to_bf16_array(t, (uint16_t *)x + b, block);
        } else {
            hadamard_block_f32((float *)x + b, block, scale);
        }
    }
}

__attribute__((optimize("fp-contract=off")))
void rotary(void *x, int64_t x_tok, int64_t x_head, int64_t tokens, int64_t heads, int64_t dim,
            const int64_t *positions, const float *cos_sin, int64_t cs_row, int64_t hadamard, int bf16,
            int num_threads) {
    const int64_t half = dim / 2;
    const int es = bf16 ? 2 : 4;
    const float h_scale = hadamard ? (float)(1.0 / sqrt((double)hadamard)) : 1.0f;
    #pragma omp parallel for schedule(static) num_threads(num_threads) if (tokens * heads * dim >= PAR_MIN_ELEMS)
    for (int64_t t = 0; t < tokens; t++) {
        const float *c = cos_sin + positions[t] * cs_row, *s = c + half;
        float cs[2 * ROT_MAX_HALF];
        const int arrays = bf16 && half <= ROT_MAX_HALF;
        if (arrays) {
            memcpy(cs, c, 2 * half * sizeof(float));
            bf16_round_array(cs, 2 * half);
        }
        for (int64_t h = 0; h < heads; h++) {
            char *x1 = (char *)x + (t * x_tok + h * x_head) * es, *x2 = x1 + half * es;
            if (arrays)
                rotary_head_bf16((uint16_t *)x1, (uint16_t *)x2, cs, half);
            else if (bf16)
                rotary_head(x1, x2, c, s, half, 1);
            else
                rotary_head(x1, x2, c, s, half, 0);
            if (hadamard)
                hadamard_head(x1, dim, hadamard, h_scale, bf16);
        }
    }
}

// The 8-bit formats' writes (kernels/kv_store.py quantize_kv_ref is the spec, matched byte for byte).
// x as fp8 e4m3fn (e5m2 = 0) or e5m2 bits, rounded to nearest even; |x| at most the format's max (the caller
// clamps), NaN gives 0x7F with x's sign as torch's cast does. Subnormals (below 2^-6, 2^-14) are multiples of
// 2^-9 (2^-16): rint of the scaled value, which also rounds up into the smallest normal exactly. Normals: the
// float32 bits rounded at the fp8 mantissa's last bit (bit 20, 21), then the exponent rebiased (127 -> 7, 15).
static inline uint8_t fp8_encode(float x, const int e5m2) {
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    const uint32_t sign = (bits >> 24) & 0x80u, mag = bits & 0x7fffffffu;
    const int shift = e5m2 ? 21 : 20;
    const uint32_t min_normal = (e5m2 ? 127u - 14 : 127u - 6) << 23;
    uint32_t q;
    if (mag > 0x7f800000u) {
        q = 0x7f;
    } else if (mag < min_normal) {
        float ax;
        memcpy(&ax, &mag, sizeof ax);
        q = (uint32_t)rintf(ax * (e5m2 ? 65536.0f : 512.0f));
    } else {
        const uint32_t rounded = (mag + (1u << (shift - 1)) - 1 + ((mag >> shift) & 1u)) >> shift;
        q = rounded - ((e5m2 ? 112u : 120u) << (23 - shift));
    }
    return (uint8_t)(sign | q);
}

// One head row x [dim] (float32 or bf16 by `bf16`, a constant at each call) into the cache's bytes.
// int8: symmetric over the row, *row_scale = amax / 127 and q = rint(x * (1 / amax * 127)), all zeros for amax 0.
// fp8: x / scale (the per-tensor scale) clamped to +-max, then fp8_encode.
static inline __attribute__((always_inline)) void quantize_head(const void *x, uint8_t *dst, int64_t dim, int kind,
                                                                float *row_scale, float scale, const int bf16) {
    if (kind == KV_INT8) {
        float amax = 0.0f;
        for (int64_t d = 0; d < dim; d++) {
            const float a = fabsf(ld(x, d, bf16));
            amax = a > amax ? a : amax;
        }
        // 1 / amax times 127, two roundings: the reference's `127.0 / amax` is torch's __rtruediv__, which is
        // reciprocal() * 127; the one-division quotient differs in the last bit for some amax, and so would q.
        const float inv = amax > 0.0f ? (1.0f / amax) * 127.0f : 0.0f;
        for (int64_t d = 0; d < dim; d++) {
            float q = rintf(ld(x, d, bf16) * inv);
            q = q > 127.0f ? 127.0f : q < -127.0f ? -127.0f : q;
            ((int8_t *)dst)[d] = (int8_t)q;
        }
        *row_scale = amax / 127.0f;
        return;
    }
    const int e5m2 = kind == KV_FP8_E5M2;
    const float bound = e5m2 ? 57344.0f : 448.0f;
    for (int64_t d = 0; d < dim; d++) {
        float y = ld(x, d, bf16) / scale;
        y = y > bound ? bound : y < -bound ? -bound : y;  // compares, not fminf: NaN stays NaN, as torch's clamp
        dst[d] = fp8_encode(y, e5m2);
    }
}

// The KV write of a step: torch's index_copy_ took 14 us a call for 64 decode tokens (24 KB), two calls a layer.
// Float32 rows into a bf16 cache (float32 activations over a half-size cache) are rounded to nearest even, as
// .to(torch.bfloat16) rounds them. Returns 0, or -1 (nothing written) when a loc is outside [0, rows), or the kind
// is neither the source's dtype, nor bf16 under float32 rows, nor an 8-bit one (int8 without its scales included):
// the caller then runs the reference, which raises or casts.
int store_kv(const void *k, int64_t k_tok, int64_t k_head, const void *v, int64_t v_tok, int64_t v_head,
             void *k_cache, int64_t kc_row, int64_t kc_head, void *v_cache, int64_t vc_row, int64_t vc_head,
             int64_t rows, const void *locs, int locs_i64, int64_t tokens, int64_t heads, int64_t dim, int bf16,
             int kv_kind, float *k_scales, float *v_scales, float k_scale, float v_scale, int num_threads) {
    const int quant = kv_kind == KV_INT8 || kv_kind == KV_FP8_E4M3 || kv_kind == KV_FP8_E5M2;
    const int narrow = !bf16 && kv_kind == KV_BF16;
    if (!quant && !narrow && kv_kind != (bf16 ? KV_BF16 : KV_F32)) return -1;
    if (kv_kind == KV_INT8 && (!k_scales || !v_scales)) return -1;
    const int es = bf16 ? 2 : 4;
    for (int64_t t = 0; t < tokens; t++) {
        const int64_t loc = locs_i64 ? ((const int64_t *)locs)[t] : ((const int32_t *)locs)[t];
        if (loc < 0 || loc >= rows) return -1;
    }
    if (quant) {
        #pragma omp parallel for schedule(static) num_threads(num_threads) if (tokens * heads * dim >= PAR_MIN_ELEMS)
        for (int64_t t = 0; t < tokens; t++) {
            const int64_t loc = locs_i64 ? ((const int64_t *)locs)[t] : ((const int32_t *)locs)[t];
            for (int64_t h = 0; h < heads; h++) {
                const char *kt = (const char *)k + (t * k_tok + h * k_head) * es;
                const char *vt = (const char *)v + (t * v_tok + h * v_head) * es;
                uint8_t *kc = (uint8_t *)k_cache + loc * kc_row + h * kc_head;
                uint8_t *vc = (uint8_t *)v_cache + loc * vc_row + h * vc_head;
                float unused;
                float *ks = k_scales ? k_scales + loc * heads + h : &unused;
                float *vs = v_scales ? v_scales + loc * heads + h : &unused;
                if (bf16) {
                    quantize_head(kt, kc, dim, kv_kind, ks, k_scale, 1);
                    quantize_head(vt, vc, dim, kv_kind, vs, v_scale, 1);
                } else {
                    quantize_head(kt, kc, dim, kv_kind, ks, k_scale, 0);
                    quantize_head(vt, vc, dim, kv_kind, vs, v_scale, 0);
                }
            }
        }
        return 0;
    }
    if (narrow) {
        #pragma omp parallel for schedule(static) num_threads(num_threads) if (tokens * heads * dim >= PAR_MIN_ELEMS)
        for (int64_t t = 0; t < tokens; t++) {
            const int64_t loc = locs_i64 ? ((const int64_t *)locs)[t] : ((const int32_t *)locs)[t];
            for (int64_t h = 0; h < heads; h++) {
                const float *kt = (const float *)k + t * k_tok + h * k_head;
                const float *vt = (const float *)v + t * v_tok + h * v_head;
                uint16_t *kc = (uint16_t *)k_cache + loc * kc_row + h * kc_head;
                uint16_t *vc = (uint16_t *)v_cache + loc * vc_row + h * vc_head;
                for (int64_t d = 0; d < dim; d++) {
                    kc[d] = f32_to_bf16(kt[d]);
                    vc[d] = f32_to_bf16(vt[d]);
                }
            }
        }
        return 0;
    }
    const size_t head_bytes = (size_t)dim * es;
    #pragma omp parallel for schedule(static) num_threads(num_threads) if (tokens * heads * dim >= PAR_MIN_ELEMS)
    for (int64_t t = 0; t < tokens; t++) {
        const int64_t loc = locs_i64 ? ((const int64_t *)locs)[t] : ((const int32_t *)locs)[t];
        char *kc = (char *)k_cache + loc * kc_row * es, *vc = (char *)v_cache + loc * vc_row * es;
        const char *kt = (const char *)k + t * k_tok * es, *vt = (const char *)v + t * v_tok * es;
        if (k_head == dim && v_head == dim && kc_head == dim && vc_head == dim) {  // heads back to back: one copy a row
            memcpy(kc, kt, heads * head_bytes);
            memcpy(vc, vt, heads * head_bytes);
        } else {
            for (int64_t h = 0; h < heads; h++) {
                memcpy(kc + h * kc_head * es, kt + h * k_head * es, head_bytes);
                memcpy(vc + h * vc_head * es, vt + h * v_head * es, head_bytes);
            }
        }
    }
    return 0;
}
