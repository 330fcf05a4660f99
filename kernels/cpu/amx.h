// AMX tiles (Intel Sapphire Rapids and later): whether a build has them, the process's permission to use them, and
// the tile configurations the kernels here use. Included by linear.c (the bf16 GEMM), prefill_attention.c (bf16) and
// quant_linear_q8.c (int8). HAS_AMX: bf16 tiles (with AVX512-BF16 beside them); HAS_AMX_INT8: int8 tiles (with
// AVX-512 for the float work on their int32 results).
#pragma once

#if defined(__AMX_TILE__) && ((defined(__AMX_BF16__) && defined(__AVX512BF16__)) || \
                              (defined(__AMX_INT8__) && defined(__AVX512F__)))
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>
#if defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define HAS_AMX 1
#else
#define HAS_AMX 0
#endif
#if defined(__AMX_INT8__) && defined(__AVX512F__)
#define HAS_AMX_INT8 1
#else
#define HAS_AMX_INT8 0
#endif

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

// Linux lends a process the tile registers only on request (arch_prctl ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA);
// without it the first tile instruction faults. The request is idempotent; it is refused where a thread's signal
// stack is too small for the tile state, and then the callers keep their other paths.
static inline int amx_permitted(void) {
    static int state;  // 0: not asked yet, 1: granted, -1: refused
    int s = __atomic_load_n(&state, __ATOMIC_ACQUIRE);
    if (!s) {
        s = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0 ? 1 : -1;
        __atomic_store_n(&state, s, __ATOMIC_RELEASE);
    }
    return s > 0;
}

// Tile t: rows[t] rows of colsb[t] bytes. Once per thread before its tile instructions (_tile_release after).
static inline void amx_configure_shapes(const uint8_t rows[8], const uint16_t colsb[8]) {
    TileConfig c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) {
        c.colsb[t] = colsb[t];
        c.rows[t] = rows[t];
    }
    _tile_loadconfig(&c);
}

// Every tile 16 rows of 64 bytes: an A operand 16 rows x 32 bf16, a B operand 16 pairs x 16 columns (each row 16
// bf16 pairs), an accumulator 16 x 16 floats.
static inline void amx_configure(void) {
    static const uint8_t rows[8] = {16, 16, 16, 16, 16, 16, 16, 16};
    static const uint16_t colsb[8] = {64, 64, 64, 64, 64, 64, 64, 64};
    amx_configure_shapes(rows, colsb);
}
#else
#define HAS_AMX 0
#define HAS_AMX_INT8 0
#endif
