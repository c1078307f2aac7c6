/* A whole decode step of a Llama-family model in one call, for small batches on a CPU.
 *
 * At batch 1 a 135M-parameter model's step is a few milliseconds of weight reads; driving it op
 * by op from Python costs about a dozen torch ops and ctypes calls per layer, each waking the
 * thread team and joining it again. Here the team is woken once per step: one OpenMP parallel
 * region runs the step as a list of ops (eight a layer, twelve with LoRA adapters), each cut
 * into chunks (a few output panels of a GEMV, one (sequence, KV head) of attention, one row of
 * a norm or of a LoRA shrink).
 *
 * Threads claim chunks with an atomic counter and then wait for the op's chunks to be *done*,
 * not for the other threads to *arrive*: a thread that the OS has descheduled (a shared
 * machine, a pod at its CPU limit) holds up nobody unless it holds a chunk, and catches up when
 * it runs again, finding the finished ops' chunks all claimed. On a quiet machine the threads
 * share every op; on a loaded one the step degrades towards one thread instead of stalling at
 * every barrier. A waiting thread spins briefly, then sleeps on a futex, so that it gives its
 * core back instead of spinning through the other's time slice.
 *
 * The pieces are the per-op kernels' own (kernels.h), so the numerics are theirs; only the
 * fp32 GEMV is new here (torch's GEMM serves the per-op path), and it sums in another order, so
 * outputs agree to rounding. The step ends with the LM head's logits; the embedding lookup
 * before it stays with the caller.
 */
#include <limits.h>
#include <math.h>
#include <omp.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#ifdef __linux__
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#else
#include <sched.h>
#endif
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define cpu_relax() _mm_pause()
#else
#define cpu_relax() ((void)0)
#endif

#include "kernels.h"

#pragma GCC diagnostic ignored "-Wpsabi"

#if defined(__AVX512F__)
#define VW 16
#define ROWS 4
#elif defined(__AVX2__)
#define VW 8
#define ROWS 2
#else
#define VW 4
#define ROWS 2
#endif
/* Outputs per tile of the fp32 GEMV at batches over ROWS: each x vector loaded serves OUTS. */
#define OUTS 4
/* GEMV outputs are cut into chunks of whole panels. */
#define PANEL 16
/* Pause instructions before a waiting thread sleeps: some tens of microseconds. */
#define SPIN 2048
/* How far ahead of its reads a GEMV asks for weights. The hardware prefetcher stops at each
 * 4 KiB page and starts again only after a few misses; asking 2 KiB ahead keeps the stream
 * going (batch-1 fp32 step 6-9% faster on an AVX-512 Xeon, 4 rows 33%; 0.5 KiB did nothing,
 * 4 KiB less than 2). */
#define PREFETCH_BYTES 2048
static inline void prefetch(const float *p) {
    __builtin_prefetch((const char *)p + PREFETCH_BYTES, 0, 3);
}
typedef float vf __attribute__((vector_size(VW * 4)));
typedef float vf_unaligned __attribute__((vector_size(VW * 4), aligned(4)));
static inline vf vload(const float *p) { return *(const vf_unaligned *)p; }

/* The sum of a vector's lanes as a tree of shuffles and adds: lane by lane, in order, the 16
 * sums that end a tile (4 rows by 4 outputs) took longer than the tile's FMAs. */
static inline float hsum(vf v) {
#if VW == 16
    return _mm512_reduce_add_ps((__m512)v);
#elif VW == 8
    __m128 s = _mm_add_ps(_mm256_castps256_ps128((__m256)v), _mm256_extractf128_ps((__m256)v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
#else
    return (v[0] + v[2]) + (v[1] + v[3]);
#endif
}

/* INT8: per output channel; INT4 and INT8_GROUPS: scale and offset per group of inputs. */
enum { DENSE = 0, INT8 = 1, INT4 = 2, INT8_GROUPS = 3 };

typedef struct {
    int32_t kind, n, k, group_size;
    const void *w;                /* fp32 [n, k] row-major, or the panel codes */
    const float *scale, *offset;  /* quantized formats only */
    const float *bias;            /* NULL, or [n] (padded to whole panels when quantized) */
    /* LoRA slots (NULL without LoRA): a [slots, lora_width, k], b [slots, n, lora_rank].
     * Output o of slice i (o < lora_end0: 0; o < lora_end1: 1; else 2) reads the shrunk
     * columns [i * lora_rank, (i + 1) * lora_rank). */
    const float *lora_a, *lora_b;
    int32_t lora_rank, lora_width, lora_end0, lora_end1;
    const uint8_t *a8; /* INT4 only: NULL, or the codes for int8 activations (a8_kernels.c) */
} ladle_linear;

typedef struct {
    ladle_linear qkv, o_proj, gate_up, down;
    const float *input_norm, *post_norm, *q_norm, *k_norm; /* q/k norms NULL unless qk-norm */
    void *key_cache, *value_cache;
    float *key_scale, *value_scale; /* int8 only: NULL for an fp32 or fp16 cache */
    int32_t kv_f16;                 /* 1: the cache holds fp16 */
} ladle_decode_layer;

typedef struct {
    int32_t num_layers, hidden, num_heads, num_kv_heads, head_dim, intermediate, block_size;
    float eps, scale;
    const ladle_decode_layer *layers;
    const float *final_norm;
    const float *cos, *sin; /* [max_position, head_dim / 2] */
    ladle_linear lm_head;
} ladle_decode_model;

/* One op's chunk counters: claimed by threads, then done; sleepers wait on done. A cache
 * line each (OP_COUNTER_INTS ints), so that neighbouring ops do not share one. */
#define OP_COUNTER_INTS 16
typedef struct {
    atomic_int claimed, done, sleepers;
    int pad[OP_COUNTER_INTS - 3];
} op_counter;

/* Per-step buffers, [max_batch, width] each, widths padded to whole panels where a quantized
 * GEMV writes them; and room for the step's op counters. */
typedef struct {
    float *residual, *x, *qkv, *attn, *out, *gate_up, *act, *logits;
    int64_t ld_qkv, ld_out, ld_gate_up, ld_logits, max_batch;
    op_counter *counters;
    float *lora_shrunk; /* [max_batch, ld_lora]: one projection's x @ A.T at a time */
    int64_t ld_lora;
} ladle_decode_buffers;

/* A step's adapters: each row's slot (-1: the base model), and where shrinks go. */
typedef struct {
    const int32_t *slots;
    float *shrunk;
    int64_t ld;
} lora_step;

/* The next unclaimed chunk of the op, or -1 when all are claimed. */
static inline int claim(op_counter *c, int chunks) {
    if (atomic_load_explicit(&c->claimed, memory_order_relaxed) >= chunks) return -1;
    const int chunk = atomic_fetch_add(&c->claimed, 1);
    return chunk < chunks ? chunk : -1;
}

static inline void finish(op_counter *c, int chunks) {
    if (atomic_fetch_add(&c->done, 1) == chunks - 1 && atomic_load(&c->sleepers)) {
#ifdef __linux__
        syscall(SYS_futex, &c->done, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
#endif
    }
}

/* Until every chunk of the op is done. */
static void wait_done(op_counter *c, int chunks) {
    for (int i = 0; i < SPIN; i++) {
        if (atomic_load_explicit(&c->done, memory_order_acquire) >= chunks) return;
        cpu_relax();
    }
    atomic_fetch_add(&c->sleepers, 1);
    int seen;
    while ((seen = atomic_load(&c->done)) < chunks) {
#ifdef __linux__
        syscall(SYS_futex, &c->done, FUTEX_WAIT_PRIVATE, seen, NULL, NULL, 0);
#else
        sched_yield();
#endif
    }
    atomic_fetch_sub(&c->sleepers, 1);
}

/* R (<= ROWS) rows against one output of a row-major fp32 weight, for small batches, where
 * the step is weight reads: outputs go one at a time, so that a thread's chunk of rows streams
 * through memory in order, and the hardware prefetcher follows one stream at full speed (tiles
 * of several interleaved rows, each row only a few KiB, restart several short streams per
 * tile). On the model's shapes, two threads on a quiet machine: 27 GB/s this way against 23
 * GB/s with four interleaved rows, where a plain read makes 33. Two accumulators per row hide
 * the FMA latency. */
static inline __attribute__((always_inline)) void dense_row(const float *x, int64_t ldx,
                                                            const float *w, int32_t K, int R,
                                                            float out[ROWS][OUTS]) {
    vf acc[ROWS][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = (vf){0};
    int k = 0;
    for (; k + 2 * VW <= K; k += 2 * VW) {
        for (int line = 0; line < 2 * VW; line += 16) prefetch(w + k + line);
        const vf w0 = vload(w + k), w1 = vload(w + k + VW);
        for (int r = 0; r < R; r++) {
            acc[r][0] += vload(x + r * ldx + k) * w0;
            acc[r][1] += vload(x + r * ldx + k + VW) * w1;
        }
    }
    for (; k + VW <= K; k += VW) {
        const vf w0 = vload(w + k);
        for (int r = 0; r < R; r++) acc[r][0] += vload(x + r * ldx + k) * w0;
    }
    for (int r = 0; r < R; r++) {
        float sum = hsum(acc[r][0] + acc[r][1]);
        for (int kk = k; kk < K; kk++) sum += x[r * ldx + kk] * w[kk];
        out[r][0] = sum;
    }
}

/* R (<= ROWS) rows against OUTS consecutive outputs, for larger batches, where the step turns
 * to arithmetic: each x vector loaded serves OUTS outputs (two threads, quiet machine: 15%
 * faster than one output at a time at 8 rows, 47% at 32). */
static inline __attribute__((always_inline)) void dense_tile(const float *x, int64_t ldx,
                                                             const float *w, int32_t K, int R,
                                                             float out[ROWS][OUTS]) {
    vf acc[ROWS][OUTS];
    for (int r = 0; r < R; r++)
        for (int o = 0; o < OUTS; o++) acc[r][o] = (vf){0};
    int k = 0;
    for (; k + VW <= K; k += VW) {
        vf wv[OUTS];
        for (int o = 0; o < OUTS; o++) {
            prefetch(w + (int64_t)o * K + k);
            wv[o] = vload(w + (int64_t)o * K + k);
        }
        for (int r = 0; r < R; r++) {
            const vf xv = vload(x + r * ldx + k);
            for (int o = 0; o < OUTS; o++) acc[r][o] += xv * wv[o];
        }
    }
    for (int r = 0; r < R; r++)
        for (int o = 0; o < OUTS; o++) {
            float sum = hsum(acc[r][o]);
            for (int kk = k; kk < K; kk++) sum += x[r * ldx + kk] * w[(int64_t)o * K + kk];
            out[r][o] = sum;
        }
}

/* Rows [r0, r0 + rows) against outputs [n, n + outs) of a row-major fp32 weight. */
static inline __attribute__((always_inline)) void dense_block(const float *x, int64_t ldx,
                                                              const ladle_linear *lin, float *y,
                                                              int64_t ldy, int32_t r0, int rows,
                                                              int32_t n, int outs) {
    float out[ROWS][OUTS];
    const float *xr = x + (int64_t)r0 * ldx, *wn = (const float *)lin->w + (int64_t)n * lin->k;
    if (outs == OUTS)
        dense_tile(xr, ldx, wn, lin->k, rows, out);
    else
        dense_row(xr, ldx, wn, lin->k, rows, out);
    for (int r = 0; r < rows; r++)
        for (int o = 0; o < outs; o++)
            y[(int64_t)(r0 + r) * ldy + n + o] = out[r][o] + (lin->bias ? lin->bias[n + o] : 0.0f);
}

/* Outputs [n0, n1) for R rows: one output at a time while the batch fits one block of ROWS
 * rows, else tiles of OUTS (a partial last tile output by output). Always inlined into
 * dense_gemv's cases, so that R, and with it every block's row count, is a constant there: the
 * accumulators stay in registers and nothing is dispatched per output. (With R known only at
 * run time, a batch-1 step took 20% longer at the same bytes.) */
static inline __attribute__((always_inline)) void dense_outputs(const float *x, int64_t ldx,
                                                                const ladle_linear *lin, float *y,
                                                                int64_t ldy, const int32_t R,
                                                                int32_t n0, int32_t n1) {
    int outs;
    for (int32_t n = n0; n < n1; n += outs) {
        outs = R > ROWS && n + OUTS <= n1 ? OUTS : 1;
        int32_t r0 = 0;
        for (; r0 + ROWS <= R; r0 += ROWS) dense_block(x, ldx, lin, y, ldy, r0, ROWS, n, outs);
        if (R % ROWS) dense_block(x, ldx, lin, y, ldy, r0, R % ROWS, n, outs);
    }
}

/* A case for every batch the fused step takes (decode_step.py's MAX_BATCH: 8). */
static void dense_gemv(const float *x, int64_t ldx, const ladle_linear *lin, float *y,
                       int64_t ldy, int32_t R, int32_t n0, int32_t n1) {
#define DENSE_CASE(C)                                                                         \
    case C:                                                                                   \
        dense_outputs(x, ldx, lin, y, ldy, C, n0, n1);                                        \
        return;
    switch (R) {
        DENSE_CASE(1)
        DENSE_CASE(2)
        DENSE_CASE(3)
        DENSE_CASE(4)
        DENSE_CASE(5)
        DENSE_CASE(6)
        DENSE_CASE(7)
        DENSE_CASE(8)
    default: dense_outputs(x, ldx, lin, y, ldy, R, n0, n1);
    }
#undef DENSE_CASE
}

static float dot(const float *a, const float *b, int32_t K) {
    vf acc = (vf){0};
    int32_t k = 0;
    for (; k + VW <= K; k += VW) acc += vload(a + k) * vload(b + k);
    float sum = hsum(acc);
    for (; k < K; k++) sum += a[k] * b[k];
    return sum;
}

/* y[:, n0:n1] += shrunk @ B[slot].T for each row with an adapter (punica's expand). */
static void lora_expand(const ladle_linear *lin, const lora_step *lora, float *y, int64_t ldy,
                        int32_t R, int64_t n0, int64_t n1) {
    const int32_t rank = lin->lora_rank;
    for (int32_t r = 0; r < R; r++) {
        const int32_t slot = lora->slots[r];
        if (slot < 0) continue;
        const float *b = lin->lora_b + (int64_t)slot * lin->n * rank;
        const float *s = lora->shrunk + r * lora->ld;
        for (int64_t n = n0; n < n1; n++) {
            const int slice = (n >= lin->lora_end0) + (n >= lin->lora_end1);
            y[r * ldy + n] += dot(s + slice * rank, b + n * rank, rank);
        }
    }
}

/* Outputs of panels [p0, p1) (16 outputs each; the last may be partial for a dense weight),
 * with each row's adapter added when ``lora`` is given. */
static void linear_panels(const float *x, int64_t ldx, const ladle_linear *lin, float *y,
                          int64_t ldy, int32_t R, int64_t p0, int64_t p1, const lora_step *lora) {
    const int64_t n1 = p1 * PANEL < lin->n ? p1 * PANEL : lin->n;
    if (lin->kind == DENSE) {
        if (p0 * PANEL < n1) dense_gemv(x, ldx, lin, y, ldy, R, (int32_t)(p0 * PANEL), (int32_t)n1);
    } else {
        const int32_t groups =
            lin->kind == INT8 ? 0 : (lin->k + lin->group_size - 1) / lin->group_size;
        const ladle_qweight q = {lin->w,          lin->scale,
                                 lin->offset,     groups,
                                 lin->group_size, lin->kind == INT4 ? 4 : 8,
                                 lin->a8};
        ladle_gemv_q_panels(x, ldx, &q, lin->bias, y, ldy, R, (int32_t)p0, (int32_t)p1, lin->k);
    }
    if (lora != NULL && lin->lora_a != NULL) lora_expand(lin, lora, y, ldy, R, p0 * PANEL, n1);
}

/* shrunk[r] = x[r] @ A[slot].T for each row with an adapter: one row per chunk. An op of its
 * own, since every output panel of the projection reads all of a row's shrunk columns. */
static void lora_shrink_op(op_counter *c, const float *x, int64_t ldx, const ladle_linear *lin,
                           const lora_step *lora, int32_t batch) {
    for (int r; (r = claim(c, batch)) >= 0; finish(c, batch)) {
        const int32_t slot = lora->slots[r];
        if (slot < 0 || lin->lora_a == NULL) continue;
        const float *a = lin->lora_a + (int64_t)slot * lin->lora_width * lin->k;
        for (int32_t j = 0; j < lin->lora_width; j++)
            lora->shrunk[r * lora->ld + j] = dot(x + r * ldx, a + (int64_t)j * lin->k, lin->k);
    }
    wait_done(c, batch);
}

static inline int64_t panels(int32_t n) { return (n + PANEL - 1) / PANEL; }

/* Output panels per GEMV chunk: about CHUNKS_PER_THREAD chunks for each thread, so that a
 * descheduled thread holds up little, and the claims cost nothing against the weights read. */
#define CHUNKS_PER_THREAD 8

static inline int64_t panels_per_chunk(int64_t num_panels, int nt) {
    const int64_t split = (int64_t)CHUNKS_PER_THREAD * nt;
    const int64_t per = (num_panels + split - 1) / split;
    return per > 0 ? per : 1;
}

/* A GEMV as claimed chunks of output panels; returns once all of them are done. With
 * ``lora``, the op before it (``c - 1``) shrinks x for the adapters first. */
static void linear_op(op_counter *c, const float *x, int64_t ldx, const ladle_linear *lin,
                      float *y, int64_t ldy, int32_t R, int nt, const lora_step *lora) {
    if (lora != NULL) lora_shrink_op(c - 1, x, ldx, lin, lora, R);
    const int64_t P = panels(lin->n), per = panels_per_chunk(P, nt);
    const int chunks = (int)((P + per - 1) / per);
    for (int chunk; (chunk = claim(c, chunks)) >= 0; finish(c, chunks)) {
        const int64_t p0 = chunk * per;
        linear_panels(x, ldx, lin, y, ldy, R, p0, p0 + per < P ? p0 + per : P, lora);
    }
    wait_done(c, chunks);
}

/* x = norm(residual += out), or norm(residual) without out: one row per chunk. */
static void norm_op(op_counter *c, float *residual, const float *out, int64_t ld_out,
                    const float *weight, float *x, int32_t batch, int32_t H, float eps) {
    for (int r; (r = claim(c, batch)) >= 0; finish(c, batch)) {
        float *res = residual + (int64_t)r * H;
        if (out != NULL)
            ladle_rms_norm_row(out + r * ld_out, res, weight, x + (int64_t)r * H, H, eps);
        else
            ladle_rms_norm_row(res, NULL, weight, x + (int64_t)r * H, H, eps);
    }
    wait_done(c, batch);
}

/* gate_up as chunks of gate panels with the matching up panels, then their SiLU-and-mul. */
static void gate_up_op(op_counter *c, const float *x, const ladle_linear *lin,
                       const ladle_decode_buffers *b, int32_t batch, int32_t H, int32_t I,
                       int nt, const lora_step *lora) {
    if (lora != NULL) lora_shrink_op(c - 1, x, H, lin, lora, batch);
    const int64_t P = I / PANEL, per = panels_per_chunk(P, nt);
    const int chunks = (int)((P + per - 1) / per);
    for (int chunk; (chunk = claim(c, chunks)) >= 0; finish(c, chunks)) {
        const int64_t p0 = chunk * per, p1 = p0 + per < P ? p0 + per : P;
        linear_panels(x, H, lin, b->gate_up, b->ld_gate_up, batch, p0, p1, lora);
        linear_panels(x, H, lin, b->gate_up, b->ld_gate_up, batch, p0 + P, p1 + P, lora);
        for (int32_t r = 0; r < batch; r++) {
            const float *g = b->gate_up + r * b->ld_gate_up + p0 * PANEL;
            ladle_silu_and_mul_row(g, g + I, b->act + (int64_t)r * I + p0 * PANEL,
                                   (int32_t)((p1 - p0) * PANEL));
        }
    }
    wait_done(c, chunks);
}

/* Q/K norm, RoPE and the KV store for one (token, KV head). Every row's store is done before
 * any row's attention (two ops), so that rows of one sequence (a verifying step's draft
 * tokens, each a row whose length ends at its own position) see each other causally. */
static void store(const ladle_decode_model *m, const ladle_decode_layer *L, float *q_row,
                  int64_t position, int64_t slot, int32_t kvh) {
    const int32_t D = m->head_dim, half = D / 2, group = m->num_heads / m->num_kv_heads;
    float *q = q_row + (int64_t)kvh * group * D;
    float *k = q_row + (int64_t)(m->num_heads + kvh) * D;
    const float *v = q_row + (int64_t)(m->num_heads + m->num_kv_heads + kvh) * D;
    if (L->q_norm != NULL) {
        for (int32_t h = 0; h < group; h++)
            ladle_rms_norm_row(q + h * D, NULL, L->q_norm, q + h * D, D, m->eps);
        ladle_rms_norm_row(k, NULL, L->k_norm, k, D, m->eps);
    }
    const float *c = m->cos + position * half, *s = m->sin + position * half;
    ladle_rope_heads(q, group, c, s, D);
    ladle_rope_heads(k, 1, c, s, D);
    const int64_t row = slot * m->num_kv_heads + kvh;
    if (L->kv_f16) {
        ladle_f32_to_f16_row(k, (uint16_t *)L->key_cache + row * D, D);
        ladle_f32_to_f16_row(v, (uint16_t *)L->value_cache + row * D, D);
    } else if (L->key_scale == NULL) {
        memcpy((float *)L->key_cache + row * D, k, sizeof(float) * (size_t)D);
        memcpy((float *)L->value_cache + row * D, v, sizeof(float) * (size_t)D);
    } else {
        ladle_quantize_kv_row(k, (int8_t *)L->key_cache + row * D, L->key_scale + row, D);
        ladle_quantize_kv_row(v, (int8_t *)L->value_cache + row * D, L->value_scale + row, D);
    }
}

/* One (token, KV head)'s query heads' attention over the token's first ``len`` positions. */
static int attend(const ladle_decode_model *m, const ladle_decode_layer *L, const float *q_row,
                  float *o_row, const int32_t *table, int32_t len, int32_t kvh) {
    const int32_t D = m->head_dim, group = m->num_heads / m->num_kv_heads;
    const int32_t h0 = kvh * group, h1 = h0 + group;
    if (L->kv_f16)
        return ladle_decode_attention_f16_heads(q_row, o_row, L->key_cache, L->value_cache, table,
                                                len, h0, h1, group, m->num_kv_heads, D,
                                                m->block_size, m->scale);
    if (L->key_scale == NULL)
        return ladle_decode_attention_f32_heads(q_row, o_row, L->key_cache, L->value_cache, table,
                                                len, h0, h1, group, m->num_kv_heads, D,
                                                m->block_size, m->scale);
    return ladle_decode_attention_i8_heads(q_row, o_row, L->key_cache, L->value_cache,
                                           L->key_scale, L->value_scale, table, len, h0, h1,
                                           group, m->num_kv_heads, D, m->block_size, m->scale);
}

/* Ops per layer (a LoRA shrink before each of the four projections, used only by steps with
 * adapters); a step has 2 + OPS_PER_LAYER * num_layers (the first input norm, the LM head). */
#define OPS_PER_LAYER 12

/* b->residual [batch, hidden] holds the embeddings on entry and the residual stream on
 * return, b->x the final-normed hidden states, b->logits the LM head's output. Positions and
 * slots are int64, one per token; block tables int32 rows table_stride apart; lora_slots NULL,
 * or each row's adapter slot (-1: none). Nonzero: more rows than the buffers hold (2), or an
 * attention buffer could not be allocated (1). */
int ladle_decode_step(const ladle_decode_model *m, const ladle_decode_buffers *b,
                      const int64_t *positions, const int64_t *slots, const int32_t *block_tables,
                      int64_t table_stride, const int32_t *seq_lens, int32_t batch,
                      int32_t num_threads, const int32_t *lora_slots) {
    const int32_t H = m->hidden, I = m->intermediate, q_size = m->num_heads * m->head_dim;
    if (batch > b->max_batch) return 2;
    memset(b->counters, 0, sizeof(op_counter) * (2 + (size_t)OPS_PER_LAYER * m->num_layers));
    const lora_step step_lora = {lora_slots, b->lora_shrunk, b->ld_lora};
    const lora_step *lora = lora_slots != NULL ? &step_lora : NULL;
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        const int nt = omp_get_num_threads();
        op_counter *op = b->counters;
        norm_op(op++, b->residual, NULL, 0, m->layers[0].input_norm, b->x, batch, H, m->eps);
        for (int32_t l = 0; l < m->num_layers; l++) {
            const ladle_decode_layer *L = &m->layers[l];
            op++; /* each projection's op follows its LoRA shrink's, ``c - 1`` in linear_op */
            linear_op(op++, b->x, H, &L->qkv, b->qkv, b->ld_qkv, batch, nt, lora);
            const int tasks = batch * m->num_kv_heads;
            for (int task; (task = claim(op, tasks)) >= 0; finish(op, tasks)) {
                const int32_t s = task / m->num_kv_heads;
                store(m, L, b->qkv + s * b->ld_qkv, positions[s], slots[s], task % m->num_kv_heads);
            }
            wait_done(op++, tasks);
            for (int task; (task = claim(op, tasks)) >= 0; finish(op, tasks)) {
                const int32_t s = task / m->num_kv_heads;
                if (attend(m, L, b->qkv + s * b->ld_qkv, b->attn + (int64_t)s * q_size,
                           block_tables + s * table_stride, seq_lens[s], task % m->num_kv_heads)) {
#pragma omp atomic write
                    failed = 1;
                }
            }
            wait_done(op++, tasks);
            op++;
            linear_op(op++, b->attn, q_size, &L->o_proj, b->out, b->ld_out, batch, nt, lora);
            norm_op(op++, b->residual, b->out, b->ld_out, L->post_norm, b->x, batch, H, m->eps);
            op++;
            gate_up_op(op++, b->x, &L->gate_up, b, batch, H, I, nt, lora);
            op++;
            linear_op(op++, b->act, I, &L->down, b->out, b->ld_out, batch, nt, lora);
            const float *next = l + 1 < m->num_layers ? m->layers[l + 1].input_norm : m->final_norm;
            norm_op(op++, b->residual, b->out, b->ld_out, next, b->x, batch, H, m->eps);
        }
        linear_op(op, b->x, H, &m->lm_head, b->logits, b->ld_logits, batch, nt, NULL);
    }
    return failed;
}
