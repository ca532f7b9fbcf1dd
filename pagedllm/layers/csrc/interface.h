/* The kernel library's interface: every struct Python builds, every function it calls, and the
 * named constants both sides use, declared once.
 *
 * The kernels include it (through kernels.h), so the compiler holds every definition to these
 * prototypes. The Python side reads this very file (layers/kernel_interface.py, through the
 * parser of layers/c_header.py) for its ctypes structures, the functions' signatures and the
 * constants; nothing of it is restated in Python. Hence the subset of C it is written in:
 * enums with an explicit value for every member, `typedef struct { ... } Name;` of fixed-width
 * scalars, pointers and structs declared above, and prototypes; no macros, arrays or unions
 * (the parser refuses them, with their line). The build adds a table of every struct's size and
 * every field's offset as the compiler laid them out (kernel_layout), and the loader checks the
 * ctypes layouts against it (kernel_interface.check_layout).
 */
#ifndef PAGEDLLM_INTERFACE_H
#define PAGEDLLM_INTERFACE_H

#include <stdint.h>

/* What every exported kernel returns: one value per outcome, never or'ed together (a parallel
 * region reports the highest any of its workers returned). A kernel checks each size and index
 * it is given against the capacity its caller passed before it touches memory, and refuses with
 * KERNEL_REFUSED (the reason in kernel_last_error()) rather than read or write past a buffer: a
 * wrong step description from the engine becomes a Python exception, not a corrupted heap
 * (checks.c). KERNEL_BAD_SHAPE: a head shape the kernels do not compute (head_dim not a
 * multiple of 8, heads not a multiple of KV heads). */
enum KernelStatus { KERNEL_OK = 0, KERNEL_NO_MEMORY = 1, KERNEL_BAD_SHAPE = 2, KERNEL_REFUSED = 3 };

/* The kinds of a packed weight's panels (Matrix.dtype). */
enum WeightKind { WEIGHT_F32 = 0, WEIGHT_I8 = 1, WEIGHT_Q8_0 = 2, WEIGHT_Q4 = 3 };

/* A weight matrix [n, k] (y = x W^T) packed for small-M matmuls: panels of VW output channels,
 * each stored k-major ([k][VW]) so that one panel is one sequential stream and every load is a
 * full vector of VW channels for one input. Channels past n are zero. int8 panels hold the
 * symmetric per-channel quantization q = round(w / scale). scale and bias are stored per panel
 * lane ([num_panels * VW]); for a fused gate/up matrix the panels alternate gate, up.
 *
 * Block-quantized panels keep llama.cpp's blocks of 32 inputs (GGUF Q8_0, Q4_1, and Q4_0 as Q4_1
 * with min -8d, which dequantizes to the same values), their bits unchanged, laid out per panel
 * block by block, each block k-major over the panel's VW channels:
 *   Q8_0: d[VW] (fp16), q[32][VW] (int8)                     w = d q
 *   Q4:   d[VW] (fp16), m[VW] (fp16), q[16][VW] (two nibbles) w = d q + m
 * A Q4 byte holds inputs j (low nibble) and j + 16 (high nibble) of its block, as in GGUF's Q4_1.
 * k is a multiple of 32. */
typedef struct {
    const void *panels;
    const float *scale; /* int8: per channel; NULL for fp32 */
    const float *bias;  /* per channel, or NULL */
    int64_t n, k, num_panels;
    int32_t dtype; /* a WeightKind */
    int32_t reserved;
    int64_t panel_capacity; /* bytes the caller allocated at panels */
    int64_t lane_capacity;  /* floats the caller allocated at scale and at bias (where given) */
    /* 1: a Q4/Q8_0 matrix multiplies activations quantized to int8 per block of 32 (scale
     * max|x| / 127, round to nearest even) with integer dot products, llama.cpp's Q8_1 way
     * (small_matmul.c): faster, not exact. 0: every weight dequantized exactly in fp32. 0 for
     * the other kinds. */
    int32_t int8_activations;
} Matrix;

/* The fused decode step's description of a model and of a step (decode_step.c), shared with
 * the loops built on it (decode_steps, and greedy speculation in speculate.c). */
typedef struct {
    Matrix qkv, o, gate_up, down;
    const float *input_norm, *post_norm; /* [hidden] */
    const float *q_norm, *k_norm;        /* [head_dim], or NULL */
    void *k_cache, *v_cache;             /* [num_blocks, block_size, num_kv_heads, head_dim], Model.kv_dtype's type */
    int64_t window;                      /* <= 0: no sliding window */
} Layer;

typedef struct {
    int64_t num_layers, hidden, num_heads, num_kv_heads, head_dim, intermediate, vocab, block_size;
    float eps, attn_scale;
    int64_t embed_rows;      /* token ids the embedding has rows for (vocab: the LM head's columns) */
    int64_t num_blocks;      /* blocks of every layer's KV caches */
    int64_t max_position;    /* rows of the rotary tables */
    const float *embed;      /* [vocab, hidden] */
    const float *cos, *sin;  /* [max_position, head_dim]; sin's first half negated (rotary.py) */
    const float *final_norm; /* [hidden] */
    const Matrix *lm_head;
    const Layer *layers;
    int64_t kv_dtype; /* the KV caches' element type: 0 float32, 1 bfloat16, 2 float16 (kernels.h KV_*; written
                       * rounded to nearest even, as torch rounds) */
} Model;

/* A LoRA adapter's low-rank pair at one projection of one layer (lora/weights.py): the rows that
 * use the adapter get (x a^T) b_t added to the projection's output columns, a [rank, k] and b_t
 * [rank, n] (k, n: the projection's inputs and outputs, the scaling folded into b_t), both float32,
 * or both bfloat16 where bf16 is 1 (vLLM's lora_dtype: half the bytes a step reads; widened
 * exactly to float32, the sums in float32). a NULL: the adapter does not target the projection. */
typedef struct {
    const void *a, *b_t;
    int64_t rank;
    int64_t a_capacity, b_capacity; /* elements (floats or bfloat16s) the caller allocated at a and at b_t */
    int64_t bf16;
} LoraPair;

/* The adapters of a fused step's rows (decode_step.c): pairs [num_adapters * num_layers * 7],
 * each layer's q, k, v, o, gate, up and down pairs in that order; row_adapter [rows], an index into
 * the adapters or -1 (the base model); gate_up_raw [num_layers]: each layer's gate/up panels as
 * a plain matrix (gate channels, then up), which the rows' gate/up deltas need before the SiLU;
 * NULL when no adapter of the step targets gate/up. */
typedef struct {
    int64_t num_adapters;
    const int64_t *row_adapter;
    const LoraPair *pairs;
    const Matrix *gate_up_raw;
} Lora;

typedef struct {
    int64_t rows;
    const int64_t *token_ids, *positions, *slots, *ctx_lens; /* [rows] */
    const int64_t *block_tables;                             /* [rows, max_blocks] */
    int64_t max_blocks;
    const int64_t *logit_rows; /* [num_logits] */
    int64_t num_logits;
    float *logits;           /* [num_logits, vocab] */
    int64_t logits_capacity; /* floats allocated at logits */
    const Lora *lora;        /* the rows' LoRA adapters, or NULL: every row the base model */
} Step;

/* Greedy speculation's sequences, in and out (speculate.c). */
typedef struct {
    int64_t num_seqs, k;
    const int64_t *block_tables; /* [num_seqs, max_blocks]: each covers its sequence's writes */
    int64_t max_blocks;
    const int64_t *capacity; /* [num_seqs]: positions its block table covers */
    const int64_t *budget;   /* [num_seqs]: the most tokens to produce (<= out_ld) */
    const int64_t *history;  /* [num_seqs, history_ld]: tokens at draft_position .. position */
    int64_t history_ld;
    int64_t *position;          /* [num_seqs] in/out: the newest token's position */
    int64_t *draft_position;    /* [num_seqs] in/out: the draft's KV is valid below it */
    const int64_t *draft_vocab; /* the draft's logit column -> token id; NULL: the same ids */
    int64_t *tokens;            /* [num_seqs, out_ld] out: the tokens produced */
    float *logprobs;            /* [num_seqs, out_ld] out: each one's logprob under the target */
    int64_t out_ld;
    int64_t *num_tokens; /* [num_seqs] out */
    int64_t *proposed;   /* [num_seqs, num_cycles] out: proposals verified per cycle, -1: none ran */
    int64_t *accepted;   /* [num_seqs, num_cycles] out: of them accepted */
    float min_log_prob;  /* a proposal with a lower draft log-probability is not made (-inf: all are) */
} Speculation;

/* One row of kernel_layout's table: a struct ("Matrix": its size, offset 0) or one of its
 * fields ("Matrix.panels": its size and offset), as this library's compiler laid them out. */
typedef struct {
    const char *name;
    int64_t size, offset;
} LayoutEntry;

/* Decode attention of `batch` sequences over the paged pool (paged_decode.c). Every size is
 * checked against what the caller allocated (q_capacity / out_capacity floats at q / out,
 * table_capacity entries at block_tables, lens_capacity at ctx_lens, num_blocks blocks in each
 * cache) before any is used. */
int paged_decode_f32(const float *q, int64_t q_stride, int64_t q_capacity, const float *k_cache, const float *v_cache,
                     int64_t num_blocks, const int64_t *block_tables, int64_t table_capacity, const int64_t *ctx_lens,
                     int64_t lens_capacity, float *out, int64_t out_stride, int64_t out_capacity, int64_t batch,
                     int64_t max_blocks, int64_t block_size, int64_t num_kv_heads, int64_t group, int64_t head_dim,
                     int64_t window, float scale, int num_threads);

/* The same over a pool of bfloat16 K/V (kv_cache_dtype="bfloat16"), each element widened exactly
 * as it is read. */
int paged_decode_bf16(const float *q, int64_t q_stride, int64_t q_capacity, const void *k_cache, const void *v_cache,
                      int64_t num_blocks, const int64_t *block_tables, int64_t table_capacity, const int64_t *ctx_lens,
                      int64_t lens_capacity, float *out, int64_t out_stride, int64_t out_capacity, int64_t batch,
                      int64_t max_blocks, int64_t block_size, int64_t num_kv_heads, int64_t group, int64_t head_dim,
                      int64_t window, float scale, int num_threads);

/* The same over a pool of float16 K/V (kv_cache_dtype="float16", llama.cpp's default cache type),
 * each element widened exactly as it is read. */
int paged_decode_f16(const float *q, int64_t q_stride, int64_t q_capacity, const void *k_cache, const void *v_cache,
                     int64_t num_blocks, const int64_t *block_tables, int64_t table_capacity, const int64_t *ctx_lens,
                     int64_t lens_capacity, float *out, int64_t out_stride, int64_t out_capacity, int64_t batch,
                     int64_t max_blocks, int64_t block_size, int64_t num_kv_heads, int64_t group, int64_t head_dim,
                     int64_t window, float scale, int num_threads);

/* Causal attention of one prefill chunk's q_len query rows, the last of a context of ctx_len
 * (prefill_attention.c); max_blocks entries at table. */
int prefill_attention_f32(const float *q, int64_t q_stride, int64_t q_capacity, const float *k_cache, const float *v_cache,
                          int64_t num_blocks, const int64_t *table, int64_t max_blocks, int64_t q_len, int64_t ctx_len,
                          float *out, int64_t out_stride, int64_t out_capacity, int64_t block_size, int64_t num_kv_heads,
                          int64_t group, int64_t head_dim, int64_t window, float scale, int num_threads);
int prefill_attention_bf16(const float *q, int64_t q_stride, int64_t q_capacity, const void *k_cache, const void *v_cache,
                           int64_t num_blocks, const int64_t *table, int64_t max_blocks, int64_t q_len, int64_t ctx_len,
                           float *out, int64_t out_stride, int64_t out_capacity, int64_t block_size, int64_t num_kv_heads,
                           int64_t group, int64_t head_dim, int64_t window, float scale, int num_threads);
int prefill_attention_f16(const float *q, int64_t q_stride, int64_t q_capacity, const void *k_cache, const void *v_cache,
                          int64_t num_blocks, const int64_t *table, int64_t max_blocks, int64_t q_len, int64_t ctx_len,
                          float *out, int64_t out_stride, int64_t out_capacity, int64_t block_size, int64_t num_kv_heads,
                          int64_t group, int64_t head_dim, int64_t window, float scale, int num_threads);

/* y = x W^T for m rows, or silu(gate) * up when `swiglu` (small_matmul.c); x_capacity /
 * y_capacity floats at x / y. */
int small_matmul(const Matrix *w, const float *x, int64_t m, int64_t ldx, int64_t x_capacity, float *y, int64_t ldy,
                 int64_t y_capacity, int swiglu, int num_threads);

/* One decode step of st->rows rows on num_threads threads: every row's K/V written at its slot,
 * the logits of st->logit_rows (decode_step.c). KERNEL_BAD_SHAPE for the head shape;
 * KERNEL_REFUSED: a size or index of the model or the step outside its buffer, nothing computed. */
int decode_step(const Model *md, const Step *st, int num_threads);
/* The LoRA deltas of one projection site for m rows (a prefill through the modules, lora/layers.py),
 * the fused step's shrink and expand: a row r with lora->row_adapter[r] = g >= 0 gets (x[r] a^T) b_t
 * of adapter g's pair at `layer` (of num_layers) for projections first .. first + count - 1, added to
 * y[r]'s columns offset .. offset + n - 1; shapes [count * 3]: each projection's k, n, offset. Rows
 * split over the threads (decode_step.c). KERNEL_REFUSED: a size, rank or index outside its buffer. */
int lora_delta(const Lora *lora, int64_t num_layers, int64_t layer, int64_t first, int64_t count, const int64_t *shapes,
               const float *x, int64_t m, int64_t ldx, int64_t x_capacity, float *y, int64_t ldy, int64_t y_capacity,
               int num_threads);

/* How decode_steps draws each logit row's token: row i at 1 / inv_temperature[i] (0: its argmax)
 * and min_p[i], or with top_k[i] < vocab or top_p[i] < 1 from the row divided by temperature[i]
 * and filtered (sample_rows' rule; min_p, top_k, top_p NULL: off for every row, temperature NULL
 * where no row filters), by inverse transform sampling of uniform[s * rows + i] at step s
 * (uniform_capacity entries). */
typedef struct {
    const float *inv_temperature;
    const float *temperature;
    const float *min_p;
    const int64_t *top_k;
    const float *top_p;
    const double *uniform;
    int64_t uniform_capacity;
} Draws;

/* num_steps decode steps of the same rows, each row's token fed back as its next input: its
 * argmax, or where draws (may be NULL: every row greedy) says so a draw; tokens and their
 * logprobs [num_steps, rows] (out_capacity entries each); step s on threads[s] threads, its time
 * in seconds[s] (decode_step.c). */
int decode_steps(const Model *md, const Step *st, int64_t num_steps, const int *threads, double *seconds, const Draws *draws,
                 int64_t *tokens, float *logprobs, int64_t out_capacity);

/* Up to num_cycles cycles of greedy draft-model speculation (speculate.c); cycle c runs the
 * target on threads[2c] threads and the draft on threads[2c + 1], their times in seconds[2c]
 * and seconds[2c + 1]. */
int speculate_greedy(const Model *target, const Model *draft, Speculation *sp, int64_t num_cycles, const int *threads,
                     double *seconds);

/* Each of `rows` rows' argmax and its log-probability (greedy.c): logits_capacity floats at
 * logits, out_capacity entries at tokens and at logprobs; rows shared among num_threads. */
int greedy_rows(const float *logits, int64_t rows, int64_t vocab, int64_t logits_capacity, int64_t *tokens, float *logprobs,
                int64_t out_capacity, int num_threads);

/* Each of `rows` rows' log-probability of its token (greedy.c; a token below 0 reads token 0):
 * logits_capacity floats at logits, out_capacity entries at logprobs; rows shared among num_threads. */
int token_logprobs(const float *logits, int64_t rows, int64_t vocab, int64_t logits_capacity, const int64_t *tokens,
                   float *logprobs, int64_t out_capacity, int num_threads);

/* `rows` rows of logits with those below each row's top-k, then top-p, threshold set to -inf,
 * written to out (which may be logits; nucleus.c); top_k or top_p NULL where no row uses it (a
 * row's top_k >= vocab or top_p >= 1: off). Capacities in floats. */
int nucleus_filter(const float *logits, int64_t rows, int64_t vocab, int64_t logits_capacity, const int64_t *top_k,
                   const float *top_p, float *out, int64_t out_capacity, int num_threads);

/* `count` tokens drawn by inverse transform sampling (categorical.c): draw i from row row_of[i] of
 * `rows` rows of logits (logits_capacity floats) at 1 / inv_temperature[i] (> 0) and min_p[i] (0:
 * off), or where top_k[i] < vocab or top_p[i] < 1 from the row divided by temperature[i] and
 * filtered to its top-k, then top-p nucleus, at temperature 1 (min_p, top_k, top_p NULL: off for
 * all; temperature NULL where no draw filters), by uniform[i] in [0, 1), into tokens
 * (out_capacity entries); draws shared among num_threads. */
int sample_rows(const float *logits, int64_t rows, int64_t vocab, int64_t logits_capacity, const int64_t *row_of,
                const float *inv_temperature, const float *temperature, const float *min_p, const int64_t *top_k,
                const float *top_p, const double *uniform, int64_t count, int64_t *tokens, int64_t out_capacity, int num_threads);

/* A STREAM-like read of n floats by num_threads threads: the best of `repeats` passes, in bytes
 * per second (small_matmul.c; the decode benchmark's limit). */
double read_bandwidth(const float *buf, int64_t n, int repeats, int num_threads);

/* The arithmetic peak of this build's instructions on num_threads threads, in operations per
 * second (a multiply-add counts two), the best of `repeats` passes of `iterations` rounds of
 * independent register-only chains (small_matmul.c): int8 = 0, fp32 FMAs (VW lanes); int8 = 1,
 * the int8 products the int8-activation matmuls use (vpdpbusd with AVX-512 VNNI, vpmaddubsw
 * with AVX2; 0 where the build has neither). The compute side of the decode benchmark's limit,
 * measured in the dtype the engine computes in. */
double arithmetic_peak(int int8, int64_t iterations, int repeats, int num_threads);

/* The vector instruction set the library was built for: "avx512", "avx2" or "generic". */
const char *kernel_isa(void);

/* The integer dot products of int8-activation matmuls over many rows (small_matmul.c): "amx"
 * where the build has AMX-INT8 and the kernel grants this process the tiles, else
 * "avx512-vnni", "avx2" or "generic" (those of every row count). */
const char *int8_dot_product(void);

/* The output channels of a packed weight's panel (VW): weights are packed for the library that
 * reads them. */
int64_t panel_width(void);

/* Why this thread's last call was refused (checks.c). */
const char *kernel_last_error(void);

/* The layout table of this header's structs, `*count` rows (generated at build time). */
const LayoutEntry *kernel_layout(int64_t *count);

#endif
