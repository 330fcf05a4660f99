// AMX tiles (Intel Sapphire Rapids and later): whether a build has them, the process's permission to use them, and
// the one tile configuration the kernels here use. Included by linear.c (the bf16 GEMM) and prefill_attention.c.
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>
#define HAS_AMX 1

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

// Every tile 16 rows of 64 bytes: an A operand 16 rows x 32 bf16, a B operand 16 pairs x 16 columns (each row 16
// bf16 pairs), an accumulator 16 x 16 floats. Once per thread before its tile instructions (_tile_release after).
static inline void amx_configure(void) {
    TileConfig c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) {
        c.colsb[t] = 64;
        c.rows[t] = 16;
    }
    _tile_loadconfig(&c);
}
#else
#define HAS_AMX 0
#endif
