// The GGML block formats as both quant_linear kernels read them (quant_linear.c with float32 activations,
// quant_linear_q8.c with int8 ones): the sizes of each block, its fp16 scales, the K-quants' packed 6-bit scales, and
// where the GEMVs stop. Block layouts: ggml-common.h's block_q4_0 .. block_q8_K; lightserve's LS_Q8_0F / LS_Q4_1F
// (kernels.h).
#pragma once
#include <stdint.h>
#include <string.h>
#if defined(__F16C__) || defined(__SSE4_1__)
#include <immintrin.h>
#endif

#include "fastmath.h"
#include "kernels.h"

#ifndef GEMV_MAX_M
// Up to here the GEMVs of both files; above, quant_linear.c's dequantized panels and register tile and
// quant_linear_q8.c's GEMM. Zen 3, 2 threads, 2048 x 2048, ms of the float GEMV / the tiles: Q4_1 M = 3 0.48 / 0.79,
// M = 4 0.53 / 0.80, M = 6 0.79 / 0.80; Q6_K M = 4 0.97 / 1.07. With int8 activations, [8192, 2048]: the GEMV at M = 4
// against the GEMM at M = 5, Q4_1 1.65 / 1.63 ms, Q4_K 1.30 / 2.12, Q6_K 3.68 / 4.29 (before the GEMM decoded
// K-quant blocks with constant shifts).
#define GEMV_MAX_M 4
#endif

static inline float half_to_float(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, sizeof h);
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    return half_bits_to_f32(h);
#endif
}

// The GEMVs read each packed row once, and a thread's rows are one contiguous run of the weight (share.h), but a tile
// of rows (a few hundred bytes to a few KB) is done before the hardware prefetchers of an Intel core run far enough
// ahead: there both GEMVs read 7-15 GB/s of the 25 the machine streams. So each tile fetches the bytes GEMV_AHEAD past
// its rows into L2 (prefetcht1), a share of the lines per block, so that the requests spread over the tile. Intel Xeon
// (AMX), 2 threads, weights from memory, M = 1 (scripts/bench_quant_linear.py), ms before / after, weight-only and
// int8 activations: SmolLM2's gate_up in Q4_1 0.122 / 0.089 and 0.116 / 0.066; its Q8_0 lm_head 2.03 / 1.11 and
// 1.92 / 0.84; a Llama-3.2-1B's [8192, 2048] Q4_1 1.34 / 0.70 and 1.07 / 0.57, Q6_K 1.56 / 1.20 and 1.32 / 0.65. 4 KB
// ahead gained less, 16 and 32 KB no more than 8 (one noisy pass each; docs/benchmarks.md, "The AMX Xeon again").
#define GEMV_AHEAD 8192
typedef struct {
    const uint8_t *next;  // the next line to fetch
    int lines;            // 64-byte lines to fetch over the tile's blocks; 0 past the weight's end
    int owed;             // ahead_step's running remainder
} Ahead;

// The `bytes` GEMV_AHEAD past `rows` (a tile's first row), cut at `end` (the weight's end).
static inline Ahead ahead_of(const uint8_t *rows, int64_t bytes, const uint8_t *end) {
    const int64_t start = (int64_t)((uintptr_t)rows - (uintptr_t)end) + GEMV_AHEAD;  // < 0 before the end
    const int64_t n = start >= 0 ? 0 : -start < bytes ? -start : bytes;
    return (Ahead){rows + (n > 0 ? GEMV_AHEAD : 0), (int)((n + 63) / 64), 0};
}

// One block of the tile's nb: its share of the lines (all of them over nb calls), without a division a block.
static inline void ahead_step(Ahead *a, int nb) {
    for (a->owed += a->lines; a->owed >= nb; a->owed -= nb, a->next += 64) __builtin_prefetch(a->next, 0, 2);
}

// The K-quants that the GEMVs take one output row at a time for a single row of x (gemv_rows and q8_rows say why).
static inline int one_row_gemv(int qtype) { return qtype == GGML_Q4_K || qtype == GGML_Q5_K || qtype == GGML_Q6_K; }

// Elements and bytes per block; 0 for a type the kernels do not take.
static inline int block_elems(int qtype) {
    switch (qtype) {
        case GGML_Q4_0: case GGML_Q4_1: case GGML_Q5_0: case GGML_Q5_1: case GGML_Q8_0: case LS_Q8_0F: case LS_Q4_1F:
            return 32;
        case GGML_Q4_K: case GGML_Q5_K: case GGML_Q6_K: case GGML_Q8_K: return 256;
        default: return 0;
    }
}

static inline int block_bytes(int qtype) {
    switch (qtype) {
        case GGML_Q4_0: return 18;
        case GGML_Q4_1: return 20;
        case GGML_Q5_0: return 22;
        case GGML_Q5_1: return 24;
        case GGML_Q8_0: return 34;
        case GGML_Q4_K: return 144;
        case GGML_Q5_K: return 176;
        case GGML_Q6_K: return 210;
        case GGML_Q8_K: return 292;
        case LS_Q8_0F: return 36;
        case LS_Q4_1F: return 24;
        default: return 0;
    }
}

// A Q4_K / Q5_K block's 12 packed bytes (q = blk + 4) as its 8 sub-blocks' 6-bit scales (*sc) and mins (*mn), sub-block
// j in byte j: ggml's get_scale_min_k4 for every j at once (its utmp unpacking), in registers. The kernels convert the
// bytes from there (scales8 and u64_bytes_to_f): written to memory as 32-bit words and read back as 8-byte loads,
// they waited on a store-to-load forward that fails (one load over two stores), which bounded the Q4_K GEMVs
// (docs/benchmarks.md, "The Q4_K GEMV's scales").
static inline void scales_mins_k4(const uint8_t *q, uint64_t *sc, uint64_t *mn) {
    uint32_t u[3];
    memcpy(u, q, 12);
    *sc = (u[0] & 0x3f3f3f3f) | (uint64_t)((u[2] & 0x0f0f0f0f) | (((u[0] >> 6) & 0x03030303) << 4)) << 32;
    *mn = (u[1] & 0x3f3f3f3f) | (uint64_t)(((u[2] >> 4) & 0x0f0f0f0f) | (((u[1] >> 6) & 0x03030303) << 4)) << 32;
}

typedef float bytes_f8 __attribute__((vector_size(32)));  // the same type as quant_linear_q8.c's f8

// The 8 bytes of v, low first, as 8 floats.
static inline bytes_f8 u64_bytes_to_f(uint64_t v) {
#if defined(__AVX2__)
    return (bytes_f8)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)v)));
#else
    bytes_f8 r;
    for (int j = 0; j < 8; j++) r[j] = (float)(v >> 8 * j & 0xff);
    return r;
#endif
}

// dst[j] = d * byte j of v, j < 8: each product d * (float)byte, rounded once.
static inline void scales8(uint64_t v, float d, float *dst) {
    const bytes_f8 r = u64_bytes_to_f(v) * d;
    memcpy(dst, &r, sizeof r);
}

// ggml's get_scale_min_k4: the 6-bit scale and min of sub-block j from a Q4_K / Q5_K block's 12 packed bytes.
static inline void scale_min_k4(int j, const uint8_t *q, int *sc, int *m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}
