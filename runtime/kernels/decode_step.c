/* A whole decode step of a Llama-family model in one call, for small batches on a CPU.
 *
 * At batch 1 a 135M-parameter model's step is a few milliseconds of weight reads; driving it op
 * by op from Python costs about a dozen torch ops and ctypes calls per layer, each waking the
 * thread team and joining it again. Here the team is woken once per step: one OpenMP parallel
 * region runs every layer, each thread takes a fixed share of each op (output panels, or
 * (sequence, KV head) pairs for attention) and the threads meet at five barriers a layer
 * (llama.cpp's scheme). Norms are computed by every thread for itself, redundantly (a few
 * thousand flops), which saves the barriers they would need; the residual stream is double
 * buffered so that thread 0 can write the new one while the others still read the old.
 *
 * The barrier spins briefly, then sleeps on a futex: on a quiet machine the threads meet within
 * microseconds, and on a shared one (a pod among others, a CPU limit) a waiting thread gives
 * its core back instead of spinning through the other's time slice.
 *
 * The pieces are the per-op kernels' own (kernels.h), so the numerics are theirs; only the
 * fp32 GEMV is new here (torch's GEMM serves the per-op path), and it sums in another order, so
 * outputs agree to rounding. The embedding lookup before and the LM head after stay with the
 * caller.
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
/* Outputs per tile of the fp32 GEMV: each x vector loaded is used OUTS times. */
#define OUTS 4
/* Outputs are shared among threads in units of one panel. */
#define PANEL 16
/* Pause instructions before a waiting thread sleeps: some tens of microseconds. */
#define SPIN 2048
typedef float vf __attribute__((vector_size(VW * 4)));
typedef float vf_unaligned __attribute__((vector_size(VW * 4), aligned(4)));
static inline vf vload(const float *p) { return *(const vf_unaligned *)p; }

enum { DENSE = 0, INT8 = 1, INT4 = 2 };

typedef struct {
    int32_t kind, n, k, group_size;
    const void *w;                /* fp32 [n, k] row-major, or the panel codes */
    const float *scale, *offset;  /* quantized formats only */
    const float *bias;            /* NULL, or [n] (padded to whole panels when quantized) */
} ladle_linear;

typedef struct {
    ladle_linear qkv, o_proj, gate_up, down;
    const float *input_norm, *post_norm, *q_norm, *k_norm; /* q/k norms NULL unless qk-norm */
    void *key_cache, *value_cache;
    float *key_scale, *value_scale; /* NULL for an fp32 cache */
} ladle_decode_layer;

typedef struct {
    int32_t num_layers, hidden, num_heads, num_kv_heads, head_dim, intermediate, block_size;
    float eps, scale;
    const ladle_decode_layer *layers;
    const float *final_norm;
    const float *cos, *sin; /* [max_position, head_dim / 2] */
} ladle_decode_model;

/* Per-step buffers, [batch, width] each: x is one such block per thread (its normed input),
 * residual two (old and new); widths are padded to whole panels where a GEMV writes them.
 * Thread 0's x holds the final hidden states on return. */
typedef struct {
    float *residual, *x, *qkv, *attn, *out, *gate_up, *act;
    int64_t ld_qkv, ld_out, ld_gate_up, max_batch;
    int32_t max_threads;
} ladle_decode_buffers;

typedef struct {
    atomic_int arrived, generation, sleepers;
    int n;
} team_barrier;

static void team_wait(team_barrier *b) {
    if (b->n == 1) return;
    const int gen = atomic_load(&b->generation);
    if (atomic_fetch_add(&b->arrived, 1) == b->n - 1) {
        atomic_store(&b->arrived, 0);
        atomic_fetch_add(&b->generation, 1);
#ifdef __linux__
        if (atomic_load(&b->sleepers))
            syscall(SYS_futex, &b->generation, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
#endif
        return;
    }
    for (int i = 0; i < SPIN; i++) {
        if (atomic_load_explicit(&b->generation, memory_order_acquire) != gen) return;
        cpu_relax();
    }
    atomic_fetch_add(&b->sleepers, 1);
    while (atomic_load(&b->generation) == gen) {
#ifdef __linux__
        syscall(SYS_futex, &b->generation, FUTEX_WAIT_PRIVATE, gen, NULL, NULL, 0);
#else
        sched_yield();
#endif
    }
    atomic_fetch_sub(&b->sleepers, 1);
}

/* This thread's share [*lo, *hi) of n units. */
static inline void share(int64_t n, int tid, int nt, int64_t *lo, int64_t *hi) {
    *lo = n * tid / nt;
    *hi = n * (tid + 1) / nt;
}

/* R (<= ROWS) rows against OUTS consecutive outputs of a row-major fp32 weight. */
static inline __attribute__((always_inline)) void dense_tile(const float *x, int64_t ldx,
                                                             const float *w, int32_t K, int R,
                                                             float out[ROWS][OUTS]) {
    vf acc[ROWS][OUTS];
    for (int r = 0; r < R; r++)
        for (int o = 0; o < OUTS; o++) acc[r][o] = (vf){0};
    int k = 0;
    for (; k + VW <= K; k += VW) {
        vf wv[OUTS];
        for (int o = 0; o < OUTS; o++) wv[o] = vload(w + (int64_t)o * K + k);
        for (int r = 0; r < R; r++) {
            const vf xv = vload(x + r * ldx + k);
            for (int o = 0; o < OUTS; o++) acc[r][o] += xv * wv[o];
        }
    }
    for (int r = 0; r < R; r++)
        for (int o = 0; o < OUTS; o++) {
            float sum = 0.0f;
            for (int l = 0; l < VW; l++) sum += acc[r][o][l];
            for (int kk = k; kk < K; kk++) sum += x[r * ldx + kk] * w[(int64_t)o * K + kk];
            out[r][o] = sum;
        }
}

/* Outputs [n0, n1) of a row-major fp32 weight, for R rows. */
static void dense_gemv(const float *x, int64_t ldx, const ladle_linear *lin, float *y,
                       int64_t ldy, int32_t R, int32_t n0, int32_t n1) {
    const float *w = lin->w;
    const int32_t K = lin->k;
    for (int32_t n = n0; n < n1; n += OUTS) {
        if (n + OUTS > n1) { /* a partial last tile, output by output */
            for (int32_t m = n; m < n1; m++)
                for (int32_t r = 0; r < R; r++) {
                    float sum = 0.0f;
                    for (int32_t k = 0; k < K; k++) sum += x[r * ldx + k] * w[(int64_t)m * K + k];
                    y[r * ldy + m] = sum + (lin->bias ? lin->bias[m] : 0.0f);
                }
            break;
        }
        for (int32_t r0 = 0; r0 < R; r0 += ROWS) {
            float out[ROWS][OUTS];
            const float *xr = x + (int64_t)r0 * ldx, *wt = w + (int64_t)n * K;
            switch (R - r0 < ROWS ? R - r0 : ROWS) { /* constant row counts for the registers */
            case 1: dense_tile(xr, ldx, wt, K, 1, out); break;
            case 2: dense_tile(xr, ldx, wt, K, 2, out); break;
#if ROWS == 4
            case 3: dense_tile(xr, ldx, wt, K, 3, out); break;
            case 4: dense_tile(xr, ldx, wt, K, 4, out); break;
#endif
            default: break;
            }
            for (int r = 0; r < ROWS && r0 + r < R; r++)
                for (int o = 0; o < OUTS; o++)
                    y[(int64_t)(r0 + r) * ldy + n + o] =
                        out[r][o] + (lin->bias ? lin->bias[n + o] : 0.0f);
        }
    }
}

/* Outputs of panels [p0, p1) (16 outputs each; the last may be partial for a dense weight). */
static void linear_panels(const float *x, int64_t ldx, const ladle_linear *lin, float *y,
                          int64_t ldy, int32_t R, int64_t p0, int64_t p1) {
    if (lin->kind == DENSE) {
        const int64_t n1 = p1 * PANEL < lin->n ? p1 * PANEL : lin->n;
        if (p0 * PANEL < n1) dense_gemv(x, ldx, lin, y, ldy, R, (int32_t)(p0 * PANEL), (int32_t)n1);
        return;
    }
    const int32_t groups = lin->kind == INT4 ? (lin->k + lin->group_size - 1) / lin->group_size : 0;
    const ladle_qweight q = {lin->w, lin->scale, lin->offset, groups, lin->group_size,
                             lin->kind == INT4};
    ladle_gemv_q_panels(x, ldx, &q, lin->bias, y, ldy, R, (int32_t)p0, (int32_t)p1, lin->k);
}

static inline int64_t panels(int32_t n) { return (n + PANEL - 1) / PANEL; }

/* This thread's share of a linear layer's outputs. */
static void linear_share(const float *x, int64_t ldx, const ladle_linear *lin, float *y,
                         int64_t ldy, int32_t R, int tid, int nt) {
    int64_t lo, hi;
    share(panels(lin->n), tid, nt, &lo, &hi);
    linear_panels(x, ldx, lin, y, ldy, R, lo, hi);
}

/* x = norm(old + out) for every row, and (thread 0) new = old + out: each thread normalizes
 * the rows for itself, so no barrier separates the norm from the GEMV that reads x. */
static void add_norm(const float *old, float *new_residual, const float *out, int64_t ld_out,
                     const float *weight, float *x, int32_t batch, int32_t H, float eps,
                     int tid) {
    for (int32_t r = 0; r < batch; r++) {
        float *xr = x + (int64_t)r * H;
        const float *o = out + r * ld_out, *res = old + (int64_t)r * H;
#pragma omp simd
        for (int32_t d = 0; d < H; d++) xr[d] = res[d] + o[d];
        if (tid == 0) memcpy(new_residual + (int64_t)r * H, xr, sizeof(float) * (size_t)H);
        ladle_rms_norm_row(xr, NULL, weight, xr, H, eps);
    }
}

/* Q/K norm, RoPE and the KV store for one (token, KV head), then its query heads' attention. */
static int attend(const ladle_decode_model *m, const ladle_decode_layer *L, float *q_row,
                  float *o_row, int64_t position, int64_t slot, const int32_t *table,
                  int32_t len, int32_t kvh) {
    const int32_t D = m->head_dim, half = D / 2, group = m->num_heads / m->num_kv_heads;
    const int32_t h0 = kvh * group, h1 = h0 + group;
    float *q = q_row + (int64_t)h0 * D;
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
    if (L->key_scale == NULL) {
        memcpy((float *)L->key_cache + row * D, k, sizeof(float) * (size_t)D);
        memcpy((float *)L->value_cache + row * D, v, sizeof(float) * (size_t)D);
        return ladle_decode_attention_f32_heads(q_row, o_row, L->key_cache, L->value_cache, table,
                                                len, h0, h1, group, m->num_kv_heads, D,
                                                m->block_size, m->scale);
    }
    ladle_quantize_kv_row(k, (int8_t *)L->key_cache + row * D, L->key_scale + row, D);
    ladle_quantize_kv_row(v, (int8_t *)L->value_cache + row * D, L->value_scale + row, D);
    return ladle_decode_attention_i8_heads(q_row, o_row, L->key_cache, L->value_cache,
                                           L->key_scale, L->value_scale, table, len, h0, h1,
                                           group, m->num_kv_heads, D, m->block_size, m->scale);
}

/* b->residual [batch, hidden] holds the embeddings on entry; thread 0's x block holds the
 * final-normed hidden states on return. Positions and slots are int64, one per token; block
 * tables int32 rows table_stride apart. Nonzero: too many threads or rows for the buffers, or
 * an attention buffer could not be allocated. */
int ladle_decode_step(const ladle_decode_model *m, const ladle_decode_buffers *b,
                      const int64_t *positions, const int64_t *slots, const int32_t *block_tables,
                      int64_t table_stride, const int32_t *seq_lens, int32_t batch,
                      int32_t num_threads) {
    const int32_t H = m->hidden, I = m->intermediate, D = m->head_dim;
    const int32_t q_size = m->num_heads * D;
    const int64_t block = b->max_batch * H; /* floats in one [max_batch, hidden] block */
    if (num_threads > b->max_threads || batch > b->max_batch) return 2;
    team_barrier barrier = {0, 0, 0, 1};
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
#pragma omp single
        barrier.n = nt; /* single ends in a barrier: everyone sees n before using it */
        float *x = b->x + tid * block;
        int cur = 0; /* which residual block holds the stream */
        for (int32_t r = 0; r < batch; r++)
            ladle_rms_norm_row(b->residual + (int64_t)r * H, NULL, m->layers[0].input_norm,
                               x + (int64_t)r * H, H, m->eps);
        for (int32_t l = 0; l < m->num_layers; l++) {
            const ladle_decode_layer *L = &m->layers[l];
            linear_share(x, H, &L->qkv, b->qkv, b->ld_qkv, batch, tid, nt);
            team_wait(&barrier);
            int64_t lo, hi;
            share((int64_t)batch * m->num_kv_heads, tid, nt, &lo, &hi);
            for (int64_t task = lo; task < hi; task++) {
                const int32_t s = (int32_t)(task / m->num_kv_heads);
                if (attend(m, L, b->qkv + s * b->ld_qkv, b->attn + (int64_t)s * q_size,
                           positions[s], slots[s], block_tables + s * table_stride, seq_lens[s],
                           (int32_t)(task % m->num_kv_heads))) {
#pragma omp atomic write
                    failed = 1;
                }
            }
            team_wait(&barrier);
            linear_share(b->attn, q_size, &L->o_proj, b->out, b->ld_out, batch, tid, nt);
            team_wait(&barrier);
            add_norm(b->residual + cur * block, b->residual + (1 - cur) * block, b->out,
                     b->ld_out, L->post_norm, x, batch, H, m->eps, tid);
            cur = 1 - cur;
            /* gate_up: a thread's gate panels and the matching up panels, then their SiLU. */
            share(panels(I), tid, nt, &lo, &hi);
            linear_panels(x, H, &L->gate_up, b->gate_up, b->ld_gate_up, batch, lo, hi);
            linear_panels(x, H, &L->gate_up, b->gate_up, b->ld_gate_up, batch, lo + I / PANEL,
                          hi + I / PANEL);
            const int64_t c0 = lo * PANEL, c1 = hi * PANEL < I ? hi * PANEL : I;
            for (int32_t r = 0; r < batch && c0 < c1; r++) {
                const float *g = b->gate_up + r * b->ld_gate_up;
                ladle_silu_and_mul_row(g + c0, g + I + c0, b->act + (int64_t)r * I + c0,
                                       (int32_t)(c1 - c0));
            }
            team_wait(&barrier);
            linear_share(b->act, I, &L->down, b->out, b->ld_out, batch, tid, nt);
            team_wait(&barrier);
            const float *next = l + 1 < m->num_layers ? m->layers[l + 1].input_norm : m->final_norm;
            add_norm(b->residual + cur * block, b->residual + (1 - cur) * block, b->out,
                     b->ld_out, next, x, batch, H, m->eps, tid);
            cur = 1 - cur;
        }
    }
    return failed;
}
