/* Weight-only int8 and int4 matrix products, and the int8 KV cache, for CPUs.
 *
 * y[M, N] = x[M, K] W^T (+ bias), W quantized, x and y fp32: weights are dequantized on the fly
 * and every product and sum is taken in fp32, so the numerics are those of the dequantized
 * weights whatever the instruction set (the torch reference in ladle.runtime.quantization
 * computes the same thing).
 *
 * Formats (see runtime/quantization/formats.py):
 * - int8: w[n, k] = q[n, k] * scale[n], q int8 [N, K], one scale per output channel;
 * - int4: w[n, k] = q[n, k] * scale[n, g] + offset[n, g], g = k / group_size, q in 0..15 packed
 *   two to a byte in blocks of 32 along K: byte j of a block holds weight j in its low nibble
 *   and weight j + 16 in its high one (llama.cpp's layout), so one 16-byte load unpacks into
 *   two runs of 16 consecutive weights. Rows hold ceil(K / 32) blocks; group_size is a
 *   multiple of 32, so a block never straddles two groups.
 *
 * Two shapes of work:
 * - GEMV (a few rows of x, decode at small batch) is bound by reading W once: each weight is
 *   converted in registers and used at once, several weight rows per pass over x;
 * - GEMM (more rows) is bound by arithmetic: each thread dequantizes a panel of weight rows
 *   into an fp32 buffer once and runs a register-blocked kernel over every row of x, so the
 *   conversion is paid once per panel instead of once per row of x.
 *
 * Instruction sets are chosen at build time from the compiler's predefined macros (the library
 * is built with -march=native): AVX-512 (F, BW, VL) with 16 lanes and masked tails, else AVX2 +
 * FMA with 8 lanes, else portable C that any compiler vectorizes as it can. VNNI and the bf16
 * dot products are not used: they multiply int8 or bf16 *activations*, and quantizing the
 * activations would change the numerics from those of a weight-only format.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define LADLE_AVX512 1
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__)
#define LADLE_AVX2 1
#include <immintrin.h>
#endif

#define INT4_BLOCK 32
/* GEMM: weight rows per panel, and K per dequantized chunk (a multiple of INT4_BLOCK). */
#define PANEL 16
#define KC 1024
/* From this many rows of x on, the GEMM path pays for its panel dequantization. */
#define GEMM_MIN_ROWS 4

/* Which path this build compiled: 2 AVX-512, 1 AVX2, 0 portable C. */
int ladle_quant_isa(void) {
#if LADLE_AVX512
    return 2;
#elif LADLE_AVX2
    return 1;
#else
    return 0;
#endif
}

#if LADLE_AVX2
static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

/* ---------------------------------------------------------------------------------------- */
/* GEMV: R weight rows (ldw bytes apart) against one row of x; out[r] = dot (unscaled for int8) */

#define GEMV_ROWS 4

static inline __attribute__((always_inline)) void dot_rows_i8(const float *x, const int8_t *w,
                                                              int64_t ldw, int32_t K, int R,
                                                              float *out) {
    int k = 0;
#if LADLE_AVX512
    __m512 acc[GEMV_ROWS];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (; k + 16 <= K; k += 16) {
        const __m512 xv = _mm512_loadu_ps(x + k);
        for (int r = 0; r < R; r++) {
            const __m128i q = _mm_loadu_si128((const __m128i *)(w + r * ldw + k));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)), xv, acc[r]);
        }
    }
    if (k < K) {
        const __mmask16 m = (__mmask16)((1u << (K - k)) - 1);
        const __m512 xv = _mm512_maskz_loadu_ps(m, x + k);
        for (int r = 0; r < R; r++) {
            const __m128i q = _mm_maskz_loadu_epi8(m, w + r * ldw + k);
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)), xv, acc[r]);
        }
        k = K;
    }
    for (int r = 0; r < R; r++) out[r] = _mm512_reduce_add_ps(acc[r]);
#elif LADLE_AVX2
    __m256 acc[GEMV_ROWS];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (; k + 8 <= K; k += 8) {
        const __m256 xv = _mm256_loadu_ps(x + k);
        for (int r = 0; r < R; r++) {
            const __m128i q = _mm_loadl_epi64((const __m128i *)(w + r * ldw + k));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), xv, acc[r]);
        }
    }
    for (int r = 0; r < R; r++) out[r] = hsum256(acc[r]);
#else
    for (int r = 0; r < R; r++) out[r] = 0.0f;
#endif
    for (; k < K; k++)
        for (int r = 0; r < R; r++) out[r] += x[k] * (float)w[r * ldw + k];
}

static inline __attribute__((always_inline)) void dot_rows_i4(
    const float *x, const uint8_t *w, int64_t ldw, const float *scale, const float *offset,
    int64_t ldg, int32_t K, int32_t group_size, int R, float *out) {
    const int blocks_per_group = group_size / INT4_BLOCK;
    int k = 0;
#if LADLE_AVX512
    __m512 acc[GEMV_ROWS];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    const __m512i low = _mm512_set1_epi32(0xF);
    for (int b = 0; k < K; b++, k += INT4_BLOCK) {
        const int g = b / blocks_per_group;
        const int left = K - k;
        /* x beyond K reads as zero, so a partial last block needs no scalar tail. */
        const __mmask16 m0 = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
        const __mmask16 m1 = left >= 32   ? (__mmask16)0xFFFF
                             : left <= 16 ? (__mmask16)0
                                          : (__mmask16)((1u << (left - 16)) - 1);
        const __m512 x0 = _mm512_maskz_loadu_ps(m0, x + k);
        const __m512 x1 = _mm512_maskz_loadu_ps(m1, x + k + 16);
        for (int r = 0; r < R; r++) {
            const __m512i v = _mm512_cvtepu8_epi32(
                _mm_loadu_si128((const __m128i *)(w + r * ldw + (int64_t)b * 16)));
            const __m512 s = _mm512_set1_ps(scale[r * ldg + g]);
            const __m512 o = _mm512_set1_ps(offset[r * ldg + g]);
            const __m512 w0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(v, low)), s, o);
            const __m512 w1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4)), s, o);
            acc[r] = _mm512_fmadd_ps(w0, x0, acc[r]);
            acc[r] = _mm512_fmadd_ps(w1, x1, acc[r]);
        }
    }
    for (int r = 0; r < R; r++) out[r] = _mm512_reduce_add_ps(acc[r]);
#else
#if LADLE_AVX2
    __m256 acc[GEMV_ROWS];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    const __m256i low = _mm256_set1_epi32(0xF);
    for (int b = 0; k + INT4_BLOCK <= K; b++, k += INT4_BLOCK) {
        const int g = b / blocks_per_group;
        const __m256 x0 = _mm256_loadu_ps(x + k), x1 = _mm256_loadu_ps(x + k + 8);
        const __m256 x2 = _mm256_loadu_ps(x + k + 16), x3 = _mm256_loadu_ps(x + k + 24);
        for (int r = 0; r < R; r++) {
            const uint8_t *p = w + r * ldw + (int64_t)b * 16;
            const __m256i v0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
            const __m256i v1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8)));
            const __m256 s = _mm256_set1_ps(scale[r * ldg + g]);
            const __m256 o = _mm256_set1_ps(offset[r * ldg + g]);
#define LADLE_I4(v, shift) \
    _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(v, shift), low)), s, o)
            acc[r] = _mm256_fmadd_ps(LADLE_I4(v0, 0), x0, acc[r]);
            acc[r] = _mm256_fmadd_ps(LADLE_I4(v1, 0), x1, acc[r]);
            acc[r] = _mm256_fmadd_ps(LADLE_I4(v0, 4), x2, acc[r]);
            acc[r] = _mm256_fmadd_ps(LADLE_I4(v1, 4), x3, acc[r]);
#undef LADLE_I4
        }
    }
    for (int r = 0; r < R; r++) out[r] = hsum256(acc[r]);
#else
    for (int r = 0; r < R; r++) out[r] = 0.0f;
#endif
    /* Portable path, and the partial last block of AVX2. */
    for (; k < K; k++) {
        const int b = k / INT4_BLOCK, j = k % INT4_BLOCK, g = b / blocks_per_group;
        for (int r = 0; r < R; r++) {
            const uint8_t byte = w[r * ldw + (int64_t)b * 16 + (j & 15)];
            const float q = (float)(j < 16 ? byte & 0xF : byte >> 4);
            out[r] += x[k] * (q * scale[r * ldg + g] + offset[r * ldg + g]);
        }
    }
#endif
}

/* ---------------------------------------------------------------------------------------- */
/* GEMM: dequantize a panel, then a register-blocked kernel over every row of x.             */

#if LADLE_AVX512
#define VW 16
#define MR 4
#define NR 4
typedef __m512 vf;
#define vzero() _mm512_setzero_ps()
#define vload(p) _mm512_loadu_ps(p)
#define vfma(a, b, c) _mm512_fmadd_ps(a, b, c)
#define vsum(v) _mm512_reduce_add_ps(v)
#elif LADLE_AVX2
#define VW 8
#define MR 4
#define NR 2
typedef __m256 vf;
#define vzero() _mm256_setzero_ps()
#define vload(p) _mm256_loadu_ps(p)
#define vfma(a, b, c) _mm256_fmadd_ps(a, b, c)
#define vsum(v) hsum256(v)
#else
#define VW 1
#define MR 4
#define NR 2
#endif

/* y[m, n] += rs[n] * dot(x row m, w row n) over kc (a multiple of VW; both zero-padded) for
 * R_M rows of x (ldx apart) and NR rows of the panel (ldw apart). */
static inline __attribute__((always_inline)) void micro(const float *x, int64_t ldx,
                                                        const float *w, int64_t ldw, int kc,
                                                        int R_M, const float *rs, float *y,
                                                        int64_t ldy, int n_valid) {
#if VW > 1
    vf acc[MR][NR];
    for (int i = 0; i < R_M; i++)
        for (int j = 0; j < NR; j++) acc[i][j] = vzero();
    for (int k = 0; k < kc; k += VW) {
        vf wv[NR];
        for (int j = 0; j < NR; j++) wv[j] = vload(w + j * ldw + k);
        for (int i = 0; i < R_M; i++) {
            const vf xv = vload(x + i * ldx + k);
            for (int j = 0; j < NR; j++) acc[i][j] = vfma(xv, wv[j], acc[i][j]);
        }
    }
    for (int i = 0; i < R_M; i++)
        for (int j = 0; j < n_valid; j++) y[i * ldy + j] += rs[j] * vsum(acc[i][j]);
#else
    for (int i = 0; i < R_M; i++)
        for (int j = 0; j < n_valid; j++) {
            float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
            for (int k = 0; k < kc; k++) acc += x[i * ldx + k] * w[j * ldw + k];
            y[i * ldy + j] += rs[j] * acc;
        }
#endif
}

/* The whole panel (n_valid of PANEL rows) against every row of x. */
static void panel_product(const float *xbuf, int64_t ldx, int64_t M, const float *wbuf,
                          int64_t ldw, int kc, const float *rs, float *y, int64_t ldy,
                          int n_valid) {
    for (int n = 0; n < n_valid; n += NR) {
        const int nv = n_valid - n < NR ? n_valid - n : NR;
        int64_t m = 0;
        for (; m + MR <= M; m += MR)
            micro(xbuf + m * ldx, ldx, wbuf + n * ldw, ldw, kc, MR, rs + n, y + m * ldy + n, ldy,
                  nv);
        for (; m < M; m++)
            micro(xbuf + m * ldx, ldx, wbuf + n * ldw, ldw, kc, 1, rs + n, y + m * ldy + n, ldy,
                  nv);
    }
}

static inline int round_up(int v, int to) { return (v + to - 1) / to * to; }

typedef struct {
    const void *w; /* int8 [N, K] or packed int4 [N, ldw] */
    int64_t ldw;   /* bytes per weight row */
    const float *scale, *offset;
    int32_t groups; /* int4: scale/offset columns */
    int32_t group_size;
    int int4;
} qweight;

/* Rows [n0, n0 + rows) of W, columns [k0, k0 + kc), as fp32 rows of ldb floats; int8 weights
 * stay unscaled (their per-row scale is applied to the finished dot product). */
static void dequant_panel(const qweight *q, int32_t n0, int rows, int k0, int kc, float *buf,
                          int64_t ldb) {
    for (int r = 0; r < rows; r++) {
        float *dst = buf + r * ldb;
        if (!q->int4) {
            const int8_t *src = (const int8_t *)q->w + (int64_t)(n0 + r) * q->ldw + k0;
#pragma omp simd
            for (int k = 0; k < kc; k++) dst[k] = (float)src[k];
            continue;
        }
        const uint8_t *src = (const uint8_t *)q->w + (int64_t)(n0 + r) * q->ldw + k0 / 2;
        const float *sc = q->scale + (int64_t)(n0 + r) * q->groups;
        const float *of = q->offset + (int64_t)(n0 + r) * q->groups;
        for (int b = 0; b * INT4_BLOCK < kc; b++) {
            const int g = (k0 + b * INT4_BLOCK) / q->group_size;
            const float s = sc[g], o = of[g];
            const uint8_t *p = src + b * 16;
            float *d = dst + b * INT4_BLOCK;
#pragma omp simd
            for (int j = 0; j < 16; j++) {
                d[j] = (float)(p[j] & 0xF) * s + o;
                d[j + 16] = (float)(p[j] >> 4) * s + o;
            }
        }
    }
}

static int gemm(const float *x, int64_t ldx, const qweight *q, const float *bias, float *y,
                int64_t M, int32_t N, int32_t K, int32_t num_threads) {
    const int kc_max = K < KC ? round_up(K, INT4_BLOCK) : KC;
    const int64_t ldb = round_up(kc_max, VW > INT4_BLOCK ? VW : INT4_BLOCK);
    float *xbuf = malloc(sizeof(float) * (size_t)(M * ldb));
    if (xbuf == NULL) return 1;
    for (int64_t m = 0; m < M; m++)
        for (int32_t n = 0; n < N; n++) y[m * N + n] = bias ? bias[n] : 0.0f;
    const int num_panels = (N + PANEL - 1) / PANEL;
    int failed = 0;
    for (int k0 = 0; k0 < K; k0 += KC) {
        const int valid = K - k0 < KC ? K - k0 : KC;
        const int kc = round_up(valid, VW > INT4_BLOCK ? VW : INT4_BLOCK);
        /* x's chunk, zero beyond K, so kernels need no tails. */
        for (int64_t m = 0; m < M; m++) {
            memcpy(xbuf + m * ldb, x + m * ldx + k0, sizeof(float) * (size_t)valid);
            memset(xbuf + m * ldb + valid, 0, sizeof(float) * (size_t)(ldb - valid));
        }
#pragma omp parallel num_threads(num_threads)
        {
            float *wbuf = malloc(sizeof(float) * (size_t)(PANEL * ldb));
            float ones[PANEL];
            for (int i = 0; i < PANEL; i++) ones[i] = 1.0f;
            if (wbuf == NULL) {
#pragma omp atomic write
                failed = 1;
            } else {
                memset(wbuf, 0, sizeof(float) * (size_t)(PANEL * ldb));
#pragma omp for schedule(static)
                for (int p = 0; p < num_panels; p++) {
                    const int32_t n0 = p * PANEL;
                    const int rows = N - n0 < PANEL ? N - n0 : PANEL;
                    /* int4 rows decode whole blocks; anything past K meets x's zeros. */
                    dequant_panel(q, n0, rows, k0, q->int4 ? round_up(valid, INT4_BLOCK) : valid,
                                  wbuf, ldb);
                    panel_product(xbuf, ldb, M, wbuf, ldb, kc, q->int4 ? ones : q->scale + n0,
                                  y + n0, N, rows);
                }
                free(wbuf);
            }
        }
    }
    free(xbuf);
    return failed;
}

/* ---------------------------------------------------------------------------------------- */
/* Entry points. x rows are ldx floats apart; y is [M, N] contiguous; bias may be NULL; the
 * int4 group size is a positive multiple of 32 (the caller checks). Nonzero: out of memory. */

int ladle_linear_i8(const float *x, int64_t ldx, const int8_t *w, const float *scale,
                    const float *bias, float *y, int64_t M, int32_t N, int32_t K,
                    int32_t num_threads) {
    if (M >= GEMM_MIN_ROWS) {
        const qweight q = {w, K, scale, NULL, 0, 0, 0};
        return gemm(x, ldx, &q, bias, y, M, N, K, num_threads);
    }
    const int blocks = (N + GEMV_ROWS - 1) / GEMV_ROWS;
#pragma omp parallel for schedule(static) num_threads(num_threads) if ((int64_t)N * K >= 65536)
    for (int blk = 0; blk < blocks; blk++) {
        const int32_t n0 = blk * GEMV_ROWS;
        const int rows = N - n0 < GEMV_ROWS ? N - n0 : GEMV_ROWS;
        for (int64_t m = 0; m < M; m++) {
            float dots[GEMV_ROWS];
            if (rows == GEMV_ROWS)
                dot_rows_i8(x + m * ldx, w + (int64_t)n0 * K, K, K, GEMV_ROWS, dots);
            else
                for (int r = 0; r < rows; r++)
                    dot_rows_i8(x + m * ldx, w + (int64_t)(n0 + r) * K, K, K, 1, dots + r);
            for (int r = 0; r < rows; r++)
                y[m * N + n0 + r] = dots[r] * scale[n0 + r] + (bias ? bias[n0 + r] : 0.0f);
        }
    }
    return 0;
}

int ladle_linear_i4(const float *x, int64_t ldx, const uint8_t *w, const float *scale,
                    const float *offset, const float *bias, float *y, int64_t M, int32_t N,
                    int32_t K, int32_t group_size, int32_t num_threads) {
    const int64_t ldw = (int64_t)(K + INT4_BLOCK - 1) / INT4_BLOCK * 16;
    const int32_t groups = (K + group_size - 1) / group_size;
    if (M >= GEMM_MIN_ROWS) {
        const qweight q = {w, ldw, scale, offset, groups, group_size, 1};
        return gemm(x, ldx, &q, bias, y, M, N, K, num_threads);
    }
    const int blocks = (N + GEMV_ROWS - 1) / GEMV_ROWS;
#pragma omp parallel for schedule(static) num_threads(num_threads) if ((int64_t)N * K >= 65536)
    for (int blk = 0; blk < blocks; blk++) {
        const int32_t n0 = blk * GEMV_ROWS;
        const int rows = N - n0 < GEMV_ROWS ? N - n0 : GEMV_ROWS;
        for (int64_t m = 0; m < M; m++) {
            float dots[GEMV_ROWS];
            const uint8_t *wr = w + (int64_t)n0 * ldw;
            const float *sr = scale + (int64_t)n0 * groups, *orow = offset + (int64_t)n0 * groups;
            if (rows == GEMV_ROWS)
                dot_rows_i4(x + m * ldx, wr, ldw, sr, orow, groups, K, group_size, GEMV_ROWS, dots);
            else
                for (int r = 0; r < rows; r++)
                    dot_rows_i4(x + m * ldx, wr + r * ldw, ldw, sr + r * groups, orow + r * groups,
                                groups, K, group_size, 1, dots + r);
            for (int r = 0; r < rows; r++) y[m * N + n0 + r] = dots[r] + (bias ? bias[n0 + r] : 0.0f);
        }
    }
    return 0;
}

/* ---------------------------------------------------------------------------------------- */
/* int8 KV cache: per (token, KV head) symmetric scales, absmax / 127, rounded half up as the
 * Triton store does (floor(x / scale + 0.5)), so both backends write the same bytes.         */

void ladle_store_kv_i8(const float *k, int64_t k_stride, const float *v, int64_t v_stride,
                       int8_t *key_cache, int8_t *value_cache, float *key_scale,
                       float *value_scale, const int64_t *slots, int64_t tokens,
                       int32_t num_kv_heads, int32_t head_dim) {
    for (int64_t t = 0; t < tokens; t++) {
        const int64_t slot = slots[t];
        if (slot < 0) continue;
        for (int part = 0; part < 2; part++) {
            const float *src = part == 0 ? k + t * k_stride : v + t * v_stride;
            int8_t *cache = part == 0 ? key_cache : value_cache;
            float *scales = part == 0 ? key_scale : value_scale;
            for (int h = 0; h < num_kv_heads; h++) {
                const float *row = src + (int64_t)h * head_dim;
                int8_t *dst = cache + (slot * num_kv_heads + h) * head_dim;
                float amax = 0.0f;
                for (int d = 0; d < head_dim; d++) amax = fmaxf(amax, fabsf(row[d]));
                const float scale = fmaxf(amax / 127.0f, 1e-8f);
                for (int d = 0; d < head_dim; d++) {
                    const float qv = floorf(row[d] / scale + 0.5f);
                    dst[d] = (int8_t)fminf(fmaxf(qv, -127.0f), 127.0f);
                }
                scales[slot * num_kv_heads + h] = scale;
            }
        }
    }
}

/* Decode attention over the int8 cache: the same walk as ladle_paged_decode_attention_f32 (one
 * sequence per task, blocks read front to back), with each key's scale applied to its score
 * and each value's scale folded into its probability, so int8 values are read once and never
 * expanded into a copy. Scales are [num_blocks, block_size, num_kv_heads]. */
int ladle_paged_decode_attention_i8(
    const float *q, int64_t q_stride, const int8_t *key_cache, const int8_t *value_cache,
    const float *key_scale, const float *value_scale, const int32_t *block_tables,
    int64_t table_stride, const int32_t *seq_lens, float *out, int32_t num_seqs,
    int32_t num_heads, int32_t num_kv_heads, int32_t head_dim, int32_t block_size, float scale,
    int32_t num_threads) {
    const int group = num_heads / num_kv_heads;
    const int64_t token_stride = (int64_t)num_kv_heads * head_dim;
    const int64_t block_stride = token_stride * block_size;
    int failed = 0;

#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int s = 0; s < num_seqs; s++) {
        const int len = seq_lens[s];
        const int32_t *table = block_tables + s * table_stride;
        const float *qs = q + (int64_t)s * q_stride;
        float *os = out + (int64_t)s * num_heads * head_dim;
        float *scores = malloc(sizeof(float) * (size_t)num_heads * ((size_t)len + 1));
        if (scores == NULL) {
#pragma omp atomic write
            failed = 1;
            continue;
        }
        float *inv_sum = scores + (size_t)num_heads * len;
        for (int t = 0; t < len; t++) {
            const int64_t slot = (int64_t)table[t / block_size] * block_size + t % block_size;
            const int8_t *k = key_cache + slot * token_stride;
            const float *ks = key_scale + slot * num_kv_heads;
            for (int head = 0; head < num_heads; head++) {
                const float *qh = qs + (int64_t)head * head_dim;
                const int kvh = head / group;
                const int8_t *kh = k + (int64_t)kvh * head_dim;
                float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
                for (int d = 0; d < head_dim; d++) acc += qh[d] * (float)kh[d];
                scores[head * len + t] = acc * ks[kvh] * scale;
            }
        }
        for (int head = 0; head < num_heads; head++) {
            float *row = scores + (size_t)head * len;
            float max = -INFINITY;
            for (int t = 0; t < len; t++) max = row[t] > max ? row[t] : max;
            float sum = 0.0f;
            for (int t = 0; t < len; t++) {
                row[t] = expf(row[t] - max);
                sum += row[t];
            }
            inv_sum[head] = 1.0f / sum;
        }
        for (int i = 0; i < num_heads * head_dim; i++) os[i] = 0.0f;
        for (int t = 0; t < len; t++) {
            const int64_t slot = (int64_t)table[t / block_size] * block_size + t % block_size;
            const int8_t *v = value_cache + slot * token_stride;
            const float *vs = value_scale + slot * num_kv_heads;
            for (int head = 0; head < num_heads; head++) {
                const int kvh = head / group;
                const float p = scores[head * len + t] * inv_sum[head] * vs[kvh];
                const int8_t *vh = v + (int64_t)kvh * head_dim;
                float *oh = os + (int64_t)head * head_dim;
#pragma omp simd
                for (int d = 0; d < head_dim; d++) oh[d] += p * (float)vh[d];
            }
        }
        free(scores);
    }
    return failed;
}
