/* Shared by the CPU kernels: vector types chosen at build time, packed weight matrices, and the
 * pieces one kernel lends another (decode attention for one sequence, the vectorised exp).
 *
 * The vector width follows the instruction set the library is compiled for: 16 floats where the
 * compiler targets AVX-512, 8 otherwise (AVX2; GCC/Clang lower the same vector code for any SIMD
 * width). A packed weight's panel is VW output channels wide, so weights are packed for the
 * library that will read them (`panel_width()`). What Python sees of the library (its structs,
 * exported functions and status codes) is in interface.h; this header adds what the kernels
 * share among themselves.
 */
#ifndef PAGEDLLM_KERNELS_H
#define PAGEDLLM_KERNELS_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "interface.h"
#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__)
#define VW 16
#define MB 8 /* activation rows per pass over a panel: 2 x MB accumulators of 32 registers */
#else
#define VW 8
#define MB 4 /* 2 x MB accumulators of AVX2's 16 registers */
#endif

typedef float vf __attribute__((vector_size(VW * 4)));
typedef int32_t vi __attribute__((vector_size(VW * 4)));
typedef int8_t vb __attribute__((vector_size(VW)));
typedef float v8 __attribute__((vector_size(32)));

static inline vf loadv(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void storev(float *p, vf v) { memcpy(p, &v, sizeof v); }

/* VW signed bytes widened to floats: vpmovsxbd + vcvtdq2ps (GCC 12 scalarises the same
 * conversion written with __builtin_convertvector, 10x slower). */
static inline vf loadv_i8(const int8_t *p) {
#if defined(__AVX512F__)
    return (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
#elif defined(__AVX2__)
    return (vf)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
#else
    vf v;
    for (int i = 0; i < VW; i++) v[i] = (float)p[i];
    return v;
#endif
}

/* VW fp16 values widened to floats (F16C's vcvtph2ps). */
static inline vf loadv_f16(const uint16_t *p) {
#if defined(__AVX512F__)
    return (vf)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
#elif defined(__AVX2__)
    return (vf)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
#else
    vf v;
    for (int i = 0; i < VW; i++) {
        const uint32_t h = p[i], sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
        union { uint32_t bits; float value; } out;
        if (exp == 0) {
            out.value = (float)man * 0x1p-24f;
            out.bits |= sign;
        } else {
            out.bits = sign | (exp == 31 ? 0x7f800000u | (man << 13) : ((exp + 112) << 23) | (man << 13));
        }
        v[i] = out.value;
    }
    return v;
#endif
}

/* VW unsigned bytes widened to 32-bit integers (vpmovzxbd). */
static inline vi loadv_u8(const uint8_t *p) {
#if defined(__AVX512F__)
    return (vi)_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
#elif defined(__AVX2__)
    return (vi)_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
#else
    vi v;
    for (int i = 0; i < VW; i++) v[i] = p[i];
    return v;
#endif
}

static inline vf int_to_float(vi v) {
#if defined(__AVX512F__)
    return (vf)_mm512_cvtepi32_ps((__m512i)v);
#elif defined(__AVX2__)
    return (vf)_mm256_cvtepi32_ps((__m256i)v);
#else
    vf f;
    for (int i = 0; i < VW; i++) f[i] = (float)v[i];
    return f;
#endif
}

#if defined(__AVX512F__) && defined(__AVX512VBMI__)
/* 64 bytes of a block-quantized panel's codes (4 inputs x 16 channels, input-major) re-laid so
 * that each 32-bit lane holds one channel's 4 inputs: the operand layout of vpdpbusd and of an
 * AMX tile's B rows (small_matmul.c, amx_int8.c): byte 4c + j of the result is byte 16 j + c of
 * the 64 loaded, channel c's 4 inputs in lane c. */
static inline __m512i relay4(const uint8_t *p) {
    const __m512i idx = _mm512_set_epi8(63, 47, 31, 15, 62, 46, 30, 14, 61, 45, 29, 13, 60, 44, 28, 12, 59, 43, 27, 11, 58, 42,
                                        26, 10, 57, 41, 25, 9, 56, 40, 24, 8, 55, 39, 23, 7, 54, 38, 22, 6, 53, 37, 21, 5, 52,
                                        36, 20, 4, 51, 35, 19, 3, 50, 34, 18, 2, 49, 33, 17, 1, 48, 32, 16, 0);
    return _mm512_permutexvar_epi8(idx, _mm512_loadu_si512((const void *)p));
}
#endif

#define QBLOCK 32 /* inputs per block of a block-quantized panel (Matrix, interface.h) */

enum { STORE = 0, ACCUMULATE = 1 };

/* The status to report of two (a parallel region's workers, or successive stages): the higher.
 * Statuses are distinct outcomes, not flags (interface.h): or'ed, two of them would read as a
 * third. */
static inline int worse_status(int a, int b) { return a > b ? a : b; }

/* Records why a call was refused (printf-style) for kernel_last_error(); returns KERNEL_REFUSED. */
int refuse(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
#define REQUIRE(cond, ...)                                                                                                   \
    do {                                                                                                                   \
        if (!(cond)) return refuse(__VA_ARGS__);                                                                           \
    } while (0)

/* The checks the kernels share: a packed matrix's panels, scales and biases lie within what was
 * allocated for them, its panels measured by its kind's bytes (panel_bytes: a block-quantized
 * matrix's blocks with their fp16 scales, its k a whole number of blocks) (`name` for the message); the first ceil(len / block_size) entries of a
 * block table (of max_blocks entries) name blocks of a pool of num_blocks. KERNEL_OK or
 * KERNEL_REFUSED. */
int check_matrix(const Matrix *w, const char *name);
int check_table(const int64_t *table, int64_t max_blocks, int64_t len, int64_t block_size, int64_t num_blocks,
                const char *what, int64_t which);
/* Whether rows of `width` floats, `stride` apart, fit `capacity` floats (rows > 0). */
static inline int rows_fit(int64_t rows, int64_t stride, int64_t width, int64_t capacity) {
    return rows <= 0 || (stride >= 0 && width >= 0 && (rows - 1) * stride + width <= capacity);
}

/* Tests only (tests/layers/test_sanitizers.py builds with -DPAGEDLLM_TEST_OFF_BY_ONE=1):
 * attention's score buffer is allocated one float short, an injected off-by-one that shows the
 * sanitizer build catches one. Never defined in a build the engine loads. */
#ifndef PAGEDLLM_TEST_OFF_BY_ONE
#define PAGEDLLM_TEST_OFF_BY_ONE 0
#endif

/* Activation rows quantized to int8 per block of 32 inputs, for matrices with int8_activations
 * (small_matmul.c): q = round_to_nearest_even(x * (127 * (1 / max|x|))), d = max|x| * (1 / 127)
 * (0 and all q 0 for a block of zeros), sum = the block's sum of q, s = d * sum. Row r's block b
 * is q[r * k + 32 b ..], d/s/sum[r * (k / 32) + b]. */
typedef struct {
    int8_t *q;
    float *d, *s;
    int32_t *sum;
    int64_t k;
} QRows;

/* Whether w multiplies int8-quantized activations (its rows go through quantize_rows first). */
static inline int int8_activations(const Matrix *w) {
    return w->int8_activations && (w->dtype == WEIGHT_Q4 || w->dtype == WEIGHT_Q8_0);
}
/* Bytes of a QRows buffer for m rows of k inputs (k a multiple of 32), and the QRows laid out in
 * one of them. */
static inline int64_t qrows_bytes(int64_t m, int64_t k) { return m * (k / QBLOCK) * 12 + m * k; }
static inline QRows qrows_in(void *buf, int64_t m, int64_t k) {
    const int64_t nb = m * (k / QBLOCK);
    float *f = (float *)buf;
    return (QRows){(int8_t *)(f + 3 * nb), f, f + nb, (int32_t *)(f + 2 * nb), k};
}
/* The rows of xq from row r on (the same buffer). */
static inline QRows qrows_from(const QRows *xq, int64_t r) {
    const int64_t nb = xq->k / QBLOCK;
    return (QRows){xq->q + r * xq->k, xq->d + r * nb, xq->s + r * nb, xq->sum + r * nb, xq->k};
}
/* The QRows of qm >= m rows laid out in buf (qrows_bytes(qm, k)), rows m .. qm - 1 zero: the
 * padding of the tiles' last 16 rows (amx_rows_of). */
static inline QRows qrows_padded(void *buf, int64_t m, int64_t qm, int64_t k) {
    const QRows xq = qrows_in(buf, qm, k);
    const int64_t nb = k / QBLOCK, pad = qm - m;
    memset(xq.d + m * nb, 0, pad * nb * sizeof(float));
    memset(xq.s + m * nb, 0, pad * nb * sizeof(float));
    memset(xq.sum + m * nb, 0, pad * nb * sizeof(int32_t));
    memset(xq.q + m * k, 0, pad * k);
    return xq;
}
/* Quantizes rows [0, m) of x (stride ldx, k inputs each) into xq. */
void quantize_rows(const float *x, int64_t m, int64_t ldx, const QRows *xq);

/* y[m][c] (=|+=) x[m] . W[c] (+ bias[c]) for the channels of panels [p0, p1), all m rows.
 * `pair`: the weights are cache-resident (fits_in_cache), so two panels may be computed in one
 * pass (small_matmul.c); the results are the same bits either way. `xq`: x's rows quantized
 * (quantize_rows) when int8_activations(w), else ignored (may be NULL). */
void matmul_panels(const Matrix *w, const float *x, const QRows *xq, int64_t m, int64_t ldx, float *y, int64_t ldy, int64_t p0,
                   int64_t p1, int mode, int pair);
/* act[m][c] = silu(gate) * up for the channels of gate/up panel pairs [j0, j1). */
void swiglu_panels(const Matrix *w, const float *x, const QRows *xq, int64_t m, int64_t ldx, float *act, int64_t ldact,
                   int64_t j0, int64_t j1, int pair);
/* AMX (amx_int8.c): the integer sums of int8-activation matmuls over many rows in tiles of 16
 * rows x 16 channels x one block of 32 inputs, where the build targets AMX-INT8 (and AVX-512
 * VBMI, for relay4) and the kernel lets this process use the tiles. */
#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AVX512VBMI__) && VW == 16
#define AMX_INT8 1
#else
#define AMX_INT8 0
#endif
#define AMX_ROWS 16                  /* activation rows of a tile */
#define AMX_MIN_ROWS 16              /* the fewest rows a matmul gives the tiles (fewer take VNNI) */
#define AMX_CODE_BYTES (QBLOCK * VW) /* one block's codes of a panel, as a tile's B rows */
#define AMX_SUM_INTS (AMX_ROWS * VW) /* one block's integer sums of 16 rows x 16 channels */
/* Whether the tiles may be used (0 in a build without them): asked of the kernel once per
 * process (arch_prctl). Call it before a parallel region whose threads use them. */
int amx_usable(void);
/* This thread's tile configuration (amx_begin) and its release (amx_end), around its work. */
void amx_begin(void);
void amx_end(void);
/* A panel's codes of nb blocks (a Q4 or Q8_0 panel, kernels.h's layout) as tiles' B rows:
 * nb * AMX_CODE_BYTES bytes at `codes`. */
void amx_codes(const uint8_t *panel, int64_t nb, int32_t dtype, uint8_t *codes);
/* isum[b][r][c] = sum over block b's inputs i of xq[r][i] * code(c, i) for rows r < 16 of x
 * (rows k bytes apart, all 16 readable), channels c < 16: nb * AMX_SUM_INTS int32. */
void amx_sums(const uint8_t *codes, const int8_t *x, int64_t k, int64_t nb, int32_t dtype, int32_t *isum);

/* A thread's scratch and tile configuration for the matmuls below (small_matmul.c). amx_start
 * returns 0 where the tiles are not in use (their rows then take the VNNI path); amx_stop undoes
 * either outcome. */
typedef struct {
    uint8_t *codes; /* a panel's codes as B rows: k / 32 * AMX_CODE_BYTES */
    int32_t *isum;  /* 16 rows' sums of AMX_CHUNK blocks, twice (small_matmul.c) */
    int started;
} AmxScratch;
int amx_start(AmxScratch *s, int64_t k);
void amx_stop(AmxScratch *s);
/* y[m][c] (=|+=, mode) x[m] . W[c] (+ bias[c]), or silu(gate) * up where swiglu, for the panels
 * (gate/up pairs) [p0, p1) through the tiles, k <= the k amx_start was given: the bits of
 * matmul_panels/swiglu_panels. xq holds amx_rows_of(m) rows, zero past m. */
void amx_panels(const Matrix *w, const QRows *xq, int64_t m, float *y, int64_t ldy, int64_t p0, int64_t p1, int swiglu, int mode,
                const AmxScratch *s);
/* The rows a QRows buffer holds for m rows of a matmul that may take the tiles: whole tiles. */
static inline int64_t amx_rows_of(int64_t m) { return m >= AMX_MIN_ROWS ? (m + AMX_ROWS - 1) / AMX_ROWS * AMX_ROWS : m; }

/* Bytes of one block of 32 inputs of a block-quantized panel. */
static inline int64_t qblock_bytes(int32_t dtype) { return dtype == WEIGHT_Q8_0 ? 34 * VW : 20 * VW; }

/* Bytes of one panel of a packed matrix. */
static inline int64_t panel_bytes(const Matrix *w) {
    if (w->dtype == WEIGHT_Q8_0 || w->dtype == WEIGHT_Q4) return w->k / QBLOCK * qblock_bytes(w->dtype);
    return w->k * VW * (w->dtype == WEIGHT_I8 ? 1 : (int64_t)sizeof(float));
}

/* Bytes of a packed matrix's panels, and whether that many bytes of weights stay in the
 * last-level cache between passes. */
int64_t matrix_bytes(const Matrix *w);
int fits_in_cache(int64_t bytes);

/* Contiguous share [lo, hi) of n items for thread t of nt. */
static inline void thread_share(int64_t n, int t, int nt, int64_t *lo, int64_t *hi) {
    *lo = n * t / nt;
    *hi = n * (t + 1) / nt;
}

typedef struct {
    int64_t block_size, num_kv_heads, group, head_dim;
    int kv; /* the pool's element type: KV_F32, KV_BF16 or KV_F16 */
} Shape;

/* A KV pool element type (Model.kv_dtype): float32; bfloat16, widened exactly (shifted into a
 * float's upper half); float16 (llama.cpp's default cache type), widened exactly (F16C's
 * vcvtph2ps). Every reader widens as it loads and then runs the float32 arithmetic unchanged. */
enum { KV_F32 = 0, KV_BF16 = 1, KV_F16 = 2 };
static inline size_t kv_bytes(int kv) { return kv == KV_F32 ? 4 : 2; }

static inline float bf16_to_float(uint16_t h) {
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* torch's float -> bfloat16 (c10::BFloat16): round to nearest even; a NaN becomes 0x7FC0. */
static inline uint16_t float_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if (f != f) return 0x7FC0;
    return (uint16_t)((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

/* float16 <-> float: exact one way, rounded to nearest even the other, as torch's .to(float16)
 * rounds (past 65504 to infinity). F16C on x86 (every x86 CPU since 2012); elsewhere the
 * compiler's _Float16 (GCC >= 12, Clang; native on AArch64). */
static inline float f16_to_float(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    _Float16 x;
    memcpy(&x, &h, sizeof h);
    return (float)x;
#endif
}

static inline uint16_t float_to_f16(float f) {
#if defined(__F16C__)
    return (uint16_t)_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
#else
    const _Float16 x = (_Float16)f;
    uint16_t h;
    memcpy(&h, &x, sizeof h);
    return h;
#endif
}

/* A float as a 16-bit pool element (KV_BF16 or KV_F16), rounded as torch rounds: kv_at's inverse. */
static inline uint16_t kv_half_of(float f, int kv) { return kv == KV_BF16 ? float_to_bf16(f) : float_to_f16(f); }

/* One K/V element as a float. */
static inline __attribute__((always_inline)) float kv_at(const void *row, int64_t d, const int kv) {
    if (kv == KV_F32) return ((const float *)row)[d];
    const uint16_t h = ((const uint16_t *)row)[d];
    return kv == KV_BF16 ? bf16_to_float(h) : f16_to_float(h);
}

/* VW K/V elements at element d of a row, as floats. */
static inline __attribute__((always_inline)) vf kv_loadv(const void *row, int64_t d, const int kv) {
    if (kv == KV_F32) return loadv((const float *)row + d);
    const uint16_t *p = (const uint16_t *)row + d;
#if defined(__AVX512F__)
    const __m256i bits = _mm256_loadu_si256((const __m256i *)p);
    return kv == KV_BF16 ? (vf)_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16) : (vf)_mm512_cvtph_ps(bits);
#elif defined(__AVX2__) && defined(__F16C__)
    const __m128i bits = _mm_loadu_si128((const __m128i *)p);
    return kv == KV_BF16 ? (vf)_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16) : (vf)_mm256_cvtph_ps(bits);
#else
    vf v;
    for (int i = 0; i < VW; i++) v[i] = kv_at(p, i, kv);
    return v;
#endif
}

/* 8 K/V elements at element d of a row, as floats. */
static inline __attribute__((always_inline)) v8 kv_load8(const void *row, int64_t d, const int kv) {
    v8 v;
    if (kv == KV_F32) {
        memcpy(&v, (const float *)row + d, sizeof v);
        return v;
    }
    const uint16_t *p = (const uint16_t *)row + d;
#if defined(__AVX2__) && defined(__F16C__)
    const __m128i bits = _mm_loadu_si128((const __m128i *)p);
    return kv == KV_BF16 ? (v8)_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16) : (v8)_mm256_cvtph_ps(bits);
#else
    for (int i = 0; i < 8; i++) v[i] = kv_at(p, i, kv);
    return v;
#endif
}

/* Decode attention of one sequence for KV heads [h0, h1): q and out point at the sequence's
 * row ([Hkv, G, D]). KERNEL_OK, or KERNEL_NO_MEMORY if the scores could not be allocated. */
int attend_sequence(const float *q, const void *k_cache, const void *v_cache, const int64_t *table, int64_t len,
                    int64_t window, float scale, Shape s, int64_t h0, int64_t h1, float *out);
/* The same for `rows` query rows of one sequence at consecutive positions (row j at
 * q + j * q_stride, attending to lens[j] positions, lens ascending), each K/V row read once for
 * all rows; each row's result is the bits attend_sequence gives it alone. */
int attend_rows(const float *q, int64_t q_stride, int64_t rows, const int64_t *lens, const void *k_cache, const void *v_cache,
                const int64_t *table, int64_t window, float scale, Shape s, int64_t h0, int64_t h1, float *out,
                int64_t out_stride);
/* attend_rows over the positions [p0, p1) of the context alone (a part; rows not reaching p0 get
 * nothing), each row's output normalised over the part, and its (largest score, sum of
 * exponentials) per query head written to stats (row j's at stats + j * stats_stride, query head
 * qh's pair at 2 qh; an empty part: -inf, 0) for merge_parts. */
int attend_part(const float *q, int64_t q_stride, int64_t rows, const int64_t *lens, const void *k_cache, const void *v_cache,
                const int64_t *table, int64_t window, float scale, Shape s, int64_t h0, int64_t h1, float *out,
                int64_t out_stride, int64_t p0, int64_t p1, float *stats, int64_t stats_stride);
/* One row's attention output from its parts' (attend_part): parts [num_parts, heads * head_dim] and
 * stats [num_parts, heads, 2] in the order of the positions, each part weighed by its sum of
 * exponentials scaled to the largest score of all (a fixed order of summation: the result depends
 * on the row's context alone). */
void merge_parts(const float *parts, const float *stats, int64_t num_parts, int64_t heads, int64_t head_dim, float *out);

/* Each row's argmax (torch.argmax's tie and NaN rule) and its log-probability (greedy.c); the
 * unchecked loop the fused calls use on their own buffers (greedy_rows is the exported one). */
void argmax_rows(const float *logits, int64_t rows, int64_t vocab, int64_t *tokens, float *logprobs);

/* A token drawn from a row of logits by inverse transform sampling of u at 1 / inv_temperature
 * and min_p (categorical.c), and a token's log-probability in a row (greedy.c): the unchecked
 * row functions the fused calls use (sample_rows and token_logprobs are the exported ones). */
int64_t categorical_row(const float *x, int64_t vocab, float inv_temperature, float min_p, double u);
float token_logprob(const float *x, int64_t vocab, int64_t token);

/* A row of logits filtered in place to its top-k, then its top-p nucleus (nucleus.c; top_k >=
 * vocab or top_p >= 1: that filter off); scratch: NUCLEUS_SCRATCH * vocab 32-bit words. */
enum { NUCLEUS_SCRATCH = 4 };
void nucleus_row(float *x, int64_t vocab, int64_t top_k, float top_p, uint32_t *scratch);

/* One random row's rule, as the sampler applies it (categorical.c, draw_row). */
typedef struct {
    float inv_temperature, temperature, min_p, top_p;
    int64_t top_k;
} RowDraw;

/* Floats of scratch a draw with top-k or top-p takes per token of the vocabulary: the row divided
 * by its temperature, and the nucleus filter's words. */
enum { DRAW_SCRATCH = 1 + NUCLEUS_SCRATCH };

/* Whether a row's draw filters its logits (top-k below the vocabulary, or top-p below 1). */
static inline int draw_filters(RowDraw d, int64_t vocab) { return d.top_k < vocab || d.top_p < 1.0f; }

/* Row i's rule from the arrays of an exported call (min_p, top_k, top_p NULL: off for every row). */
static inline RowDraw row_draw(const float *inv_temperature, const float *temperature, const float *min_p, const int64_t *top_k,
                               const float *top_p, int64_t i) {
    return (RowDraw){inv_temperature[i], temperature ? temperature[i] : 0.0f, min_p ? min_p[i] : 0.0f,
                     top_p ? top_p[i] : 1.0f, top_k ? top_k[i] : INT64_MAX};
}

/* The sampler's draw of one random row (categorical.c): unfiltered, categorical_row at the row's
 * 1 / temperature; with top-k or top-p, the logits divided by the temperature into scratch
 * (DRAW_SCRATCH * vocab floats), filtered there and drawn at temperature 1. */
int64_t draw_row(const float *x, int64_t vocab, RowDraw d, double u, float *scratch);

/* Refuses a rule outside the sampler's ranges (1 / temperature > 0 and finite, min_p in [0, 1],
 * top_k >= 1, top_p in (0, 1], a filtered row's temperature > 0 and finite), naming the row as
 * `what` ("sample rows: draw") and its index. */
int check_row_draw(RowDraw d, int64_t vocab, const char *what, int64_t i);

/* Cephes' expf, shared by exp_nonpositive and paged_decode.c's vector exp_lanes (c, n, r and p a
 * float or a vector of floats, so both expand to the same arithmetic): the exponent n =
 * floor(c log2(e) + 1/2), the reduced argument r = c - n ln2 (ln2 in two parts), and the
 * degree-6 polynomial p(r) ~ exp(r) on [-ln2/2, ln2/2], its leading coefficient EXP_LEAD. */
#define EXP_EXPONENT_ARG(c) ((c) * 1.44269504088896341f + 0.5f)
#define EXP_REDUCED(c, n) ((c) - (n) * 0.693359375f + (n) * 2.12194440e-4f)
#define EXP_LEAD 1.9875691500e-4f
#define EXP_POLY(p, r)                   \
    do {                                 \
        p = p * r + 1.3981999507e-3f;    \
        p = p * r + 8.3334519073e-3f;    \
        p = p * r + 4.1665795894e-2f;    \
        p = p * r + 1.6666665459e-1f;    \
        p = p * r + 5.0000001201e-1f;    \
        p = p * r * r + r + 1.0f;        \
    } while (0)

/* exp(x) for x <= 0, within 2 ulp of expf (Cephes' expf: 2^n times a degree-6 polynomial on
 * [-ln2/2, ln2/2]), written so that the compiler vectorises it — libm's expf is a scalar call.
 * Below -87 (where expf is under 2e-38) it returns 0, so no subnormal is produced. */
static inline float exp_nonpositive(float x) {
    const float c = x < -87.0f ? -87.0f : x;
    const float n = __builtin_floorf(EXP_EXPONENT_ARG(c));
    const float r = EXP_REDUCED(c, n);
    float p = EXP_LEAD;
    EXP_POLY(p, r);
    union {
        int32_t bits;
        float value;
    } scale = {.bits = ((int32_t)n + 127) << 23};
    return x < -87.0f ? 0.0f : p * scale.value;
}

/* The largest of a row's n floats in one vector pass, and in *nan whether any is NaN (the sampler's
 * kernels treat such a row as torch does: greedy.c takes the NaN as the maximum, nucleus.c leaves
 * the row unfiltered). */
static inline float row_max(const float *x, int64_t n, int *nan) {
    float top = -INFINITY;
    int any_nan = 0;
#pragma omp simd reduction(max : top) reduction(| : any_nan)
    for (int64_t i = 0; i < n; i++) {
        top = x[i] > top ? x[i] : top;
        any_nan |= x[i] != x[i];
    }
    *nan = any_nan;
    return top;
}

#endif
