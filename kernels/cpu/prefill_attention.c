// Causal attention of a prefill/extend step on CPU, straight over the token-level KV cache.
//
// Why C: the torch path (kernels/prefill_attention.py, prefill_attention_ref) makes one SDPA call
// per request per layer, after gathering the request's K/V rows and, when a prefix is cached,
// building an explicit [extend, total] mask. In a burst of requests sharing a cached 1,024-token
// prefix (16 x 48 new tokens) that came to 1.25 s of a 3.1 s step, for 53 GFLOP of attention.
// Here all requests of the step are one parallel loop of small flash-attention tasks that read the
// K/V rows where they lie.
//
// Shapes (strides in elements):
//   q            [T, Hq, D]          float32 or bfloat16 (act_bf16), token stride q_tok, head stride q_head
//                                    (a view of qkv)
//   k_cache      [rows, Hk, D]       kv_kind (kernels.h): float32, bfloat16, int8 or fp8 e4m3 / e5m2, row stride
//                                    kc_row, head stride kc_head
//   v_cache      [rows, Hk, D]       same kind, row stride vc_row, head stride vc_head
//   k_scales, v_scales [rows, Hk]    float32, int8 only: row r's head h is q * scales[r * Hk + h]
//   k_scale, v_scale                 fp8 only: the per-tensor scales
//   req_to_token [num_rows, max_len] int32, row stride r2t_row
//   req_rows, q_start, prefix_lens, extend_lens  [B] int32
//   out          [T, Hq, D]          q's dtype, contiguous
// New token i of request b (q row q_start[b] + i) attends to the request's tokens 0 .. prefix_lens[b] + i;
// with window > 0 only to the last `window` of them (a task then starts at its first row's first key).
// softcap > 0: scores s become softcap * tanh(s / softcap) before the mask (Gemma 2). Both are off at 0,
// which leaves the loops as they were.
// Query heads h*G .. h*G+G-1 share KV head h.
//
// One task = (request, KV head, block of BQ new tokens). Its R = BQ * G query rows (token-major:
// row r is token r / G, head r % G) share every K/V row the task loads. Per block of BN keys:
//   scores  St[key][row] = K[key] . Qt[:, row]     (register tile: 6 keys x 2 vectors of rows, k = head dim)
//   online softmax down each row (vectorized across rows, since rows are St's contiguous axis)
//   O[row] += P[row][key] V[key]                   (register tile: 6 rows x 2 vectors of the head dim)
// Scores are computed transposed so that both tiles read K and V rows in place: one broadcast per
// K element and contiguous V loads, with only Q (once per task) transposed.
// A bf16 or 8-bit cache's rows of a block are first widened into float buffers (one block: [BN][D] each), the
// 8-bit ones dequantized on the way (dequant_row), so the tiles are the float32 cache's; the whole cache is never
// copied.
// bf16 q and KV on an AVX512-BF16 CPU (the native build's DPBF16): the same tiles with vdpbf16ps, over pairs
// of the head dim (scores, K read as bf16 in place) and of keys (P V, P rounded to bf16); see
// score_tile_bf16. Zen 4, 2 threads, 16 requests x 48 new tokens after a 1,024-token prefix, 9/3 heads of 64:
// 14.7 -> 10.1 ms a layer; 8/2 heads of 128: 24.2 -> 15.2; one 512-token prompt: 2.07 -> 1.30.
// On an AMX CPU the same bf16 operands go to the tile unit instead (head_dim a multiple of 32; amx_scores and
// amx_pv below): the block's K rows gathered into 16-key A tiles against q's pairs as B tiles, and P (rounded to
// bf16, row-major) as A tiles against the V pairs as B tiles, accumulating into the output rows.
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "amx.h"
#include "fastmath.h"
#include "kernels.h"
#include "vec.h"

#define BN 96         // keys per block: a multiple of 6 and 12, so no tile computes spare keys
#define MAXR 64       // query rows per task (BQ * G)
#define TARGET_R 48   // rows a task aims for: 8 PV tiles of 6
#define MAX_DIM 256

// The float tiles are 6 x 2 vectors (12 accumulators: two vector loads and six broadcasts a step). The
// vector is vec.h's: 16 floats with AVX-512, 8 with AVX2. Where rows (scores) or head dims (P V) do not
// fill 2 vectors, the tail is a 16-wide tile of KT rows (12 zmm or 6 x 2 ymm accumulators).
// Against 12 x 16 tiles over 64-key blocks, Zen 4, 2 threads, 15 requests x 48 new tokens over a 1,024-token
// prefix: float32 10.7 -> 9.8 ms a layer, bf16 7.9 -> 7.0 (AVX2 build: 12.0 and 11.2 -> 10.8). One source
// for every CPU.
#if VL == 16
#define KT 12
#else
#define KT 6
#endif
#define TV (16 / VL)  // vectors per tile row

#if defined(__AVX512BF16__) && VL == 16
#include <immintrin.h>
#define DPBF16 1
#else
#define DPBF16 0
#endif

// St[j][r0 .. r0+NV*VL) = k_j . Qt[:, r0 .. r0+NV*VL) for the NK keys k_0 .. k_{NK-1} (row pointers). Called
// with constant NK and NV, as pv_tile.
static inline __attribute__((always_inline)) void score_tile(const float *const *k, const float *qt, int64_t qt_row,
                                                             int dim, float *st, int64_t st_row, const int NK,
                                                             const int NV) {
    vf c[KT][2];
    for (int j = 0; j < NK; j++)
        for (int t = 0; t < NV; t++) c[j][t] = (vf){0};
    for (int d = 0; d < dim; d++, qt += qt_row) {
        vf b[2];
        for (int t = 0; t < NV; t++) b[t] = vload(qt + t * VL);
        for (int j = 0; j < NK; j++) {
            vf a = vbroadcast(k[j][d]);
            for (int t = 0; t < NV; t++) c[j][t] += a * b[t];
        }
    }
    for (int j = 0; j < NK; j++)
        for (int t = 0; t < NV; t++) vstore(st + j * st_row + t * VL, c[j][t]);
}

// O[r0+i][d0 .. d0+NV*VL) += sum_j Pt[j][r0+i] v_j[d0 .. d0+NV*VL) for i < NR (rows past mr repeat the
// last). Called with constant NR and NV, so each call site is its own fully unrolled register tile:
// NR x NV accumulators, NV loads of V and NR broadcasts of P per key.
static inline __attribute__((always_inline)) void pv_tile(const float *pt, int64_t pt_row, int mr,
                                                          const float *const *v, int d0, int nkeys, float *o,
                                                          int64_t o_row, const int NR, const int NV) {
    int row[KT];
    vf c[KT][2];
    for (int i = 0; i < NR; i++) {
        row[i] = i < mr ? i : mr - 1;
        for (int t = 0; t < NV; t++) c[i][t] = vload(o + row[i] * o_row + t * VL);
    }
    for (int j = 0; j < nkeys; j++, pt += pt_row) {
        vf b[2];
        for (int t = 0; t < NV; t++) b[t] = vload(v[j] + d0 + t * VL);
        for (int i = 0; i < NR; i++) {
            vf a = vbroadcast(pt[row[i]]);
            for (int t = 0; t < NV; t++) c[i][t] += a * b[t];
        }
    }
    // Stores in reverse, so the real row's value is the last written when rows repeat.
    for (int i = NR - 1; i >= 0; i--)
        for (int t = 0; t < NV; t++) vstore(o + row[i] * o_row + t * VL, c[i][t]);
}

#if DPBF16
// The bf16 model's tiles on an AVX512-BF16 CPU (vdpbf16ps: 32 bf16 products summed in pairs into 16 floats).
// Both reduce over pairs: of the head dim for the scores (a K row's pairs are adjacent in the cache, so each is
// one broadcast, and K needs no widening), of keys for P V (each P pair broadcast against 16 dims of two V rows
// interleaved once per block). P is rounded to bf16 for it, as GPU flash attention feeds its P V matmul.
// Half the multiply instructions of the float tiles.

// St[j][r0 .. r0+16) = scale * k_j . Q[r0 .. r0+16) for the KT bf16 keys k_j; qp [dim / 2][MAXR] bf16 pairs.
static void score_tile_bf16(const uint16_t *const *k, const uint32_t *qp, int dim, float scale, float *st,
                            int64_t st_row) {
    __m512 c[KT];
    for (int j = 0; j < KT; j++) c[j] = _mm512_setzero_ps();
    for (int i = 0; i < dim / 2; i++) {
        const __m512bh b = (__m512bh)_mm512_loadu_si512(qp + (int64_t)i * MAXR);
        for (int j = 0; j < KT; j++) {
            uint32_t kk;
            memcpy(&kk, k[j] + 2 * i, sizeof kk);
            c[j] = _mm512_dpbf16_ps(c[j], b, (__m512bh)_mm512_set1_epi32((int)kk));
        }
    }
    for (int j = 0; j < KT; j++) _mm512_storeu_ps(st + j * st_row, _mm512_mul_ps(c[j], _mm512_set1_ps(scale)));
}

// O[r0+i][d0 .. d0+16) += sum over key pairs p: (P[2p][r0+i], P[2p+1][r0+i]) . (V[2p][d], V[2p+1][d]).
// pp [pairs][MAXR] and vp [pairs][dim]: both as bf16 pairs. Rows past mr repeat the last, as in pv_tile.
static void pv_tile_bf16(const uint32_t *pp, int mr, const uint32_t *vp, int dim, int d0, int npairs, float *o,
                         int64_t o_row) {
    int row[KT];
    __m512 c[KT];
    for (int i = 0; i < KT; i++) {
        row[i] = i < mr ? i : mr - 1;
        c[i] = _mm512_loadu_ps(o + row[i] * o_row);
    }
    for (int p = 0; p < npairs; p++) {
        const __m512bh b = (__m512bh)_mm512_loadu_si512(vp + (int64_t)p * dim + d0);
        for (int i = 0; i < KT; i++)
            c[i] = _mm512_dpbf16_ps(c[i], b, (__m512bh)_mm512_set1_epi32((int)pp[p * MAXR + row[i]]));
    }
    for (int i = KT - 1; i >= 0; i--) _mm512_storeu_ps(o + row[i] * o_row, c[i]);
}
#endif

#if HAS_AMX && DPBF16
// St[j][r] for keys j < nb (rounded up to 16) and rows r < RP: kb [keys][dim] bf16 (the block's K rows, gathered;
// rows up to the next 16 finite), qp [dim / 2][MAXR] q's bf16 pairs. A tile: 16 K rows by 32 dims; B tile: 16 dim
// pairs by 16 rows. Unscaled, as score_tile_bf16's products before its scale.
static void amx_scores(const uint16_t *kb, const uint32_t *qp, int nb, int RP, int dim, float *st) {
    for (int j0 = 0; j0 < nb; j0 += 16)
        for (int r0 = 0; r0 < RP; r0 += 16) {
            _tile_zero(0);
            for (int c = 0; c < dim / 32; c++) {
                _tile_loadd(1, kb + (int64_t)j0 * dim + c * 32, dim * 2);
                _tile_loadd(2, qp + (int64_t)c * 16 * MAXR + r0, MAXR * 4);
                _tile_dpbf16ps(0, 1, 2);
            }
            _tile_stored(0, st + (int64_t)j0 * MAXR + r0, MAXR * 4);
        }
}

// pa [RP][BN] bf16 = St transposed for keys j < nb (zero up to keys), each row's keys gathered 16 at a time down
// St's column. As a scalar f32_to_bf16 a value it took a third of the time of 8 requests x 9 new tokens over 1,000
// cached (a speculative verify step; 0.82 against 0.55 ms a layer on an AMX Xeon).
// vcvtneps2bf16 rounds as f32_to_bf16 except that it reads float32 subnormals as zero (a probability below 1e-38).
static void p_rows_bf16(const float *st, int nb, int keys, int RP, uint16_t *pa) {
    const __m512i idx = _mm512_mullo_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), _mm512_set1_epi32(MAXR));
    for (int r = 0; r < RP; r++)
        for (int j0 = 0; j0 < keys; j0 += 16) {
            const int n = nb - j0 < 0 ? 0 : nb - j0 > 16 ? 16 : nb - j0;
            const __mmask16 m = (__mmask16)((1u << n) - 1);
            const __m512 v = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), m, idx, st + (int64_t)j0 * MAXR + r, 4);
            _mm256_storeu_si256((__m256i *)(pa + (int64_t)r * BN + j0), (__m256i)_mm512_cvtneps_pbh(v));
        }
}

// O[r][d] += sum over keys j < kp2 * 2: P[r][j] V[j][d], rows r < RP. pa [MAXR][BN] bf16 (P row-major, zero past
// the block's keys), vp [kp2][dim] V rows interleaved in pairs (zero past them), kp2 a multiple of 16. A tile: 16
// rows by 32 keys of P; B tile: 16 key pairs by 16 dims of V; the accumulator is O's 16 x 16 floats, loaded and stored.
static void amx_pv(const uint16_t *pa, const uint32_t *vp, int kp2, int RP, int dim, float *o) {
    for (int r0 = 0; r0 < RP; r0 += 16)
        for (int d0 = 0; d0 < dim; d0 += 16) {
            _tile_loadd(0, o + (int64_t)r0 * dim + d0, dim * 4);
            for (int c = 0; c < kp2 / 16; c++) {
                _tile_loadd(1, pa + (int64_t)r0 * BN + c * 32, BN * 2);
                _tile_loadd(2, vp + (int64_t)c * 16 * dim + d0, dim * 4);
                _tile_dpbf16ps(0, 1, 2);
            }
            _tile_stored(0, o + (int64_t)r0 * dim + d0, dim * 4);
        }
}
#endif

typedef struct {
    const void *q;
    const void *k_cache, *v_cache;
    int kv_kind, kv_bf16, act_bf16;
    int amx;  // the bf16 tiles run on AMX (amx_scores, amx_pv)
    const float *k_scales, *v_scales;  // int8: [rows, num_kv_heads]
    float k_mul, v_mul;                // fp8: the per-tensor scale times 2^8 (e4m3) or 1 (e5m2; dequant_row)
    int num_kv_heads;
    const int32_t *req_to_token, *req_rows, *q_start, *prefix_lens, *extend_lens;
    void *out;
    int num_heads, dim, group, bq;
    int64_t q_tok, q_head, kc_row, vc_row, kc_head, vc_head, r2t_row;
    float scale;
    int window;
    float softcap;
} Args;

typedef struct {
    float *qt;   // [dim][MAXR]: the task's queries, transposed and pre-scaled
    float *st;   // [BN + KT][MAXR]: scores, then probabilities, of one key block (KT spare key rows)
    float *o;    // [MAXR][dim]: output accumulators
    float *kf;   // [BN + KT][dim]: a bf16 or 8-bit block's K rows in float32 (unused for float32 caches);
                 // the DPBF16 path: the block's P as bf16 pairs of keys, [BN / 2][MAXR] uint32
    float *vf;   // [BN][dim]: the same for V; the DPBF16 path: V rows interleaved in pairs, [BN / 2][dim] uint32
} Scratch;

// Head row `off` (in elements) of a bf16 or 8-bit cache as dim floats, the value gather_kv gives in float32:
// bf16 widened; int8 q * mul (the row's scale); fp8 by vec.h's vload_fp8 (the value, times 2^-8 for e4m3; exact, and
// never a float32 subnormal), mul carrying that power of two times the per-tensor scale.
static inline void dequant_row(int kind, const void *cache, int64_t off, float mul, int dim, float *dst) {
    if (kind == KV_BF16) {
        const uint16_t *p = (const uint16_t *)cache + off;
        for (int d = 0; d < dim; d++) dst[d] = bf16_to_f32(p[d]);
    } else if (kind == KV_INT8) {
        const int8_t *p = (const int8_t *)cache + off;
        for (int d = 0; d < dim; d++) dst[d] = (float)p[d] * mul;
    } else {
        const uint8_t *p = (const uint8_t *)cache + off;
        for (int d = 0; d < dim; d += VL) vstore(dst + d, vload_fp8(p + d, kind == KV_FP8_E5M2) * mul);
    }
}

// One task: request b, KV head h, new tokens t0 .. t0 + nt - 1.
static void run_task(const Args *a, Scratch *s, int b, int h, int t0, int nt) {
    const int dim = a->dim, G = a->group, R = nt * G, RP = (R + 15) & ~15;
    const int prefix = a->prefix_lens[b];
    const int32_t *locs = a->req_to_token + (int64_t)a->req_rows[b] * a->r2t_row;
    const int64_t q0 = a->q_start[b] + t0;
    float m[MAXR], l[MAXR], alpha[MAXR];
    int pos[MAXR];  // the last key row r may see
    const int use_dp = DPBF16 && a->kv_bf16 && a->act_bf16;
    uint32_t *qp = (uint32_t *)s->qt;  // use_dp: [dim / 2][MAXR] pairs of q, unscaled (score_tile_bf16 scales)
    for (int r = 0; r < RP; r++) {
        int rr = r < R ? r : R - 1;  // padding rows copy the last real row: finite, never stored
        const int64_t qoff = (q0 + rr / G) * a->q_tok + (int64_t)(h * G + rr % G) * a->q_head;
        if (use_dp) {
            const uint16_t *qr = (const uint16_t *)a->q + qoff;
            for (int i = 0; i < dim / 2; i++) memcpy(qp + i * MAXR + r, qr + 2 * i, sizeof(uint32_t));
        } else if (a->act_bf16) {
            const uint16_t *qr = (const uint16_t *)a->q + qoff;
            for (int d = 0; d < dim; d++) s->qt[d * MAXR + r] = bf16_to_f32(qr[d]) * a->scale;
        } else {
            const float *qr = (const float *)a->q + qoff;
            for (int d = 0; d < dim; d++) s->qt[d * MAXR + r] = qr[d] * a->scale;
        }
        pos[r] = prefix + t0 + rr / G;
        m[r] = -INFINITY;
        l[r] = 0.0f;
    }
    memset(s->o, 0, sizeof(float) * (size_t)RP * dim);
    const int kv_end = prefix + t0 + nt;  // keys past the block's last token are never loaded
    // Keys before the first row's window are never loaded either. Each row's own first key then lies in
    // the first block (it is kv_start + its token index < bq <= TARGET_R < BN), so m is finite from there on.
    const int win = a->window;
    const int kv_start = win > 0 && prefix + t0 + 1 > win ? prefix + t0 + 1 - win : 0;
    const float *kr[BN + KT], *vr[BN];
    for (int n0 = kv_start; n0 < kv_end; n0 += BN) {
        const int nb = kv_end - n0 < BN ? kv_end - n0 : BN;
#if DPBF16
        if (use_dp) {
            const uint16_t *kb[BN + KT];
            uint32_t *vp = (uint32_t *)s->vf;
            const uint16_t *kh = (const uint16_t *)a->k_cache + (int64_t)h * a->kc_head;  // head h of row 0
            const uint16_t *vh = (const uint16_t *)a->v_cache + (int64_t)h * a->vc_head;
            for (int j = 0; j < nb; j++) kb[j] = kh + locs[n0 + j] * a->kc_row;
            for (int j = nb; j < nb + KT; j++) kb[j] = kb[nb - 1];
            for (int p = 0; p < nb / 2; p++) {
                const uint16_t *v0 = vh + locs[n0 + 2 * p] * a->vc_row, *v1 = vh + locs[n0 + 2 * p + 1] * a->vc_row;
                for (int d = 0; d < dim; d++) vp[p * dim + d] = v0[d] | (uint32_t)v1[d] << 16;
            }
            if (nb % 2) {  // an odd block's last pair takes a zero second row
                const uint16_t *v0 = vh + locs[n0 + nb - 1] * a->vc_row;
                for (int d = 0; d < dim; d++) vp[nb / 2 * dim + d] = v0[d];
            }
#if HAS_AMX
            if (a->amx) {
                // K rows gathered (up to the next 16 keys, the last repeated); V pairs zero up to the next 16 pairs.
                uint16_t *kg = (uint16_t *)s->kf;
                const int nb16 = (nb + 15) & ~15, kp2 = ((nb + 31) & ~31) / 2;
                for (int j = 0; j < nb16; j++) memcpy(kg + (int64_t)j * dim, kb[j < nb ? j : nb - 1], dim * 2);
                memset(vp + (int64_t)((nb + 1) / 2) * dim, 0, sizeof(uint32_t) * (kp2 - (nb + 1) / 2) * dim);
                amx_scores(kg, qp, nb, RP, dim, s->st);
                for (int j = 0; j < nb; j++)
                    for (int r = 0; r < RP; r++) s->st[j * MAXR + r] *= a->scale;
            } else
#endif
                for (int j0 = 0; j0 < nb; j0 += KT)
                    for (int r0 = 0; r0 < RP; r0 += 16)
                        score_tile_bf16(kb + j0, qp + r0, dim, a->scale, s->st + j0 * MAXR + r0, MAXR);
        } else
#endif
        {
            for (int j = 0; j < nb; j++) {
                int64_t loc = locs[n0 + j];
                if (a->kv_kind == KV_F32) {
                    kr[j] = (const float *)a->k_cache + loc * a->kc_row + (int64_t)h * a->kc_head;
                    vr[j] = (const float *)a->v_cache + loc * a->vc_row + (int64_t)h * a->vc_head;
                    continue;
                }
                float k_mul = a->k_mul, v_mul = a->v_mul;
                if (a->kv_kind == KV_INT8) {
                    k_mul = a->k_scales[loc * a->num_kv_heads + h];
                    v_mul = a->v_scales[loc * a->num_kv_heads + h];
                }
                dequant_row(a->kv_kind, a->k_cache, loc * a->kc_row + (int64_t)h * a->kc_head, k_mul, dim,
                            s->kf + j * dim);
                dequant_row(a->kv_kind, a->v_cache, loc * a->vc_row + (int64_t)h * a->vc_head, v_mul, dim,
                            s->vf + j * dim);
                kr[j] = s->kf + j * dim;
                vr[j] = s->vf + j * dim;
            }
            for (int j = nb; j < nb + KT; j++) kr[j] = kr[nb - 1];  // spare keys of the last tile
            // 6 keys x 2 vectors of rows where the rows fill them (as pv_tile), 16 rows at a time after.
            int r0 = 0;
            for (; r0 + 2 * VL <= RP; r0 += 2 * VL)
                for (int j0 = 0; j0 < nb; j0 += 6)
                    score_tile(kr + j0, s->qt + r0, MAXR, dim, s->st + j0 * MAXR + r0, MAXR, 6, 2);
            for (; r0 < RP; r0 += 16)
                for (int j0 = 0; j0 < nb; j0 += KT)
                    score_tile(kr + j0, s->qt + r0, MAXR, dim, s->st + j0 * MAXR + r0, MAXR, KT, TV);
        }
        if (a->softcap > 0.0f) {
            const float cap = a->softcap;
            for (int j = 0; j < nb; j++)
                for (int r = 0; r < RP; r++) s->st[j * MAXR + r] = tanhf(s->st[j * MAXR + r] / cap) * cap;
        }
        // Causal mask: only the keys past the block's first token position can be hidden.
        const int masked_from = prefix + t0 + 1 - n0;  // keys j >= this are hidden from some row
        for (int j = masked_from > 0 ? masked_from : 0; j < nb; j++)
            for (int r = 0; r < RP; r++)
                if (n0 + j > pos[r]) s->st[j * MAXR + r] = -INFINITY;
        if (win > 0) {  // window: keys at or before pos - window are hidden; only below the last row's edge
            const int edge = prefix + t0 + nt - win - n0;  // keys j <= edge are hidden from some row
            for (int j = 0; j < nb && j <= edge; j++)
                for (int r = 0; r < RP; r++)
                    if (n0 + j <= pos[r] - win) s->st[j * MAXR + r] = -INFINITY;
        }
        // Online softmax down each row. Key 0 is visible to every row, so m is finite from the
        // first block on; a row whose keys in a later block are all hidden gets P = 0 there.
        float mx[MAXR];
        for (int r = 0; r < RP; r++) mx[r] = m[r];
        for (int j = 0; j < nb; j++)
            for (int r = 0; r < RP; r++) mx[r] = s->st[j * MAXR + r] > mx[r] ? s->st[j * MAXR + r] : mx[r];
        for (int r = 0; r < RP; r++) {
            alpha[r] = exp_neg(m[r] - mx[r]);  // m is -inf on the first block: alpha ~0, O and l are 0
            m[r] = mx[r];
        }
        float sum[MAXR];
        for (int r = 0; r < RP; r++) sum[r] = 0.0f;
        for (int j = 0; j < nb; j++) {
            float *p = s->st + j * MAXR;
            for (int r = 0; r < RP; r++) {
                float x = p[r] - mx[r];
                p[r] = x < -87.0f ? 0.0f : exp_neg(x);  // hidden keys (-inf) give exactly 0
                sum[r] += p[r];
            }
        }
        for (int r = 0; r < RP; r++) {
            l[r] = l[r] * alpha[r] + sum[r];
            if (alpha[r] == 1.0f) continue;  // the row's max held (most blocks past the first few)
            float *orow = s->o + (int64_t)r * dim;
            for (int d = 0; d < dim; d++) orow[d] *= alpha[r];
        }
#if HAS_AMX && DPBF16
        if (a->amx && use_dp) {  // P row-major in bf16 (after the gathered K rows), zero past the block's keys
            uint16_t *pa = (uint16_t *)s->kf + BN * MAX_DIM;
            const int kp2 = ((nb + 31) & ~31) / 2;
            p_rows_bf16(s->st, nb, 2 * kp2, RP, pa);
            amx_pv(pa, (const uint32_t *)s->vf, kp2, RP, dim, s->o);
            continue;
        }
#endif
#if DPBF16
        if (use_dp) {
            uint32_t *pp = (uint32_t *)s->kf;
            const int npairs = (nb + 1) / 2;
            for (int p = 0; p < npairs; p++) {
                const float *p0 = s->st + 2 * p * MAXR, *p1 = p0 + MAXR;
                const int second = 2 * p + 1 < nb;
                for (int r = 0; r < R; r++)
                    pp[p * MAXR + r] = f32_to_bf16(p0[r]) | (second ? (uint32_t)f32_to_bf16(p1[r]) << 16 : 0u);
            }
            for (int r0 = 0; r0 < R; r0 += KT)
                for (int d0 = 0; d0 < dim; d0 += 16)
                    pv_tile_bf16(pp + r0, R - r0 < KT ? R - r0 : KT, (const uint32_t *)s->vf, dim, d0, npairs,
                                 s->o + (int64_t)r0 * dim + d0, dim);
            continue;
        }
#endif
        // 6 rows x 2 vectors: two V loads and six P broadcasts a key for 12 FMAs (a 12 x 1 tile
        // needs 12 broadcasts); a head dim that is not a multiple of 2 vectors ends with 16-wide tiles.
        const int dw = dim - dim % (2 * VL);
        for (int r0 = 0; r0 < R; r0 += 6)
            for (int d0 = 0; d0 < dw; d0 += 2 * VL)
                pv_tile(s->st + r0, MAXR, R - r0 < 6 ? R - r0 : 6, vr, d0, nb, s->o + (int64_t)r0 * dim + d0, dim,
                        6, 2);
        for (int r0 = 0; r0 < R && dw < dim; r0 += KT)
            for (int d0 = dw; d0 < dim; d0 += 16)
                pv_tile(s->st + r0, MAXR, R - r0 < KT ? R - r0 : KT, vr, d0, nb, s->o + (int64_t)r0 * dim + d0, dim,
                        KT, TV);
    }
    for (int r = 0; r < R; r++) {
        float inv = 1.0f / l[r];
        const int64_t off = ((q0 + r / G) * a->num_heads + h * G + r % G) * (int64_t)dim;
        const float *src = s->o + (int64_t)r * dim;
        if (a->act_bf16)
            for (int d = 0; d < dim; d++) ((uint16_t *)a->out)[off + d] = f32_to_bf16(src[d] * inv);
        else
            for (int d = 0; d < dim; d++) ((float *)a->out)[off + d] = src[d] * inv;
    }
}

typedef struct {
    int64_t cost;  // keys its last token sees, minus one
    int32_t b, h, t0;
} Task;

static int by_cost_desc(const void *x, const void *y) {
    int64_t a = ((const Task *)x)->cost, b = ((const Task *)y)->cost;
    return (a < b) - (a > b);
}

// Whether prefill_attention runs bf16 queries over a bf16 cache of this head_dim on AMX tiles here: 1, or 0.
int prefill_attention_amx(int dim) {
#if HAS_AMX && DPBF16
    return dim % 32 == 0 && amx_permitted();
#else
    (void)dim;
    return 0;
#endif
}

// Whether prefill_attention takes these head counts and head_dim: 1, or 0.
int prefill_attention_supported(int num_heads, int num_kv_heads, int dim) {
    return num_kv_heads > 0 && num_heads % num_kv_heads == 0 && dim % 16 == 0 && dim <= MAX_DIM
        && num_heads / num_kv_heads <= MAXR;
}

// Returns 0, or -1 for shapes this kernel does not take (the caller falls back to the reference).
int prefill_attention(const void *q, int64_t q_tok, int64_t q_head, int act_bf16, const void *k_cache,
                      const void *v_cache, int kv_kind, const float *k_scales, const float *v_scales,
                      float k_scale, float v_scale, const int32_t *req_to_token, int64_t r2t_row,
                      const int32_t *req_rows, const int32_t *q_start, const int32_t *prefix_lens,
                      const int32_t *extend_lens, void *out,
                      int batch, int num_heads, int num_kv_heads, int dim, int64_t kc_row, int64_t vc_row,
                      int64_t kc_head, int64_t vc_head, float scale, int window, float softcap, int num_threads) {
    if (!prefill_attention_supported(num_heads, num_kv_heads, dim) || kv_kind < KV_F32 || kv_kind > KV_FP8_E5M2
        || (kv_kind == KV_INT8 && (!k_scales || !v_scales)))
        return -1;
    const int kv_bf16 = kv_kind == KV_BF16;
    // fp8: 2^8 (e4m3) or 1 (e5m2) folded into the scales (dequant_row); a scale so large that the product is not a
    // float is left to the reference.
    const float fp8_pow2 = kv_kind == KV_FP8_E5M2 ? 1.0f : 0x1p8f;
    const float k_mul = k_scale * fp8_pow2, v_mul = v_scale * fp8_pow2;
    if ((kv_kind == KV_FP8_E4M3 || kv_kind == KV_FP8_E5M2) && !(isfinite(k_mul) && isfinite(v_mul))) return -1;
    const int group = num_heads / num_kv_heads;
    int bq = TARGET_R / group;
    if (bq < 1) bq = 1;
    const int amx = kv_bf16 && act_bf16 && prefill_attention_amx(dim);
    Args a = {q, k_cache, v_cache, kv_kind, kv_bf16, act_bf16, amx, k_scales, v_scales, k_mul, v_mul, num_kv_heads,
              req_to_token, req_rows, q_start, prefix_lens, extend_lens, out, num_heads, dim, group, bq, q_tok, q_head,
              kc_row, vc_row, kc_head, vc_head, r2t_row, scale, window, softcap};
    // Tasks, the longest first (the last token block of each request sees the most keys), so the
    // dynamic schedule does not end with one long task on one thread.
    int64_t ntasks = 0;
    for (int b = 0; b < batch; b++) ntasks += (int64_t)((extend_lens[b] + bq - 1) / bq) * num_kv_heads;
    if (ntasks == 0) return 0;
    Task *tasks = malloc(sizeof(Task) * ntasks);
    if (!tasks) return -1;
    int64_t n = 0;
    for (int b = 0; b < batch; b++)
        for (int t0 = 0; t0 < extend_lens[b]; t0 += bq)
            for (int h = 0; h < num_kv_heads; h++, n++)
                tasks[n] = (Task){window > 0 && prefix_lens[b] + t0 > window ? window : (int64_t)prefix_lens[b] + t0,
                                  b, h, t0};
    qsort(tasks, ntasks, sizeof(Task), by_cost_desc);
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        Scratch s;
        s.qt = aligned_alloc(64, sizeof(float) * MAX_DIM * MAXR);
        s.st = aligned_alloc(64, sizeof(float) * (BN + KT) * MAXR);
        s.o = aligned_alloc(64, sizeof(float) * MAXR * MAX_DIM);
        s.kf = aligned_alloc(64, sizeof(float) * (BN + KT) * MAX_DIM);
        s.vf = aligned_alloc(64, sizeof(float) * BN * MAX_DIM);
        int ok = s.qt && s.st && s.o && s.kf && s.vf;
        if (!ok) {
#pragma omp atomic write
            failed = 1;
        }
#if HAS_AMX
        if (amx) amx_configure();
#endif
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < ntasks; i++) {
            if (!ok) continue;
            const Task t = tasks[i];
            const int nt = extend_lens[t.b] - t.t0 < bq ? extend_lens[t.b] - t.t0 : bq;
            run_task(&a, &s, t.b, t.h, t.t0, nt);
        }
#if HAS_AMX
        if (amx) _tile_release();
#endif
        free(s.qt);
        free(s.st);
        free(s.o);
        free(s.kf);
        free(s.vf);
    }
    free(tasks);
    return failed ? -1 : 0;
}
