// Shared by the C kernels' AVX2 register tiles (linear.c, prefill_attention.c).
#pragma once

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

// One row of a 6 x 16 tile at one k: broadcast the row's A element, two FMAs with the two halves of
// B's 16 columns into the row's two accumulators.
#define TILE_ROW_FMA(a_ptr, b0, b1, c0, c1)                \
    do {                                                   \
        __m256 a_ = _mm256_broadcast_ss(a_ptr);            \
        (c0) = _mm256_fmadd_ps(a_, (b0), (c0));            \
        (c1) = _mm256_fmadd_ps(a_, (b1), (c1));            \
    } while (0)
#endif
