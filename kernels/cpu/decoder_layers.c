// The decoder layers of a Llama-family model (pre-norm attention and gated-SiLU MLP) run in one call on CPU.
//
// Why: the model's forward (model_infer/models/llama.py) calls about ten C kernels a layer through their
// Python wrappers, and each wrapper costs 7-9 us before the kernel starts (the checks, ctypes, torch.empty for
// its output). Over SmolLM2's 30 layers that was 4.0 ms of a 16.5 ms bf16 decode step at batch 1 and 8.4 ms of
// 85 ms at batch 64 (scripts/profile_step.py, Zen 4). Here the same kernels run in the same order with the same
// arguments, reading and writing a few scratch buffers the caller allocates once per step, so the result is
// bit for bit the per-kernel forward's. The caller (kernels/decoder_layers.py) checks beforehand everything the
// kernels would decline, so a kernel returning -1 here is a bug or an out-of-memory, not a fallback.
//
// One layer, T tokens (the step's decode tokens first, then its prefill chunks), activations of one dtype
// (float32 or bfloat16, `bf16`), row-major and contiguous unless said:
//   x        = layer 0: rmsnorm(residual); else: residual += hidden, rmsnorm(residual)   [T, H]
//   qkv      = x . w_qkv^T (+ b)                                          [T, (Hq + 2 Hk) D]
//   with q/k norms (Qwen3): q, k = RMSNorm over D of each head of q and of k, into their own buffers
//                                                                         [T, Hq, D], [T, Hk, D]
//   rotary on q and k (views of qkv, or those buffers), k and v written to the layer's KV cache at kv_locs
//              (quantized there in an 8-bit cache; an int8 one has q and k through the Walsh-Hadamard transform first)
//   attn     = decode attention of the first num_decode tokens, prefill attention of the rest   [T, Hq D]
//   hidden   = attn . w_o^T (+ b)                                         [T, H]
//   x        = residual += hidden, rmsnorm(residual)                      [T, H]
//   gate_up  = x . w_gate_up^T                                            [T, 2 I]
//   act      = silu(gate) * up                                            [T, I]
//              (float32: one call, linear_packed_silu, where it takes the shapes; gate_up is then never written)
//   hidden   = act . w_down^T                                             [T, H]
// On return `hidden` holds the last layer's MLP output and `residual` the sum before it: what the model's final
// add + RMSNorm reads. Linear weights are in the layout of the dtype's C GEMM: linear.c's panels (float32) or
// its bf16 pair layout. The pair kernels take every M in a build with vdpbf16ps and up to PAIR_MAX_M rows in every
// build. On a CPU without native bf16 products a bf16 model's layers also carry float32 panels (`*_f`, with float32
// biases): above PAIR_MAX_M rows x is widened to float32, the float32 GEMM runs and its output is rounded to bf16,
// as kernels/linear.py's linear() runs `PrepackedLinear.widened`. The caller keeps a step's tokens within what its
// weights' kernels take (kernels/decoder_layers.py): where a bf16 weight keeps oneDNN's copy for larger M (an AMX CPU
// without the tile GEMM), the decode of one to a few requests runs here and larger steps run the per-kernel forward.
// A float32 model's projections may instead be kept in GGML blocks (a GGUF checkpoint; kernels/quant_linear.py):
// then the layer's `*_q` descriptor is set and the projection runs quant_linear.c's kernel segment by segment, with
// the activation as its own call after gate_up (linear_packed_silu takes float32 panels only).
// LoRA (S-LoRA's segmented adapters, model_infer/lora.py): where the step has adapter segments (StepArgs.lora) and
// a layer's group of projections has adapters bound (LayerArgs.lora), each projection's delta is added right after
// its GEMM, with lora.c's lora_apply over the same x and output as the per-kernel forward's `_add_lora` passes it:
//   qkv     += lora(x)        before the q/k norms and rotary
//   hidden  += lora(attn)     after the o GEMM (and its bias), before the post-attention norm
//   gate_up += lora(x)        before the activation: gate_up is then written (no linear_packed_silu)
//   hidden  += lora(act)      after the down GEMM
// A group is skipped where no segment's slot targets it in that layer, as LoraWeights.apply skips it.
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#include "fastmath.h"
#include "kernels.h"

// A projection kept in GGML blocks: row segments of one block type each, stacked (kernels/quant_linear.py's
// QuantLinear). Segment i is rows[i] rows of row_bytes[i] bytes from blocks[i]. int8_dot: multiplied with int8
// activations (quant_linear_q8, which runs quant_linear_f32 itself over its cut-over in M and for Q8_K), as
// quant_linear() does for such a weight.
#define QUANT_MAX_SEGMENTS 4
typedef struct QuantWeight {
    int32_t segments, int8_dot;
    int32_t qtype[QUANT_MAX_SEGMENTS], rows[QUANT_MAX_SEGMENTS];
    int64_t row_bytes[QUANT_MAX_SEGMENTS];
    const uint8_t *blocks[QUANT_MAX_SEGMENTS];
} QuantWeight;

// One layer's stacked LoRA weights of one group of projections (model_infer/lora.py's GroupBuffers), float32 or
// bfloat16 (w_bf16; --lora_dtype): a [num_slots, R, K], bt [num_slots, R, N] with the adapters' scaling folded in, and
// the expand's slices.
typedef struct LoraGroupArgs {
    const void *a, *bt;
    const int32_t *slices;    // [num_slices, 4] (r0, rj, n0, nj): rank rows [r0, r0 + rj) write columns [n0, n0 + nj)
    const uint8_t *targeted;  // [num_slots]: 1 where the slot's adapter targets this group in this layer
    int32_t rank, num_slices; // rank: R, the rows of a slot's a and bt (all rank blocks of the group)
    int32_t w_bf16;           // 1: a and bt are bf16
} LoraGroupArgs;

// The groups in LoraGroupArgs arrays, in model_infer/lora.py's LoraGroup order.
enum { LORA_QKV, LORA_O, LORA_GATE_UP, LORA_DOWN, LORA_GROUPS };

// One layer's tensors. Linear weights as packed at load; biases and the cos/sin table as noted.
typedef struct LayerArgs {
    const void *input_norm, *post_attn_norm;  // [H]
    const void *q_norm, *k_norm;              // [D] each, or NULL: no q/k norm (then both NULL)
    const void *qkv, *qkv_bias;               // packed [(Hq + 2 Hk) D, H]; bias [(Hq + 2 Hk) D] or NULL
    const void *o_proj, *o_bias;              // packed [H, Hq D]; bias [H] or NULL
    const void *gate_up, *down;               // packed [2 I, H] (gate rows, then up rows), [H, I]
    // bf16 with `widened` only (else NULL): the same four projections in float32 panels, the biases in float32
    const float *qkv_f, *qkv_bias_f, *o_proj_f, *o_bias_f, *gate_up_f, *down_f;
    void *k_cache, *v_cache;                  // [kv_rows, Hk, D], row strides kc_row / vc_row, head kc_head / vc_head
    const float *cos_sin;                     // [max_pos, D] float32 (cos | sin), row stride cos_sin_row
    int64_t cos_sin_row;
    int32_t window;                           // attention window in tokens, 0 for none
    // An 8-bit cache's scales (kernels.h, KV_INT8 .. KV_FP8_E5M2): int8 [kv_rows, Hk] float32 each, else NULL;
    // fp8 the per-tensor floats, else 1
    float *k_scales, *v_scales;
    float k_scale, v_scale;
    // float32 models whose projections are kept in GGML blocks: their descriptors (then qkv .. down are unused),
    // else NULL
    const QuantWeight *qkv_q, *o_proj_q, *gate_up_q, *down_q;
    // [LORA_GROUPS] of the model's LoRA adapters, or NULL (none bound); a group with a NULL `a` takes no adapter
    // (the MLP of a family whose adapters target attention only)
    const LoraGroupArgs *lora;
} LayerArgs;

// The model's shapes, the same for every layer and step.
typedef struct ModelDims {
    int32_t num_layers, hidden, num_heads, num_kv_heads, head_dim, inter, bf16;
    int32_t widened;  // bf16: GEMMs over PAIR_MAX_M rows run the layers' float32 panels
    float eps, sm_scale, softcap;
    int64_t kv_rows, kc_row, vc_row, kc_head, vc_head;
    int32_t kv_kind;  // the KV cache's format, KV_F32 .. KV_FP8_E5M2 (kernels.h); a float cache is the activations'
} ModelDims;

// A step's LoRA segments (kernels/lora.py's LoraSegments): tokens [starts[i], starts[i] + lens[i]) run under
// slot slots[i], [segments] int32 each, ascending and disjoint; tokens in no segment run the base model.
typedef struct LoraStep {
    const int32_t *starts, *lens, *slots;
    int32_t segments, num_slots;  // num_slots: the slots of the bound adapters' stacks
} LoraStep;

// One step's batch: token order is the decode tokens, then each prefill chunk's.
typedef struct StepArgs {
    int32_t tokens, num_decode, num_extend, locs_i64;
    const int64_t *positions;                       // [T]
    const void *kv_locs;                            // [T] int32, or int64 with locs_i64
    const int32_t *req_to_token;                    // [num_req_rows, max_len], row stride r2t_row
    int64_t r2t_row;
    const int32_t *decode_rows, *decode_lens;       // [num_decode]
    // [num_extend]; q_start counts from the first prefill token (token num_decode)
    const int32_t *extend_rows, *extend_q_start, *extend_prefix_lens, *extend_lens;
    const LoraStep *lora;                           // the step's adapter segments, or NULL: none
} StepArgs;

// Scratch the caller allocates for the step, each [T, width] in the activation dtype.
typedef struct Scratch {
    void *x, *qkv, *attn, *gate_up, *act;  // widths H, (Hq + 2 Hk) D, Hq D, 2 I, I
    void *q, *k;                           // widths Hq D, Hk D: the normed q and k (used with q/k norms only)
    float *xf, *yf;                        // with `widened`: a GEMM's x and output in float32, [T, max K], [T, max N]
} Scratch;

// The size of each struct above ("ModelDims") and the offset of each of its fields ("ModelDims.eps"), by name; -1 for
// a name not listed. tests/model/test_decoder_layers.py holds kernels/decoder_layers.py's ctypes mirrors to them.
#define SIZE_OF(S) {#S, sizeof(S)}
#define FIELD_AT(S, f) {#S "." #f, offsetof(S, f)}
static const struct {
    const char *name;
    size_t value;
} LAYOUT[] = {
    SIZE_OF(LayerArgs), FIELD_AT(LayerArgs, input_norm), FIELD_AT(LayerArgs, post_attn_norm),
    FIELD_AT(LayerArgs, q_norm), FIELD_AT(LayerArgs, k_norm), FIELD_AT(LayerArgs, qkv), FIELD_AT(LayerArgs, qkv_bias),
    FIELD_AT(LayerArgs, o_proj), FIELD_AT(LayerArgs, o_bias), FIELD_AT(LayerArgs, gate_up), FIELD_AT(LayerArgs, down),
    FIELD_AT(LayerArgs, qkv_f), FIELD_AT(LayerArgs, qkv_bias_f), FIELD_AT(LayerArgs, o_proj_f),
    FIELD_AT(LayerArgs, o_bias_f), FIELD_AT(LayerArgs, gate_up_f), FIELD_AT(LayerArgs, down_f),
    FIELD_AT(LayerArgs, k_cache), FIELD_AT(LayerArgs, v_cache), FIELD_AT(LayerArgs, cos_sin),
    FIELD_AT(LayerArgs, cos_sin_row), FIELD_AT(LayerArgs, window), FIELD_AT(LayerArgs, k_scales),
    FIELD_AT(LayerArgs, v_scales), FIELD_AT(LayerArgs, k_scale), FIELD_AT(LayerArgs, v_scale),
    FIELD_AT(LayerArgs, qkv_q), FIELD_AT(LayerArgs, o_proj_q), FIELD_AT(LayerArgs, gate_up_q),
    FIELD_AT(LayerArgs, down_q), FIELD_AT(LayerArgs, lora),
    SIZE_OF(LoraGroupArgs), FIELD_AT(LoraGroupArgs, a), FIELD_AT(LoraGroupArgs, bt), FIELD_AT(LoraGroupArgs, slices),
    FIELD_AT(LoraGroupArgs, targeted), FIELD_AT(LoraGroupArgs, rank), FIELD_AT(LoraGroupArgs, num_slices),
    FIELD_AT(LoraGroupArgs, w_bf16),
    SIZE_OF(LoraStep), FIELD_AT(LoraStep, starts), FIELD_AT(LoraStep, lens), FIELD_AT(LoraStep, slots),
    FIELD_AT(LoraStep, segments), FIELD_AT(LoraStep, num_slots),
    SIZE_OF(QuantWeight), FIELD_AT(QuantWeight, segments), FIELD_AT(QuantWeight, int8_dot),
    FIELD_AT(QuantWeight, qtype), FIELD_AT(QuantWeight, rows),
    FIELD_AT(QuantWeight, row_bytes), FIELD_AT(QuantWeight, blocks),
    SIZE_OF(ModelDims), FIELD_AT(ModelDims, num_layers), FIELD_AT(ModelDims, hidden), FIELD_AT(ModelDims, num_heads),
    FIELD_AT(ModelDims, num_kv_heads), FIELD_AT(ModelDims, head_dim), FIELD_AT(ModelDims, inter),
    FIELD_AT(ModelDims, bf16), FIELD_AT(ModelDims, widened), FIELD_AT(ModelDims, eps), FIELD_AT(ModelDims, sm_scale),
    FIELD_AT(ModelDims, softcap), FIELD_AT(ModelDims, kv_rows), FIELD_AT(ModelDims, kc_row),
    FIELD_AT(ModelDims, vc_row), FIELD_AT(ModelDims, kc_head), FIELD_AT(ModelDims, vc_head),
    FIELD_AT(ModelDims, kv_kind),
    SIZE_OF(StepArgs), FIELD_AT(StepArgs, tokens), FIELD_AT(StepArgs, num_decode), FIELD_AT(StepArgs, num_extend),
    FIELD_AT(StepArgs, locs_i64), FIELD_AT(StepArgs, positions), FIELD_AT(StepArgs, kv_locs),
    FIELD_AT(StepArgs, req_to_token), FIELD_AT(StepArgs, r2t_row), FIELD_AT(StepArgs, decode_rows),
    FIELD_AT(StepArgs, decode_lens), FIELD_AT(StepArgs, extend_rows), FIELD_AT(StepArgs, extend_q_start),
    FIELD_AT(StepArgs, extend_prefix_lens), FIELD_AT(StepArgs, extend_lens), FIELD_AT(StepArgs, lora),
    SIZE_OF(Scratch), FIELD_AT(Scratch, x), FIELD_AT(Scratch, qkv), FIELD_AT(Scratch, attn), FIELD_AT(Scratch, gate_up),
    FIELD_AT(Scratch, act), FIELD_AT(Scratch, q), FIELD_AT(Scratch, k), FIELD_AT(Scratch, xf), FIELD_AT(Scratch, yf),
};

int64_t struct_layout(const char *name) {
    for (size_t i = 0; i < sizeof LAYOUT / sizeof LAYOUT[0]; i++)
        if (strcmp(LAYOUT[i].name, name) == 0) return (int64_t)LAYOUT[i].value;
    return -1;
}

// Per-kernel wall times, in seconds, added into times[] when the caller passes it (Python's kernel_times()
// labels in kernels/decoder_layers.py, in this order).
enum { T_NORM, T_LINEAR, T_ROTARY, T_STORE_KV, T_DECODE, T_PREFILL, T_ACT, T_LORA, NUM_TIMED };

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

// The step's timer: a no-op without a times array.
typedef struct {
    double *times, start;
} Timer;

static void tic(Timer *t) {
    if (t->times) t->start = now();
}

static void toc(Timer *t, int what) {
    if (t->times) t->times[what] += now() - t->start;
}

// x [M, K] -> out [M, N], contiguous, in the activation dtype. w / bias: the dtype's layout; wf / bias_f: the float32
// panels and bias where `widened` (bf16 over PAIR_MAX_M rows), else unused; q: the weight in GGML blocks (float32
// models), else NULL.
static int linear(const ModelDims *d, const Scratch *buf, const void *x, int M, int K, const void *w, int N,
                  const void *bias, const float *wf, const float *bias_f, const QuantWeight *q, void *out,
                  int threads) {
    if (q) {  // each segment writes its own output columns, as quant_linear() does
        int row = 0;
        for (int i = 0; i < q->segments; i++) {
            if ((q->int8_dot ? quant_linear_q8 : quant_linear_f32)(x, K, M, K, q->blocks[i], q->row_bytes[i], q->qtype[i], q->rows[i],
                                 bias ? (const float *)bias + row : NULL, (float *)out + row, N, threads))
                return -1;
            row += q->rows[i];
        }
        return row == N ? 0 : -1;
    }
    if (!d->bf16) return linear_packed(x, K, M, K, w, N, bias, out, N, threads);
    if (!d->widened || M <= PAIR_MAX_M) return linear_bf16_pairs(x, K, M, K, w, N, bias, out, N, threads);
    // Row blocks: each thread widens and rounds the rows it covers (x.float() and .to(bfloat16) in linear()).
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int i = 0; i < M; i++) {
        const uint16_t *xi = (const uint16_t *)x + (int64_t)i * K;
        for (int j = 0; j < K; j++) buf->xf[(int64_t)i * K + j] = bf16_to_f32(xi[j]);
    }
    if (linear_packed(buf->xf, K, M, K, wf, N, bias_f, buf->yf, N, threads)) return -1;
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int i = 0; i < M; i++) f32_to_bf16_array(buf->yf + (int64_t)i * N, (uint16_t *)out + (int64_t)i * N, N);
    return 0;
}

// Layer w's group g where the step's segments need it: adapters bound there and some segment's slot targeting it
// (LoraWeights.apply's rule); else NULL. A slot out of range counts as targeting, so lora_apply reports it.
static const LoraGroupArgs *lora_group(const LoraStep *ls, const LayerArgs *w, int g) {
    if (!ls || !w->lora || !w->lora[g].a) return NULL;
    const LoraGroupArgs *lg = &w->lora[g];
    for (int i = 0; i < ls->segments; i++) {
        const int32_t slot = ls->slots[i];
        if (slot < 0 || slot >= ls->num_slots || lg->targeted[slot]) return lg;
    }
    return NULL;
}

// y [T, N] += group lg's delta for x [T, K], both contiguous in the activation dtype: lora_apply with the
// arguments kernels/lora.py's lora_apply_cpu gives it for the per-kernel forward's tensors.
static int add_lora(const LoraStep *ls, const LoraGroupArgs *lg, void *y, int N, const void *x, int K, int T,
                    int bf16, int threads) {
    return lora_apply(y, N, bf16, x, K, bf16, T, K, N, lg->a, lg->bt, lg->w_bf16, ls->num_slots, lg->rank, ls->starts,
                      ls->lens, ls->slots, ls->segments, lg->slices, lg->num_slices, threads);
}

// 1 when decoder_layers takes this model: shapes its kernels take (the bf16 pair GEMMs need an even K).
int decoder_layers_supported(const ModelDims *d) {
    // A float cache holds the activations' dtype, or bf16 under float32 ones; an 8-bit one any format the attention
    // kernels read.
    if (d->kv_kind == KV_F32 && d->bf16) return 0;
    if (d->bf16 && (d->hidden % 2 || d->inter % 2 || (d->num_heads * d->head_dim) % 2)) return 0;
    return decode_attention_supported(d->num_heads, d->num_kv_heads, d->head_dim)
        && prefill_attention_supported(d->num_heads, d->num_kv_heads, d->head_dim) && d->head_dim % 2 == 0;
}

// Runs every layer over the step. residual [T, H]: the embeddings in, the residual stream out; hidden [T, H]:
// the last MLP output out. Returns 0, or -(1 + layer * NUM_TIMED + kernel) for the first kernel that declined.
int decoder_layers(const ModelDims *d, const LayerArgs *layers, const StepArgs *s, const Scratch *buf,
                   void *residual, void *hidden, double *times, int threads) {
    if (!decoder_layers_supported(d)) return -1;
    const int T = s->tokens, nd = s->num_decode, H = d->hidden, D = d->head_dim, bf16 = d->bf16;
    const int hq = d->num_heads, hk = d->num_kv_heads, I = d->inter;
    const int qkv_w = (hq + 2 * hk) * D, es = bf16 ? 2 : 4;
    // q and k through the Walsh-Hadamard transform after the rotary, ahead of an int8 cache (kernels/rotary.py)
    const int64_t hadamard = d->kv_kind == KV_INT8 ? hadamard_block(D) : 0;
    char *qkv = buf->qkv, *attn = buf->attn;
    const LoraStep *ls = s->lora;
    const LoraGroupArgs *lg;
    Timer t = {times, 0.0};
#define FAIL(layer, kernel) return -(1 + (layer) * NUM_TIMED + (kernel))
    for (int l = 0; l < d->num_layers; l++) {
        const LayerArgs *w = &layers[l];
        tic(&t);
        rmsnorm(l == 0 ? residual : hidden, H, l == 0 ? NULL : residual, w->input_norm, T, H, d->eps, buf->x, bf16,
                threads);
        toc(&t, T_NORM);

        tic(&t);
        if (linear(d, buf, buf->x, T, H, w->qkv, qkv_w, w->qkv_bias, w->qkv_f, w->qkv_bias_f, w->qkv_q, qkv,
                   threads))
            FAIL(l, T_LINEAR);
        toc(&t, T_LINEAR);
        if ((lg = lora_group(ls, w, LORA_QKV))) {  // before the q/k norms and rotary read q and k
            tic(&t);
            if (add_lora(ls, lg, qkv, qkv_w, buf->x, H, T, bf16, threads)) FAIL(l, T_LORA);
            toc(&t, T_LORA);
        }
        // q [T, Hq, D] and k [T, Hk, D] with token strides q_tok / k_tok; v stays a view of qkv.
        char *q = qkv, *k = qkv + (int64_t)hq * D * es, *v = k + (int64_t)hk * D * es;
        int64_t q_tok = qkv_w, k_tok = qkv_w;
        if (w->q_norm) {  // per head over D, each token's heads one norm call (the rows are strided per token)
            tic(&t);
            for (int i = 0; i < T; i++) {
                rmsnorm(q + (int64_t)i * qkv_w * es, D, NULL, w->q_norm, hq, D, d->eps,
                        (char *)buf->q + (int64_t)i * hq * D * es, bf16, threads);
                rmsnorm(k + (int64_t)i * qkv_w * es, D, NULL, w->k_norm, hk, D, d->eps,
                        (char *)buf->k + (int64_t)i * hk * D * es, bf16, threads);
            }
            toc(&t, T_NORM);
            q = buf->q, k = buf->k, q_tok = (int64_t)hq * D, k_tok = (int64_t)hk * D;
        }
        tic(&t);
        rotary(q, q_tok, D, T, hq, D, s->positions, w->cos_sin, w->cos_sin_row, hadamard, bf16, threads);
        rotary(k, k_tok, D, T, hk, D, s->positions, w->cos_sin, w->cos_sin_row, hadamard, bf16, threads);
        toc(&t, T_ROTARY);
        tic(&t);
        if (store_kv(k, k_tok, D, v, qkv_w, D, w->k_cache, d->kc_row, d->kc_head, w->v_cache, d->vc_row, d->vc_head,
                     d->kv_rows, s->kv_locs, s->locs_i64, T, hk, D, bf16, d->kv_kind, w->k_scales, w->v_scales,
                     w->k_scale, w->v_scale, threads))
            FAIL(l, T_STORE_KV);
        toc(&t, T_STORE_KV);

        if (nd > 0) {
            tic(&t);
            if (decode_attention(q, q_tok, D, bf16, w->k_cache, w->v_cache, d->kv_kind, w->k_scales, w->v_scales,
                                 w->k_scale, w->v_scale, s->req_to_token, s->decode_rows,
                                 s->decode_lens, attn, nd, hq, hk, D, d->kc_row, d->vc_row, d->kc_head, d->vc_head,
                                 s->r2t_row, d->sm_scale, w->window, d->softcap, threads))
                FAIL(l, T_DECODE);
            toc(&t, T_DECODE);
        }
        if (s->num_extend > 0) {
            tic(&t);
            if (prefill_attention(q + (int64_t)nd * q_tok * es, q_tok, D, bf16, w->k_cache, w->v_cache,
                                  d->kv_kind, w->k_scales, w->v_scales, w->k_scale, w->v_scale,
                                  s->req_to_token, s->r2t_row, s->extend_rows, s->extend_q_start,
                                  s->extend_prefix_lens, s->extend_lens, attn + (int64_t)nd * hq * D * es,
                                  s->num_extend, hq, hk, D, d->kc_row, d->vc_row, d->kc_head, d->vc_head, d->sm_scale,
                                  w->window, d->softcap, threads))
                FAIL(l, T_PREFILL);
            toc(&t, T_PREFILL);
        }
        tic(&t);
        if (linear(d, buf, attn, T, hq * D, w->o_proj, H, w->o_bias, w->o_proj_f, w->o_bias_f, w->o_proj_q, hidden,
                   threads))
            FAIL(l, T_LINEAR);
        toc(&t, T_LINEAR);
        if ((lg = lora_group(ls, w, LORA_O))) {
            tic(&t);
            if (add_lora(ls, lg, hidden, H, attn, hq * D, T, bf16, threads)) FAIL(l, T_LORA);
            toc(&t, T_LORA);
        }

        tic(&t);
        rmsnorm(hidden, H, residual, w->post_attn_norm, T, H, d->eps, buf->x, bf16, threads);
        toc(&t, T_NORM);
        // float32: gate_up with SiLU-and-mul as its epilogue where linear_packed_silu takes the shapes (timed as the
        // GEMM it is) and no LoRA delta goes between them; else the GEMM, its delta, then the activation.
        const LoraGroupArgs *gate_up_lora = lora_group(ls, w, LORA_GATE_UP);
        tic(&t);
        if (!bf16 && !w->gate_up_q && !gate_up_lora &&
            linear_packed_silu(buf->x, H, T, H, w->gate_up, I, buf->act, threads) == 0) {
            toc(&t, T_LINEAR);
        } else {
            if (linear(d, buf, buf->x, T, H, w->gate_up, 2 * I, NULL, w->gate_up_f, NULL, w->gate_up_q, buf->gate_up,
                       threads))
                FAIL(l, T_LINEAR);
            toc(&t, T_LINEAR);
            if (gate_up_lora) {
                tic(&t);
                if (add_lora(ls, gate_up_lora, buf->gate_up, 2 * I, buf->x, H, T, bf16, threads)) FAIL(l, T_LORA);
                toc(&t, T_LORA);
            }
            tic(&t);
            silu_and_mul(buf->gate_up, 2 * I, T, I, buf->act, bf16, threads);
            toc(&t, T_ACT);
        }
        tic(&t);
        if (linear(d, buf, buf->act, T, I, w->down, H, NULL, w->down_f, NULL, w->down_q, hidden, threads))
            FAIL(l, T_LINEAR);
        toc(&t, T_LINEAR);
        if ((lg = lora_group(ls, w, LORA_DOWN))) {
            tic(&t);
            if (add_lora(ls, lg, hidden, H, buf->act, I, T, bf16, threads)) FAIL(l, T_LORA);
            toc(&t, T_LORA);
        }
    }
#undef FAIL
    return 0;
}
