/* Matmuls for a few activation rows (decode: M <= 16), where every weight byte is used M times
 * and the time is the time to read the weights: the kernel's job is to stream them at the memory
 * system's full speed and keep the arithmetic out of the way.
 *
 * Weights are packed once (see Matrix in kernels.h): panels of VW output channels, k-major, so a
 * thread's share of a matrix is one contiguous run of memory read front to back — the pattern
 * the hardware prefetchers follow best — and each vector load brings VW channels of one input.
 * For each input k the panel's vector is multiplied by x[m][k] (a broadcast) into row m's
 * accumulator; no horizontal sums, and the result is a vector of VW outputs.
 *
 * Rows are taken MB at a time (a panel is then re-read from L1/L2, not from memory). Each row has
 * two accumulators (even and odd k), so a single row has two independent FMA chains; the
 * summation order of a row is fixed — k in order, split even/odd, added at the end — whatever M
 * and MB are, so a row's result does not depend on the rest of the batch, nor on the vector width.
 *
 * Panel pairs. When the weights stay in the cache between steps (a small model: speculative
 * verification of a few rows is then not bound by memory but by the core), the one-panel loop
 * is bound by loads: for each k it loads the weight vector and then x[r][k] once per row (a
 * broadcast, often folded into the FMA), 1 + M loads for M FMAs. dot2() computes two panels in
 * one pass, loading each x[r][k] into a register once for both panels' FMAs: 2 + M loads per 2M
 * FMAs. Each panel keeps its own even/odd accumulators and gets the same FMAs in the same order as
 * in dot(), so a row's bits do not change with the pairing, with how many panels a thread's share
 * holds (an odd last panel goes through dot()), nor with the row count that chose the path; the
 * tests compare every row count against single rows and the AVX2 build against AVX-512. Weights
 * that do not fit in the cache are never paired: streamed from memory, two panels' interleaved
 * streams read far slower than one. Which row counts pair is per instruction set (below).
 *
 * int8 panels (weight-only quantization, per-channel symmetric scales) are widened to floats in
 * registers (vpmovsxbd + vcvtdq2ps) and multiplied by the fp32 activations exactly like the fp32
 * path; the channel's scale is applied once to the finished sum. Activations stay fp32.
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>

#include "kernels.h"

const char *kernel_isa(void) {
#if defined(__AVX512F__)
    return "avx512";
#elif defined(__AVX2__)
    return "avx2";
#else
    return "generic";
#endif
}

int64_t panel_width(void) { return VW; }

int64_t matrix_bytes(const Matrix *w) { return w->num_panels * panel_bytes(w); }

/* The size of the last-level cache as Linux describes it to this CPU (sysfs), 4 MB where it does
 * not. Not sysconf(_SC_LEVEL3_CACHE_SIZE): glibc takes it from cpuid, which in a VM can report
 * the L3 of the host's every core complex, many times what this CPU shares. */
static int64_t last_level_cache(void) {
    int64_t size = 4 << 20;
    int best_level = 0;
    for (int i = 0; i < 8; i++) {
        char path[96];
        int level = 0;
        long kb = 0;
        snprintf(path, sizeof path, "/sys/devices/system/cpu/cpu0/cache/index%d/level", i);
        FILE *f = fopen(path, "r");
        if (f == NULL) break;
        const int got_level = fscanf(f, "%d", &level) == 1;
        fclose(f);
        snprintf(path, sizeof path, "/sys/devices/system/cpu/cpu0/cache/index%d/size", i);
        if (!got_level || (f = fopen(path, "r")) == NULL) continue;
        if (fscanf(f, "%ldK", &kb) == 1 && level > best_level && kb > 0) {
            best_level = level;
            size = (int64_t)kb << 10;
        }
        fclose(f);
    }
    return size;
}

/* Whether `bytes` of weights stay in the last-level cache from one pass to the next: at most half
 * of it (the rest is left to activations, the KV and whatever else runs). */
int fits_in_cache(int64_t bytes) {
    static _Atomic int64_t llc = 0;
    int64_t size = atomic_load_explicit(&llc, memory_order_relaxed);
    if (size == 0) atomic_store_explicit(&llc, size = last_level_cache(), memory_order_relaxed);
    return bytes <= size / 2;
}

/* Software prefetch of streamed weights: how many bytes ahead of the read, and the locality
 * hint. Set per CPU vendor at build time (kernels.py, STREAM_HINTS), because the best hint is
 * not the same on both: on the AMD EPYCs these kernels were first tuned on, a non-temporal
 * prefetch 1 KB ahead streamed as fast as any other choice; on an Intel Xeon it starved the
 * stream (a non-temporal prefetch fills L1 alone and leaves the L2 streamer untrained): the
 * fused Q4 decode step took 8.0 ms there and 3.2 ms with a prefetch into L2 4 KB ahead
 * (docs/engine.md, "Prefetch hints"). A prefetch past the end of a matrix is harmless (a
 * prefetch never faults). */
#ifndef STREAM_AHEAD_BYTES
#define STREAM_AHEAD_BYTES 1024
#endif
#ifndef STREAM_LOCALITY
#define STREAM_LOCALITY 0
#endif

/* Panel pairs (dot2) take PAIR_MIN..PAIR_ROWS rows, in passes of at most MB2 rows (4 x MB2
 * accumulators, plus the 4 weight vectors and the broadcasts, in the register file). With AVX-512
 * a single row is left to dot(): its weights arrive from the cache no faster for the pairing, and
 * two streams instead of one slowed it; nor are 7-16 rows paired, which gained nothing. With AVX2
 * (16 registers, two rows a pass) every row count gained. */
#if defined(__AVX512F__)
#define MB2 6
#define PAIR_MIN 2
#define PAIR_ROWS 6
#else
#define MB2 2
#define PAIR_MIN 1
#define PAIR_ROWS 16
#endif

/* Input k's VW weights of a panel as floats: fp32 as stored, int8 widened in registers. */
static inline __attribute__((always_inline)) vf panel_weights(const void *w, int64_t k, const int i8) {
    return i8 ? loadv_i8((const int8_t *)w + k * VW) : loadv((const float *)w + k * VW);
}

/* out[r] = sum over k of W_panel[k] * x[r][k], rows r < mb; mb and i8 are constants after
 * inlining. The prefetch runs the same number of bytes ahead for both widths. */
static inline __attribute__((always_inline)) void dot(const void *w, const int i8, const float *x, int64_t ldx, int64_t K,
                                                      const int mb, vf *out) {
    const int64_t bytes_per_k = i8 ? VW : VW * (int64_t)sizeof(float), ahead_k = STREAM_AHEAD_BYTES / bytes_per_k;
    vf even[MB], odd[MB];
#pragma GCC unroll 8
    for (int r = 0; r < mb; r++) even[r] = odd[r] = (vf){0};
    int64_t k = 0;
    for (; k + 1 < K; k += 2) {
        if (STREAM_AHEAD_BYTES > 0) __builtin_prefetch((const char *)w + (k + ahead_k) * bytes_per_k, 0, STREAM_LOCALITY);
        const vf w0 = panel_weights(w, k, i8), w1 = panel_weights(w, k + 1, i8);
#pragma GCC unroll 8
        for (int r = 0; r < mb; r++) {
            even[r] += w0 * x[r * ldx + k];
            odd[r] += w1 * x[r * ldx + k + 1];
        }
    }
    if (k < K) {
        const vf w0 = panel_weights(w, k, i8);
#pragma GCC unroll 8
        for (int r = 0; r < mb; r++) even[r] += w0 * x[r * ldx + k];
    }
#pragma GCC unroll 8
    for (int r = 0; r < mb; r++) out[r] = even[r] + odd[r];
}

/* out_a[r], out_b[r] for two panels a and b of the same matrix, rows r < mb: dot() of each, with
 * the same accumulators and the same order of operations, interleaved so that x[r][k] is loaded
 * into a register once and used for both panels' FMAs. The empty asms keep the weights and the
 * broadcasts in registers: without them the compiler folds one or the other back into every FMA
 * as a memory operand, which is the load per FMA this is meant to save. */
static inline __attribute__((always_inline)) void dot2(const void *wa, const void *wb, const int i8, const float *x, int64_t ldx,
                                                       int64_t K, const int mb, vf *out_a, vf *out_b) {
    vf even_a[MB2], odd_a[MB2], even_b[MB2], odd_b[MB2];
#pragma GCC unroll 8
    for (int r = 0; r < mb; r++) even_a[r] = odd_a[r] = even_b[r] = odd_b[r] = (vf){0};
    int64_t k = 0;
    for (; k + 1 < K; k += 2) {
        vf a0 = panel_weights(wa, k, i8), a1 = panel_weights(wa, k + 1, i8);
        vf b0 = panel_weights(wb, k, i8), b1 = panel_weights(wb, k + 1, i8);
        __asm__("" : "+v"(a0), "+v"(a1), "+v"(b0), "+v"(b1));
#pragma GCC unroll 8
        for (int r = 0; r < mb; r++) {
            vf x0 = (vf){0} + x[r * ldx + k], x1 = (vf){0} + x[r * ldx + k + 1];
            __asm__("" : "+v"(x0), "+v"(x1));
            even_a[r] += a0 * x0;
            even_b[r] += b0 * x0;
            odd_a[r] += a1 * x1;
            odd_b[r] += b1 * x1;
        }
    }
    if (k < K) {
        const vf a0 = panel_weights(wa, k, i8), b0 = panel_weights(wb, k, i8);
#pragma GCC unroll 8
        for (int r = 0; r < mb; r++) {
            vf x0 = (vf){0} + x[r * ldx + k];
            __asm__("" : "+v"(x0));
            even_a[r] += a0 * x0;
            even_b[r] += b0 * x0;
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < mb; r++) {
        out_a[r] = even_a[r] + odd_a[r];
        out_b[r] = even_b[r] + odd_b[r];
    }
}

/* Block-quantized panels (kernels.h): each block's weights are dequantized in registers, exactly
 * (d q and d q + m are exact in fp32, the latter one fused multiply-add), and multiplied into the
 * rows as dot() does (an empty asm keeps the compiler, free to reassociate under -ffast-math,
 * from folding the scale into the activations differently for different row counts): two accumulators a row (Q8_0: even and odd inputs; Q4: a block's first and
 * second 16 inputs, one nibble each), so a row's result does not depend on the batch either.
 * The prefetch runs STREAM_AHEAD_BYTES ahead. */
static inline __attribute__((always_inline)) void prefetch_block(const uint8_t *blk, int64_t bytes) {
    if (STREAM_AHEAD_BYTES > 0)
        for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(blk + STREAM_AHEAD_BYTES + i, 0, STREAM_LOCALITY);
}

static inline __attribute__((always_inline)) void dot_q8(const uint8_t *panel, const float *x, int64_t ldx, int64_t K,
                                                         const int mb, vf *out) {
    const int64_t bytes = qblock_bytes(WEIGHT_Q8_0);
    vf even[MB], odd[MB];
#pragma GCC unroll 8
    for (int r = 0; r < mb; r++) even[r] = odd[r] = (vf){0};
    for (int64_t b = 0; b < K / QBLOCK; b++) {
        const uint8_t *blk = panel + b * bytes;
        prefetch_block(blk, bytes);
        const vf d = loadv_f16((const uint16_t *)blk);
        const int8_t *q = (const int8_t *)(blk + 2 * VW);
        const float *xb = x + b * QBLOCK;
        for (int j = 0; j < QBLOCK; j += 2) {
            vf w0 = loadv_i8(q + j * VW) * d, w1 = loadv_i8(q + (j + 1) * VW) * d;
            __asm__("" : "+v"(w0), "+v"(w1)); /* the weights as values: no reassociation with x (-ffast-math) */
#pragma GCC unroll 8
            for (int r = 0; r < mb; r++) {
                even[r] += w0 * xb[r * ldx + j];
                odd[r] += w1 * xb[r * ldx + j + 1];
            }
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < mb; r++) out[r] = even[r] + odd[r];
}

static inline __attribute__((always_inline)) void dot_q4(const uint8_t *panel, const float *x, int64_t ldx, int64_t K,
                                                         const int mb, vf *out) {
    const int64_t bytes = qblock_bytes(WEIGHT_Q4);
    const vi low = (vi){0} + 15;
    vf first[MB], second[MB];
#pragma GCC unroll 8
    for (int r = 0; r < mb; r++) first[r] = second[r] = (vf){0};
    for (int64_t b = 0; b < K / QBLOCK; b++) {
        const uint8_t *blk = panel + b * bytes;
        prefetch_block(blk, bytes);
        const vf d = loadv_f16((const uint16_t *)blk), m = loadv_f16((const uint16_t *)blk + VW);
        const uint8_t *q = blk + 4 * VW;
        const float *xb = x + b * QBLOCK;
        for (int j = 0; j < QBLOCK / 2; j++) {
            const vi nibbles = loadv_u8(q + j * VW);
            vf w0 = int_to_float(nibbles & low) * d + m, w1 = int_to_float(nibbles >> 4) * d + m;
            __asm__("" : "+v"(w0), "+v"(w1));
#pragma GCC unroll 8
            for (int r = 0; r < mb; r++) {
                first[r] += w0 * xb[r * ldx + j];
                second[r] += w1 * xb[r * ldx + j + QBLOCK / 2];
            }
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < mb; r++) out[r] = first[r] + second[r];
}

/* int8 activations (Matrix.int8_activations, llama.cpp's way): each row's activations are
 * quantized once per matmul to int8 per block of 32 (quantize_rows), and a block's products are
 * integer dot products of the weight's codes (Q4: nibbles 0..15; Q8_0: int8) with the row's
 * codes, exact in int32 whatever the instructions: a block's integer sums are the same on every
 * build. The fp32 epilogue per block and row, in a fixed order (fmav, so no contraction or
 * reassociation differs between builds or row counts):
 *   Q4:   first  = fma(d_w * d_x, float(isum), first);  second = fma(m_w, s_x, second)
 *         out    = first + second                           (s_x = d_x * sum(xq))
 *   Q8_0: acc    = fma(d_w * d_x, float(isum), acc)
 * The integer sums, per instruction set:
 *   AVX-512 VNNI + VBMI: 64 bytes of panel (4 inputs x 16 channels, input-major) are re-laid by
 *     one vpermb so each 32-bit lane holds one channel's 4 inputs, then vpdpbusd (u8 x s8) with
 *     the row's 4 codes broadcast. Q8_0's signed codes are made unsigned (xor 0x80 = q + 128) and
 *     128 * sum(xq) is subtracted at the block's end.
 *   AVX2: 32 bytes (4 inputs x 8 channels) re-laid by vpermd + vpshufb, then vpmaddubsw: Q4
 *     accumulates 16-bit pair sums over the block (8 of at most 2 * 15 * 127 each: no overflow)
 *     and widens them once (vpmaddwd by 1); Q8_0 multiplies |q| by xq with q's sign (pairs at
 *     most 2 * 128 * 127: no saturation) and widens every group.
 *   Otherwise (AVX-512 without VNNI/VBMI, no AVX2): plain loops. */
static inline vf fmav(vf a, vf b, vf c) {
#if defined(__AVX512F__)
    return (vf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__AVX2__) && defined(__FMA__)
    return (vf)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
    vf r;
    for (int i = 0; i < VW; i++) r[i] = __builtin_fmaf(a[i], b[i], c[i]);
    return r;
#endif
}

/* VW floats rounded to the nearest integer, ties to even (the default MXCSR mode). */
static inline vi round_to_int(vf v) {
#if defined(__AVX512F__)
    return (vi)_mm512_cvtps_epi32((__m512)v);
#elif defined(__AVX2__)
    return (vi)_mm256_cvtps_epi32((__m256)v);
#else
    vi r;
    for (int i = 0; i < VW; i++) r[i] = (int32_t)__builtin_rintf(v[i]);
    return r;
#endif
}

void quantize_rows(const float *x, int64_t m, int64_t ldx, const QRows *xq) {
    const int64_t k = xq->k, nb = k / QBLOCK;
    const vi magnitude = (vi){0} + 0x7fffffff;
    for (int64_t r = 0; r < m; r++) {
        for (int64_t b = 0; b < nb; b++) {
            const float *xb = x + r * ldx + b * QBLOCK;
            vi mx = (vi){0};
            for (int i = 0; i < QBLOCK; i += VW) {
                const vi a = (vi)loadv(xb + i) & magnitude; /* |x| as bits: ordered as the floats are */
                const vi greater = mx > a;
                mx = (mx & greater) | (a & ~greater);
            }
#if defined(__AVX512F__)
            int32_t bits = _mm512_reduce_max_epi32((__m512i)mx);
#else
            int32_t bits = 0;
            for (int i = 0; i < VW; i++) bits = mx[i] > bits ? mx[i] : bits;
#endif
            float amax;
            memcpy(&amax, &bits, sizeof amax);
            float inv = amax > 0.0f ? 1.0f / amax : 0.0f;
            __asm__("" : "+x"(inv)); /* 127 * (1 / amax), not folded into 127 / amax */
            const float id = 127.0f * inv;
            int8_t *q = xq->q + r * k + b * QBLOCK;
            vi total = (vi){0};
            for (int i = 0; i < QBLOCK; i += VW) {
                const vi qi = round_to_int(loadv(xb + i) * id);
                total += qi;
#if defined(__AVX512F__)
                _mm_storeu_si128((__m128i *)(q + i), _mm512_cvtepi32_epi8((__m512i)qi)); /* |qi| <= 127 */
#else
                for (int j = 0; j < VW; j++) q[i + j] = (int8_t)qi[j];
#endif
            }
#if defined(__AVX512F__)
            const int32_t sum = _mm512_reduce_add_epi32((__m512i)total);
#else
            int32_t sum = 0;
            for (int i = 0; i < VW; i++) sum += total[i];
#endif
            const float d = amax * (1.0f / 127.0f);
            xq->d[r * nb + b] = d;
            xq->sum[r * nb + b] = sum;
            xq->s[r * nb + b] = d * (float)sum;
        }
    }
}

/* Rows per pass over a panel with int8 activations: MB, except with AVX2, whose int8 loops need
 * only a row's running sum in a register (its fp32 sums wait in the stack between blocks: see
 * pin), so 8 rows share one unpacking of a block's nibbles instead of two passes of 4 (Q4 x int8
 * in cache 145 -> 157 GOP/s a thread on a Zen 3). */
#if defined(__AVX2__) && !defined(__AVX512F__)
#define MB_I8 8
#else
#define MB_I8 MB
#endif

/* The integer sums of one block for rows r < mb: isum[r][c] = sum over the block's inputs i of
 * code(c, i) * xq[r][i]; q: the block's codes (Q4: 16 bytes a channel; Q8_0: 32), x: row 0's
 * codes of this block, rows k apart. */
#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512VBMI__)
#define INT8_DOT "avx512-vnni"
static inline __m512i bcast4(const int8_t *x) {
    int32_t v;
    memcpy(&v, x, sizeof v);
    return _mm512_set1_epi32(v);
}
static inline __attribute__((always_inline)) void q4_isums(const uint8_t *q, const int8_t *x, int64_t k, const int mb, vi *isum) {
    const __m512i low = _mm512_set1_epi8(0x0f);
    __m512i acc[MB];
#pragma GCC unroll 8
    for (int r = 0; r < mb; r++) acc[r] = _mm512_setzero_si512();
    for (int g = 0; g < 4; g++) {
        const __m512i v = relay4(q + g * 64);
        const __m512i lo = _mm512_and_si512(v, low), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
#pragma GCC unroll 8
        for (int r = 0; r < mb; r++) {
            acc[r] = _mm512_dpbusd_epi32(acc[r], lo, bcast4(x + r * k + 4 * g));
            acc[r] = _mm512_dpbusd_epi32(acc[r], hi, bcast4(x + r * k + 16 + 4 * g));
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < mb; r++) isum[r] = (vi)acc[r];
}
static inline __attribute__((always_inline)) void q8_isums(const uint8_t *q, const int8_t *x, int64_t k, const int32_t *sums,
                                                           int64_t nb, const int mb, vi *isum) {
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    __m512i acc[MB];
#pragma GCC unroll 8
    for (int r = 0; r < mb; r++) acc[r] = _mm512_setzero_si512();
    for (int g = 0; g < 8; g++) {
        const __m512i v = _mm512_xor_si512(relay4(q + g * 64), flip); /* q + 128, unsigned */
#pragma GCC unroll 8
        for (int r = 0; r < mb; r++) acc[r] = _mm512_dpbusd_epi32(acc[r], v, bcast4(x + r * k + 4 * g));
    }
#pragma GCC unroll 8
    for (int r = 0; r < mb; r++) isum[r] = (vi)_mm512_sub_epi32(acc[r], _mm512_set1_epi32(128 * sums[r * nb]));
}
#elif defined(__AVX2__) && !defined(__AVX512F__)
#define INT8_DOT "avx2"
/* Byte 4c + j of the result is byte 8 j + c of the 32 loaded: channel c's 4 inputs in lane c. */
static inline __m256i relay4(const uint8_t *p) {
    const __m256i v = _mm256_permutevar8x32_epi32(_mm256_loadu_si256((const __m256i *)p), _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7));
    return _mm256_shuffle_epi8(v, _mm256_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15, 0, 4, 8, 12, 1, 5, 9, 13, 2,
                                                   6, 10, 14, 3, 7, 11, 15));
}
/* Keeps a row's running sum in a register at this point of the block. Without it GCC reassociates
 * the block's adds (integer adds: any order is exact) into one sum at the block's end, so every
 * product of every row is live at once: with AVX2's 16 registers 32 of them went through the
 * stack a block, and a step of 8 rows was 11 % slower (in cache, 125 vs 149 GOP/s on a thread of
 * a Zen 3; docs/benchmarks.md). A single row has registers enough: left to the compiler. */
static inline __attribute__((always_inline)) void pin(__m256i *v) { __asm__("" : "+x"(*v)); }
static inline __m256i bcast4(const int8_t *x) {
    int32_t v;
    memcpy(&v, x, sizeof v);
    return _mm256_set1_epi32(v);
}
static inline __attribute__((always_inline)) void q4_isums(const uint8_t *q, const int8_t *x, int64_t k, const int mb, vi *isum) {
    const __m256i low = _mm256_set1_epi8(0x0f);
    __m256i acc[MB_I8];
#pragma GCC unroll 8
    for (int r = 0; r < mb; r++) acc[r] = _mm256_setzero_si256();
    for (int g = 0; g < 4; g++) {
        const __m256i v = relay4(q + g * 32);
        const __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
#pragma GCC unroll 8
        for (int r = 0; r < mb; r++) {
            acc[r] = _mm256_add_epi16(acc[r], _mm256_maddubs_epi16(lo, bcast4(x + r * k + 4 * g)));
            acc[r] = _mm256_add_epi16(acc[r], _mm256_maddubs_epi16(hi, bcast4(x + r * k + 16 + 4 * g)));
            if (mb > 1) pin(&acc[r]);
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < mb; r++) isum[r] = (vi)_mm256_madd_epi16(acc[r], _mm256_set1_epi16(1));
}
static inline __attribute__((always_inline)) void q8_isums(const uint8_t *q, const int8_t *x, int64_t k, const int32_t *sums,
                                                           int64_t nb, const int mb, vi *isum) {
    (void)sums, (void)nb;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i acc[MB_I8];
#pragma GCC unroll 8
    for (int r = 0; r < mb; r++) acc[r] = _mm256_setzero_si256();
    for (int g = 0; g < 8; g++) {
        const __m256i v = relay4(q + g * 32), magnitude = _mm256_abs_epi8(v);
#pragma GCC unroll 8
        for (int r = 0; r < mb; r++) {
            const __m256i xs = _mm256_sign_epi8(bcast4(x + r * k + 4 * g), v);
            acc[r] = _mm256_add_epi32(acc[r], _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, xs), ones));
            if (mb > 1) pin(&acc[r]);
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < mb; r++) isum[r] = (vi)acc[r];
}
#else
#define INT8_DOT "generic"
static inline void q4_isums(const uint8_t *q, const int8_t *x, int64_t k, const int mb, vi *isum) {
    for (int r = 0; r < mb; r++)
        for (int c = 0; c < VW; c++) {
            int32_t total = 0;
            for (int j = 0; j < QBLOCK / 2; j++)
                total += (q[j * VW + c] & 15) * x[r * k + j] + (q[j * VW + c] >> 4) * x[r * k + j + QBLOCK / 2];
            isum[r][c] = total;
        }
}
static inline void q8_isums(const uint8_t *q, const int8_t *x, int64_t k, const int32_t *sums, int64_t nb, const int mb, vi *isum) {
    (void)sums, (void)nb;
    for (int r = 0; r < mb; r++)
        for (int c = 0; c < VW; c++) {
            int32_t total = 0;
            for (int j = 0; j < QBLOCK; j++) total += (int8_t)q[j * VW + c] * x[r * k + j];
            isum[r][c] = total;
        }
}
#endif

/* The fp32 epilogue of one block (b of nb) for rows r < mb of xq, given their integer sums: the
 * one sequence of operations both the VNNI loops here and the AMX tiles' sums go through. */
static inline __attribute__((always_inline)) void q4_accumulate(const uint8_t *blk, const QRows *xq, int64_t b, int64_t nb,
                                                                const int mb, const vi *isum, vf *first, vf *second) {
    const vf d = loadv_f16((const uint16_t *)blk), m = loadv_f16((const uint16_t *)blk + VW);
#pragma GCC unroll 8
    for (int r = 0; r < mb; r++) {
        vf scale = d * xq->d[r * nb + b];
        __asm__("" : "+v"(scale));
        first[r] = fmav(scale, int_to_float(isum[r]), first[r]);
        second[r] = fmav(m, (vf){0} + xq->s[r * nb + b], second[r]);
    }
}

static inline __attribute__((always_inline)) void q8_accumulate(const uint8_t *blk, const QRows *xq, int64_t b, int64_t nb,
                                                                const int mb, const vi *isum, vf *acc) {
    const vf d = loadv_f16((const uint16_t *)blk);
#pragma GCC unroll 8
    for (int r = 0; r < mb; r++) {
        vf scale = d * xq->d[r * nb + b];
        __asm__("" : "+v"(scale));
        acc[r] = fmav(scale, int_to_float(isum[r]), acc[r]);
    }
}

/* Rows r < mb of xq (already at the block's first row) against a Q4 panel. */
static inline __attribute__((always_inline)) void dot_q4_i8(const uint8_t *panel, const QRows *xq, int64_t K, const int mb,
                                                            vf *out) {
    const int64_t bytes = qblock_bytes(WEIGHT_Q4), nb = K / QBLOCK;
    vf first[MB_I8], second[MB_I8];
    vi isum[MB_I8];
#pragma GCC unroll 8
    for (int r = 0; r < mb; r++) first[r] = second[r] = (vf){0};
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = panel + b * bytes;
        prefetch_block(blk, bytes);
        q4_isums(blk + 4 * VW, xq->q + b * QBLOCK, K, mb, isum);
        q4_accumulate(blk, xq, b, nb, mb, isum, first, second);
    }
#pragma GCC unroll 8
    for (int r = 0; r < mb; r++) out[r] = first[r] + second[r];
}

static inline __attribute__((always_inline)) void dot_q8_i8(const uint8_t *panel, const QRows *xq, int64_t K, const int mb,
                                                            vf *out) {
    const int64_t bytes = qblock_bytes(WEIGHT_Q8_0), nb = K / QBLOCK;
    vf acc[MB_I8];
    vi isum[MB_I8];
#pragma GCC unroll 8
    for (int r = 0; r < mb; r++) acc[r] = (vf){0};
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = panel + b * bytes;
        prefetch_block(blk, bytes);
        q8_isums(blk + 2 * VW, xq->q + b * QBLOCK, K, xq->sum + b, nb, mb, isum);
        q8_accumulate(blk, xq, b, nb, mb, isum, acc);
    }
#pragma GCC unroll 8
    for (int r = 0; r < mb; r++) out[r] = acc[r];
}

#define DISPATCH_Q(fn, w, x, ldx, K, mb, out)          \
    switch (mb) {                                      \
        case 1: fn(w, x, ldx, K, 1, out); break;       \
        case 2: fn(w, x, ldx, K, 2, out); break;       \
        case 3: fn(w, x, ldx, K, 3, out); break;       \
        case 4: fn(w, x, ldx, K, 4, out); break;       \
        DISPATCH_Q_WIDE(fn, w, x, ldx, K, mb, out)     \
    }
#if MB == 8
#define DISPATCH_Q_WIDE(fn, w, x, ldx, K, mb, out)     \
    case 5: fn(w, x, ldx, K, 5, out); break;           \
    case 6: fn(w, x, ldx, K, 6, out); break;           \
    case 7: fn(w, x, ldx, K, 7, out); break;           \
    default: fn(w, x, ldx, K, 8, out); break;
#else
#define DISPATCH_Q_WIDE(fn, w, x, ldx, K, mb, out)     \
    default: fn(w, x, ldx, K, 4, out); break;
#endif

#define DISPATCH_I8(fn, w, xq, K, mb, out)   \
    switch (mb) {                             \
        case 1: fn(w, xq, K, 1, out); break;  \
        case 2: fn(w, xq, K, 2, out); break;  \
        case 3: fn(w, xq, K, 3, out); break;  \
        case 4: fn(w, xq, K, 4, out); break;  \
        DISPATCH_I8_WIDE(fn, w, xq, K, mb, out) \
    }
#if MB_I8 == 8
#define DISPATCH_I8_WIDE(fn, w, xq, K, mb, out) \
    case 5: fn(w, xq, K, 5, out); break;        \
    case 6: fn(w, xq, K, 6, out); break;        \
    case 7: fn(w, xq, K, 7, out); break;        \
    default: fn(w, xq, K, 8, out); break;
#else
#define DISPATCH_I8_WIDE(fn, w, xq, K, mb, out) \
    default: fn(w, xq, K, 4, out); break;
#endif

#define DISPATCH(i8, w, x, ldx, K, mb, out)        \
    switch (mb) {                                  \
        case 1: dot(w, i8, x, ldx, K, 1, out); break; \
        case 2: dot(w, i8, x, ldx, K, 2, out); break; \
        case 3: dot(w, i8, x, ldx, K, 3, out); break; \
        case 4: dot(w, i8, x, ldx, K, 4, out); break; \
        DISPATCH_WIDE(i8, w, x, ldx, K, mb, out)   \
    }
#if MB == 8
#define DISPATCH_WIDE(i8, w, x, ldx, K, mb, out)   \
    case 5: dot(w, i8, x, ldx, K, 5, out); break;  \
    case 6: dot(w, i8, x, ldx, K, 6, out); break;  \
    case 7: dot(w, i8, x, ldx, K, 7, out); break;  \
    default: dot(w, i8, x, ldx, K, 8, out); break;
#else
#define DISPATCH_WIDE(i8, w, x, ldx, K, mb, out) \
    default: dot(w, i8, x, ldx, K, 4, out); break;
#endif

#define DISPATCH2(i8, wa, wb, x, ldx, K, mb, oa, ob)              \
    switch (mb) {                                                 \
        case 1: dot2(wa, wb, i8, x, ldx, K, 1, oa, ob); break;    \
        DISPATCH2_WIDE(i8, wa, wb, x, ldx, K, mb, oa, ob)         \
    }
#if MB2 == 6
#define DISPATCH2_WIDE(i8, wa, wb, x, ldx, K, mb, oa, ob)         \
    case 2: dot2(wa, wb, i8, x, ldx, K, 2, oa, ob); break;        \
    case 3: dot2(wa, wb, i8, x, ldx, K, 3, oa, ob); break;        \
    case 4: dot2(wa, wb, i8, x, ldx, K, 4, oa, ob); break;        \
    case 5: dot2(wa, wb, i8, x, ldx, K, 5, oa, ob); break;        \
    default: dot2(wa, wb, i8, x, ldx, K, 6, oa, ob); break;
#else
#define DISPATCH2_WIDE(i8, wa, wb, x, ldx, K, mb, oa, ob)         \
    default: dot2(wa, wb, i8, x, ldx, K, 2, oa, ob); break;
#endif

/* Scale (int8) and bias of panel p applied to rows' finished sums, as panel_block does. */
static inline void epilogue(const Matrix *w, int64_t p, int mb, vf *out) {
    if (w->dtype == WEIGHT_I8) {
        const vf scale = loadv(w->scale + p * VW);
        for (int r = 0; r < mb; r++) out[r] *= scale;
    }
    if (w->bias != NULL) {
        const vf bias = loadv(w->bias + p * VW);
        for (int r = 0; r < mb; r++) out[r] += bias;
    }
}

/* Panel p's VW channels (scale and bias applied) for rows [r0, r0 + mb), mb <= block_rows: x points at
 * row r0, xq (int8 activations) holds every row. */
static void panel_block(const Matrix *w, int64_t p, const float *x, const QRows *xq, int64_t r0, int64_t ldx, int mb, vf *out) {
    const int64_t K = w->k;
    if (xq != NULL && int8_activations(w)) {
        const QRows rows = qrows_from(xq, r0);
        const uint8_t *panel = (const uint8_t *)w->panels + p * panel_bytes(w);
        if (w->dtype == WEIGHT_Q4) {
            DISPATCH_I8(dot_q4_i8, panel, &rows, K, mb, out);
        } else {
            DISPATCH_I8(dot_q8_i8, panel, &rows, K, mb, out);
        }
    } else if (w->dtype == WEIGHT_Q4) {
        const uint8_t *panel = (const uint8_t *)w->panels + p * panel_bytes(w);
        DISPATCH_Q(dot_q4, panel, x, ldx, K, mb, out);
    } else if (w->dtype == WEIGHT_Q8_0) {
        const uint8_t *panel = (const uint8_t *)w->panels + p * panel_bytes(w);
        DISPATCH_Q(dot_q8, panel, x, ldx, K, mb, out);
    } else if (w->dtype == WEIGHT_I8) {
        const int8_t *panel = (const int8_t *)w->panels + p * K * VW;
        DISPATCH(1, panel, x, ldx, K, mb, out);
    } else {
        const float *panel = (const float *)w->panels + p * K * VW;
        DISPATCH(0, panel, x, ldx, K, mb, out);
    }
    epilogue(w, p, mb, out);
}

/* Panels p and q's channels for rows [r0, r0 + mb), mb <= MB2: the same values panel_block gives
 * for each. */
static void panel_pair(const Matrix *w, int64_t p, int64_t q, const float *x, int64_t ldx, int mb, vf *out_p, vf *out_q) {
    const int64_t K = w->k;
    if (w->dtype == WEIGHT_I8) {
        const int8_t *a = (const int8_t *)w->panels + p * K * VW, *b = (const int8_t *)w->panels + q * K * VW;
        DISPATCH2(1, a, b, x, ldx, K, mb, out_p, out_q);
    } else {
        const float *a = (const float *)w->panels + p * K * VW, *b = (const float *)w->panels + q * K * VW;
        DISPATCH2(0, a, b, x, ldx, K, mb, out_p, out_q);
    }
    epilogue(w, p, mb, out_p);
    epilogue(w, q, mb, out_q);
}

/* Whether m rows go through panel pairs (`pair`: the weights are cache-resident; fp32 and int8
 * panels only). */
static inline int paired(const Matrix *w, int pair, int64_t m) {
    return pair && m >= PAIR_MIN && m <= PAIR_ROWS && w->dtype <= WEIGHT_I8;
}

/* The rows of pass i of n passes over m rows (balanced: 5 rows in passes of at most 2 as 1 + 2 + 2). */
static inline void pass_rows(int64_t m, int64_t n, int64_t i, int64_t *r0, int *mb) {
    const int64_t lo = m * i / n, hi = m * (i + 1) / n;
    *r0 = lo;
    *mb = (int)(hi - lo);
}

/* Writes the first `valid` lanes of v to y (all VW when the panel is full). */
static inline void put(float *y, vf v, int64_t valid, int mode) {
    if (valid >= VW) {
        storev(y, mode == ACCUMULATE ? loadv(y) + v : v);
        return;
    }
    float lanes[VW];
    storev(lanes, v);
    for (int64_t i = 0; i < valid; i++) y[i] = mode == ACCUMULATE ? y[i] + lanes[i] : lanes[i];
}

/* Rows a pass of panel_block takes: MB_I8 where the rows arrive as int8 codes. */
static inline int block_rows(const Matrix *w, const QRows *xq) { return xq != NULL && int8_activations(w) ? MB_I8 : MB; }

void matmul_panels(const Matrix *w, const float *x, const QRows *xq, int64_t m, int64_t ldx, float *y, int64_t ldy, int64_t p0,
                   int64_t p1, int mode, int pair) {
    vf out[MB_I8 > MB2 ? MB_I8 : MB2], out_q[MB2];
    int64_t p = p0;
    if (paired(w, pair, m)) {
        const int64_t passes = (m + MB2 - 1) / MB2;
        for (; p + 1 < p1; p += 2) {
            for (int64_t i = 0; i < passes; i++) {
                int64_t r0;
                int mb;
                pass_rows(m, passes, i, &r0, &mb);
                panel_pair(w, p, p + 1, x + r0 * ldx, ldx, mb, out, out_q);
                for (int r = 0; r < mb; r++) {
                    put(y + (r0 + r) * ldy + p * VW, out[r], w->n - p * VW, mode);
                    put(y + (r0 + r) * ldy + (p + 1) * VW, out_q[r], w->n - (p + 1) * VW, mode);
                }
            }
        }
    }
    const int rows = block_rows(w, xq);
    for (; p < p1; p++) {
        for (int64_t r0 = 0; r0 < m; r0 += rows) {
            const int mb = m - r0 < rows ? (int)(m - r0) : rows;
            panel_block(w, p, x + r0 * ldx, xq, r0, ldx, mb, out);
            for (int r = 0; r < mb; r++) put(y + (r0 + r) * ldy + p * VW, out[r], w->n - p * VW, mode);
        }
    }
}

/* silu(g) = g * sigmoid(g), the sigmoid from exp(-|g|) so the exp never overflows. Inlined into
 * each caller; under -ffast-math the compiler may contract its polynomial differently in
 * different callers, so the AMX path's gate/up rows are compared bit for bit with the VNNI
 * loops' (tests/layers/test_amx_int8.py): a two-panel variant of that path did differ. (A
 * non-inlined copy agreed in every caller but moved SmolLM2's int8-activation answers off a
 * near-tie the real-model test pins, so the numerics stay those of the inlined one.) */
static inline vf silu(vf g) {
    float lanes[VW];
    storev(lanes, g);
#pragma omp simd
    for (int i = 0; i < VW; i++) {
        const float x = lanes[i];
        const float e = exp_nonpositive(x < 0.0f ? x : -x);
        lanes[i] = x * (x < 0.0f ? e : 1.0f) / (1.0f + e);
    }
    return loadv(lanes);
}

void swiglu_panels(const Matrix *w, const float *x, const QRows *xq, int64_t m, int64_t ldx, float *act, int64_t ldact,
                   int64_t j0, int64_t j1, int pair) {
    vf gate[MB_I8 > MB ? MB_I8 : MB], up[MB_I8 > MB ? MB_I8 : MB];
    const int64_t width = w->n / 2; /* channels of the activation */
    if (paired(w, pair, m)) {
        const int64_t passes = (m + MB2 - 1) / MB2;
        for (int64_t j = j0; j < j1; j++) {
            for (int64_t i = 0; i < passes; i++) {
                int64_t r0;
                int mb;
                pass_rows(m, passes, i, &r0, &mb);
                panel_pair(w, 2 * j, 2 * j + 1, x + r0 * ldx, ldx, mb, gate, up);
                for (int r = 0; r < mb; r++) put(act + (r0 + r) * ldact + j * VW, silu(gate[r]) * up[r], width - j * VW, STORE);
            }
        }
        return;
    }
    const int rows = block_rows(w, xq);
    for (int64_t j = j0; j < j1; j++) {
        for (int64_t r0 = 0; r0 < m; r0 += rows) {
            const int mb = m - r0 < rows ? (int)(m - r0) : rows;
            panel_block(w, 2 * j, x + r0 * ldx, xq, r0, ldx, mb, gate);
            panel_block(w, 2 * j + 1, x + r0 * ldx, xq, r0, ldx, mb, up);
            for (int r = 0; r < mb; r++) put(act + (r0 + r) * ldact + j * VW, silu(gate[r]) * up[r], width - j * VW, STORE);
        }
    }
}

/* Rows per pass over a thread's panels when m is large (a prefill through block-quantized
 * weights): the tile's activations stay in the cache while the panels stream past them once per
 * tile. A row's result does not depend on the tiling. */
#define ROW_TILE 64

#if AMX_INT8
/* Int8 activations of many rows through the AMX tiles (amx_int8.c): for each panel its codes are
 * re-laid once, then for each 16 rows the tiles give every block's integer sums and the epilogue
 * runs over them 8 rows at a time with q4_accumulate/q8_accumulate — the operations
 * dot_q4_i8/dot_q8_i8 apply to the same integers, so a row gets the same bits from either path,
 * and which path a row count takes is a matter of speed alone. From AMX_MIN_ROWS rows on (the
 * rows are quantized into whole tiles of 16, the rows past m zero: amx_rows_of).
 *
 * Blocks per pass of the tiles and then the epilogue (AMX_CHUNK): their sums (8 KB) stay in L1
 * for the epilogue, which a whole row of blocks (48 KB at k = 1536) did not. */
#define AMX_CHUNK 8

int amx_start(AmxScratch *s, int64_t k) {
    const int64_t nb = k / QBLOCK;
    s->codes = aligned_alloc(64, (size_t)(nb * AMX_CODE_BYTES));
    s->isum = aligned_alloc(64, (size_t)(2 * AMX_CHUNK * AMX_SUM_INTS * (int64_t)sizeof(int32_t)));
    s->started = s->codes != NULL && s->isum != NULL;
    if (s->started) amx_begin();
    return s->started;
}

void amx_stop(AmxScratch *s) {
    if (s->started) amx_end();
    free(s->codes);
    free(s->isum);
}

/* Blocks [b0, b0 + n) of the epilogue for MB rows of xq (at their first row) from their sums
 * (isum: row 0's sums of block b0; rows VW ints apart, blocks AMX_SUM_INTS), continuing the
 * accumulators first[r] and second[r] (Q8_0: first alone) where b0 > 0, starting them at 0
 * where b0 == 0; q4 a constant after inlining. */
static inline __attribute__((always_inline)) void amx_rows(const uint8_t *panel, const QRows *xq, const int32_t *isum, int64_t b0,
                                                           int64_t n, int64_t nb, const int q4, vf *first, vf *second) {
    const int64_t bytes = qblock_bytes(q4 ? WEIGHT_Q4 : WEIGHT_Q8_0);
    vf f[MB], g[MB];
    vi sums[MB];
#pragma GCC unroll 8
    for (int r = 0; r < MB; r++) f[r] = b0 ? first[r] : (vf){0}, g[r] = b0 && q4 ? second[r] : (vf){0};
    for (int64_t b = b0; b < b0 + n; b++) {
#pragma GCC unroll 8
        for (int r = 0; r < MB; r++) memcpy(&sums[r], isum + (b - b0) * AMX_SUM_INTS + r * VW, sizeof(vi));
        if (q4)
            q4_accumulate(panel + b * bytes, xq, b, nb, MB, sums, f, g);
        else
            q8_accumulate(panel + b * bytes, xq, b, nb, MB, sums, f);
    }
#pragma GCC unroll 8
    for (int r = 0; r < MB; r++) first[r] = f[r], second[r] = g[r];
}

/* Panel p's channels (scale and bias applied) for rows [0, m) of xq, m <= ROW_TILE: out[r].
 * The work is a sequence of steps, (16 rows, AMX_CHUNK blocks) each; the tiles' sums of step
 * i + 1 are asked for before the epilogue of step i, into the other half of the scratch, so
 * the tile unit computes them while the vector units run the epilogue. */
static void amx_panel(const Matrix *w, int64_t p, const QRows *xq, int64_t m, const AmxScratch *s, vf *out) {
    const int64_t nb = w->k / QBLOCK, chunks = (nb + AMX_CHUNK - 1) / AMX_CHUNK, steps = (m + AMX_ROWS - 1) / AMX_ROWS * chunks;
    const int q4 = w->dtype == WEIGHT_Q4;
    const uint8_t *panel = (const uint8_t *)w->panels + p * panel_bytes(w);
    vf second[AMX_ROWS];
    amx_codes(panel, nb, w->dtype, s->codes);
    for (int64_t i = 0; i <= steps; i++) {
        if (i < steps) { /* the sums of step i */
            const int64_t g = i / chunks * AMX_ROWS, b0 = i % chunks * AMX_CHUNK;
            const int64_t n = nb - b0 < AMX_CHUNK ? nb - b0 : AMX_CHUNK;
            amx_sums(s->codes + b0 * AMX_CODE_BYTES, xq->q + g * w->k + b0 * QBLOCK, w->k, n, w->dtype,
                     s->isum + i % 2 * AMX_CHUNK * AMX_SUM_INTS);
        }
        if (i == 0) continue;
        /* the epilogue of step i - 1 */
        const int64_t j = i - 1, g = j / chunks * AMX_ROWS, b0 = j % chunks * AMX_CHUNK;
        const int64_t n = nb - b0 < AMX_CHUNK ? nb - b0 : AMX_CHUNK;
        const int32_t *isum = s->isum + j % 2 * AMX_CHUNK * AMX_SUM_INTS;
        for (int64_t h = 0; h < AMX_ROWS && g + h < m; h += MB) {
            const QRows rows = qrows_from(xq, g + h);
            if (q4)
                amx_rows(panel, &rows, isum + h * VW, b0, n, nb, 1, out + g + h, second + h);
            else
                amx_rows(panel, &rows, isum + h * VW, b0, n, nb, 0, out + g + h, second + h);
        }
        if (q4 && b0 + n == nb)
            for (int64_t r = g; r < g + AMX_ROWS && r < m; r++) out[r] += second[r - g];
    }
    epilogue(w, p, (int)m, out);
}

/* Rows [0, m) of x W^T (or silu(gate) * up) for the panels [p0, p1) (gate/up pairs when swiglu),
 * m <= ROW_TILE. */
static void amx_tile(const Matrix *w, const QRows *xq, int64_t m, float *y, int64_t ldy, int64_t p0, int64_t p1, int swiglu,
                     int mode, const AmxScratch *s) {
    vf out[ROW_TILE], up[ROW_TILE];
    const int64_t width = swiglu ? w->n / 2 : w->n;
    for (int64_t p = p0; p < p1; p++) {
        amx_panel(w, swiglu ? 2 * p : p, xq, m, s, out);
        if (swiglu) {
            amx_panel(w, 2 * p + 1, xq, m, s, up);
            for (int64_t r = 0; r < m; r++) out[r] = silu(out[r]) * up[r];
        }
        for (int64_t r = 0; r < m; r++) put(y + r * ldy + p * VW, out[r], width - p * VW, mode);
    }
}

void amx_panels(const Matrix *w, const QRows *xq, int64_t m, float *y, int64_t ldy, int64_t p0, int64_t p1, int swiglu, int mode,
                const AmxScratch *s) {
    for (int64_t r0 = 0; r0 < m; r0 += ROW_TILE) {
        const QRows rows = qrows_from(xq, r0);
        amx_tile(w, &rows, m - r0 < ROW_TILE ? m - r0 : ROW_TILE, y + r0 * ldy, ldy, p0, p1, swiglu, mode, s);
    }
}
#else
int amx_start(AmxScratch *s, int64_t k) {
    (void)k;
    *s = (AmxScratch){0};
    return 0;
}
void amx_stop(AmxScratch *s) { (void)s; }
void amx_panels(const Matrix *w, const QRows *xq, int64_t m, float *y, int64_t ldy, int64_t p0, int64_t p1, int swiglu, int mode,
                const AmxScratch *s) {
    (void)w, (void)xq, (void)m, (void)y, (void)ldy, (void)p0, (void)p1, (void)swiglu, (void)mode, (void)s;
}
#endif

/* The standalone entry point (tests, prefills through block-quantized weights, any caller
 * outside the decode step): y = x W^T, or silu(gate) * up when `swiglu`, split by panels over
 * the threads, rows in tiles of ROW_TILE. check_matrix covers the weight of every kind (a
 * block-quantized one's k a whole number of blocks, its panels' bytes with their fp16 scales). */
int small_matmul(const Matrix *w, const float *x, int64_t m, int64_t ldx, int64_t x_capacity, float *y, int64_t ldy,
                 int64_t y_capacity, int swiglu, int num_threads) {
    const int status = check_matrix(w, "small matmul: the weight");
    if (status) return status;
    const int64_t width = swiglu ? w->n / 2 : w->n;
    REQUIRE(m >= 0 && num_threads >= 1 && (!swiglu || w->num_panels % 2 == 0), "small matmul: %lld rows, %d threads",
            (long long)m, num_threads);
    REQUIRE(rows_fit(m, ldx, w->k, x_capacity) && (m <= 1 || ldx >= w->k),
            "small matmul: %lld rows of %lld inputs do not fit x (stride %lld, %lld floats)", (long long)m, (long long)w->k,
            (long long)ldx, (long long)x_capacity);
    REQUIRE(rows_fit(m, ldy, width, y_capacity) && (m <= 1 || ldy >= width),
            "small matmul: %lld rows of %lld outputs do not fit y (stride %lld, %lld floats)", (long long)m, (long long)width,
            (long long)ldy, (long long)y_capacity);
    const int pair = fits_in_cache(matrix_bytes(w));
    /* int8 activations: every row quantized once, shared by the threads; for the AMX tiles in
     * whole tiles of 16 rows, the rows past m zero */
    void *qbuf = NULL;
    QRows xq = {0};
    const int quantized = int8_activations(w) && m > 0;
    const int tiles = quantized && m >= AMX_MIN_ROWS && amx_usable();
    const int64_t qm = tiles ? amx_rows_of(m) : m;
    if (quantized) {
        qbuf = malloc(qrows_bytes(qm, w->k));
        if (qbuf == NULL) return KERNEL_NO_MEMORY;
        xq = qrows_padded(qbuf, m, qm, w->k);
    }
#pragma omp parallel num_threads(num_threads)
    {
        if (quantized) {
#pragma omp for schedule(static)
            for (int64_t r = 0; r < m; r++) {
                const QRows row = qrows_from(&xq, r);
                quantize_rows(x + r * ldx, 1, ldx, &row);
            }
        }
        int64_t lo, hi;
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        thread_share(swiglu ? w->num_panels / 2 : w->num_panels, t, nt, &lo, &hi);
        AmxScratch scratch = {0};
        const int amx = tiles && amx_start(&scratch, w->k);
        for (int64_t r0 = 0; r0 < m; r0 += ROW_TILE) {
            const int64_t rows = m - r0 < ROW_TILE ? m - r0 : ROW_TILE;
            const QRows tile = quantized ? qrows_from(&xq, r0) : xq;
            const QRows *tq = quantized ? &tile : NULL;
            if (amx && rows >= AMX_MIN_ROWS)
                amx_panels(w, tq, rows, y + r0 * ldy, ldy, lo, hi, swiglu, STORE, &scratch);
            else if (swiglu)
                swiglu_panels(w, x + r0 * ldx, tq, rows, ldx, y + r0 * ldy, ldy, lo, hi, pair);
            else
                matmul_panels(w, x + r0 * ldx, tq, rows, ldx, y + r0 * ldy, ldy, lo, hi, STORE, pair);
        }
        amx_stop(&scratch);
    }
    free(qbuf);
    return KERNEL_OK;
}

/* Which instructions sum int8-activation products of many rows: "amx" where the tiles are usable
 * (from AMX_MIN_ROWS rows), else those of every row count. */
const char *int8_dot_product(void) { return amx_usable() ? "amx" : INT8_DOT; }

/* A STREAM-like read of n floats by num_threads threads (each its contiguous share, 4 vector
 * accumulators): the best of `repeats` passes, in bytes per second. The denominator of the decode
 * benchmark's share of the limit, so it reads the way the matmuls do, with the matmuls' software
 * prefetch hint (STREAM_LOCALITY) ahead of the loads: on an AMD EPYC VM a non-temporal prefetch
 * read ~10 % faster than the hardware prefetchers alone, and a limit below what a kernel reaches
 * would flatter it. */
#define READ_AHEAD_FLOATS 2048 /* 8 KB */
double read_bandwidth(const float *buf, int64_t n, int repeats, int num_threads) {
    double best = 0.0;
    volatile float sink = 0.0f;
    for (int rep = 0; rep < repeats; rep++) {
        const double start = omp_get_wtime();
        float total = 0.0f;
#pragma omp parallel num_threads(num_threads) reduction(+ : total)
        {
            int64_t lo, hi;
            thread_share(n / (4 * VW), omp_get_thread_num(), omp_get_num_threads(), &lo, &hi);
            vf a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
            for (int64_t i = lo * 4 * VW; i < hi * 4 * VW; i += 4 * VW) {
                __builtin_prefetch(buf + i + READ_AHEAD_FLOATS, 0, STREAM_LOCALITY);
                a0 += loadv(buf + i);
                a1 += loadv(buf + i + VW);
                a2 += loadv(buf + i + 2 * VW);
                a3 += loadv(buf + i + 3 * VW);
            }
            const vf a = a0 + a1 + a2 + a3;
            for (int i = 0; i < VW; i++) total += a[i];
        }
        const double seconds = omp_get_wtime() - start;
        sink = total;
        const double rate = (double)(n / (4 * VW)) * 4 * VW * sizeof(float) / seconds;
        best = rate > best ? rate : best;
    }
    (void)sink;
    return best;
}

/* arithmetic_peak (interface.h): PEAK_CHAINS independent accumulators, enough to cover the
 * latency of an FMA or a dot-product instruction on two pipes; the empty asm statements keep the
 * compiler from folding the constant operands or hoisting the loop-invariant products. */
#define PEAK_CHAINS 12
static double peak_round(int int8, int64_t iterations) {
#if defined(__AVX512F__) && defined(__AVX512VNNI__)
    if (int8) {
        __m512i acc[PEAK_CHAINS], a = _mm512_set1_epi8(1), b = _mm512_set1_epi8(2);
        __asm__("" : "+v"(a), "+v"(b));
        for (int c = 0; c < PEAK_CHAINS; c++) acc[c] = _mm512_setzero_si512();
        for (int64_t i = 0; i < iterations; i++)
#pragma GCC unroll 12
            for (int c = 0; c < PEAK_CHAINS; c++) acc[c] = _mm512_dpbusd_epi32(acc[c], a, b);
        for (int c = 0; c < PEAK_CHAINS; c++) __asm__ volatile("" : : "v"(acc[c]));
        return (double)iterations * PEAK_CHAINS * 64 * 2;
    }
#elif defined(__AVX2__) && !defined(__AVX512F__)
    if (int8) {
        __m256i acc[PEAK_CHAINS], a = _mm256_set1_epi8(1), b = _mm256_set1_epi8(2);
        for (int c = 0; c < PEAK_CHAINS; c++) acc[c] = _mm256_setzero_si256();
        for (int64_t i = 0; i < iterations; i++) {
            __asm__("" : "+x"(a));
#pragma GCC unroll 12
            for (int c = 0; c < PEAK_CHAINS; c++) acc[c] = _mm256_add_epi16(acc[c], _mm256_maddubs_epi16(a, b));
        }
        for (int c = 0; c < PEAK_CHAINS; c++) __asm__ volatile("" : : "x"(acc[c]));
        return (double)iterations * PEAK_CHAINS * 32 * 2;
    }
#endif
    if (int8) return 0.0;
    vf acc[PEAK_CHAINS], one = (vf){0} + 1.0f, zero = (vf){0};
    __asm__("" : "+v"(one), "+v"(zero));
    for (int c = 0; c < PEAK_CHAINS; c++) acc[c] = zero;
    for (int64_t i = 0; i < iterations; i++)
#pragma GCC unroll 12
        for (int c = 0; c < PEAK_CHAINS; c++) acc[c] = fmav(acc[c], one, zero);
    for (int c = 0; c < PEAK_CHAINS; c++) __asm__ volatile("" : : "v"(acc[c]));
    return (double)iterations * PEAK_CHAINS * VW * 2;
}

double arithmetic_peak(int int8, int64_t iterations, int repeats, int num_threads) {
    double best = 0.0;
    for (int rep = 0; rep < repeats; rep++) {
        double ops = 0.0;
        const double start = omp_get_wtime();
#pragma omp parallel num_threads(num_threads) reduction(+ : ops)
        ops += peak_round(int8, iterations);
        const double rate = ops / (omp_get_wtime() - start);
        best = rate > best ? rate : best;
    }
    return best;
}
