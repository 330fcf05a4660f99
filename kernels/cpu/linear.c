// Linear layer on CPU: out[M, N] = x[M, K] . w[N, K]^T (+ bias), float32, for every M (one row
// per decoding request, or thousands of prompt tokens in a prefill chunk).
//
// Why C: on this kind of CPU MKL's sgemm reaches about half the machine's read bandwidth when M is
// a handful of rows (decode), and 70-115 GFLOP/s when M is large (prefill). This kernel runs one
// register tile for all M: it streams the weights once per 48 rows of x, which is bandwidth-bound
// at small M and near the FMA ceiling at large M (docs/benchmarks.md, "Measured while writing the CPU kernels").
//
// Weight layout: packed once at load time (kernels/linear.py, pack_linear_weight) into panels of
// NR output features (two vectors: 32 on AVX-512 CPUs, 16 on AVX2 ones), k-major inside a panel:
//   wp   [Np / NR, K, NR]  float32, Np = N rounded up to NR (padding rows are zero)
// so a panel is one contiguous stream, and each k gives the NR weights one FMA pair needs.
// Other shapes (row-major, strides in elements):
//   x    [M, K]  float32, row stride x_row
//   bias [N]     float32 or NULL
//   out  [M, N]  float32, row stride out_row
//
// Register tile (gemm_tile.h, shared with quant_linear.c): 6 or 8 rows of x by the NR features of one panel, 12 or
// 16 vector accumulators (the classic AVX2 6x16 shape; on AVX-512 also 8x32, see tile_rows).
// Work split: the panels are shared out as a static schedule would (share.h: each thread streams one contiguous
// part of wp, a thread that finishes first taking panels from the back of another's), and each panel meets every
// row of x before the next is read: the weights, hundreds of MB per step and never cache-resident, stream from
// memory once per call. x stays in cache (L2, or L3 for prefill chunks). Only an x over X_BLOCK_BYTES is cut into
// row blocks, each streaming the weights again.
// Measured over SmolLM2's 30 layers (424 MB of weights, far past the 32 MB L3): 48-row blocks, which
// read the weights once per 48 rows, ran 95-114 GFLOP/s at M = 64..576; one block 120-142.
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "amx.h"
#include "fastmath.h"
#include "gemm_tile.h"
#include "kernels.h"
#include "share.h"
#include "silu.h"
#include "vec.h"

#define X_BLOCK_BYTES (4 << 20)

// The panel width this build packs for (kernels/linear.py packs weights to match the library it calls).
int linear_panel_width(void) { return NR; }

// The first of a panel's `rows` rows (k, or k pairs) that tile i of `tiles` prefetches from the next panel.
static inline int64_t slice_start(int i, int tiles, int rows) { return (int64_t)i * ((rows + tiles - 1) / tiles); }

// The weights stream from memory once per call, and a panel's first tile would wait on DRAM while the rest of its
// tiles run from L2: at M = 64 (eight tiles a panel, K = 576) the first tile reads 72 KB from memory for an eighth of
// the FMAs. So while a thread computes panel p it prefetches panel p + 1: with `tiles` tiles a panel, tile i fetches
// the i-th of `tiles` slices of its rows, one row every `tiles` k (next_panel gives the slice; NULL past the last
// panel), which spreads the misses over the whole panel instead of one tile's burst. Zen 5, 2 threads, SmolLM2's
// projections over 30 layers from memory, ms a layer without / with it (fastest of two passes), M = 64: qkv 0.224 /
// 0.179, o 0.127 / 0.118, gate_up 0.624 / 0.523, down 0.327 / 0.290, lm_head 9.78 / 8.17; M = 8: lm_head 3.16 /
// 2.56; M = 512 within the passes' spread. The first tile prefetching all of the next panel (one burst) gained less
// than half as much (o nothing).
static inline const float *next_panel(const float *wp, int64_t p, int64_t panels, int i, int tiles, int K) {
    return p + 1 < panels ? wp + ((p + 1) * (int64_t)K + slice_start(i, tiles, K)) * NR : 0;
}

// Rows of x per block, a multiple of mr: M cut into equal blocks of at most block_bytes of x (rows of row_bytes),
// each streaming the weights once. Shared by the float32 and the bf16 GEMM.
static int row_block(int M, int64_t row_bytes, int64_t block_bytes, int mr) {
    const int64_t max_rows = block_bytes / row_bytes;
    const int64_t blocks = max_rows < mr ? (M + mr - 1) / mr : (M + max_rows - 1) / max_rows;
    return (int)(((M + blocks - 1) / blocks + mr - 1) / mr * mr);
}

// The loops every GEMM here runs: M cut into row blocks of MC rows (row_block), and within a block the weight panels
// [0, panels) shared out among the caller's num_threads threads (share.h), each panel then meeting every tile of ROWS
// rows of the block before the next panel is read. BODY runs once for each (block, panel), with m0 and mc (the
// block's first row and its row count), tiles (its tile count) and `p` (the panel) in scope. A macro rather than a
// function taking a callback, so that the always_inline tile functions BODY calls are still inlined into the
// parallel loop.
#define FOR_BLOCK_PANELS(M, MC, ROWS, panels, p, ...)                                               \
    for (int m0 = 0; m0 < (M); m0 += (MC)) {                                                        \
        const int mc = (M) - m0 < (MC) ? (M) - m0 : (MC), tiles = (mc + (ROWS) - 1) / (ROWS);       \
        Shares shares;                                                                              \
        shares_init(&shares, (panels), num_threads);                                                \
        _Pragma("omp parallel num_threads(num_threads)")                                            \
        for (int64_t p; (p = shares_take(&shares)) >= 0;) { __VA_ARGS__ }                           \
    }

// num_threads: torch's (the OpenMP pool is shared). Returns 0, or -1 for arguments this kernel
// does not take (the caller then runs the torch path).
int linear_packed(const float *x, int64_t x_row, int M, int K, const float *wp, int N,
                  const float *bias, float *out, int64_t out_row, int num_threads) {
    if (M < 1 || N < 1 || K < 1) return -1;
    int64_t panels = ((int64_t)N + NR - 1) / NR;
    const int rows = tile_rows(M);
    const int MC = row_block(M, (int64_t)K * 4, X_BLOCK_BYTES, rows);
    FOR_BLOCK_PANELS(M, MC, rows, panels, p,
        int64_t n = p * NR;
        int ncols = N - n < NR ? (int)(N - n) : NR;
        const float *b = wp + p * (int64_t)K * NR;
        for (int i = 0; i < mc; i += rows) {
            const int mr = mc - i < rows ? mc - i : rows;
            const float *xi = x + (int64_t)(m0 + i) * x_row, *bias_n = bias ? bias + n : 0;
            float *oi = out + (int64_t)(m0 + i) * out_row + n;
            tile_of(rows, xi, x_row, mr, b, K, oi, out_row, ncols, bias_n,
                    next_panel(wp, p, panels, i / rows, tiles, K), tiles, 0);
        })
    return 0;
}

// The gate_up projection with SiLU-and-mul as its epilogue, float32: out[M, I] = silu(x . w_gate^T) * (x . w_up^T)
// for x [M, K] (row stride x_row) and gate_up packed as linear_packed's [2I, K] weight (gate rows, then up rows);
// out [M, I] contiguous. With I a multiple of NR no panel holds both halves: a thread computes gate panel p and up
// panel p + I / NR for a tile of rows into two L1 buffers and writes their SiLU-and-mul, so the [M, 2I] output of
// the GEMM is never written and read back. Bit for bit linear_packed followed by silu_and_mul (the same tiles, then
// the same row function on the same floats). Zen 5, 2 threads, against the two calls: SmolLM2's gate_up over 30
// layers from memory, alternated in one process, 0.98x the time at M = 64 and 0.94x at M = 512 (medians); served, W1's
// float32 throughput 1.00-1.15x in six alternated pairs (median 1.05), while the decode step at batch 64 and a
// 512-token prefill step moved within their spread. Returns 0, or -1 (I not a multiple of NR) and the caller runs
// the two kernels.
// bf16 has no such fusion: over the pair GEMM (the gate pair, then the up pair, 96 rows at a time) it ran 1.04x the
// time of that GEMM and silu_and_mul (median), whose bf16 output and SiLU pass are half the float32 bytes.
int linear_packed_silu(const float *x, int64_t x_row, int M, int K, const float *wp, int inter, float *out,
                       int num_threads) {
    if (M < 1 || K < 1 || inter < 1 || inter % NR) return -1;
    const int64_t half = inter / NR;  // gate panels; up panel p is p + half
    const int rows = tile_rows(M);
    const int MC = row_block(M, (int64_t)K * 4, X_BLOCK_BYTES, rows);
    FOR_BLOCK_PANELS(M, MC, rows, half, p,
        const float *bg = wp + p * (int64_t)K * NR, *bu = wp + (p + half) * (int64_t)K * NR;
        float g[MR_TALL * NR], u[MR_TALL * NR];  // [rows, NR]
        for (int i = 0; i < mc; i += rows) {
            const int mr = mc - i < rows ? mc - i : rows;
            const float *xi = x + (int64_t)(m0 + i) * x_row;
            tile_of(rows, xi, x_row, mr, bg, K, g, NR, NR, NULL,
                    next_panel(wp, p, half, i / rows, tiles, K), tiles, 0);
            tile_of(rows, xi, x_row, mr, bu, K, u, NR, NR, NULL,
                    next_panel(wp, p + half, 2 * half, i / rows, tiles, K), tiles, 0);
            for (int m = 0; m < mr; m++)
                silu_and_mul_row(g + m * NR, u + m * NR, out + (int64_t)(m0 + i + m) * inter + p * NR, NR, 0);
        })
    return 0;
}

// ---------------------------------------------------------------------------------------------------------
// bfloat16 weights: out[M, N] = x[M, K] . w[N, K]^T (+ bias), all bf16.
// - M <= PAIR_MAX_M (decode of one to a few requests), every build: a stream of the weights. oneDNN's prepacked
//   bf16 GEMM read them at 17-23 GB/s on Zen 4 at M = 1 against 32-35 for this loop (SmolLM2's shapes, weights
//   from DRAM).
// - Larger M, builds with vdpbf16ps only: a register-tiled GEMM (below). Other builds return -1 and the caller runs
//   oneDNN.
//
// Weight layout, packed once at load (kernels/linear.py, pack_bf16_pairs), the same on every CPU:
//   wp   [Np / PAIR_PW, K / 2, PAIR_PW]  uint32, Np = N rounded up to 2 * PAIR_PW (padding rows are zero)
// each uint32 holding the bf16 pair (w[n, 2j], w[n, 2j + 1]), low half first: one 64-byte row of a panel is
// 16 output features times one pair of k, which is what vdpbf16ps multiplies against a broadcast pair of x
// (AVX512-BF16). Elsewhere each pair is split by a shift and a mask into two float vectors (vec.h's trick).
// Panels come in pairs, so the GEMM's two-panel tile needs no one-panel variant (which cost 0-8% per shape at
// M = 512).
//   x    [M, K]  bf16, row stride x_row (K even; above PAIR_MAX_M also x_row even);  bias [N] bf16 or NULL;
//   out  [M, N]  bf16, row stride out_row; or, from linear_bf16_pairs_f32, float32 sums left unrounded (what
//        kernels/argmax_head.py bounds the error of)
// The products are exact in float and summed in float; the output is rounded once (bias added first), as
// oneDNN's bf16 GEMM rounds.
#define PAIR_PW 16
// The pair GEMV (M <= PAIR_MAX_M) fetches each line of its panels PAIR_AHEAD bytes before it reads it, into L2: a
// thread's panels are one contiguous stream, which an Intel core's prefetchers follow too late at this rate (as the
// packed GEMVs, ggml_blocks.h's GEMV_AHEAD). Intel Xeon (AMX), SmolLM2's projections over 30 layers and its lm_head
// (scripts/bench_cpu_kernels.py --linears): M = 1 15.58 ms before, 12.33 after; M = 4 18.72 and 12.62 (oneDNN's
// prepacked GEMM 12.9-13.4). Past the weight's end the prefetches fetch nothing the kernel reads (they never fault).
#ifndef PAIR_AHEAD
#define PAIR_AHEAD 8192
#endif
#if defined(__AVX512BF16__) && VL == 16
#include <immintrin.h>
#define PAIR_DPBF16 1
#else
#define PAIR_DPBF16 0
#endif
#define PAIR_AMX (PAIR_DPBF16 && HAS_AMX)

// One panel (PAIR_PW features) for rows 0 .. m-1 of x, m a constant at each call site. acc [m][PAIR_PW].
// Two accumulator sets, even and odd j, so that the adds into one register are not one dependency chain.
static inline __attribute__((always_inline)) void pair_panel(const uint16_t *x, int64_t x_row, int kp,
                                                             const uint32_t *w, float acc[][PAIR_PW], const int m) {
#if PAIR_DPBF16
    __m512 a[2][PAIR_MAX_M];
    for (int i = 0; i < m; i++) a[0][i] = a[1][i] = _mm512_setzero_ps();
    int j = 0;
    for (; j + 2 <= kp; j += 2)
        for (int u = 0; u < 2; u++) {
            __builtin_prefetch((const void *)((uintptr_t)(w + (int64_t)(j + u) * PAIR_PW) + PAIR_AHEAD), 0, 2);
            const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + (int64_t)(j + u) * PAIR_PW);
            for (int i = 0; i < m; i++) {
                uint32_t xx;
                memcpy(&xx, x + i * x_row + 2 * (j + u), sizeof xx);
                a[u][i] = _mm512_dpbf16_ps(a[u][i], wv, (__m512bh)_mm512_set1_epi32((int)xx));
            }
        }
    for (; j < kp; j++) {
        const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + (int64_t)j * PAIR_PW);
        for (int i = 0; i < m; i++) {
            uint32_t xx;
            memcpy(&xx, x + i * x_row + 2 * j, sizeof xx);
            a[0][i] = _mm512_dpbf16_ps(a[0][i], wv, (__m512bh)_mm512_set1_epi32((int)xx));
        }
    }
    for (int i = 0; i < m; i++) _mm512_storeu_ps(acc[i], _mm512_add_ps(a[0][i], a[1][i]));
#else
    enum { NC = PAIR_PW / VL };
    vf a[2][PAIR_MAX_M][NC];
    for (int i = 0; i < m; i++)
        for (int c = 0; c < NC; c++) a[0][i][c] = a[1][i][c] = (vf){0};
    for (int j = 0; j < kp; j++) {
        const int u = j & 1;
        for (int c = 0; c < NC; c++) {
            const vu wv = *(const vu_u *)(w + (int64_t)j * PAIR_PW + c * VL);
            const vf lo = (vf)(wv << 16), hi = (vf)(wv & 0xffff0000u);  // w[n, 2j], w[n, 2j + 1]
            for (int i = 0; i < m; i++)
                a[u][i][c] += lo * vbroadcast(bf16_to_f32(x[i * x_row + 2 * j]))
                            + hi * vbroadcast(bf16_to_f32(x[i * x_row + 2 * j + 1]));
        }
    }
    for (int i = 0; i < m; i++)
        for (int c = 0; c < NC; c++) vstore(acc[i] + c * VL, a[0][i][c] + a[1][i][c]);
#endif
}

#if PAIR_DPBF16
// Above PAIR_MAX_M rows the same layout runs a register-tiled GEMM: GEMM_MR rows of x by two panels (32
// features) in 24 zmm accumulators, so each k pair costs two 64-byte weight loads, GEMM_MR broadcasts of an x pair
// and 24 vdpbf16ps, and the 24 accumulator chains hide vdpbf16ps's latency. A thread takes a contiguous run of
// panel pairs (static), and each pair meets every row of its x block before the next is read: weights stream from
// memory once per x block, and while a thread computes one pair its tiles prefetch the next pair into L2, a slice
// each, so the stream overlaps the tiles (against the first tile fetching all of it, Zen 5: lm_head at M = 512
// 32.0 ms against 46.7, gate_up at M = 64 0.277 against 0.302 ms a layer; the rest within the spread).
// Zen 4, 2 threads, SmolLM2's four projections over 30 layers plus its lm_head, weights from DRAM:
// 415 GFLOP/s at M = 64 and 432 at M = 512, against 446 for back-to-back vdpbf16ps there and 328 and 413 for
// oneDNN's prepacked bf16 GEMM (scripts/bench_cpu_kernels.py --linears; kernels/linear.py says which runs where).
// Packing x into tiles (to free the rows' address registers) measured no faster; 8 x 3 tiles ran -2% to +6% of
// this one's time across M, 6 x 4 tiles 1-14% slower.
#define GEMM_MR 12
#define GEMM_X_BLOCK_BYTES (2 << 20)

// One tile: rows 0 .. mr-1 of x by the two panels at w (panel stride pstride), all K, into acc
// [GEMM_MR][2 * PAIR_PW] floats; mr is a constant at each call site. next: NULL, or rows of the next panel pair
// (at the same panel stride) to fetch into L2 alongside, one k pair of both panels every `every` k pairs.
static inline __attribute__((always_inline)) void gemm_tile(const uint16_t *x, int64_t x_row, const int mr,
                                                            int kp, const uint32_t *w, int64_t pstride,
                                                            const uint32_t *next, int every, float *acc) {
    __m512 c[GEMM_MR][2];
    const uint32_t *xr[GEMM_MR];
    for (int i = 0; i < mr; i++) {
        xr[i] = (const uint32_t *)(x + i * x_row);  // K and x_row even: 4-byte aligned pairs
        c[i][0] = c[i][1] = _mm512_setzero_ps();
    }
    for (int j = 0, wait = 1; j < kp; j++) {
        __m512bh b[2];
        for (int p = 0; p < 2; p++) b[p] = (__m512bh)_mm512_loadu_si512(w + p * pstride + (int64_t)j * PAIR_PW);
        if (next && --wait == 0) {
            for (int p = 0; p < 2; p++) _mm_prefetch((const char *)(next + p * pstride), _MM_HINT_T1);
            next += PAIR_PW;
            wait = every;
        }
        for (int i = 0; i < mr; i++) {
            const __m512bh a = (__m512bh)_mm512_set1_epi32((int)xr[i][j]);
            for (int p = 0; p < 2; p++) c[i][p] = _mm512_dpbf16_ps(c[i][p], b[p], a);
        }
    }
    for (int i = 0; i < mr; i++)
        for (int p = 0; p < 2; p++) _mm512_storeu_ps(acc + (i * 2 + p) * PAIR_PW, c[i][p]);
}

// out rows 0 .. mr-1, columns n0 .. n0 + ncols - 1 (ncols <= 32) = acc + bias, rounded to bf16 (RNE); or into
// outf as float32 where outf is not NULL.
static void gemm_store(const float *acc, int mr, const uint16_t *bias, uint16_t *out, float *outf, int64_t out_row,
                       int64_t n0, int ncols) {
    for (int p = 0; p * PAIR_PW < ncols; p++) {
        const int cols = ncols - p * PAIR_PW < PAIR_PW ? ncols - p * PAIR_PW : PAIR_PW;
        const __mmask16 mask = (__mmask16)((1u << cols) - 1);
        __m512 b = _mm512_setzero_ps();
        if (bias)
            b = _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, bias + n0 + p * PAIR_PW)), 16));
        for (int i = 0; i < mr; i++) {
            const __m512 v = _mm512_add_ps(_mm512_loadu_ps(acc + (i * 2 + p) * PAIR_PW), b);
            if (outf) {
                float *o = outf + i * out_row + n0 + p * PAIR_PW;
                if (cols == PAIR_PW)
                    _mm512_storeu_ps(o, v);
                else
                    _mm512_mask_storeu_ps(o, mask, v);
                continue;
            }
            const __m256i y = (__m256i)_mm512_cvtneps_pbh(v);
            uint16_t *o = out + i * out_row + n0 + p * PAIR_PW;
            if (cols == PAIR_PW)  // a full panel: a plain store (masked stores are slow on Zen 4)
                _mm256_storeu_si256((__m256i *)o, y);
            else
                _mm256_mask_storeu_epi16(o, mask, y);
        }
    }
}

#define GEMM_CASE(m) \
    case m: gemm_tile(xb, x_row, m, kp, w, pstride, next, tiles, acc); break;

static void linear_bf16_gemm(const uint16_t *x, int64_t x_row, int M, int K, const uint32_t *wp, int N,
                             const uint16_t *bias, uint16_t *out, float *outf, int64_t out_row, int num_threads) {
    const int kp = K / 2;
    const int64_t pstride = (int64_t)kp * PAIR_PW;
    const int64_t pairs = ((int64_t)N + 2 * PAIR_PW - 1) / (2 * PAIR_PW);  // wp has 2 * pairs panels
    const int MC = row_block(M, (int64_t)K * 2, GEMM_X_BLOCK_BYTES, GEMM_MR);
    FOR_BLOCK_PANELS(M, MC, GEMM_MR, pairs, g,
        const uint32_t *w = wp + 2 * g * pstride;
        const int64_t n0 = 2 * g * PAIR_PW;
        const int ncols = N - n0 < 2 * PAIR_PW ? (int)(N - n0) : 2 * PAIR_PW;
        float acc[GEMM_MR * 2 * PAIR_PW];
        for (int i0 = 0; i0 < mc; i0 += GEMM_MR) {
            const int mr = mc - i0 < GEMM_MR ? mc - i0 : GEMM_MR;
            const uint16_t *xb = x + (int64_t)(m0 + i0) * x_row;
            // As in the float32 GEMM (next_panel): tile i fetches the i-th slice of the next pair's k pairs.
            const uint32_t *next =
                g + 1 < pairs ? w + 2 * pstride + slice_start(i0 / GEMM_MR, tiles, kp) * PAIR_PW : 0;
            switch (mr) {
                GEMM_CASE(1) GEMM_CASE(2) GEMM_CASE(3) GEMM_CASE(4) GEMM_CASE(5) GEMM_CASE(6) GEMM_CASE(7)
                GEMM_CASE(8) GEMM_CASE(9) GEMM_CASE(10) GEMM_CASE(11)
                default: gemm_tile(xb, x_row, GEMM_MR, kp, w, pstride, next, tiles, acc); break;
            }
            const int64_t at = (int64_t)(m0 + i0) * out_row;
            gemm_store(acc, mr, bias, outf ? NULL : out + at, outf ? outf + at : NULL, out_row, n0, ncols);
        })
}
#endif

#if PAIR_AMX
// On an AMX CPU the same layout runs on the tile unit above PAIR_MAX_M rows: a 64-byte row of a panel (16 features
// times a k pair) is a row of the B operand tdpbf16ps takes, so 16 consecutive rows of a panel (32 k, 1 KB, contiguous)
// are one B tile, and 16 rows of x by 32 k (row stride x_row) one A tile, loaded in place. A block is 32 rows of x
// by a panel pair: two A tiles, two B tiles, four C tiles of 16 x 16 floats (tiles 4-5, 6-7 and 0-3). Each pair meets
// every 32-row block of its x block before the next pair is read, as in the register-tiled GEMM, so the weights
// stream from memory once per x block of AMX_X_BLOCK_BYTES (256 KB and 4 MB blocks took 1.00-1.09x its time at
// M = 256, 1.04-1.27x at 2,048). x rows past M in the last 16-row tile are read from a zeroed copy of x's tail, never
// past x's end. K must be a multiple of 32; other K go to oneDNN (kernels/linear.py).
// Intel Xeon (AMX), 2 threads, SmolLM2's projections over 30 layers and its lm_head from memory, against oneDNN's
// prepacked GEMM (docs/benchmarks.md, "AMX tiles for the bf16 GEMM"): 0.80-0.84x the time at M = 5-9, 0.74-0.78x at
// 16-32, 0.83-0.86x at 64, 0.84-0.91x at 128, 1.10-1.17x at 256, 0.94-1.00x at 512-1,024 and 1.27x at 2,048. At
// M = 16 the 269 MB stream at 21 GB/s; at 64 the tile unit's own time (7-9 ms over these shapes with the weights in
// cache) overlaps it only in part. Fetching the next pair into L2 alongside (one pair or two ahead, prefetcht0 or t1)
// moved no M by more than the runs' spread; fetching each panel's own tiles AMX_AHEAD chunks ahead (8 KB of the pair,
// into L2, while the pair's first row block reads it) does, presumably because a panel's tiles span several 4 KB
// pages and the hardware prefetchers do not cross one. Six alternations of the builds (scripts/bench_cpu_kernels.py
// --dtypes bfloat16 --linears 16 32 64 128 [256]): 0.89-0.98x the time at M = 16, 0.83-0.91x at 32, 0.82-0.95x at
// 64, 0.85-1.02x at 128, 0.91-0.93x at 256; 4 or 12 chunks ahead gained less, 16 less again, 2 lost at 64 rows.
#define AMX_K 32                  // k a tile step
#define AMX_CHUNK (16 * PAIR_PW)  // uint32 of one B tile: 16 k pairs of one panel
#define AMX_X_BLOCK_BYTES (1 << 20)
#define AMX_AHEAD 8               // chunks (1 KB of each panel) the first row block fetches ahead

// acc [32][2 * PAIR_PW] = rows of x0 (16) and x1 (16, where two) by the pair at w (panel stride pstride), all K;
// x0 / x1 with row strides s0 / s1 in bytes. `ahead`: the pair's first row block, which reads it from memory.
static inline __attribute__((always_inline)) void amx_block(const uint16_t *x0, int64_t s0, const uint16_t *x1,
                                                            int64_t s1, const int two, int chunks, const uint32_t *w,
                                                            int64_t pstride, float *acc, const int ahead) {
    _tile_zero(0);
    _tile_zero(1);
    if (two) {
        _tile_zero(2);
        _tile_zero(3);
    }
    for (int c = 0; c < chunks; c++) {
        const uint32_t *b = w + (int64_t)c * AMX_CHUNK;
        if (ahead && c + AMX_AHEAD < chunks) {  // both panels' tiles of chunk c + AMX_AHEAD, 16 lines each
            const char *p0 = (const char *)(b + AMX_AHEAD * AMX_CHUNK), *p1 = p0 + pstride * sizeof *w;
            for (size_t l = 0; l < AMX_CHUNK * sizeof *w; l += 64)
                _mm_prefetch(p0 + l, _MM_HINT_T1), _mm_prefetch(p1 + l, _MM_HINT_T1);
        }
        _tile_loadd(6, b, 64);
        _tile_loadd(7, b + pstride, 64);
        _tile_loadd(4, x0 + c * AMX_K, s0);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        if (two) {
            _tile_loadd(5, x1 + c * AMX_K, s1);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
    }
    _tile_stored(0, acc, 2 * PAIR_PW * 4);
    _tile_stored(1, acc + PAIR_PW, 2 * PAIR_PW * 4);
    if (two) {
        _tile_stored(2, acc + 16 * 2 * PAIR_PW, 2 * PAIR_PW * 4);
        _tile_stored(3, acc + 16 * 2 * PAIR_PW + PAIR_PW, 2 * PAIR_PW * 4);
    }
}

// M > PAIR_MAX_M, K % 32 == 0, x_row even, amx_permitted(). Returns 0, or -1 where it could not allocate.
static int linear_bf16_amx(const uint16_t *x, int64_t x_row, int M, int K, const uint32_t *wp, int N,
                           const uint16_t *bias, uint16_t *out, float *outf, int64_t out_row, int num_threads) {
    const int chunks = K / AMX_K;
    const int64_t pstride = (int64_t)(K / 2) * PAIR_PW;
    const int64_t pairs = ((int64_t)N + 2 * PAIR_PW - 1) / (2 * PAIR_PW);
    // The last 16-row tile's rows past M: a copy of x's tail, zero past it. [16, K] bf16, rows K apart.
    const int full = M / 16 * 16;
    uint16_t *tail = NULL;
    if (full < M) {
        tail = aligned_alloc(64, (size_t)16 * K * sizeof *tail);
        if (!tail) return -1;
        memset(tail, 0, (size_t)16 * K * sizeof *tail);
        for (int i = full; i < M; i++) memcpy(tail + (int64_t)(i - full) * K, x + i * x_row, (size_t)K * sizeof *x);
    }
    const int MC = row_block(M, (int64_t)K * 2, AMX_X_BLOCK_BYTES, 32);
    for (int m0 = 0; m0 < M; m0 += MC) {
        const int mc = M - m0 < MC ? M - m0 : MC;
        Shares shares;
        shares_init(&shares, pairs, num_threads);
        #pragma omp parallel num_threads(num_threads)
        {
            amx_configure();
            float acc[32 * 2 * PAIR_PW];
            for (int64_t g; (g = shares_take(&shares)) >= 0;) {
                const uint32_t *w = wp + 2 * g * pstride;
                const int64_t n0 = 2 * g * PAIR_PW;
                const int ncols = N - n0 < 2 * PAIR_PW ? (int)(N - n0) : 2 * PAIR_PW;
                for (int i0 = m0; i0 < m0 + mc; i0 += 32) {
                    const int mr = m0 + mc - i0 < 32 ? m0 + mc - i0 : 32;
                    // Tile rows i0 .. i0 + 15 and i0 + 16 .. i0 + 31: from x where all 16 rows are in it.
                    const uint16_t *x0 = i0 + 16 <= M ? x + i0 * x_row : tail;
                    const int64_t s0 = i0 + 16 <= M ? x_row * 2 : (int64_t)K * 2;
                    const uint16_t *x1 = i0 + 32 <= M ? x + (i0 + 16) * x_row : tail;
                    const int64_t s1 = i0 + 32 <= M ? x_row * 2 : (int64_t)K * 2;
                    if (mr > 16)
                        amx_block(x0, s0, x1, s1, 1, chunks, w, pstride, acc, i0 == m0);
                    else
                        amx_block(x0, s0, x1, s1, 0, chunks, w, pstride, acc, i0 == m0);
                    const int64_t at = (int64_t)i0 * out_row;
                    gemm_store(acc, mr, bias, outf ? NULL : out + at, outf ? outf + at : NULL, out_row, n0, ncols);
                }
            }
            _tile_release();
        }
    }
    free(tail);
    return 0;
}
#endif

// Either output: bf16 `out` or, where `outf` is not NULL, float32 `outf`.
static int pairs_gemm(const uint16_t *x, int64_t x_row, int M, int K, const uint32_t *wp, int N,
                      const uint16_t *bias, uint16_t *out, float *outf, int64_t out_row, int num_threads) {
    if (M < 1 || K < 2 || K % 2 || N < 1) return -1;
#if PAIR_AMX
    if (M > PAIR_MAX_M && K % AMX_K == 0 && x_row % 2 == 0 && amx_permitted())
        return linear_bf16_amx(x, x_row, M, K, wp, N, bias, out, outf, out_row, num_threads);
#endif
#if PAIR_DPBF16
    if (M > PAIR_MAX_M) {
        if (x_row % 2) return -1;
        linear_bf16_gemm(x, x_row, M, K, wp, N, bias, out, outf, out_row, num_threads);
        return 0;
    }
#else
    if (M > PAIR_MAX_M) return -1;
#endif
    const int64_t panels = ((int64_t)N + PAIR_PW - 1) / PAIR_PW;
    const int kp = K / 2;
    // Each thread streams one contiguous part of wp; one done early takes panels from the back of another's (share.h).
    Shares shares;
    shares_init(&shares, panels, num_threads);
    #pragma omp parallel num_threads(num_threads)
    for (int64_t p; (p = shares_take(&shares)) >= 0;) {
        const uint32_t *w = wp + p * kp * PAIR_PW;
        float acc[PAIR_MAX_M][PAIR_PW];
        switch (M) {
            case 1: pair_panel(x, x_row, kp, w, acc, 1); break;
            case 2: pair_panel(x, x_row, kp, w, acc, 2); break;
            case 3: pair_panel(x, x_row, kp, w, acc, 3); break;
            default: pair_panel(x, x_row, kp, w, acc, 4); break;
        }
        const int64_t n0 = p * PAIR_PW;
        const int ncols = N - n0 < PAIR_PW ? (int)(N - n0) : PAIR_PW;
        for (int i = 0; i < M; i++)
            for (int c = 0; c < ncols; c++) {
                const float v = acc[i][c] + (bias ? bf16_to_f32(bias[n0 + c]) : 0.0f);
                if (outf)
                    outf[i * out_row + n0 + c] = v;
                else
                    out[i * out_row + n0 + c] = f32_to_bf16(v);
            }
    }
    return 0;
}

// num_threads: torch's. Returns 0, or -1 for arguments it does not take (K odd or x_row odd, or M over PAIR_MAX_M
// in a build without vdpbf16ps: the caller then runs oneDNN).
int linear_bf16_pairs(const uint16_t *x, int64_t x_row, int M, int K, const uint32_t *wp, int N,
                      const uint16_t *bias, uint16_t *out, int64_t out_row, int num_threads) {
    return pairs_gemm(x, x_row, M, K, wp, N, bias, out, NULL, out_row, num_threads);
}

// The same with float32 output [M, N] (row stride out_row), the sums not rounded to bf16.
int linear_bf16_pairs_f32(const uint16_t *x, int64_t x_row, int M, int K, const uint32_t *wp, int N,
                          const uint16_t *bias, float *out, int64_t out_row, int num_threads) {
    return pairs_gemm(x, x_row, M, K, wp, N, bias, NULL, out, out_row, num_threads);
}

// Whether this build multiplies the pairs with vdpbf16ps, and so also takes every M (kernels/linear.py).
int linear_bf16_pairs_dpbf16(void) { return PAIR_DPBF16; }

// Whether this build runs the pairs on AMX tiles above PAIR_MAX_M rows (where K is a multiple of 32), and the process
// has been granted the tile registers (asked here, once).
int linear_bf16_pairs_amx(void) {
#if PAIR_AMX
    return amx_permitted();
#else
    return 0;
#endif
}
