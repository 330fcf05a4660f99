// Decode attention on CPU, straight over the token-level KV cache (no gather).
//
// Why C: the torch path (kernels/decode_attention.py, decode_attention_ref) first gathers every
// request's K/V rows into a padded [B, L, Hk, D] copy, then runs SDPA over it. At batch 64 and 384
// tokens of context that copy alone is 1.1 GB of writes per step over 30 layers. Here each task
// streams its rows once, in place: the step reads the KV it needs and nothing more, and it is
// written to run at the machine's read bandwidth (scripts/bench_cpu_kernels.py measures both).
//
// Shapes (row-major, strides in elements):
//   q            [B, Hq, D]            float32 or bfloat16 (act_bf16), token stride q_tok, head stride q_head
//   k_cache      [rows, Hk, D]         kv_kind (kernels.h): float32, bfloat16, int8, fp8 e4m3 or e5m2; row stride
//                                      kc_row, head stride kc_head
//   v_cache      [rows, Hk, D]         same dtype as k_cache, row stride vc_row, head stride vc_head
//   k_scales     [rows, Hk]            int8's scales: float32, contiguous (token-major whatever the cache's strides)
//   v_scales     [rows, Hk]            the same for V; fp8 takes the per-tensor floats k_scale / v_scale instead
//   req_to_token [num_rows, max_len]   int32, KV row of token t of a request, row stride r2t_row
//   req_rows     [B]                   int32, each request's row in req_to_token
//   seq_lens     [B]                   int32, tokens to attend to (>= 1)
//   out          [B, Hq, D]            q's dtype, contiguous
// Query heads h*G .. h*G+G-1 share KV head h (G = Hq / Hk, grouped-query attention).
// window > 0: the query (at seq_len - 1) sees only its last `window` tokens, so the tasks cover just
// those rows. softcap > 0: each score s becomes softcap * tanh(s / softcap) (Gemma 2), one scalar pass
// over the block's scores; with 0 the block runs exactly as before.
//
// Work: a task is one request's tokens [lo, hi), all heads. Requests are split into chunks when
// there are few of them (batch 1 at 2,000 tokens is 8 tasks on 2 threads, not 1), so every thread
// streams about the same number of KV bytes; a second pass merges a request's chunks (log-sum-exp).
// A task walks its tokens in blocks of BLOCK, each block for every KV head in turn, or (HEAD_OUTER, below) all of one
// head's blocks before the next head's. For each KV head it computes the block's scores for all
// G query heads from one load of each K row, updates the online softmax once per block, and adds the
// block's V rows into the G output rows, which stay in registers (a tile at a time). Meanwhile it
// prefetches the next block's K rows while it scores and its V rows while it adds V, a few lines per
// row it touches: the rows are a gather the hardware prefetchers follow only partly (measured faster on Zen 5;
// requesting all of the next block's lines at once gained nothing, too many requests in flight). The prefetches go
// to L2 (PF_LOCALITY below). The V rows' prefetches are issued from the V pass, not the score pass, which keeps
// memory busy through both passes (measured faster on Zen 4).
// A thread claims its next task when the rows it prefetches pass the current one's end (its last block, or last two
// where it prefetches two blocks ahead), and those blocks prefetch the next task's first rows, so a task never starts
// on rows nobody asked for: each thread's tasks are one stream to the prefetches, and the claim comes late enough to
// keep the balance of claiming on completion (measured faster on Zen 4; claiming at the start of the current task
// instead cost a batch of few tasks, where one thread then takes two).
// The measurements behind this file's choices: docs/benchmarks.md, "Measured while writing the CPU kernels".
// Vectors are vec.h's `vf`: 16 lanes on AVX-512 CPUs, 8 on AVX2 ones, from this one source.
// An 8-bit cache (int8, fp8 e4m3 / e5m2; kernels/kv_store.py) is read the same way at a byte an element: load_row
// widens each row to floats in registers, and the scales apply to the scores and the weights (int8's per row) or fold
// into the score scale and the merge (fp8's per tensor, with vload_fp8's power of two). The bf16-only paths (DPBF16)
// never take it.
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fastmath.h"
#include "kernels.h"
#include "vec.h"

// AVX512-BF16 (Zen 4/5, Sapphire Rapids and later, in the native build of such a CPU): bf16 K rows
// are scored with vdpbf16ps against a bf16 query, each instruction 32 products summed in pairs into
// 16 float lanes, so K needs no widening and half the multiply instructions. Only for bf16 queries
// (the bf16 model): their products are exact in float, as in the widening path. Measured faster on Zen 4: see
// docs/benchmarks.md, "Measured while writing the CPU kernels".
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>  // vload_i8's widening loads
#endif
#if defined(__AVX512BF16__) && VL == 16
#include <immintrin.h>
#define DPBF16 1
#else
#define DPBF16 0
#endif
// Head-packed scores (DPBF16, groups of PACK_MIN_GROUP or more query heads): four query heads share each vdpbf16ps,
// one head per 128-bit lane. Scoring a K row one head at a time leaves 16 partial sums per token and head, and
// folding them to one score cost as many shuffles and adds as the products; packed, each instruction takes four K
// pairs broadcast to every lane against four pairs of each of four heads, and four tokens' results fold to their
// scores in three in-lane steps. With 1 or 2 heads in a group half the lanes or more would multiply zeros.
// Measured faster on Zen 5 for SmolLM2's groups of 3 and for groups of 8 (docs/benchmarks.md, as above).
#ifndef PACK_MIN_GROUP  // PACK_MIN_GROUP, PF_DIST and PF_LOCALITY: a build may set them
#define PACK_MIN_GROUP 3   // (kernels/cpu/__init__.py TUNABLES, scripts/bench_cpu_kernels.py --define)
#endif
// Smaller groups would pad the packed query past its buffer (1 head: 4x its elements, 2: 2x; the buffer holds 2x).
_Static_assert(PACK_MIN_GROUP >= 3, "PACK_MIN_GROUP below 3");
// HEAD_OUTER: a task walks all of its tokens for KV head 0, then for head 1, and so on, rather than every head of a
// block before the next block; each head's softmax state is its own either way. A token's K (and V) row holds all
// heads, so head by head a thread reads two strided streams (a head's part of each row) rather than 2 x Hk
// interleaved ones; with a head-major cache (head stride rows x D: kc_head / vc_head, as a CPU KVCache lays it out)
// the two are contiguous. Measured on Zen 4: a head at a time over the head-major cache is the fastest of the four
// combinations in the native bf16 build; in the AVX2 build it is slower with L2 prefetches and faster with
// prefetcht0 (how a Zen 3 fills). So on where vdpbf16ps scores, off elsewhere until a Zen 3 is measured; a build may
// set it.
#ifndef HEAD_OUTER
#define HEAD_OUTER DPBF16
#endif
#ifndef SHARE_K
#define SHARE_K 1  // head-packed passes two at a time from one load of each K pair (scores_packed)
#endif
// Each pass loading its own K measured slower on Zen 4 for every group size tried, most at groups of 7 and 8 at
// head_dim 128.
// The V pass as vdpbf16ps (DPBF16, groups of DPV_MIN_GROUP or more query heads): the block's weights rounded to bf16
// pairs (token j, j + 1) and two V rows interleaved into the same pairs, so each instruction adds two tokens where the
// widening pass needs an FMA per token. The interleave (a shift and a 16-bit blend per 32 elements) costs what the
// widening did; the multiplies halve, and pay where there are many per V row: measured faster on Zen 4 for groups of
// 4 to 8 at head_dim 128, no better for SmolLM2's groups of 3 at 64, which stay widening. The weights' rounding to
// bf16 is within the bf16 model's tolerance (its KV and output are bf16).
#ifndef DPV_MIN_GROUP
#define DPV_MIN_GROUP 4
#endif

#define BLOCK 32        // tokens per softmax block: a multiple of VL, one row-fold per VL tokens
// PF_NEAR_L1: on CPUs with AMX (Intel Sapphire Rapids and later), head rows of up to 128 bytes are fetched only 16
// tokens ahead, and into L1 (prefetcht0): a thread's K and V lines for those tokens fit its 48 KB L1 there. Measured
// on the AMX Xeon (family 6 model 167, scripts/bench_cpu_kernels.py, bf16 activations, SmolLM2's heads, the builds
// alternated rep by rep): bf16 KV 0.86-0.87x the time at batch 64 x 384, 0.89-0.97x at 16 x 1,100, 0.96-0.97x at
// 1 x 2,000; int8 and fp8 0.92-0.96x at 64 x 384, level at the others; float32 KV's 256-byte rows 1.03-1.07x (they
// keep the defaults below). In the batch-64 bf16 step (profile_step.py) attention took 32.8-33.0 ms against 33.6-35.6.
// Zen 4 measured prefetcht0 as slow as no prefetch (below), so elsewhere nothing changes. A build that sets PF_DIST or
// PF_LOCALITY itself (the tuning defines) gets exactly what it sets.
#if defined(__AMX_TILE__) && !defined(PF_DIST) && !defined(PF_LOCALITY)
#define PF_NEAR_L1 1
#else
#define PF_NEAR_L1 0
#endif
// How many tokens ahead the rows are prefetched: the next block, or two blocks where the scores run fastest against
// the fewest bytes, the DPBF16 scores of 128-byte head rows (bf16 at head_dim 64): measured faster on Zen 4 there,
// slower in the AVX2 build (whose scores take longer) and with 256-byte head rows; on Zen 5 no better than one block.
// A build may fix the distance (PF_DIST; scripts/bench_cpu_kernels.py --define PF_DIST=...).
#ifdef PF_DIST
#define PF_TOKENS(dp_scores, head_bytes) PF_DIST
#else
#define PF_TOKENS(dp_scores, head_bytes) \
    (PF_NEAR_L1 && (head_bytes) <= 128 ? 16 : (dp_scores) && (head_bytes) <= 128 ? 2 * BLOCK : BLOCK)
#endif
// Prefetch into L2, not L1 (prefetcht2): a block's K and V rows plus the next block's are ~49 KB in
// bf16 at 3 KV heads x 64, more than a 32 KB L1: measured faster on Zen 4, where prefetcht0 (into L1) is as slow
// as no software prefetch at all, whatever the block size. AMD documents the fill into L2 for T1/T2 as new in
// Zen 4: on Zen 3 and earlier every prefetch hint fills L1, the likely reason the kernel reads less there.
#ifndef PF_LOCALITY
#define PF_LOCALITY 1  // the hint: 0 = prefetchnta, 1 = prefetcht2, 2 = prefetcht1, 3 = prefetcht0
#endif
#if PF_LOCALITY < 0  // -1: no software prefetch, to measure what they bring
#define PREFETCH(p) ((void)(p))
#else
#define PREFETCH(p) __builtin_prefetch((p), 0, PF_LOCALITY)
#endif
// A prefetch of p for head rows of row_bytes: into L1 where PF_NEAR_L1 takes them, else PREFETCH's.
#define PREFETCH_ROW(p, row_bytes) \
    (PF_NEAR_L1 && (row_bytes) <= 128 ? __builtin_prefetch((p), 0, 3) : PREFETCH(p))
#define MAX_GROUP 16
// Head dims 64, 128 and 256 (Gemma's) are compiled in: Gemma's heads would otherwise fall back to the gathering torch
// reference, measured over ten times slower.
#define MAX_DIM 256
#define MAX_HEADS 128
#define MIN_CHUNK 128   // tokens: a shorter chunk costs more in its merge than it balances
// Vector registers (AVX-512: 32, AVX2: 16). The V pass keeps a tile of output vectors, the V row's part it multiplies
// and the broadcast weight in them (see attend). One more than there are (3 heads of 8 vectors at head_dim 128 with
// AVX-512, as it once was) made gcc keep an output vector in memory, stored and reloaded every token.
#define REGS (VL == 16 ? 32 : 16)

typedef struct {
    int req, lo, hi;
} Task;

// The tasks in the order the threads claim them (longest first), and where a task's rows are.
typedef struct {
    const Task *order;
    int num_tasks;
    int *claimed;  // the next unclaimed index in order; threads take tasks by atomic increments
    const int32_t *req_to_token, *req_rows;
    int64_t r2t_row;
} Queue;

// Claims the next task: its index in queue->order, or num_tasks when none is left.
static int claim(const Queue *queue) { return __atomic_fetch_add(queue->claimed, 1, __ATOMIC_RELAXED); }

// The compiled element formats of the cache (TASK_TABLE's first index): kernels.h's kinds, except that fp8 e4m3 and
// e5m2 share one, KIND_FP8, their format a run-time flag (fp8_e5m2 below) that costs the same instructions.
#define KIND_F32 0
#define KIND_BF16 1
#define KIND_INT8 2
#define KIND_FP8 3
#define NUM_KINDS 4

// VL int8 values at any address, sign-extended to 32-bit lanes: one vpmovsxbd. gcc compiles the same written as a
// vector conversion of a VL-byte vector type one byte at a time (a scalar load and insert per lane).
static inline vi vload_i8(const int8_t *p) {
#if VL == 16
    return (vi)_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p));
#elif defined(__AVX2__)
    return (vi)_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p));
#else
    vi x;
    for (int k = 0; k < VL; k++) x[k] = p[k];
    return x;
#endif
}

// One K or V row of one head (dim elements) as dim / VL float vectors: bf16 rows in vec.h's even/odd order, the
// others in element order. 8-bit rows are widened, not yet scaled: int8 to its integer value (the row's scale is
// applied to the scores and weights), fp8 by vec.h's vload_fp8 (fp8_e5m2: the format) to its value, times 2^-8 for
// e4m3, that power folded into the per-tensor scales (see decode_attention); exact, as kernels/kv_store.py's contract
// says, and never a float32 subnormal (vload_fp8 says why that matters).
static inline __attribute__((always_inline)) void load_row(const void *p, int kind, int fp8_e5m2, int dim, vf *r) {
    if (kind == KIND_BF16) {
        for (int c = 0; c < dim / (2 * VL); c++) vload_bf16_pairs((const uint16_t *)p + 2 * VL * c, &r[2 * c], &r[2 * c + 1]);
    } else if (kind == KIND_INT8) {
        for (int i = 0; i < dim / VL; i++) r[i] = __builtin_convertvector(vload_i8((const int8_t *)p + i * VL), vf);
    } else if (kind == KIND_FP8) {
        for (int i = 0; i < dim / VL; i++) r[i] = vload_fp8((const uint8_t *)p + i * VL, fp8_e5m2);
    } else {
        for (int i = 0; i < dim / VL; i++) r[i] = vload((const float *)p + i * VL);
    }
}

#if DPBF16
// Four bf16 pairs (16 bytes at p) in every 128-bit lane.
static inline __m512bh pairs_x4(const char *p) {
    return (__m512bh)_mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)p));
}

// Sums each lane's four partials of four tokens, within 128-bit lanes: a[r] lane 4L + c holds head L's products with
// token r over pairs = c mod 4; the result's lane 4L + r holds head L's score for token r.
static inline __attribute__((always_inline)) __m512 fold4(const __m512 a[4]) {
    const __m512 b0 = _mm512_add_ps(_mm512_unpacklo_ps(a[0], a[1]), _mm512_unpackhi_ps(a[0], a[1]));
    const __m512 b1 = _mm512_add_ps(_mm512_unpacklo_ps(a[2], a[3]), _mm512_unpackhi_ps(a[2], a[3]));
    return _mm512_add_ps(_mm512_shuffle_ps(b0, b1, _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(b0, b1, _MM_SHUFFLE(3, 2, 3, 2)));
}

// s4[i] lane 4L + r (head g0 + L, token j0 + 4i + r) -> p[g0 + L][j0 .. j0 + 15] * sc for the heads the group has
// (a 4 x 4 transpose of 128-bit lanes).
static inline __attribute__((always_inline)) void store_scores(const __m512 s4[4], int g0, int group, int j0,
                                                              __m512 sc, float p[][BLOCK]) {
    const __m512 t0 = _mm512_shuffle_f32x4(s4[0], s4[1], _MM_SHUFFLE(2, 0, 2, 0));
    const __m512 t1 = _mm512_shuffle_f32x4(s4[0], s4[1], _MM_SHUFFLE(3, 1, 3, 1));
    const __m512 t2 = _mm512_shuffle_f32x4(s4[2], s4[3], _MM_SHUFFLE(2, 0, 2, 0));
    const __m512 t3 = _mm512_shuffle_f32x4(s4[2], s4[3], _MM_SHUFFLE(3, 1, 3, 1));
    const __m512 hs[4] = {_mm512_shuffle_f32x4(t0, t2, _MM_SHUFFLE(2, 0, 2, 0)),
                          _mm512_shuffle_f32x4(t1, t3, _MM_SHUFFLE(2, 0, 2, 0)),
                          _mm512_shuffle_f32x4(t0, t2, _MM_SHUFFLE(3, 1, 3, 1)),
                          _mm512_shuffle_f32x4(t1, t3, _MM_SHUFFLE(3, 1, 3, 1))};
    for (int L = 0; L < 4 && g0 + L < group; L++) _mm512_store_ps(&p[g0 + L][j0], _mm512_mul_ps(hs[L], sc));
}

// One block's scores for the query heads of one KV head, head-packed (PACK_MIN_GROUP above). kr[j]: token j's K row
// (bf16, head_off bytes in: this head's dim elements); pk[j]: a head row to prefetch meanwhile, or NULL. qv: this KV
// head's packed query from pack_query, (group + 3) / 4 passes of dim / 8 vectors. Writes p[g][j] = scale * q_g . k_j
// for every token of the block and g < group. Passes go two at a time (SHARE_K): the second pass's instructions take
// the first's broadcast of each K pair, which saves a third of a token's loads in groups of 5-8.
static inline __attribute__((always_inline)) void scores_packed(const char *const *kr, const char *const *pk,
                                                               int64_t head_off, const __m512bh *qv, int dim,
                                                               int group, float scale, float p[][BLOCK]) {
    const int nq = dim / 8;
    const __m512 sc = _mm512_set1_ps(scale);
    for (int g0 = 0; g0 < group;) {
        const int two = SHARE_K && g0 + 4 < group;  // heads g0 + 4 .. g0 + 7 from the same K loads
        const __m512bh *qw = qv + nq;               // their packed query
        for (int j0 = 0; j0 < BLOCK; j0 += 16) {
            // s4[i]: lane 4L + r = the score of head g0 + L for token j0 + 4i + r (t4: of head g0 + 4 + L)
            __m512 s4[4], t4[4];
            for (int i = 0; i < 4; i++) {
                // a[r]: lane 4L + c = head g0 + L's products with token j0 + 4i + r over pairs = c mod 4
                // (b: head g0 + 4 + L's)
                __m512 a[4], b[4];
                for (int r = 0; r < 4; r++) {
                    const int j = j0 + 4 * i + r;
                    if (g0 == 0 && pk[j])
                        for (int o = 0; o < dim * 2; o += 64) PREFETCH_ROW(pk[j] + o, dim * 2);
                    const char *k = kr[j] + head_off;
                    // Two chains a pass: half the latency.
                    __m512 x0 = _mm512_setzero_ps(), x1 = _mm512_setzero_ps();
                    __m512 y0 = _mm512_setzero_ps(), y1 = _mm512_setzero_ps();
                    for (int m = 0; m < nq; m += 2) {  // pairs 4m .. 4m + 3 of the row in every 128-bit lane
                        const __m512bh k0 = pairs_x4(k + 16 * m), k1 = pairs_x4(k + 16 * m + 16);
                        x0 = _mm512_dpbf16_ps(x0, k0, qv[m]);
                        x1 = _mm512_dpbf16_ps(x1, k1, qv[m + 1]);
                        if (two) {
                            y0 = _mm512_dpbf16_ps(y0, k0, qw[m]);
                            y1 = _mm512_dpbf16_ps(y1, k1, qw[m + 1]);
                        }
                    }
                    a[r] = _mm512_add_ps(x0, x1);
                    b[r] = _mm512_add_ps(y0, y1);
                }
                s4[i] = fold4(a);
                if (two) t4[i] = fold4(b);
            }
            store_scores(s4, g0, group, j0, sc, p);
            if (two) store_scores(t4, g0 + 4, group, j0, sc, p);
        }
        g0 += two ? 8 : 4;
        qv += two ? 2 * nq : nq;
    }
}

// A request's bf16 query [Hq, dim] (head stride q_head) packed for scores_packed: for KV head h and pass ps (query
// heads 4 ps .. 4 ps + 3 of its group), dim / 8 vectors of 16 bf16 pairs, lane 4L + i of vector m holding pair
// 4m + i of query head 4 ps + L, and zeros where the group has no such head. dst: num_kv_heads * passes * dim * 4.
static void pack_query(const uint16_t *q, int64_t q_head, int num_heads, int group, int dim, uint16_t *dst) {
    const int passes = (group + 3) / 4, nq = dim / 8;
    memset(dst, 0, sizeof(uint16_t) * (size_t)(num_heads / group) * passes * dim * 4);
    for (int hg = 0; hg < num_heads; hg++) {
        const int h = hg / group, g = hg % group;
        uint16_t *v = dst + ((int64_t)(h * passes + g / 4) * nq * 16 + 4 * (g % 4)) * 2;  // lane 4L of vector 0
        for (int m = 0; m < nq; m++) memcpy(v + m * 32, q + (int64_t)hg * q_head + 8 * m, 4 * sizeof(uint32_t));
    }
}
#endif

// One task. qp: [Hq, dim], the request's query in load_row's element order; scores are scaled by `scale` (for fp8
// with the per-tensor k_scale and load_row's power of two folded in).
// locs: the request's KV rows by token; the task reads tokens [lo, hi). Its last blocks claim the thread's next
// task from `queue` and prefetch that task's first rows; returns the claimed index (num_tasks: none left).
// qb: [Hq, dim], the query as bf16 in its own order, for the DPBF16 scores (qp is then unset), or with groups of
// PACK_MIN_GROUP or more as pack_query packs it; NULL: widen K.
// state (written): m [Hq], l [Hq], acc [Hq, dim] (unnormalized, load_row's order) over tokens [lo, hi); for fp8,
// acc is in load_row's units (the merge multiplies by v_scale and the power of two).
// k_scales, v_scales: int8's [rows, Hk] float32 scales (token-major whatever the cache's layout), else unused;
// fp8_e5m2: load_row's.
// kind (KIND_*), dim and group are compile-time constants in the instances below (a runtime group works too).
static inline __attribute__((always_inline)) int attend(
    const float *qp, const uint16_t *qb, const void *k_cache, const void *v_cache, const int32_t *locs, int lo,
    int hi, const Queue *queue, int num_kv_heads, int64_t kc_row, int64_t vc_row, int64_t kc_head, int64_t vc_head,
    float scale, float softcap, float *state, const float *k_scales, const float *v_scales, int fp8_e5m2,
    const int kind, const int dim, const int group) {
    enum { NV_MAX = MAX_DIM / VL };
    const int bf16 = kind == KIND_BF16, int8 = kind == KIND_INT8;
    const int nv = dim / VL, esize = kind == KIND_F32 ? 4 : bf16 ? 2 : 1;
    // The V pass's tile: cv vectors of each output row (a chunk of its dims, at least the 2 a bf16 load gives) for gc
    // heads, gc * cv + cv + 1 <= REGS. Every head of the group in one tile where some chunk allows it: each V row is
    // then loaded (and widened from bf16) once, in chunks, rather than once per few heads. Constant expressions, so
    // that each compiled instance keeps its tile in registers.
#define V_FITS(c) (group * (c) + (c) + 1 <= REGS)
    const int cmin = bf16 ? 2 : 1;
    const int cv = V_FITS(nv) || nv <= cmin           ? nv
                   : V_FITS(nv / 2) || nv / 2 <= cmin ? nv / 2
                   : V_FITS(nv / 4) || nv / 4 <= cmin ? nv / 4
                   : V_FITS(nv / 8) || nv / 8 <= cmin ? nv / 8
                                                      : nv / 16;
    const int gc = V_FITS(cv) ? group : ((REGS - 1 - cv) / cv < 1 ? 1 : (REGS - 1 - cv) / cv);
#undef V_FITS
    const int num_heads = num_kv_heads * group;
    float *m = state, *l = state + num_heads, *acc = state + 2 * num_heads;
    vf lsum[MAX_HEADS];  // per-lane partial sums of l: no horizontal sum per block
    for (int hg = 0; hg < num_heads; hg++) {
        m[hg] = -INFINITY;
        lsum[hg] = (vf){0};
    }
    memset(acc, 0, sizeof(float) * (size_t)num_heads * dim);
    const char *kc = k_cache, *vc = v_cache;
    const int64_t k_step = kc_row * esize, v_step = vc_row * esize;
    const int pf_dist = PF_TOKENS(qb != NULL, dim * esize);
    int next = -1;  // the next task, claimed once the prefetched rows pass hi
    const int32_t *nlocs = NULL;
    int nlo = 0, nhi = 0;

    // HEAD_OUTER: the task's tokens a KV head at a time (all of head 0's blocks, then head 1's, ...); else each block
    // for every head in turn.
    const int outer_heads = HEAD_OUTER ? num_kv_heads : 1;
    for (int ho = 0; ho < outer_heads; ho++)
    for (int t0 = lo; t0 < hi; t0 += BLOCK) {
        const int n = hi - t0 < BLOCK ? hi - t0 : BLOCK;
        const char *kr[BLOCK], *vr[BLOCK];
        int64_t rows[BLOCK];
        for (int j = 0; j < BLOCK; j++) {  // rows past n repeat the last one: scored, then masked
            int64_t loc = locs[t0 + (j < n ? j : n - 1)];
            rows[j] = loc;
            kr[j] = kc + loc * k_step;
            vr[j] = vc + loc * v_step;
        }
        if (ho == outer_heads - 1 && t0 + pf_dist >= hi && next < 0) {  // the rows pf_dist ahead are the next task's
            next = claim(queue);
            if (next < queue->num_tasks) {
                const Task nt = queue->order[next];
                nlocs = queue->req_to_token + (int64_t)queue->req_rows[nt.req] * queue->r2t_row;
                nlo = nt.lo, nhi = nt.hi;
            }
        }
        const int h_lo = HEAD_OUTER ? ho : 0, h_hi = HEAD_OUTER ? ho + 1 : num_kv_heads;
        for (int h = h_lo; h < h_hi; h++) {
            const int64_t head_off = (int64_t)h * kc_head * esize, vhead_off = (int64_t)h * vc_head * esize;
            // The rows pf_dist tokens ahead of this head's (past hi: the next head's first ones where the heads go
            // one after another, else the next task's), prefetched K in the score loop and V in the V loop: spread
            // out, so the requests never outnumber the line-fill buffers (a burst of them at the block's start was
            // measured to gain nothing). Pointers to the head's part of the row.
            const char *pk[BLOCK], *pv[BLOCK];
            for (int j = 0; j < BLOCK; j++) {
                const int t = t0 + pf_dist + j;
                int64_t loc = -1;
                int hp = h;
                if (t < hi) {
                    loc = locs[t];
                } else if (HEAD_OUTER && h + 1 < num_kv_heads) {
                    loc = lo + (t - hi) < hi ? locs[lo + (t - hi)] : -1;
                    hp = h + 1;
                } else if (nlocs && nlo + (t - hi) < nhi) {
                    loc = nlocs[nlo + (t - hi)];
                    hp = HEAD_OUTER ? 0 : h;
                }
                pk[j] = loc >= 0 ? kc + loc * k_step + (int64_t)hp * kc_head * esize : NULL;
                pv[j] = loc >= 0 ? vc + loc * v_step + (int64_t)hp * vc_head * esize : NULL;
                // int8: the row's scales too, a line apart from its K and V (all heads' scales of a row in one).
                if (int8 && loc >= 0) {
                    PREFETCH_ROW(k_scales + loc * num_kv_heads, dim * esize);
                    PREFETCH_ROW(v_scales + loc * num_kv_heads, dim * esize);
                }
            }
            // int8: the block's K scales times `scale` (the scores') and V scales, by token; rows past n repeat the
            // last one, as kr and vr do.
            float ksc[BLOCK] __attribute__((aligned(64))), vsc[BLOCK] __attribute__((aligned(64)));
            if (int8)
                for (int j = 0; j < BLOCK; j++) {
                    ksc[j] = k_scales[rows[j] * num_kv_heads + h] * scale;
                    vsc[j] = v_scales[rows[j] * num_kv_heads + h];
                }
            const float *qh = qp + (int64_t)h * group * dim;
            // Scores: each K row is loaded once for the group's G query heads, head-packed where that applies.
            // Otherwise part[g][j] holds the per-lane products of head g and token j, and one fold per VL tokens
            // sums them.
            float p[MAX_GROUP][BLOCK] __attribute__((aligned(64)));
#if DPBF16
            const int packed = bf16 && qb && group >= PACK_MIN_GROUP;
            if (packed)
                scores_packed((const char *const *)kr, (const char *const *)pk, head_off,
                              (const __m512bh *)qb + (int64_t)h * ((group + 3) / 4) * (dim / 8), dim, group, scale, p);
#else
            const int packed = 0;
#endif
            vf part[MAX_GROUP][BLOCK];
            for (int j = 0; j < BLOCK && !packed; j++) {
                if (pk[j])
                    for (int o = 0; o < dim * esize; o += 64) PREFETCH_ROW(pk[j] + o, dim * esize);
#if DPBF16
                if (bf16 && qb) {
                    const uint16_t *qbh = qb + (int64_t)h * group * dim;
                    __m512bh kb[MAX_DIM / 32];
                    for (int c = 0; c < dim / 32; c++)
                        kb[c] = (__m512bh)_mm512_loadu_si512((const uint16_t *)(kr[j] + head_off) + 32 * c);
                    for (int g = 0; g < group; g++) {
                        __m512 a = _mm512_setzero_ps();
                        for (int c = 0; c < dim / 32; c++)
                            a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_loadu_si512(qbh + g * dim + 32 * c), kb[c]);
                        part[g][j] = (vf)a;
                    }
                    continue;
                }
#endif
                vf kv[NV_MAX];
                load_row(kr[j] + head_off, kind, fp8_e5m2, dim, kv);
                for (int g = 0; g < group; g++) {
                    const float *qg = qh + g * dim;
                    vf a = vload(qg) * kv[0];
                    for (int i = 1; i < nv; i++) a += vload(qg + i * VL) * kv[i];
                    part[g][j] = a;
                }
            }
            float alpha[MAX_GROUP];
            for (int g = 0; g < group; g++) {
                const int hg = h * group + g;
                if (!packed)
                    for (int j0 = 0; j0 < BLOCK; j0 += VL)
                        vstore(&p[g][j0], vreduce_lanes(&part[g][j0]) * (int8 ? vload(&ksc[j0]) : vbroadcast(scale)));
                if (softcap > 0.0f)
                    for (int j = 0; j < BLOCK; j++) p[g][j] = tanhf(p[g][j] / softcap) * softcap;
                // Rows j >= n repeat row n - 1 (see the loads above), so the whole block's maximum is
                // the real rows' maximum: vector maxes, no scalar chain.
                vf bm = vload(p[g]);
                for (int j0 = VL; j0 < BLOCK; j0 += VL) bm = vmax(vload(&p[g][j0]), bm);
                float mx = vhmax(bm);
                mx = mx > m[hg] ? mx : m[hg];
                alpha[g] = exp_neg(m[hg] - mx);  // ~1e-38 on the first block (m is -inf), where acc and l are 0
                m[hg] = mx;
                vf s = (vf){0};
                for (int j0 = 0; j0 < BLOCK; j0 += VL) {
                    const vu live = (vu)(vlane_index() + j0 < n);  // rows n .. BLOCK - 1 weigh 0
                    const vf e = (vf)((vu)vexp_neg(vload(&p[g][j0]) - mx) & live);
                    vstore(&p[g][j0], e);
                    s += e;
                }
                lsum[hg] = lsum[hg] * alpha[g] + s;
                // int8: V rows are added as integers, so each weight takes its row's scale (after the sum above,
                // which is over the softmax weights themselves).
                if (int8)
                    for (int j0 = 0; j0 < BLOCK; j0 += VL) vstore(&p[g][j0], vload(&p[g][j0]) * vload(&vsc[j0]));
            }
#if DPBF16
            _Static_assert(BLOCK == 2 * VL, "a head's block of weights is one vcvtne2ps2bf16 of two vectors");
            const int dpv = bf16 && qb && group >= DPV_MIN_GROUP;
            uint32_t pb[MAX_GROUP][BLOCK / 2] __attribute__((aligned(64)));  // weights as bf16 pairs (j, j + 1)
            if (dpv)
                for (int g = 0; g < group; g++)
                    _mm512_store_si512(pb[g], (__m512i)_mm512_cvtne2ps_pbh(vload(&p[g][VL]), vload(&p[g][0])));
#else
            const int dpv = 0;
#endif
            // V: the block's V rows stream past the output tile in registers (cv vectors of gc heads' rows).
            for (int c0 = 0; c0 < nv; c0 += cv)
                for (int g0 = 0; g0 < group; g0 += gc) {
                    const int ng = group - g0 < gc ? group - g0 : gc;
                    float *ag = acc + (int64_t)(h * group + g0) * dim + c0 * VL;
                    vf o[MAX_GROUP][NV_MAX];
                    for (int g = 0; g < ng; g++)
                        for (int i = 0; i < cv; i++) o[g][i] = vload(ag + g * dim + i * VL) * alpha[g0 + g];
#if DPBF16
                    // Two tokens at a time; with n odd the last pair's second row repeats the last, weighted 0.
                    for (int j = 0; j < n && dpv; j += 2) {
                        // Each column chunk prefetches its own columns of the next rows: with half the iterations
                        // a chunk, the whole rows at once would come in bursts.
                        for (int t = j; t < j + 2 && g0 == 0; t++)
                            if (pv[t])
                                for (int off = c0 * VL * esize; off < (c0 + cv) * VL * esize; off += 64)
                                    PREFETCH_ROW(pv[t] + off, dim * esize);
                        const uint16_t *r0 = (const uint16_t *)(vr[j] + vhead_off) + c0 * VL;
                        const uint16_t *r1 = (const uint16_t *)(vr[j + 1] + vhead_off) + c0 * VL;
                        __m512bh w[NV_MAX];  // in load_row's order: per 32 elements the even ones, then the odd
                        for (int i = 0; i < cv; i += 2) {
                            const __m512i a = _mm512_loadu_si512(r0 + i * VL), b = _mm512_loadu_si512(r1 + i * VL);
                            w[i] = (__m512bh)_mm512_mask_blend_epi16(0xAAAAAAAAu, a, _mm512_slli_epi32(b, 16));
                            w[i + 1] = (__m512bh)_mm512_mask_blend_epi16(0xAAAAAAAAu, _mm512_srli_epi32(a, 16), b);
                        }
                        for (int g = 0; g < ng; g++) {
                            const __m512bh pp = (__m512bh)_mm512_set1_epi32((int)pb[g0 + g][j / 2]);
                            for (int i = 0; i < cv; i++) o[g][i] = (vf)_mm512_dpbf16_ps((__m512)o[g][i], pp, w[i]);
                        }
                    }
#endif
                    for (int j = 0; j < n && !dpv; j++) {
                        if (c0 == 0 && g0 == 0 && pv[j])
                            for (int o = 0; o < dim * esize; o += 64) PREFETCH_ROW(pv[j] + o, dim * esize);
                        vf vv[NV_MAX];
                        load_row(vr[j] + vhead_off + (int64_t)c0 * VL * esize, kind, fp8_e5m2, cv * VL, vv);
                        for (int g = 0; g < ng; g++) {
                            vf pj = vbroadcast(p[g0 + g][j]);
                            for (int i = 0; i < cv; i++) o[g][i] += pj * vv[i];
                        }
                    }
                    for (int g = 0; g < ng; g++)
                        for (int i = 0; i < cv; i++) vstore(ag + g * dim + i * VL, o[g][i]);
                }
        }
    }
    for (int hg = 0; hg < num_heads; hg++) {
        float t[VL];
        vstore(t, lsum[hg]);
        float sum = 0.0f;
        for (int i = 0; i < VL; i++) sum += t[i];
        l[hg] = sum;
    }
    return next < 0 ? claim(queue) : next;  // next < 0: no block ran (an empty task; the callers make none)
}

typedef int (*task_fn)(const float *, const uint16_t *, const void *, const void *, const int32_t *, int, int,
                       const Queue *, int, int64_t, int64_t, int64_t, int64_t, float, float, float *, const float *,
                       const float *, int, int);

#define TASK(KIND, DIM, G)                                                                                    \
    static int task_##KIND##_##DIM##_##G(const float *qp, const uint16_t *qb, const void *kc, const void *vc,   \
                                         const int32_t *locs, int lo, int hi, const Queue *queue, int hk,         \
                                         int64_t kc_row, int64_t vc_row, int64_t kc_head, int64_t vc_head,        \
                                         float scale, float softcap, float *state, const float *k_scales,         \
                                         const float *v_scales, int fp8_e5m2, int group) {                        \
        return attend(qp, qb, kc, vc, locs, lo, hi, queue, hk, kc_row, vc_row, kc_head, vc_head, scale, softcap, \
                      state, k_scales, v_scales, fp8_e5m2, KIND, DIM, G ? G : group);                            \
    }
// Group sizes 1-8 compiled in (the output rows then live in registers); 0 = any group, at run time.
#define TASKS(KIND, DIM) TASK(KIND, DIM, 0) TASK(KIND, DIM, 1) TASK(KIND, DIM, 2) TASK(KIND, DIM, 3)           \
    TASK(KIND, DIM, 4) TASK(KIND, DIM, 5) TASK(KIND, DIM, 6) TASK(KIND, DIM, 7) TASK(KIND, DIM, 8)
#define KIND_TASKS(KIND) TASKS(KIND, 64) TASKS(KIND, 128) TASKS(KIND, 256)
KIND_TASKS(KIND_F32)
KIND_TASKS(KIND_BF16)
KIND_TASKS(KIND_INT8)
KIND_TASKS(KIND_FP8)
#define ROW(KIND, DIM) {task_##KIND##_##DIM##_0, task_##KIND##_##DIM##_1, task_##KIND##_##DIM##_2,               \
    task_##KIND##_##DIM##_3, task_##KIND##_##DIM##_4, task_##KIND##_##DIM##_5, task_##KIND##_##DIM##_6,         \
    task_##KIND##_##DIM##_7, task_##KIND##_##DIM##_8}
#define KIND_ROWS(KIND) {ROW(KIND, 64), ROW(KIND, 128), ROW(KIND, 256)}
static const task_fn TASK_TABLE[NUM_KINDS][3][9] = {KIND_ROWS(KIND_F32), KIND_ROWS(KIND_BF16), KIND_ROWS(KIND_INT8),
                                                    KIND_ROWS(KIND_FP8)};

static int longest_first(const void *a, const void *b) {
    const Task *x = a, *y = b;
    return (y->hi - y->lo) - (x->hi - x->lo);
}

// Whether decode_attention takes these head counts and head_dim (the shapes compiled in): 1, or 0.
int decode_attention_supported(int num_heads, int num_kv_heads, int dim) {
    return num_kv_heads > 0 && num_heads % num_kv_heads == 0 && num_heads / num_kv_heads <= MAX_GROUP
        && num_heads <= MAX_HEADS && (dim == 64 || dim == 128 || dim == 256);
}

// Returns 0, or -1 when the shape is not compiled in or memory runs out (the caller falls back).
int decode_attention(const void *q, int64_t q_tok, int64_t q_head, int act_bf16, const void *k_cache,
                     const void *v_cache, int kv_kind, const float *k_scales, const float *v_scales, float k_scale,
                     float v_scale, const int32_t *req_to_token, const int32_t *req_rows,
                     const int32_t *seq_lens, void *out, int batch, int num_heads, int num_kv_heads, int dim,
                     int64_t kc_row, int64_t vc_row, int64_t kc_head, int64_t vc_head, int64_t r2t_row, float scale,
                     int window, float softcap, int num_threads) {
    if (!decode_attention_supported(num_heads, num_kv_heads, dim) || kv_kind < KV_F32 || kv_kind > KV_FP8_E5M2
        || (kv_kind == KV_INT8 && (!k_scales || !v_scales)))
        return -1;
    const int kv_is_bf16 = kv_kind == KV_BF16;
    const int kind = kv_kind == KV_FP8_E5M2 ? KIND_FP8 : kv_kind;  // KV_F32 .. KV_FP8_E4M3 are KIND_F32 .. KIND_FP8
    // fp8: the power of two load_row's floats are short of the values (2^8 for e4m3, 1 for e5m2), folded with the
    // per-tensor scales into the score scale and into v_mul, which the merge multiplies each output by (1 for the
    // other kinds).
    const int fp8_e5m2 = kv_kind == KV_FP8_E5M2;
    const float fp8_pow = fp8_e5m2 ? 1.0f : 0x1p8f;
    const float v_mul = kind == KIND_FP8 ? v_scale * fp8_pow : 1.0f;
    if (kind == KIND_FP8) scale *= k_scale * fp8_pow;
    int group = num_heads / num_kv_heads;
    // Request b reads its tokens [lo_b, seq_lens[b]): all of them, or the window's.
#define WINDOW_LO(b) (window > 0 && seq_lens[b] > window ? seq_lens[b] - window : 0)
    // Chunk so that there are ~4 tasks per thread when requests are few, never under MIN_CHUNK tokens.
    int64_t total = 0;
    for (int b = 0; b < batch; b++) total += seq_lens[b] - WINDOW_LO(b);
    int64_t chunk = (total + 4 * num_threads - 1) / (4 * num_threads);
    chunk = chunk < MIN_CHUNK ? MIN_CHUNK : (chunk + BLOCK - 1) / BLOCK * BLOCK;
    int num_tasks = 0;
    for (int b = 0; b < batch; b++) num_tasks += (int)((seq_lens[b] - WINDOW_LO(b) + chunk - 1) / chunk);
    const int64_t state_len = (int64_t)num_heads * (dim + 2);
    Task *tasks = malloc(sizeof(Task) * (size_t)num_tasks);
    int *first = malloc(sizeof(int) * (size_t)(batch + 1));  // request b's tasks: [first[b], first[b+1])
    float *state = malloc(sizeof(float) * (size_t)(num_tasks * state_len));
    Task *order = malloc(sizeof(Task) * (size_t)num_tasks);
    if (!tasks || !first || !state || !order) {
        free(tasks), free(first), free(state), free(order);
        return -1;
    }
    for (int b = 0, t = 0; b < batch; b++) {
        first[b] = t;
        for (int lo = WINDOW_LO(b); lo < seq_lens[b]; lo += (int)chunk, t++)
            tasks[t] = (Task){b, lo, lo + (int)chunk < seq_lens[b] ? lo + (int)chunk : seq_lens[b]};
    }
    first[batch] = num_tasks;
    memcpy(order, tasks, sizeof(Task) * (size_t)num_tasks);
    qsort(order, (size_t)num_tasks, sizeof(Task), longest_first);  // long tasks first: even finish
    const task_fn fn = TASK_TABLE[kind][dim == 64 ? 0 : dim == 128 ? 1 : 2][group <= 8 ? group : 0];

    int claimed = 0;
    const Queue queue = {order, num_tasks, &claimed, req_to_token, req_rows, r2t_row};
#pragma omp parallel num_threads(num_threads)
    {
        // Tasks longest first; each task's last blocks claim the thread's next (see the top).
        for (int i = claim(&queue); i < num_tasks;) {
            const Task tk = order[i];
            const int b = tk.req;
            // The request's query: bf16 as given for the DPBF16 scores (head-packed for groups of PACK_MIN_GROUP or
            // more), else as floats in load_row's order. A task reads one of the forms, so they share one buffer.
            const int use_dp = DPBF16 && kv_is_bf16 && act_bf16;
            union {
                float f[MAX_HEADS * MAX_DIM];
                uint16_t b[2 * MAX_HEADS * MAX_DIM];  // packed: up to 1.6x the query's elements (groups of 5)
            } qbuf __attribute__((aligned(64)));
            float *qp = qbuf.f;
            uint16_t *qb = qbuf.b;
            if (use_dp && group >= PACK_MIN_GROUP) {
#if DPBF16
                pack_query((const uint16_t *)q + (int64_t)b * q_tok, q_head, num_heads, group, dim, qb);
#endif
            } else {
                for (int hg = 0; hg < num_heads; hg++) {
                    const int64_t off = (int64_t)b * q_tok + (int64_t)hg * q_head;
                    if (use_dp) {
                        memcpy(qb + hg * dim, (const uint16_t *)q + off, sizeof(uint16_t) * dim);
                        continue;
                    }
                    float qrow[MAX_DIM];
                    for (int d = 0; d < dim; d++)
                        qrow[d] = act_bf16 ? bf16_to_f32(((const uint16_t *)q)[off + d]) : ((const float *)q)[off + d];
                    if (kv_is_bf16)
                        bf16_order(qrow, qp + hg * dim, dim);
                    else
                        memcpy(qp + hg * dim, qrow, sizeof(float) * dim);
                }
            }
            // The task's slot in `state`: its index in `tasks` (request order), found from its lo.
            int slot = first[b] + (int)((tk.lo - WINDOW_LO(b)) / chunk);
            i = fn(qp, use_dp ? qb : NULL, k_cache, v_cache, req_to_token + (int64_t)req_rows[b] * r2t_row, tk.lo,
                   tk.hi, &queue, num_kv_heads, kc_row, vc_row, kc_head, vc_head, scale, softcap,
                   state + slot * state_len, k_scales, v_scales, fp8_e5m2, group);
        }
#pragma omp barrier
        // Merge each request's chunks: out = sum_t acc_t e^(m_t - M) / sum_t l_t e^(m_t - M).
#pragma omp for schedule(static)
        for (int b = 0; b < batch; b++) {
            for (int hg = 0; hg < num_heads; hg++) {
                float mx = -INFINITY;
                for (int t = first[b]; t < first[b + 1]; t++) mx = fmaxf(mx, state[t * state_len + hg]);
                float o[MAX_DIM] = {0}, lsum = 0.0f;
                for (int t = first[b]; t < first[b + 1]; t++) {
                    const float *st = state + t * state_len;
                    float w = expf(st[hg] - mx);
                    lsum += st[num_heads + hg] * w;
                    const float *a = st + 2 * num_heads + (int64_t)hg * dim;
                    for (int d = 0; d < dim; d++) o[d] += a[d] * w;
                }
                float inv = v_mul / lsum, ordered[MAX_DIM];
                for (int d = 0; d < dim; d++) o[d] *= inv;
                if (kv_is_bf16) bf16_unorder(o, ordered, dim);
                const float *src = kv_is_bf16 ? ordered : o;
                const int64_t off = ((int64_t)b * num_heads + hg) * dim;
                for (int d = 0; d < dim; d++) {
                    if (act_bf16)
                        ((uint16_t *)out)[off + d] = f32_to_bf16(src[d]);
                    else
                        ((float *)out)[off + d] = src[d];
                }
            }
        }
    }
    free(tasks), free(first), free(state), free(order);
    return 0;
#undef WINDOW_LO
}
