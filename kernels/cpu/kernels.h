// The entry points of the CPU kernel library, as Python's ctypes (kernels/cpu/__init__.py, load) and the
// decoder-layer driver (decoder_layers.c) call them: their one declaration. Each source includes this header, so the
// compiler checks every definition against its declaration here, and load() reads the ctypes signatures from it
// (c_signatures: a pointer of any type is a void pointer there, so keep to the types it maps). Shapes and dtypes:
// the comment at the top of each source.
#pragma once
#include <stdint.h>

// The KV cache's element formats (kv_kind; kernels/kv_store.py KV_KIND holds the same numbers). The 8-bit ones:
//   KV_INT8      int8, one float32 scale per token and KV head: k_scales / v_scales [rows, Hk] contiguous, value
//                = q * scales[row * Hk + head] (symmetric, scale = amax / 127, written by store_kv);
//   KV_FP8_E4M3  fp8 e4m3fn bytes, one scale per tensor (k_scale / v_scale): value = fp8(q) * k_scale;
//   KV_FP8_E5M2  fp8 e5m2 bytes, the same.
// Kernels that take a kind ignore the scales it does not use (pass NULL and 1.0).
#define KV_F32 0
#define KV_BF16 1
#define KV_INT8 2
#define KV_FP8_E4M3 3
#define KV_FP8_E5M2 4

// decode_attention.c
int decode_attention_supported(int num_heads, int num_kv_heads, int dim);
int decode_attention(const void *q, int64_t q_tok, int64_t q_head, int act_bf16, const void *k_cache,
                     const void *v_cache, int kv_kind, const float *k_scales, const float *v_scales, float k_scale,
                     float v_scale, const int32_t *req_to_token, const int32_t *req_rows,
                     const int32_t *seq_lens, void *out, int batch, int num_heads, int num_kv_heads, int dim,
                     int64_t kc_row, int64_t vc_row, int64_t kc_head, int64_t vc_head, int64_t r2t_row, float scale,
                     int window, float softcap, int num_threads);

// prefill_attention.c
int prefill_attention_amx(int dim);
int prefill_attention_supported(int num_heads, int num_kv_heads, int dim);
int prefill_attention(const void *q, int64_t q_tok, int64_t q_head, int act_bf16, const void *k_cache,
                      const void *v_cache, int kv_kind, const float *k_scales, const float *v_scales,
                      float k_scale, float v_scale, const int32_t *req_to_token, int64_t r2t_row,
                      const int32_t *req_rows, const int32_t *q_start, const int32_t *prefix_lens,
                      const int32_t *extend_lens, void *out,
                      int batch, int num_heads, int num_kv_heads, int dim, int64_t kc_row, int64_t vc_row,
                      int64_t kc_head, int64_t vc_head, float scale, int window, float softcap, int num_threads);

// linear.c
#define PAIR_MAX_M 4  // up to here linear_bf16_pairs streams the weights, in every build (kernels/linear.py)
int linear_panel_width(void);
int linear_packed(const float *x, int64_t x_row, int M, int K, const float *wp, int N,
                  const float *bias, float *out, int64_t out_row, int num_threads);
int linear_bf16_pairs(const uint16_t *x, int64_t x_row, int M, int K, const uint32_t *wp, int N,
                      const uint16_t *bias, uint16_t *out, int64_t out_row, int num_threads);
int linear_bf16_pairs_f32(const uint16_t *x, int64_t x_row, int M, int K, const uint32_t *wp, int N,
                          const uint16_t *bias, float *out, int64_t out_row, int num_threads);
int linear_bf16_pairs_dpbf16(void);
int linear_bf16_pairs_amx(void);
int linear_packed_silu(const float *x, int64_t x_row, int M, int K, const float *wp, int inter, float *out,
                       int num_threads);

// quant_linear.c and quant_linear_q8.c; the GGML type numbers of the block formats they take (ggml.h's enum ggml_type, kernels/quant_linear.py
// GGMLType). quant_linear_f32 and quant_dequant_rows return 0, or -1 for a type or a K they do not take.
#define GGML_Q4_0 2
#define GGML_Q4_1 3
#define GGML_Q5_0 6
#define GGML_Q5_1 7
#define GGML_Q8_0 8
#define GGML_Q4_K 12
#define GGML_Q5_K 13
#define GGML_Q6_K 14
#define GGML_Q8_K 15
// lightserve's own block formats, past ggml's numbers (HF checkpoints' int8 and 4-bit weights repacked at load,
// model_infer/hf_quant_reader.py): Q8_0 and Q4_1 with float32 scales, a block being
//   LS_Q8_0F  float32 s, 32 int8 q                        value = q * s        (36 bytes)
//   LS_Q4_1F  float32 s, float32 o, 16 bytes of nibbles    value = q * s + o    (24 bytes; Q4_1's nibble order)
#define LS_Q8_0F 100
#define LS_Q4_1F 101
int quant_linear_f32(const float *x, int64_t x_row, int M, int K, const uint8_t *w, int64_t w_row_bytes, int qtype,
                     int N, const float *bias, float *out, int64_t out_row, int threads);
// quant_linear_q8.c, int8 activations: x quantized per 32-block to int8 with a float32 scale, integer dot products with
// the weight blocks (a GEMV to GEMV_MAX_M rows, a GEMM above); Q8_K weights and lightserve's own formats run
// quant_linear_f32. quant_activations_q8: that quantization alone, x [M, K] -> q [M, K] int8 and d [M, K / 32].
int quant_linear_q8(const float *x, int64_t x_row, int M, int K, const uint8_t *w, int64_t w_row_bytes, int qtype,
                    int N, const float *bias, float *out, int64_t out_row, int threads);
int quant_activations_q8(const float *x, int64_t x_row, int M, int K, int8_t *q, float *d);
int quant_dequant_rows(const uint8_t *w, int64_t w_row_bytes, int qtype, int K, const int64_t *rows, int n,
                       float *out, int64_t out_row);

// lora.c: LoRA's segmented shrink and expand (kernels/lora.py); 0, -1 for segments or slices out of range (nothing
// written), -2 when out of memory. starts/lens/slots [S] int32, slices [num_slices, 4] int32 (r0, rj, n0, nj);
// a and bt float32, or bfloat16 with w_bf16.
int lora_shrink(const void *x, int64_t x_row, int x_bf16, int T, int K, const void *a, int w_bf16, int num_slots,
                int R, const int32_t *starts, const int32_t *lens, const int32_t *slots, int S, float *xa,
                int threads);
int lora_expand(void *y, int64_t y_row, int y_bf16, int T, int N, const float *xa, int64_t xa_row, const void *bt,
                int w_bf16, int num_slots, int R, const int32_t *starts, const int32_t *lens, const int32_t *slots,
                int S, const int32_t *slices, int num_slices, int threads);
int lora_apply(void *y, int64_t y_row, int y_bf16, const void *x, int64_t x_row, int x_bf16, int T, int K, int N,
               const void *a, const void *bt, int w_bf16, int num_slots, int R, const int32_t *starts,
               const int32_t *lens, const int32_t *slots, int S, const int32_t *slices, int num_slices, int threads);

// elementwise.c
void silu_and_mul(const void *x, int64_t x_row, int64_t rows, int64_t inter, void *out, int bf16, int num_threads);
void rmsnorm(const void *x, int64_t x_row, void *residual, const void *weight, int64_t rows, int64_t hidden,
             float eps, void *out, int bf16, int num_threads);
void rotary(void *x, int64_t x_tok, int64_t x_head, int64_t tokens, int64_t heads, int64_t dim,
            const int64_t *positions, const float *cos_sin, int64_t cs_row, int64_t hadamard, int bf16,
            int num_threads);
int64_t hadamard_block(int64_t dim);
int store_kv(const void *k, int64_t k_tok, int64_t k_head, const void *v, int64_t v_tok, int64_t v_head,
             void *k_cache, int64_t kc_row, int64_t kc_head, void *v_cache, int64_t vc_row, int64_t vc_head,
             int64_t rows, const void *locs, int locs_i64, int64_t tokens, int64_t heads, int64_t dim, int bf16,
             int kv_kind, float *k_scales, float *v_scales, float k_scale, float v_scale, int num_threads);

// sampling.c
void argmax_logsumexp(const void *logits, int64_t row, int64_t rows, int64_t vocab, int64_t *ids, float *lse,
                      int bf16, int num_threads);
void exact_near_max(float *approx, int64_t row, int64_t rows, int64_t vocab, const float *x, int64_t x_row, int64_t k,
                    const float *w, const float *norm, float c, int cap, int32_t *count, int num_threads);

// decoder_layers.c; kernels/decoder_layers.py mirrors its structs with ctypes
struct ModelDims;
struct LayerArgs;
struct StepArgs;
struct Scratch;
int decoder_layers_supported(const struct ModelDims *d);
int decoder_layers(const struct ModelDims *d, const struct LayerArgs *layers, const struct StepArgs *s,
                   const struct Scratch *buf, void *residual, void *hidden, double *times, int threads);
int64_t struct_layout(const char *name);
