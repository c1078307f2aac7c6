/* What the kernel sources share: the quantized weight descriptor, and the per-row and per-task
 * pieces that both the standalone entry points and the fused decode step (decode_step.c) run,
 * so that a fused step computes exactly what the per-op path computes. */
#ifndef LADLE_KERNELS_H
#define LADLE_KERNELS_H

#include <stdint.h>

/* A weight in the panel formats of runtime/quantization/formats.py. */
typedef struct {
    const void *w;               /* 8 bits [P, K, 16] or 4 bits [P, ceil(K / 2), 16] */
    const float *scale, *offset; /* groups == 0: scale [P * 16]; else [P, groups, 16] each */
    int32_t groups, group_size;  /* groups == 0: int8 per output channel (offset NULL) */
    int32_t bits;                /* of a group format's codes: 4 or 8 */
    /* NULL, or (4 bits) the codes again for int8 activations (a8_kernels.c): a draft
     * model's GEMVs use them where the CPU has VNNI. */
    const uint8_t *a8;
} ladle_qweight;

/* Whether a8_kernels.c is compiled here (x86-64, GCC or Clang); the CPU decides at run time. */
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define LADLE_HAVE_A8 1
#else
#define LADLE_HAVE_A8 0
#endif

/* Rows up to which a product with int8-activation codes uses them: the fused decode step's
 * largest batch (decode_step.py's MAX_BATCH). */
#define LADLE_A8_MAX_ROWS 8

/* 1 when this CPU runs the int8-activation GEMV (AVX-512 VNNI), else 0. */
int ladle_a8_supported(void);

#if LADLE_HAVE_A8
/* ladle_gemv_q_panels for a weight with its int8-activation codes (q->a8, K a multiple of 8);
 * only where ladle_a8_supported(). */
void ladle_a8_gemv_panels(const float *x, int64_t ldx, const ladle_qweight *q, const float *bias,
                          float *y, int64_t ldy, int64_t R, int32_t p0, int32_t p1, int32_t K);
#endif

/* y[r] = x[r] W^T (+ bias) for R rows and the outputs of panels [p0, p1), weights converted in
 * registers and read once for all rows. */
void ladle_gemv_q_panels(const float *x, int64_t ldx, const ladle_qweight *q, const float *bias,
                         float *y, int64_t ldy, int64_t R, int32_t p0, int32_t p1, int32_t K);

/* One row of RMSNorm (with the residual added in place first, when residual is not NULL). */
void ladle_rms_norm_row(const float *x, float *residual, const float *weight, float *out,
                        int32_t cols, float eps);

/* RoPE (rotate-half) of one token's heads, in place, with that token's cos/sin rows. */
void ladle_rope_heads(float *x, int32_t heads, const float *cos, const float *sin,
                      int32_t head_dim);

/* SiLU-and-mul of n values: out[d] = silu(gate[d]) * up[d]. */
void ladle_silu_and_mul_row(const float *gate, const float *up, float *out, int32_t n);

/* Decode attention of one sequence (query qs, output os, context len) for query heads
 * [h0, h1), with its own score buffer; nonzero when that could not be allocated. The f16
 * variant reads an fp16 cache, the i8 variant an int8 cache with per-(slot, KV head) scales. */
int ladle_decode_attention_f32_heads(const float *qs, float *os, const float *key_cache,
                                     const float *value_cache, const int32_t *table, int32_t len,
                                     int32_t h0, int32_t h1, int32_t group, int32_t num_kv_heads,
                                     int32_t head_dim, int32_t block_size, float scale);
int ladle_decode_attention_f16_heads(const float *qs, float *os, const uint16_t *key_cache,
                                     const uint16_t *value_cache, const int32_t *table,
                                     int32_t len, int32_t h0, int32_t h1, int32_t group,
                                     int32_t num_kv_heads, int32_t head_dim, int32_t block_size,
                                     float scale);
int ladle_decode_attention_i8_heads(const float *qs, float *os, const int8_t *key_cache,
                                    const int8_t *value_cache, const float *key_scale,
                                    const float *value_scale, const int32_t *table, int32_t len,
                                    int32_t h0, int32_t h1, int32_t group, int32_t num_kv_heads,
                                    int32_t head_dim, int32_t block_size, float scale);

/* One row to fp16, rounding to nearest even. */
void ladle_f32_to_f16_row(const float *x, uint16_t *out, int32_t n);

/* One (token, KV head) row of the int8 cache: codes and its absmax / 127 scale. */
void ladle_quantize_kv_row(const float *row, int8_t *dst, float *scale, int32_t head_dim);

#endif
