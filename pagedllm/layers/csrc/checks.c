/* The kernels' boundary checks: why the last call was refused, and the checks several kernels
 * share.
 *
 * Why at the boundary: the kernels index the KV pool, the rotary tables, the embedding and their
 * own scratch space with numbers the engine computes (block ids, slots, positions, token ids,
 * logit rows). One wrong number there once meant a write past a malloc'd buffer and a process
 * killed by glibc minutes later, far from the cause (issue 28: a step with 1 row and 8 logit
 * rows). Each exported kernel now checks every such number against the capacity its caller
 * passed and returns KERNEL_REFUSED with a message; the Python wrapper raises it
 * (layers/kernels.py `check_status`). The checks cost a pass over a step's few integers.
 */
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>

#include "kernels.h"

static _Thread_local char last_error[256];

int refuse(const char *fmt, ...) {
    va_list args;
    va_start(args, fmt);
    vsnprintf(last_error, sizeof last_error, fmt, args);
    va_end(args);
    return KERNEL_REFUSED;
}

const char *kernel_last_error(void) { return last_error; }

int check_matrix(const Matrix *w, const char *name) {
    REQUIRE(w->panels != NULL && w->n > 0 && w->k > 0 && w->num_panels > 0, "%s: an empty or missing matrix", name);
    REQUIRE(w->dtype == WEIGHT_F32 || w->dtype == WEIGHT_I8 || w->dtype == WEIGHT_Q8_0 || w->dtype == WEIGHT_Q4,
            "%s: unknown weight dtype %d", name, w->dtype);
    /* a block-quantized panel holds k / 32 whole blocks (their fp16 scales, and Q4's minimums,
     * inside the panel's bytes): a k that is not a multiple would leave inputs out */
    REQUIRE(!(w->dtype == WEIGHT_Q8_0 || w->dtype == WEIGHT_Q4) || w->k % QBLOCK == 0,
            "%s: a block-quantized matrix of %lld inputs, not a multiple of %d", name, (long long)w->k, QBLOCK);
    REQUIRE(w->num_panels <= INT64_MAX / VW && w->n <= w->num_panels * VW, "%s: %lld channels do not fit %lld panels of %d",
            name, (long long)w->n, (long long)w->num_panels, VW);
    /* panel_bytes per kind: k * VW * 4 (fp32), k * VW (int8), k / 32 blocks of 34 VW (Q8_0: fp16
     * scales, int8 values) or 20 VW (Q4: fp16 scales and minimums, nibbles) bytes */
    REQUIRE(w->k <= INT64_MAX / (VW * (int64_t)sizeof(float)) && w->num_panels <= INT64_MAX / panel_bytes(w),
            "%s: %lld panels of %lld inputs overflow a byte count", name, (long long)w->num_panels, (long long)w->k);
    REQUIRE(matrix_bytes(w) <= w->panel_capacity, "%s: %lld panels of %d lanes (dtype %d) need %lld bytes, %lld were allocated",
            name, (long long)w->num_panels, VW, w->dtype, (long long)matrix_bytes(w), (long long)w->panel_capacity);
    REQUIRE(w->dtype != WEIGHT_I8 || w->scale != NULL, "%s: an int8 matrix without scales", name);
    REQUIRE(w->int8_activations == 0 || (w->int8_activations == 1 && (w->dtype == WEIGHT_Q8_0 || w->dtype == WEIGHT_Q4)),
            "%s: int8_activations %d on a matrix of dtype %d (1 only for Q8_0 and Q4)", name, w->int8_activations, w->dtype);
    /* block-quantized panels carry their scales inside (no scale array is read for them) */
    REQUIRE((w->scale == NULL && w->bias == NULL) || w->num_panels * VW <= w->lane_capacity,
            "%s: scales/biases of %lld lanes, %lld needed", name, (long long)w->lane_capacity, (long long)(w->num_panels * VW));
    return KERNEL_OK;
}

int check_table(const int64_t *table, int64_t max_blocks, int64_t len, int64_t block_size, int64_t num_blocks,
                const char *what, int64_t which) {
    REQUIRE(block_size > 0, "%s: block size %lld", what, (long long)block_size);
    const int64_t used = (len + block_size - 1) / block_size;
    REQUIRE(len >= 0 && used <= max_blocks, "%s %lld: %lld positions need %lld blocks, its table has %lld", what, (long long)which,
            (long long)len, (long long)used, (long long)max_blocks);
    for (int64_t b = 0; b < used; b++)
        REQUIRE(table[b] >= 0 && table[b] < num_blocks, "%s %lld: block %lld of its table is %lld, the pool has %lld", what,
                (long long)which, (long long)b, (long long)table[b], (long long)num_blocks);
    return KERNEL_OK;
}
