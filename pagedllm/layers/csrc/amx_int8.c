/* The integer sums of int8-activation matmuls (small_matmul.c) with Intel AMX tiles, for many
 * activation rows (a batch of decodes, a prefill).
 *
 * With int8 activations a block's products are integer dot products of the weight's codes with a
 * row's codes, summed exactly in int32 whatever computes them; only then does the fp32 epilogue
 * (scales, minimums) run. VNNI's vpdpbusd does 64 multiply-adds per instruction; one AMX
 * TDPBSUD/TDPBSSD does 16 rows x 16 channels x 32 inputs = 8192. The sums are the same integers
 * either way, so small_matmul.c's epilogue over them gives the VNNI path's bits exactly, and the
 * tests compare the two builds bit for bit.
 *
 * A tile product is C[16 x 16 int32] += A[16 x 32 int8] . B, where A holds 16 rows of a block's
 * activation codes (straight from the quantized rows, k bytes apart) and B a block's codes of
 * a panel's 16 channels in the "VNNI" layout (row i: each channel's inputs 4i .. 4i + 3): one
 * relay4 per 4 inputs, as the VNNI path lays them in registers. Q4 codes (0..15) are unsigned
 * (TDPBSUD: signed A, unsigned B), Q8_0 codes signed (TDPBSSD). The scales are per block of 32,
 * so each block's sums are stored (a 1 KB tile) for the epilogue; two blocks are in flight at a
 * time, in two sets of tile registers.
 *
 * Linux hands the tiles' 8 KB register state to a process only once it asks (arch_prctl
 * ARCH_REQ_XCOMP_PERM, once per process; Linux 5.16+); a kernel that refuses leaves the VNNI
 * path in use. Each thread loads its tile configuration before its share and releases the tiles
 * after, so a descheduled thread does not carry their state.
 */
#include <stdatomic.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "kernels.h"

#if AMX_INT8
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

int amx_usable(void) {
    static _Atomic int state = 0; /* 0: not asked yet, 1: granted, -1: refused */
    int granted = atomic_load_explicit(&state, memory_order_acquire);
    if (granted == 0) {
        granted = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 1 : -1;
        atomic_store_explicit(&state, granted, memory_order_release);
    }
    return granted > 0;
}

/* LDTILECFG's 64-byte operand, palette 1. */
typedef struct __attribute__((packed)) {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

/* Tiles 0 and 3: sums C (16 rows x 16 int32); 1 and 4: activations A (16 rows x 32 codes);
 * 2 and 5: a block's codes B (8 rows of 16 channels x 4 inputs). A constant in memory: GCC's
 * _tile_loadconfig does not tell the compiler it reads its operand, and stores into a local
 * configuration were dropped as dead. */
static const TileConfig CONFIG = {
    .palette = 1,
    .colsb = {VW * 4, QBLOCK, VW * 4, VW * 4, QBLOCK, VW * 4},
    .rows = {AMX_ROWS, AMX_ROWS, QBLOCK / 4, AMX_ROWS, AMX_ROWS, QBLOCK / 4},
};

void amx_begin(void) { _tile_loadconfig(&CONFIG); }

void amx_end(void) { _tile_release(); }

void amx_codes(const uint8_t *panel, int64_t nb, int32_t dtype, uint8_t *codes) {
    const int64_t bytes = qblock_bytes(dtype);
    const __m512i low = _mm512_set1_epi8(0x0f);
    for (int64_t b = 0; b < nb; b++) {
        uint8_t *out = codes + b * AMX_CODE_BYTES;
        if (dtype == WEIGHT_Q4) {
            const uint8_t *q = panel + b * bytes + 4 * VW; /* after the fp16 scales and minimums */
            for (int g = 0; g < 4; g++) {                 /* inputs 4g.. in the low nibbles, 16 + 4g.. in the high */
                const __m512i v = relay4(q + g * 64);
                _mm512_storeu_si512(out + g * 64, _mm512_and_si512(v, low));
                _mm512_storeu_si512(out + (4 + g) * 64, _mm512_and_si512(_mm512_srli_epi16(v, 4), low));
            }
        } else {
            const uint8_t *q = panel + b * bytes + 2 * VW; /* after the fp16 scales */
            for (int g = 0; g < 8; g++) _mm512_storeu_si512(out + g * 64, relay4(q + g * 64));
        }
    }
}

/* One block's sums into tile set (C, A, B) = (c, a, b): tile numbers are literals, which the
 * intrinsics (macros) paste into the instruction. */
#define BLOCK_SUMS(c, a, b, q4, x, k, codes, isum) \
    do {                                           \
        _tile_zero(c);                             \
        _tile_loadd(a, x, k);                      \
        _tile_loadd(b, codes, VW * 4);             \
        if (q4)                                    \
            _tile_dpbsud(c, a, b);                 \
        else                                       \
            _tile_dpbssd(c, a, b);                 \
        _tile_stored(c, isum, VW * 4);             \
    } while (0)

void amx_sums(const uint8_t *codes, const int8_t *x, int64_t k, int64_t nb, int32_t dtype, int32_t *isum) {
    const int q4 = dtype == WEIGHT_Q4;
    int64_t b = 0;
    for (; b + 1 < nb; b += 2) {
        BLOCK_SUMS(0, 1, 2, q4, x + b * QBLOCK, k, codes + b * AMX_CODE_BYTES, isum + b * AMX_SUM_INTS);
        BLOCK_SUMS(3, 4, 5, q4, x + (b + 1) * QBLOCK, k, codes + (b + 1) * AMX_CODE_BYTES, isum + (b + 1) * AMX_SUM_INTS);
    }
    if (b < nb) BLOCK_SUMS(0, 1, 2, q4, x + b * QBLOCK, k, codes + b * AMX_CODE_BYTES, isum + b * AMX_SUM_INTS);
}
#else
int amx_usable(void) { return 0; }
#endif
