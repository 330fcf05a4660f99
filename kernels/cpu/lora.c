// LoRA's segmented shrink and expand (kernels/lora.py holds the torch reference, the Triton kernels and the dispatch):
// the low-rank products of many adapters in one batch, each run of consecutive tokens (a segment) under one slot.
//
// Shapes (row-major, strides in elements):
//   x      [T, K]  float32 or bfloat16 (x_bf16), row stride x_row (often a slice of a larger buffer)
//   a      [num_slots, R, K] float32 or bfloat16 (w_bf16, as bt), contiguous
//   xa     [T, R]  float32 (lora_shrink: contiguous; lora_expand: row stride xa_row)
//   bt     [num_slots, R, N] float32 or bfloat16 (w_bf16, as a), contiguous (the adapter's scaling folded in)
//   y      [T, N]  float32 or bfloat16 (y_bf16), row stride y_row, updated in place
//   starts, lens, slots [S] int32: segment s is tokens [starts[s], starts[s] + lens[s]) under slot slots[s]; starts
//          ascending and the segments disjoint, tokens in no segment untouched
//   slices [num_slices, 4] int32 (r0, rj, n0, nj): rank rows [r0, r0 + rj) of bt write y's columns [n0, n0 + nj);
//          the column ranges disjoint
//
//   shrink: xa[t, :] = x[t, :] . a[slot]^T                    (rows outside every segment: zero)
//   expand: y[t, n0:n0+nj] += xa[t, r0:r0+rj] . bt[slot][r0:r0+rj, n0:n0+nj]
//
// Numerics: float32 products summed in float32 (in another order than the reference's GEMM); a bf16 y gets the float32
// delta added to its value in float32 and is rounded once, as the reference does. bf16 weights are widened to float32
// (exactly: a 16-bit shift) in registers as they are loaded, so a call reads 2 bytes a weight from memory: at batch 1
// the product is bound by those reads (SmolLM2-135M's rank-16 stacks: 19.5 MB a step in float32).
//
// Why this shape of loops: the LoRA product must cost little beside the base GEMM, so each A[slot] and BT[slot] is
// read from memory once per segment, not once per token.
// - shrink: a work item is a segment's chunk of up to SHRINK_TOKENS tokens against a block of SHRINK_RANKS rows of
//   A[slot] (8 rows of K = 2048: 64 KB, in L2 while the chunk's tokens pass over it). In it a register tile of 4
//   tokens x 2 rank rows (8 vector accumulators) runs down K; leftover tokens run 1 x 8.
// - expand: a work item is a segment's chunk of up to EXPAND_TOKENS tokens, one slice and a block of EXPAND_COLS
//   output columns. In it columns go by chunks of 4 vectors, over which each group of 4 tokens accumulates 4 x 2
//   vectors and each leftover token 1 x 4 (four independent FMA chains: the decode case), rank row by rank row:
//   rank-1 updates over contiguous BT rows, whose [rj, 4 VL] block (packed into a row first, expand_item says why)
//   stays in L1 across the chunk's tokens; bf16 rows are widened as they are packed, once per chunk.
// Work items are shared among the threads by share.h; lora_apply runs both phases in one parallel region with a
// barrier between them (one ctypes call and one fork per LoRA product, as the model makes 4 per layer), xa in a
// [T, R] buffer of its own.
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>  // wload's widening loads
#endif

#include "fastmath.h"
#include "kernels.h"
#include "share.h"
#include "vec.h"

#define SHRINK_TOKENS 16
#define SHRINK_RANKS 8
#define EXPAND_TOKENS 64
#define EXPAND_COLS 256  // a multiple of 4 VL in every build
// Multiply-adds below which one thread runs the call. A batch-1 decode product of SmolLM2's shapes is 18,000-68,000
// multiply-adds over 75-470 KB of weights that the base model's GEMMs have pushed out of cache: its time is the
// weights' trip from memory, which two threads make in parallel. Between the model's GEMMs the OpenMP threads are
// awake, so the fork is cheap: on a Zen 3 the 120 products of a rank-16 step took 1.33 ms on one thread each and
// 1.03 ms on two (float32 stacks; bf16 1.17 -> 0.82 ms).
#define LORA_PAR_MIN 4096

#define INLINE static inline __attribute__((always_inline))

// ---------------------------------------------------------------------------------------------------------------
// Arguments checked once per call: a bad segment or slice would read or write out of bounds.

static int check_segments(int T, int num_slots, const int32_t *starts, const int32_t *lens, const int32_t *slots,
                          int S) {
    int64_t end = 0;
    for (int s = 0; s < S; s++) {
        if (starts[s] < end || lens[s] < 0 || (int64_t)starts[s] + lens[s] > T || slots[s] < 0 ||
            slots[s] >= num_slots)
            return -1;
        end = (int64_t)starts[s] + lens[s];
    }
    return 0;
}

static int check_slices(int R, int N, const int32_t *slices, int num_slices) {
    for (int j = 0; j < num_slices; j++) {
        const int32_t *sl = slices + 4 * j;
        if (sl[0] < 0 || sl[1] < 0 || sl[0] + sl[1] > R || sl[2] < 0 || sl[3] < 0 || sl[2] + sl[3] > N) return -1;
        for (int i = 0; i < j; i++) {  // disjoint columns: items of different slices run in parallel
            const int32_t *o = slices + 4 * i;
            if (sl[3] && o[3] && sl[2] < o[2] + o[3] && o[2] < sl[2] + sl[3]) return -1;
        }
    }
    return 0;
}

// A segment's chunks of up to `chunk` tokens, as (segment, first token, token count): the rows of the work items.
typedef struct {
    int32_t seg, t0, n;
} Chunk;

// The chunks of every segment into *out (malloc'd; the caller frees it); their number, or -1 when out of memory.
static int64_t make_chunks(const int32_t *starts, const int32_t *lens, int S, int chunk, Chunk **out) {
    int64_t count = 0;
    for (int s = 0; s < S; s++) count += (lens[s] + chunk - 1) / chunk;
    *out = malloc((size_t)(count ? count : 1) * sizeof(Chunk));
    if (!*out) return -1;
    int64_t i = 0;
    for (int s = 0; s < S; s++)
        for (int t = 0; t < lens[s]; t += chunk)
            (*out)[i++] = (Chunk){s, starts[s] + t, lens[s] - t < chunk ? lens[s] - t : chunk};
    return count;
}

// bf16 as VL-lane vectors of their bits; the element-aligned twin loads at any bf16 address.
typedef uint16_t vh __attribute__((vector_size(VL * 2)));
typedef uint16_t vh_u __attribute__((vector_size(VL * 2), aligned(2)));

// VL weights from w[i] on, float32 or bf16 (W_BF16, a constant at each call) widened: one vpmovzxwd and a shift.
// gcc compiles the same written as a vector conversion into two 128-bit vpmovzxwd, a byte shift and an insert (AVX2),
// which left the bf16 shrink compute-bound in L3 at 1.25x the float32 one's time.
INLINE vf wload(const void *w, int64_t i, const int W_BF16) {
    if (!W_BF16) return vload((const float *)w + i);
    const uint16_t *p = (const uint16_t *)w + i;
#if VL == 16
    return (vf)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16);
#elif defined(__AVX2__)
    return (vf)_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16);
#else
    return (vf)(__builtin_convertvector(*(const vh_u *)p, vu) << 16);
#endif
}

INLINE float wscalar(const void *w, int64_t i, const int W_BF16) {
    return W_BF16 ? bf16_to_f32(((const uint16_t *)w)[i]) : ((const float *)w)[i];
}

static inline float hsum(vf v) {
    float s = 0.0f;
    for (int i = 0; i < VL; i++) s += v[i];
    return s;
}

// ---------------------------------------------------------------------------------------------------------------
// Shrink

// out[i * out_row + j] = x_i . a_j over K, for TM rows x_i (xr[i]) and TR rows a_j (a + j * K elements, float32 or
// bf16 by W_BF16); TM, TR and W_BF16 constants at each call, so the accumulators stay in registers.
INLINE void shrink_tile(const float *const *xr, const void *a, int K, float *out, int64_t out_row, const int TM,
                        const int TR, const int W_BF16) {
    vf acc[4][8];
    for (int i = 0; i < TM; i++)
        for (int j = 0; j < TR; j++) acc[i][j] = vbroadcast(0.0f);
    int k = 0;
    for (; k + VL <= K; k += VL) {
        vf av[8];
        for (int j = 0; j < TR; j++) av[j] = wload(a, (int64_t)j * K + k, W_BF16);
        for (int i = 0; i < TM; i++) {
            const vf xv = vload(xr[i] + k);
            for (int j = 0; j < TR; j++) acc[i][j] += xv * av[j];
        }
    }
    for (int i = 0; i < TM; i++)
        for (int j = 0; j < TR; j++) {
            float s = hsum(acc[i][j]);
            for (int kk = k; kk < K; kk++) s += xr[i][kk] * wscalar(a, (int64_t)j * K + kk, W_BF16);
            out[i * out_row + j] = s;
        }
}

// One shrink item: tokens [c.t0, c.t0 + c.n) against rank rows [r0, r0 + nr) of a[slot] (float32 or bf16 by W_BF16, a
// constant at each call: each weight dtype compiles to its own loops); xbuf (SHRINK_TOKENS * K floats) holds bf16 x
// rows widened.
INLINE void shrink_item(const void *x, int64_t x_row, int x_bf16, int K, const void *a_slot, int R, Chunk c, int r0,
                        int nr, float *xa, float *xbuf, const int W_BF16) {
    const float *rows[SHRINK_TOKENS];
    for (int i = 0; i < c.n; i++) {
        const int64_t t = c.t0 + i;
        if (x_bf16) {
            const uint16_t *src = (const uint16_t *)x + t * x_row;
            float *dst = xbuf + (int64_t)i * K;
            for (int k = 0; k < K; k++) dst[k] = bf16_to_f32(src[k]);
            rows[i] = dst;
        } else {
            rows[i] = (const float *)x + t * x_row;
        }
    }
    const int es = W_BF16 ? 2 : 4;
    const char *a = (const char *)a_slot + (int64_t)r0 * K * es;
    float *out = xa + (int64_t)c.t0 * R + r0;
#define A_ROW(j) (a + (int64_t)(j) * K * es)
    int i = 0;
    for (; i + 4 <= c.n; i += 4) {
        int j = 0;
        for (; j + 2 <= nr; j += 2) shrink_tile(rows + i, A_ROW(j), K, out + (int64_t)i * R + j, R, 4, 2, W_BF16);
        for (; j < nr; j++) shrink_tile(rows + i, A_ROW(j), K, out + (int64_t)i * R + j, R, 4, 1, W_BF16);
    }
    for (; i < c.n; i++) {
        int j = 0;
        for (; j + 8 <= nr; j += 8) shrink_tile(rows + i, A_ROW(j), K, out + (int64_t)i * R + j, R, 1, 8, W_BF16);
        for (; j < nr; j++) shrink_tile(rows + i, A_ROW(j), K, out + (int64_t)i * R + j, R, 1, 1, W_BF16);
    }
#undef A_ROW
}

typedef struct {
    const void *x;
    int64_t x_row;
    int x_bf16, K, R;
    const void *a;  // float32, or bf16 with w_bf16
    int w_bf16;
    const int32_t *slots;
    const Chunk *chunks;
    int rank_blocks;
    float *xa;    // [T, R] contiguous
    int *failed;  // set when a thread has no memory for its bf16 rows
} Shrink;

static void shrink_take(const Shrink *p, Shares *sh) {
    float *xbuf = NULL;
    for (int64_t it; (it = shares_take(sh)) >= 0;) {
        if (p->x_bf16 && !xbuf && !(xbuf = malloc(sizeof(float) * SHRINK_TOKENS * (size_t)p->K))) {
            __atomic_store_n(p->failed, 1, __ATOMIC_RELAXED);
            continue;
        }
        const Chunk c = p->chunks[it / p->rank_blocks];
        const int r0 = (int)(it % p->rank_blocks) * SHRINK_RANKS;
        const int nr = p->R - r0 < SHRINK_RANKS ? p->R - r0 : SHRINK_RANKS;
        const int64_t a_off = (int64_t)p->slots[c.seg] * p->R * p->K;  // elements
        if (p->w_bf16)
            shrink_item(p->x, p->x_row, p->x_bf16, p->K, (const uint16_t *)p->a + a_off, p->R, c, r0, nr, p->xa, xbuf,
                        1);
        else
            shrink_item(p->x, p->x_row, p->x_bf16, p->K, (const float *)p->a + a_off, p->R, c, r0, nr, p->xa, xbuf, 0);
    }
    free(xbuf);
}

// ---------------------------------------------------------------------------------------------------------------
// Expand

// y[0 : VL] (bf16) = y + d, added in float32 and rounded once to nearest even (f32_to_bf16's rounding, NaN kept
// quiet), in vector operations: f32_to_bf16 lane by lane stayed scalar code (its NaN branch), and cost the bf16
// expand 40% more time than the float32 one at rank 64.
static inline void add_to_bf16(uint16_t *y, vf d) {
    const vu bits = (vu)((vf)(__builtin_convertvector(*(const vh_u *)y, vu) << 16) + d);
    const vu nan = (vu)((bits & 0x7fffffffu) > 0x7f800000u);
    const vu rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
    *(vh_u *)y = __builtin_convertvector((rounded & ~nan) | (((bits >> 16) | 0x40u) & nan), vh);
}

// y_i[0 : NV VL] += sum over rj rank rows r of xa_i[r] * b[r * N : r * N + NV VL] (float32 or bf16 by B_BF16), for TM
// token rows; TM, NV and B_BF16 constants at each call.
INLINE void expand_tile(const float *const *xr, const void *b, int64_t N, int rj, void *const *yr, int y_bf16,
                        const int TM, const int NV, const int B_BF16) {
    vf acc[4][4];
    for (int i = 0; i < TM; i++)
        for (int v = 0; v < NV; v++) acc[i][v] = vbroadcast(0.0f);
    for (int r = 0; r < rj; r++) {
        vf bv[4];
        for (int v = 0; v < NV; v++) bv[v] = wload(b, r * N + v * VL, B_BF16);
        for (int i = 0; i < TM; i++) {
            const vf xv = vbroadcast(xr[i][r]);
            for (int v = 0; v < NV; v++) acc[i][v] += xv * bv[v];
        }
    }
    for (int i = 0; i < TM; i++)
        for (int v = 0; v < NV; v++) {
            if (y_bf16) {
                add_to_bf16((uint16_t *)yr[i] + v * VL, acc[i][v]);
            } else {
                float *yp = (float *)yr[i] + v * VL;
                vstore(yp, vload(yp) + acc[i][v]);
            }
        }
}

// The columns past the last whole vector, one at a time.
static void expand_tail(const float *xr, const void *b, int64_t N, int rj, void *yr, int y_bf16, int cols,
                        int b_bf16) {
    for (int c = 0; c < cols; c++) {
        float s = 0.0f;
        for (int r = 0; r < rj; r++) s += xr[r] * (b_bf16 ? wscalar(b, r * N + c, 1) : wscalar(b, r * N + c, 0));
        if (y_bf16)
            ((uint16_t *)yr)[c] = f32_to_bf16(bf16_to_f32(((uint16_t *)yr)[c]) + s);
        else
            ((float *)yr)[c] += s;
    }
}

// One chunk of 4 VL columns for the item's n tokens: groups of 4 tokens 4 x 2 vectors at a time, leftover ones 1 x 4.
// b: its rank rows, `stride` elements apart, float32 or bf16 by B_BF16 (a constant at each call).
INLINE void expand_chunk(const float *const *xr, const void *b, int64_t stride, int rj, void *const *yc, int n,
                         const int y_bf16, const int B_BF16) {
    const int es = y_bf16 ? 2 : 4;
    int i = 0;
    for (; i + 4 <= n; i += 4) {
        expand_tile(xr + i, b, stride, rj, yc + i, y_bf16, 4, 2, B_BF16);
        void *yh[4];
        for (int h = 0; h < 4; h++) yh[h] = (char *)yc[i + h] + 2 * VL * es;
        expand_tile(xr + i, (const char *)b + 2 * VL * (B_BF16 ? 2 : 4), stride, rj, yh, y_bf16, 4, 2, B_BF16);
    }
    for (; i < n; i++) expand_tile(xr + i, b, stride, rj, yc + i, y_bf16, 1, 4, B_BF16);
}

// One expand item: tokens [c.t0, c.t0 + c.n), rank rows [r0, r0 + rj) of b_slot (float32 or bf16 by W_BF16), output
// columns [c0, c0 + nc). y_bf16 and W_BF16 constants at each call (below), so that each pair of dtypes compiles to its
// own loops.
// pack (rj * 4 VL floats, or NULL): where the item has 4 tokens or more, each chunk of 4 VL columns of the rank rows
// is copied there first (bf16 rows widened on the way). Why: the rows sit N floats apart, and with N = 1536 (6 KB)
// the 64 rows of a chunk fall in 4 of L1's 64 sets and evict one another on every token; packed, they are 8 KB in a
// row. Zen 3, one thread, 512 tokens x rank 64 x 1536 columns: 2.2 -> 1.75 ms. A token or three read each row once:
// no packing (bf16 rows widened in registers, as the shrink's).
INLINE void expand_item(void *y, int64_t y_row, const int y_bf16, int64_t N, const float *xa, int64_t xa_row,
                        const void *b_slot, Chunk c, int r0, int rj, int c0, int nc, float *pack, const int W_BF16) {
    const int es = y_bf16 ? 2 : 4, ws = W_BF16 ? 2 : 4;
    const float *xr[EXPAND_TOKENS];
    void *yr[EXPAND_TOKENS];
    for (int i = 0; i < c.n; i++) {
        xr[i] = xa + (int64_t)(c.t0 + i) * xa_row + r0;
        yr[i] = (char *)y + ((int64_t)(c.t0 + i) * y_row + c0) * es;
    }
    const char *b = (const char *)b_slot + ((int64_t)r0 * N + c0) * ws;
    int col = 0;
    for (; col + 4 * VL <= nc; col += 4 * VL) {
        void *yc[EXPAND_TOKENS];
        for (int i = 0; i < c.n; i++) yc[i] = (char *)yr[i] + (int64_t)col * es;
        const char *bc = b + (int64_t)col * ws;
        if (pack && c.n >= 4) {
            for (int r = 0; r < rj; r++)
                for (int v = 0; v < 4; v++) vstore(pack + (r * 4 + v) * VL, wload(bc, r * N + v * VL, W_BF16));
            expand_chunk(xr, pack, 4 * VL, rj, yc, c.n, y_bf16, 0);
        } else {
            expand_chunk(xr, bc, N, rj, yc, c.n, y_bf16, W_BF16);
        }
    }
    for (; col + VL <= nc; col += VL)
        for (int i = 0; i < c.n; i++) {
            void *yc = (char *)yr[i] + (int64_t)col * es;
            expand_tile(xr + i, b + (int64_t)col * ws, N, rj, &yc, y_bf16, 1, 1, W_BF16);
        }
    if (col < nc)
        for (int i = 0; i < c.n; i++)
            expand_tail(xr[i], b + (int64_t)col * ws, N, rj, (char *)yr[i] + (int64_t)col * es, y_bf16, nc - col,
                        W_BF16);
}

typedef struct {
    void *y;
    int64_t y_row;
    int y_bf16, N, R;
    const float *xa;
    int64_t xa_row;
    const void *bt;  // float32, or bf16 with w_bf16
    int w_bf16;
    const int32_t *slots;
    const int32_t *slices;
    const Chunk *chunks;
    // Column blocks of all slices in order: block b is slice blk_slice[b] columns [blk_c0[b], + EXPAND_COLS).
    const int32_t *blk_slice, *blk_c0;
    int blocks;
} Expand;

static void expand_take(const Expand *p, Shares *sh) {
    float *pack = NULL;  // malloc'd at the first item of 4 tokens or more; without memory, items run unpacked
    for (int64_t it; (it = shares_take(sh)) >= 0;) {
        const Chunk c = p->chunks[it / p->blocks];
        if (c.n >= 4 && !pack) pack = malloc(sizeof(float) * 4 * VL * (size_t)p->R);
        const int blk = (int)(it % p->blocks);
        const int32_t *sl = p->slices + 4 * p->blk_slice[blk];
        const int c0 = p->blk_c0[blk], end = sl[2] + sl[3];
        const int64_t b_off = (int64_t)p->slots[c.seg] * p->R * p->N;  // elements
        const int nc = end - c0 < EXPAND_COLS ? end - c0 : EXPAND_COLS;
#define EXPAND_ITEM(Y_BF16, W_BF16)                                                                            \
    expand_item(p->y, p->y_row, Y_BF16, p->N, p->xa, p->xa_row, (const char *)p->bt + b_off * ((W_BF16) ? 2 : 4), c, \
                sl[0], sl[1], c0, nc, pack, W_BF16)
        if (p->y_bf16) {
            if (p->w_bf16)
                EXPAND_ITEM(1, 1);
            else
                EXPAND_ITEM(1, 0);
        } else {
            if (p->w_bf16)
                EXPAND_ITEM(0, 1);
            else
                EXPAND_ITEM(0, 0);
        }
#undef EXPAND_ITEM
    }
    free(pack);
}

// The column blocks of the slices into blk_slice / blk_c0 (room for the count that expand_blocks returns).
static int expand_blocks(const int32_t *slices, int num_slices, int32_t *blk_slice, int32_t *blk_c0) {
    int b = 0;
    for (int j = 0; j < num_slices; j++) {
        if (slices[4 * j + 1] == 0) continue;  // rank 0: nothing to add
        for (int c = 0; c < slices[4 * j + 3]; c += EXPAND_COLS) {
            if (blk_slice) blk_slice[b] = j, blk_c0[b] = slices[4 * j + 2] + c;
            b++;
        }
    }
    return b;
}

static int64_t expand_madds(const int32_t *slices, int num_slices) {
    int64_t m = 0;
    for (int j = 0; j < num_slices; j++) m += (int64_t)slices[4 * j + 1] * slices[4 * j + 3];
    return m;
}

static int64_t tokens_in(const int32_t *lens, int S) {
    int64_t n = 0;
    for (int s = 0; s < S; s++) n += lens[s];
    return n;
}

// ---------------------------------------------------------------------------------------------------------------
// Entry points: 0; -1 for segments or slices out of range (nothing written); -2 when out of memory (y untouched).

int lora_shrink(const void *x, int64_t x_row, int x_bf16, int T, int K, const void *a, int w_bf16, int num_slots,
                int R, const int32_t *starts, const int32_t *lens, const int32_t *slots, int S, float *xa,
                int threads) {
    if (check_segments(T, num_slots, starts, lens, slots, S)) return -1;
    Chunk *chunks;
    const int64_t nc = make_chunks(starts, lens, S, SHRINK_TOKENS, &chunks);
    if (nc < 0) return -2;
    memset(xa, 0, sizeof(float) * (size_t)T * R);
    const int rank_blocks = (R + SHRINK_RANKS - 1) / SHRINK_RANKS;
    int failed = 0;
    const Shrink p = {x, x_row, x_bf16, K, R, a, w_bf16, slots, chunks, rank_blocks, xa, &failed};
    Shares sh;
    shares_init(&sh, nc * rank_blocks, threads);
    #pragma omp parallel num_threads(threads) if (tokens_in(lens, S) * R * K >= LORA_PAR_MIN)
    shrink_take(&p, &sh);
    free(chunks);
    return failed ? -2 : 0;
}

int lora_expand(void *y, int64_t y_row, int y_bf16, int T, int N, const float *xa, int64_t xa_row, const void *bt,
                int w_bf16, int num_slots, int R, const int32_t *starts, const int32_t *lens, const int32_t *slots,
                int S, const int32_t *slices, int num_slices, int threads) {
    if (check_segments(T, num_slots, starts, lens, slots, S) || check_slices(R, N, slices, num_slices)) return -1;
    const int blocks = expand_blocks(slices, num_slices, NULL, NULL);
    int32_t *blk = malloc(sizeof(int32_t) * 2 * (size_t)(blocks ? blocks : 1));
    Chunk *chunks = NULL;
    const int64_t nc = blk ? make_chunks(starts, lens, S, EXPAND_TOKENS, &chunks) : -1;
    if (nc < 0) {
        free(blk);
        return -2;
    }
    expand_blocks(slices, num_slices, blk, blk + blocks);
    const Expand p = {y, y_row, y_bf16, N, R, xa, xa_row, bt, w_bf16, slots, slices,
                      chunks, blk, blk + blocks, blocks};
    Shares sh;
    shares_init(&sh, nc * blocks, threads);
    #pragma omp parallel num_threads(threads) if (tokens_in(lens, S) * expand_madds(slices, num_slices) >= LORA_PAR_MIN)
    expand_take(&p, &sh);
    free(chunks);
    free(blk);
    return 0;
}

int lora_apply(void *y, int64_t y_row, int y_bf16, const void *x, int64_t x_row, int x_bf16, int T, int K, int N,
               const void *a, const void *bt, int w_bf16, int num_slots, int R, const int32_t *starts,
               const int32_t *lens, const int32_t *slots, int S, const int32_t *slices, int num_slices, int threads) {
    if (check_segments(T, num_slots, starts, lens, slots, S) || check_slices(R, N, slices, num_slices)) return -1;
    const int blocks = expand_blocks(slices, num_slices, NULL, NULL);
    // xa [T, R]: only the rows of segments are written and read.
    float *xa = malloc(sizeof(float) * ((size_t)T * R + 1));
    int32_t *blk = malloc(sizeof(int32_t) * 2 * (size_t)(blocks ? blocks : 1));
    Chunk *sc = NULL, *ec = NULL;
    const int64_t nsc = xa && blk ? make_chunks(starts, lens, S, SHRINK_TOKENS, &sc) : -1;
    const int64_t nec = nsc >= 0 ? make_chunks(starts, lens, S, EXPAND_TOKENS, &ec) : -1;
    if (nec < 0) {
        free(xa), free(blk), free(sc), free(ec);
        return -2;
    }
    expand_blocks(slices, num_slices, blk, blk + blocks);
    const int rank_blocks = (R + SHRINK_RANKS - 1) / SHRINK_RANKS;
    int failed = 0;
    const Shrink ps = {x, x_row, x_bf16, K, R, a, w_bf16, slots, sc, rank_blocks, xa, &failed};
    const Expand pe = {y, y_row, y_bf16, N, R, xa, R, bt, w_bf16, slots, slices, ec, blk, blk + blocks, blocks};
    Shares ss, se;
    shares_init(&ss, nsc * rank_blocks, threads);
    shares_init(&se, nec * blocks, threads);
    const int64_t madds = tokens_in(lens, S) * ((int64_t)R * K + expand_madds(slices, num_slices));
    #pragma omp parallel num_threads(threads) if (madds >= LORA_PAR_MIN)
    {
        shrink_take(&ps, &ss);
        #pragma omp barrier
        if (!__atomic_load_n(&failed, __ATOMIC_RELAXED)) expand_take(&pe, &se);
    }
    free(xa), free(blk), free(sc), free(ec);
    return failed ? -2 : 0;
}
