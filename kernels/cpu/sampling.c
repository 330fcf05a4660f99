// Greedy sampling on CPU: each row's argmax and logsumexp, float32.
//
// Why C: torch runs them as two ops (argmax, then logsumexp's max / sub / exp / sum / log), and at
// batch 64 over a 49,152-token vocabulary they took 11.5 ms of a 365 ms decode step. Here each row is
// read from memory once, in blocks that stay in L1: a block's maximum, then its exponentials against
// the running maximum (the running sum rescaled when a block raises it), with the rows split over the
// threads. The argmax is found afterwards inside the one block that first reached the row's maximum.
//
// Shapes: logits [B, V] float32 (or bf16, below), row stride row; ids [B] int64 (the first index of the row's
// maximum, as torch.argmax); lse [B] float32 (log sum exp of the row). Rows with NaN or no finite value
// give a non-finite lse: the caller checks and redoes the batch with torch ops.
// lse NULL: the argmax alone, for a batch that shows no logprob, and rows with NaN or no finite value give id -1.
// SmolLM2's bf16 decode step at batch 64 on the AMX Xeon (scripts/profile_step.py, ~52 ms): 1.45 ms with the
// exponentials, 0.90 ms without (the [64, 49152] logits are read from L3 either way).
// bf16: the logits are bfloat16 (a bf16 model's lm_head output, taken as it is by an argmax-only step rather than
// copied to float32 first), each block widened into an L1 buffer; the same results as on their float32 copy.
#include <math.h>
#include <stdint.h>

#include "fastmath.h"
#include "kernels.h"
#include "vec.h"

#define LANES 16    // independent partial sums: vectorizes without reassociation flags
#define BLOCK 2048  // floats a block: 8 KB, read from L1 by the exponentials after the max

// The maximum of x[0 .. n) (NaN entries ignored), -inf when there is none. Four vector accumulators: a
// vmaxps waits on the previous one into the same register.
static float block_max(const float *x, int64_t n) {
    vf mx[4];
    for (int i = 0; i < 4; i++) mx[i] = vbroadcast(-INFINITY);
    int64_t v = 0;
    for (; v + 4 * VL <= n; v += 4 * VL)
        for (int i = 0; i < 4; i++) mx[i] = vmax(vload(x + v + i * VL), mx[i]);
    float m = -INFINITY;
    for (int i = 0; i < 4; i++)
        for (int j = 0; j < VL; j++) m = mx[i][j] > m ? mx[i][j] : m;
    for (; v < n; v++) m = x[v] > m ? x[v] : m;
    return m;
}

// sum of exp(x[i] - m) over x[0 .. n), terms below exp(-87) dropped; NaN in x gives NaN.
static float block_sum_exp(const float *x, int64_t n, float m) {
    float part[LANES] = {0};
    int64_t v = 0;
    for (; v + LANES <= n; v += LANES)
        for (int i = 0; i < LANES; i++) {
            float d = x[v + i] - m;
            part[i] += exp_neg(d) * (d >= -87.0f);
        }
    float sum = 0.0f;
    for (; v < n; v++) {
        float d = x[v] - m;
        sum += d < -87.0f ? 0.0f : exp_in_range(d);
    }
    for (int i = 0; i < LANES; i++) sum += part[i];
    return sum;
}

// Whether x[0 .. n) holds a NaN: one compare a vector.
static int block_has_nan(const float *x, int64_t n) {
    vu bad = (vu){0};
    int64_t v = 0;
    for (; v + VL <= n; v += VL) {
        const vf xv = vload(x + v);
        bad |= (vu)(xv != xv);
    }
    int nan = 0;
    for (int j = 0; j < VL; j++) nan |= bad[j] != 0;
    for (; v < n; v++) nan |= x[v] != x[v];
    return nan;
}

// Block [b0, b0 + n) of a logits row as floats: in place for float32, else widened into buf.
static const float *row_block(const void *x, int64_t b0, int64_t n, int bf16, float *buf) {
    if (!bf16) return (const float *)x + b0;
    const uint16_t *src = (const uint16_t *)x + b0;
    for (int64_t v = 0; v < n; v++) buf[v] = bf16_to_f32(src[v]);
    return buf;
}

void argmax_logsumexp(const void *logits, int64_t row, int64_t rows, int64_t vocab, int64_t *ids, float *lse,
                      int bf16, int num_threads) {
    #pragma omp parallel for schedule(static) num_threads(num_threads) if (rows * vocab >= 65536)
    for (int64_t r = 0; r < rows; r++) {
        const void *x = (const char *)logits + r * row * (bf16 ? 2 : 4);
        float buf[BLOCK] __attribute__((aligned(64)));
        float m = -INFINITY, sum = 0.0f;
        int64_t best = 0;  // start of the first block holding the maximum
        int nan = 0;
        for (int64_t b0 = 0; b0 < vocab; b0 += BLOCK) {
            const int64_t n = vocab - b0 < BLOCK ? vocab - b0 : BLOCK;
            const float *xb = row_block(x, b0, n, bf16, buf);
            const float bm = block_max(xb, n);
            if (bm > m) {
                sum *= exp_neg(m - bm);  // m = -inf (nothing finite yet): sum is 0 and stays 0
                m = bm;
                best = b0;
            }
            if (!lse || m == -INFINITY) {  // no sum asked for, or every exponential so far is 0: only a NaN counts
                nan |= block_has_nan(xb, n);
                continue;
            }
            sum += block_sum_exp(xb, n, m);  // NaN in the block makes the sum NaN
        }
        int64_t arg = 0;  // as torch.argmax of an all -inf row (the caller redoes it anyway)
        if (m != -INFINITY) {  // the first maximum: in the first block that reached it
            const float *xb = row_block(x, best, vocab - best < BLOCK ? vocab - best : BLOCK, bf16, buf);
            while (!(xb[arg] == m)) arg++;
            arg += best;
        }
        ids[r] = arg;
        if (lse)
            lse[r] = nan ? NAN : m + logf(sum);
        else if (nan || m == -INFINITY)
            ids[r] = -1;
    }
}

// Approximate logits made exact where they can hold a row's maximum (kernels/argmax_head.py). approx [rows, vocab]
// float32 (row stride row): x [rows, k] . w[vocab, k]^T from bf16-rounded operands, each entry within
// e(b, v) = c |x_b|_2 norm[v] of the float32 dot (the caller's bound: c, and norm[v] >= |w_v|_2). Row b's candidates
// are the v with approx[b, v] + e(b, v) >= max over u of (approx[b, u] - e(b, u)): the exact maximum is among them,
// since its exact logit is at least that lower bound. Each candidate's entry is overwritten with the float32 dot of
// x_b and the row-major w_v, up to `cap` of them a row; count[b] gets their number, which may exceed cap (the caller
// then computes that row whole). NaN entries are never candidates.
void exact_near_max(float *approx, int64_t row, int64_t rows, int64_t vocab, const float *x, int64_t x_row, int64_t k,
                    const float *w, const float *norm, float c, int cap, int32_t *count, int num_threads) {
    #pragma omp parallel for schedule(static) num_threads(num_threads) if (rows * vocab >= 65536)
    for (int64_t b = 0; b < rows; b++) {
        float *a = approx + b * row;
        const float *xb = x + b * x_row;
        double sq = 0.0;
        for (int64_t i = 0; i < k; i++) sq += (double)xb[i] * xb[i];
        // Rounded up, and the flushes of vdpbf16ps (denormal inputs and sums to zero) add under 1e-33 to any
        // entry's error.
        const float r = (float)(c * sqrt(sq) * (1.0 + 1e-6)), tiny = 1e-30f;
        const vf rv = vbroadcast(r), tv = vbroadcast(tiny);
        vf mx[2] = {vbroadcast(-INFINITY), vbroadcast(-INFINITY)};
        int64_t v = 0;
        for (; v + 2 * VL <= vocab; v += 2 * VL)
            for (int i = 0; i < 2; i++)
                mx[i] = vmax(vload(a + v + i * VL) - (rv * vload(norm + v + i * VL) + tv), mx[i]);
        float m = vhmax(vmax(mx[0], mx[1]));
        for (; v < vocab; v++) {
            const float lo = a[v] - (r * norm[v] + tiny);
            m = lo > m ? lo : m;
        }
        int32_t n = 0;
        const vf mv = vbroadcast(m), one = vbroadcast(1.0f);
        for (v = 0; v < vocab; v += VL) {
            if (v + VL <= vocab) {
                // 1.0 in the lanes at or above m (a comparison, so a NaN lane is 0, never hiding another lane).
                const vf hit = (vf)((vu)(vload(a + v) + (rv * vload(norm + v) + tv) >= mv) & (vu)one);
                if (vhmax(hit) == 0.0f) continue;  // the usual case: no candidate in this vector
            }
            const int64_t end = v + VL < vocab ? v + VL : vocab;
            for (int64_t j = v; j < end; j++) {
                if (!(a[j] + (r * norm[j] + tiny) >= m)) continue;
                if (++n > cap) continue;
                const float *wj = w + j * k;
                float part[LANES] = {0};
                int64_t i = 0;
                for (; i + LANES <= k; i += LANES)
                    for (int l = 0; l < LANES; l++) part[l] += xb[i + l] * wj[i + l];
                float dot = 0.0f;
                for (; i < k; i++) dot += xb[i] * wj[i];
                for (int l = 0; l < LANES; l++) dot += part[l];
                a[j] = dot;  // tested already: the test above read the approximation
            }
        }
        count[b] = n;
    }
}
