/* Weight-only int8 and int4 matrix products, and the int8 KV cache, for CPUs.
 *
 * y[M, N] = x[M, K] W^T (+ bias), W quantized, x and y fp32: weights are dequantized on the fly
 * and every product and sum is taken in fp32, so the numerics are those of the dequantized
 * weights whatever the instruction set (the torch reference in ladle.runtime.quantization
 * computes the same thing). The group GEMV takes the same sum in another order: codes times x
 * per group, then the group's scale, plus its offset times the group's sum of x.
 *
 * Formats (see runtime/quantization/formats.py): output channels in panels of 16, stored
 * input by input, so one input's weights for a panel are one 16-byte row:
 * - int8 per output channel: codes [P, K, 16], w = q * scale[n];
 * - groups (groups > 0): w = q * scale[p, g, j] + offset[p, g, j] with g = k / group_size, and
 *   8-bit codes [P, K, 16] (0..255) or 4-bit ones [P, ceil(K / 2), 16], byte j of row i
 *   holding inputs 2i (low nibble) and 2i + 1 (high) of channel 16 p + j.
 *
 * Every product is an outer product: a panel row of weights (one vector of 16) times a
 * broadcast input, accumulated per output, so nothing is ever summed horizontally.
 * - GEMV (up to 4 rows of x: decode at small batch) is bound by reading W once: each panel is
 *   read front to back, its codes converted in registers and used at once;
 * - GEMM (more rows) is bound by arithmetic: each thread dequantizes a tile of panels into an
 *   fp32 buffer once (L2-sized chunks of K) and runs a register-blocked kernel over every row
 *   of x, so the conversion is paid once per tile instead of once per row.
 *
 * Instruction sets are chosen at build time (the library is built with -march=native): the
 * code is written on 16-float vectors (GCC/Clang vector extensions), which the compiler maps
 * onto one zmm register with AVX-512, two ymm with AVX2, or whatever the target has; the
 * predefined macros pick the register tiles to match (__AVX512F__: 8 rows x 32 outputs,
 * __AVX2__: 6 x 16, otherwise 2 x 16). VNNI and the bf16 dot products are not used here: they
 * multiply int8 or bf16 *activations*, and quantizing activations would change the numerics
 * from those of the weight-only format the quality table measures. A draft model, whose
 * numerics only sway its acceptance, does (a8_kernels.c: a weight with ``a8`` codes).
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

/* The 16-float vectors below never cross a non-inlined call, so their ABI does not matter. */
#pragma GCC diagnostic ignored "-Wpsabi"

#define PANEL 16
/* From this many rows of x on, each thread dequantizes a tile of panels into an fp32 buffer
 * once and reuses it for every row; below, weights are converted in registers as they are
 * read (GEMV: a decode step at small batch, bound by reading W). */
#define GEMV_MAX_ROWS 4
/* K per dequantized chunk: the buffer (KC x 32 floats, 128 KiB) stays in L2. */
#define KC 1024
/* Rows of x per pass over the tiles (a prefill chunk has thousands). */
#define MC 256

/* Register tiles: MR rows of x times TILE_PANELS panels of 16 outputs, one accumulator vector
 * per (row, panel): 16 of the 32 zmm registers with AVX-512, 12 of the 16 ymm with AVX2 (a
 * 16-float vector is two of them). */
#if defined(__AVX512F__)
#define LADLE_ISA 2
#define TILE_PANELS 2
#define MR 8
#elif defined(__AVX2__) && defined(__FMA__)
#define LADLE_ISA 1
#define TILE_PANELS 1
#define MR 6
#else
#define LADLE_ISA 0
#define TILE_PANELS 1
#define MR 2
#endif
#define TILE (TILE_PANELS * PANEL)

/* Which path this build compiled: 2 AVX-512, 1 AVX2, 0 portable C. */
int ladle_quant_isa(void) { return LADLE_ISA; }

/* Native float vectors of VW lanes (GCC/Clang vector extensions); a panel row of 16 outputs
 * is VPP of them. */
#if LADLE_ISA == 2
#include <immintrin.h>
#define VW 16
#elif LADLE_ISA == 1
#include <immintrin.h>
#define VW 8
#else
#define VW 4
#endif
#define VPP (PANEL / VW)
typedef float vf __attribute__((vector_size(VW * 4)));
typedef float vf_unaligned __attribute__((vector_size(VW * 4), aligned(4)));

static inline vf vload(const float *p) { return *(const vf_unaligned *)p; }
static inline void vstore(float *p, vf v) { *(vf_unaligned *)p = v; }
static inline vf splat(float x) { return (vf){0} + x; }

/* A panel row of codes to floats, written per instruction set (compilers convert a whole
 * int8 vector to floats lane by lane): one extension and one conversion per 8 or 16 codes.
 *
 * With `gemv` set, the vectors may come out in GEMV order rather than output order. With AVX2,
 * widening each half of 16 codes to 32 bits crosses the 128-bit lanes three times per row.
 * Widening all 16 to 16 bits once and splitting them within lanes crosses them once, and leaves
 * outputs [0-3, 8-11] in the first vector and [4-7, 12-15] in the second. A GEMV keeps that
 * order from its scales to its sums (gemv_order), and its codes go through 1.2x faster
 * (int4, one thread, a Zen 3 EPYC). A GEMM's dequantized tile needs output order. AVX-512
 * widens all 16 codes in one step, so both orders are the same there. */
#if LADLE_ISA >= 1
#if LADLE_ISA == 1
/* 16 codes widened to 16 bits, [0-7 | 8-15], split within lanes into GEMV order. */
static inline void split16(__m256i w, int is_signed, vf out[VPP]) {
    if (is_signed) {
        out[0] = (vf)_mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_unpacklo_epi16(w, w), 16));
        out[1] = (vf)_mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_unpackhi_epi16(w, w), 16));
    } else {
        const __m256i zero = _mm256_setzero_si256();
        out[0] = (vf)_mm256_cvtepi32_ps(_mm256_unpacklo_epi16(w, zero));
        out[1] = (vf)_mm256_cvtepi32_ps(_mm256_unpackhi_epi16(w, zero));
    }
}
#endif

static inline __attribute__((always_inline)) void widen(__m128i b, int is_signed, int gemv,
                                                        vf out[VPP]) {
#if LADLE_ISA == 2
    (void)gemv;
    out[0] = (vf)_mm512_cvtepi32_ps(is_signed ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b));
#else
    if (gemv) {
        split16(is_signed ? _mm256_cvtepi8_epi16(b) : _mm256_cvtepu8_epi16(b), is_signed, out);
        return;
    }
    const __m128i high = _mm_unpackhi_epi64(b, b);
    out[0] = (vf)_mm256_cvtepi32_ps(is_signed ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b));
    out[1] = (vf)_mm256_cvtepi32_ps(is_signed ? _mm256_cvtepi8_epi32(high)
                                              : _mm256_cvtepu8_epi32(high));
#endif
}

static inline __attribute__((always_inline)) void from_i8(const int8_t *p, int gemv,
                                                          vf out[VPP]) {
    widen(_mm_loadu_si128((const __m128i *)p), 1, gemv, out);
}

static inline __attribute__((always_inline)) void from_u8(const uint8_t *p, int gemv,
                                                          vf out[VPP]) {
    widen(_mm_loadu_si128((const __m128i *)p), 0, gemv, out);
}

/* One byte row of an int4 panel: the codes of input 2i (low nibbles) and 2i + 1 (high). */
static inline __attribute__((always_inline)) void from_u4(const uint8_t *p, int gemv,
                                                          vf even[VPP], vf odd[VPP]) {
    const __m128i b = _mm_loadu_si128((const __m128i *)p);
#if LADLE_ISA == 1
    if (gemv) {
        /* One byte per 16-bit lane, so the high nibble's shift needs no mask. */
        const __m256i w = _mm256_cvtepu8_epi16(b);
        split16(_mm256_and_si256(w, _mm256_set1_epi16(0xF)), 0, even);
        split16(_mm256_srli_epi16(w, 4), 0, odd);
        return;
    }
#endif
    const __m128i mask = _mm_set1_epi8(0xF);
    widen(_mm_and_si128(b, mask), 0, gemv, even);
    widen(_mm_and_si128(_mm_srli_epi16(b, 4), mask), 0, gemv, odd);
}
#else
static inline void from_i8(const int8_t *p, int gemv, vf out[VPP]) {
    (void)gemv;
    float f[PANEL];
    for (int j = 0; j < PANEL; j++) f[j] = (float)p[j];
    for (int h = 0; h < VPP; h++) out[h] = vload(f + h * VW);
}

static inline void from_u8(const uint8_t *p, int gemv, vf out[VPP]) {
    (void)gemv;
    float f[PANEL];
    for (int j = 0; j < PANEL; j++) f[j] = (float)p[j];
    for (int h = 0; h < VPP; h++) out[h] = vload(f + h * VW);
}

static inline void from_u4(const uint8_t *p, int gemv, vf even[VPP], vf odd[VPP]) {
    (void)gemv;
    float lo[PANEL], hi[PANEL];
    for (int j = 0; j < PANEL; j++) {
        lo[j] = (float)(p[j] & 0xF);
        hi[j] = (float)(p[j] >> 4);
    }
    for (int h = 0; h < VPP; h++) {
        even[h] = vload(lo + h * VW);
        odd[h] = vload(hi + h * VW);
    }
}
#endif

/* Output order to GEMV order and back (the permutation is its own inverse): swap the second
 * half of the first vector with the first half of the second. */
static inline void gemv_order(vf v[VPP]) {
#if LADLE_ISA == 1
    const __m256 a = (__m256)v[0], b = (__m256)v[1];
    v[0] = (vf)_mm256_permute2f128_ps(a, b, 0x20);
    v[1] = (vf)_mm256_permute2f128_ps(a, b, 0x31);
#else
    (void)v;
#endif
}

/* VPP vectors from p (PANEL floats) in GEMV order. */
static inline void vload_gemv(const float *p, vf v[VPP]) {
    for (int h = 0; h < VPP; h++) v[h] = vload(p + h * VW);
    gemv_order(v);
}

typedef ladle_qweight qweight;

static inline const int8_t *panel_i8(const qweight *q, int64_t p, int32_t K) {
    return (const int8_t *)q->w + p * K * PANEL;
}

/* A group format's panel p: K byte rows of 8-bit codes, or ceil(K / 2) of 4-bit pairs. */
static inline const uint8_t *panel_groups(const qweight *q, int64_t p, int32_t K) {
    return (const uint8_t *)q->w + p * (q->bits == 4 ? (K + 1) / 2 : K) * PANEL;
}

/* The codes of inputs k and k + 1 (k even, k + 1 < K) of a group panel: one byte row of 4-bit
 * pairs, or two rows of 8-bit codes. bits and gemv are constants where this is inlined. */
static inline __attribute__((always_inline)) void from_pair(const uint8_t *w, int k, int bits,
                                                            int gemv, vf even[VPP],
                                                            vf odd[VPP]) {
    if (bits == 4) {
        from_u4(w + (int64_t)(k / 2) * PANEL, gemv, even, odd);
    } else {
        from_u8(w + (int64_t)k * PANEL, gemv, even);
        from_u8(w + (int64_t)(k + 1) * PANEL, gemv, odd);
    }
}

/* The codes of input k alone. */
static inline __attribute__((always_inline)) void from_one(const uint8_t *w, int k, int bits,
                                                           int gemv, vf out[VPP]) {
    if (bits == 4) {
        vf pair[2][VPP];
        from_u4(w + (int64_t)(k / 2) * PANEL, gemv, pair[0], pair[1]);
        for (int h = 0; h < VPP; h++) out[h] = pair[k % 2][h];
    } else {
        from_u8(w + (int64_t)k * PANEL, gemv, out);
    }
}

/* ---------------------------------------------------------------------------------------- */
/* GEMV: R (<= GEMV_MAX_ROWS) rows of x against one panel, converting weights in registers.  */

/* Four accumulators per (row, vector), cycled over inputs, so that four multiply-adds of one
 * chain are in flight. */
#define UNROLL 4

/* A group format: sum(x * (q * s + o)) over a group is s * sum(x * q) + o * sum(x), so the
 * codes are multiplied as they are and each group's scale and offset are applied once, to its
 * partial sums and to xs (the group's sum of x, per row). */
static inline __attribute__((always_inline)) void gemv_groups(const float *x, int64_t ldx,
                                                              const float *xs, const qweight *q,
                                                              int64_t p, int32_t K, int R,
                                                              int bits,
                                                              vf out[GEMV_MAX_ROWS][VPP]) {
    vf acc[GEMV_MAX_ROWS][UNROLL][VPP];
    const uint8_t *w = panel_groups(q, p, K);
    const float *sc = q->scale + p * q->groups * PANEL, *of = q->offset + p * q->groups * PANEL;
    for (int r = 0; r < R; r++)
        for (int h = 0; h < VPP; h++) out[r][h] = (vf){0};
    for (int g = 0; g < q->groups; g++) {
        for (int r = 0; r < R; r++)
            for (int u = 0; u < UNROLL; u++)
                for (int h = 0; h < VPP; h++) acc[r][u][h] = (vf){0};
        const int k0 = g * q->group_size;
        const int k1 = k0 + q->group_size < K ? k0 + q->group_size : K;
        int k = k0;
        for (; k + UNROLL <= k1; k += UNROLL)
            for (int u = 0; u < UNROLL; u += 2) {
                vf wv[2][VPP];
                from_pair(w, k + u, bits, 1, wv[0], wv[1]);
                for (int r = 0; r < R; r++)
                    for (int e = 0; e < 2; e++) {
                        const vf xv = splat(x[r * ldx + k + u + e]);
                        for (int h = 0; h < VPP; h++) acc[r][u + e][h] += xv * wv[e][h];
                    }
            }
        for (; k < k1; k++) {
            vf wv[VPP];
            from_one(w, k, bits, 1, wv);
            for (int r = 0; r < R; r++)
                for (int h = 0; h < VPP; h++) acc[r][0][h] += splat(x[r * ldx + k]) * wv[h];
        }
        vf s[VPP], o[VPP];
        vload_gemv(sc + g * PANEL, s);
        vload_gemv(of + g * PANEL, o);
        for (int h = 0; h < VPP; h++)
            for (int r = 0; r < R; r++)
                out[r][h] += (acc[r][0][h] + acc[r][1][h] + acc[r][2][h] + acc[r][3][h]) * s[h] +
                             splat(xs[r * q->groups + g]) * o[h];
    }
    for (int r = 0; r < R; r++) gemv_order(out[r]);
}

static inline __attribute__((always_inline)) void gemv_panel(const float *x, int64_t ldx,
                                                             const float *xs, const qweight *q,
                                                             int64_t p, int32_t K, int R,
                                                             vf out[GEMV_MAX_ROWS][VPP]) {
    if (q->groups == 0) {
        vf acc[GEMV_MAX_ROWS][UNROLL][VPP];
        for (int r = 0; r < R; r++)
            for (int u = 0; u < UNROLL; u++)
                for (int h = 0; h < VPP; h++) acc[r][u][h] = (vf){0};
        const int8_t *w = panel_i8(q, p, K);
        int k = 0;
        for (; k + UNROLL <= K; k += UNROLL)
            for (int u = 0; u < UNROLL; u++) {
                vf wv[VPP];
                from_i8(w + (int64_t)(k + u) * PANEL, 1, wv);
                for (int r = 0; r < R; r++) {
                    const vf xv = splat(x[r * ldx + k + u]);
                    for (int h = 0; h < VPP; h++) acc[r][u][h] += xv * wv[h];
                }
            }
        for (; k < K; k++) {
            vf wv[VPP];
            from_i8(w + (int64_t)k * PANEL, 1, wv);
            for (int r = 0; r < R; r++)
                for (int h = 0; h < VPP; h++) acc[r][0][h] += splat(x[r * ldx + k]) * wv[h];
        }
        vf s[VPP];
        vload_gemv(q->scale + p * PANEL, s);
        for (int r = 0; r < R; r++) {
            for (int h = 0; h < VPP; h++)
                out[r][h] = (acc[r][0][h] + acc[r][1][h] + acc[r][2][h] + acc[r][3][h]) * s[h];
            gemv_order(out[r]);
        }
        return;
    }
    if (q->bits == 4)
        gemv_groups(x, ldx, xs, q, p, K, R, 4, out);
    else
        gemv_groups(x, ldx, xs, q, p, K, R, 8, out);
}

/* Each group's sum of x, per row (xs[r * groups + g]), for gemv_panel. */
static void group_sums(const float *x, int64_t ldx, const qweight *q, int64_t R, int32_t K,
                       float *xs) {
    for (int64_t r = 0; r < R; r++)
        for (int g = 0; g < q->groups; g++) {
            const int k0 = g * q->group_size;
            const int k1 = k0 + q->group_size < K ? k0 + q->group_size : K;
            float sum = 0.0f;
            for (int k = k0; k < k1; k++) sum += x[r * ldx + k];
            xs[r * q->groups + g] = sum;
        }
}

/* One panel of outputs for every row, GEMV_MAX_ROWS rows at a time: the panel's weights come
 * from memory once and from cache for the later rows. */
static inline void gemv_panel_rows(const float *x, int64_t ldx, const float *xs,
                                   const qweight *q, const float *bias, float *y, int64_t ldy,
                                   int64_t R, int32_t p, int32_t K) {
    for (int64_t r0 = 0; r0 < R; r0 += GEMV_MAX_ROWS) {
        const float *xr = x + r0 * ldx, *xsr = xs + r0 * q->groups;
        float *yr = y + r0 * ldy;
        const int64_t rows = R - r0 < GEMV_MAX_ROWS ? R - r0 : GEMV_MAX_ROWS;
        vf out[GEMV_MAX_ROWS][VPP];
        switch (rows) { /* constant row counts, so the accumulators stay in registers */
        case 1: gemv_panel(xr, ldx, xsr, q, p, K, 1, out); break;
        case 2: gemv_panel(xr, ldx, xsr, q, p, K, 2, out); break;
        case 3: gemv_panel(xr, ldx, xsr, q, p, K, 3, out); break;
        default: gemv_panel(xr, ldx, xsr, q, p, K, 4, out); break;
        }
        for (int h = 0; h < VPP; h++) {
            const vf b = bias ? vload(bias + p * PANEL + h * VW) : (vf){0};
            for (int r = 0; r < rows; r++)
                vstore(yr + r * ldy + p * PANEL + h * VW, out[r][h] + b);
        }
    }
}

/* xs lives on the stack: R * groups floats, a few KiB for a decode batch (R <= 8) even at
 * K = 16k. */
void ladle_gemv_q_panels(const float *x, int64_t ldx, const qweight *q, const float *bias,
                         float *y, int64_t ldy, int64_t R, int32_t p0, int32_t p1, int32_t K) {
#if LADLE_HAVE_A8
    if (q->a8 != NULL) {
        ladle_a8_gemv_panels(x, ldx, q, bias, y, ldy, R, p0, p1, K);
        return;
    }
#endif
    float xs[R * q->groups + 1];
    group_sums(x, ldx, q, R, K, xs);
    for (int32_t p = p0; p < p1; p++) gemv_panel_rows(x, ldx, xs, q, bias, y, ldy, R, p, K);
}

static void gemv(const float *x, int64_t ldx, const qweight *q, const float *bias, float *y,
                 int64_t ldy, int R, int32_t P, int32_t K, int32_t num_threads) {
#if LADLE_HAVE_A8
    if (q->a8 != NULL) {
        /* Contiguous panels per thread: each quantizes x once for its share. */
#pragma omp parallel num_threads(num_threads) if ((int64_t)P * K >= 4096)
        {
            const int t = omp_get_thread_num(), n = omp_get_num_threads();
            const int32_t p0 = (int32_t)((int64_t)P * t / n), p1 = (int32_t)((int64_t)P * (t + 1) / n);
            if (p0 < p1) ladle_a8_gemv_panels(x, ldx, q, bias, y, ldy, R, p0, p1, K);
        }
        return;
    }
#endif
    float xs[R * q->groups + 1];
    group_sums(x, ldx, q, R, K, xs);
#pragma omp parallel for schedule(static) num_threads(num_threads) if ((int64_t)P * K >= 4096)
    for (int32_t p = 0; p < P; p++) gemv_panel_rows(x, ldx, xs, q, bias, y, ldy, R, p, K);
}

/* ---------------------------------------------------------------------------------------- */
/* GEMM: dequantize a tile of panels once, then register tiles over every row of x.          */

/* Inputs [k0, k0 + kc) of panels [p, p + np) as fp32 rows of TILE floats: buf[k * TILE + 16 t
 * + j] is weight (16 (p + t) + j, k0 + k); int8 codes stay unscaled (the per-output scale
 * multiplies the finished sums). k0 is even. */
static void dequant_tile(const qweight *q, int64_t p, int np, int32_t K, int k0, int kc,
                         float *buf) {
    for (int t = 0; t < np; t++) {
        float *dst = buf + t * PANEL;
        if (q->groups == 0) {
            const int8_t *w = panel_i8(q, p + t, K) + (int64_t)k0 * PANEL;
            for (int k = 0; k < kc; k++) {
                vf wv[VPP];
                from_i8(w + k * PANEL, 0, wv);
                for (int h = 0; h < VPP; h++) vstore(dst + k * TILE + h * VW, wv[h]);
            }
            continue;
        }
        const uint8_t *w = panel_groups(q, p + t, K);
        const float *sc = q->scale + (p + t) * q->groups * PANEL;
        const float *of = q->offset + (p + t) * q->groups * PANEL;
        for (int k = 0; k < kc; k += 2) {
            const int g = (k0 + k) / q->group_size; /* even k0 and group size: one group */
            vf wv[2][VPP];
            if (k + 1 < kc)
                from_pair(w, k0 + k, q->bits, 0, wv[0], wv[1]);
            else
                from_one(w, k0 + k, q->bits, 0, wv[0]);
            for (int e = 0; e < 2 && k + e < kc; e++)
                for (int h = 0; h < VPP; h++) {
                    const vf s = vload(sc + g * PANEL + h * VW), o = vload(of + g * PANEL + h * VW);
                    vstore(dst + (k + e) * TILE + h * VW, wv[e][h] * s + o);
                }
        }
    }
}

#define NV (TILE_PANELS * VPP) /* vectors per buffer row */

/* y[r, tile] += mul * sum over the chunk of x[r, k] * buf[k]: R rows, nv vectors of outputs. */
static inline __attribute__((always_inline)) void micro(const float *x, int64_t ldx,
                                                        const float *buf, int kc, int R, int nv,
                                                        float *y, int64_t ldy, const vf *mul) {
    vf acc[MR][NV];
    for (int r = 0; r < R; r++)
        for (int v = 0; v < nv; v++) acc[r][v] = (vf){0};
    for (int k = 0; k < kc; k++) {
        vf wv[NV];
        for (int v = 0; v < nv; v++) wv[v] = vload(buf + k * TILE + v * VW);
        for (int r = 0; r < R; r++) {
            const vf xv = splat(x[r * ldx + k]);
            for (int v = 0; v < nv; v++) acc[r][v] += xv * wv[v];
        }
    }
    for (int r = 0; r < R; r++)
        for (int v = 0; v < nv; v++) {
            float *dst = y + r * ldy + v * VW;
            vstore(dst, vload(dst) + acc[r][v] * mul[v]);
        }
}

#define MICRO_CASE(n) \
    case n: micro(x, ldx, buf, kc, n, nv, y, ldy, mul); break;

static inline __attribute__((always_inline)) void micro_rows(const float *x, int64_t ldx,
                                                             const float *buf, int kc, int R,
                                                             int nv, float *y, int64_t ldy,
                                                             const vf *mul) {
    switch (R) { /* constant row counts, so the accumulators stay in registers */
        MICRO_CASE(1)
        MICRO_CASE(2)
#if MR >= 6
        MICRO_CASE(3) MICRO_CASE(4) MICRO_CASE(5) MICRO_CASE(6)
#endif
#if MR >= 8
        MICRO_CASE(7) MICRO_CASE(8)
#endif
    default: break;
    }
}

static void tile_product(const float *x, int64_t ldx, int64_t M, const float *buf, int kc, int np,
                         float *y, int64_t ldy, const vf *mul) {
    for (int64_t m = 0; m < M; m += MR) {
        const int R = M - m < MR ? (int)(M - m) : MR;
        if (np == TILE_PANELS)
            micro_rows(x + m * ldx, ldx, buf, kc, R, NV, y + m * ldy, ldy, mul);
        else
            micro_rows(x + m * ldx, ldx, buf, kc, R, VPP, y + m * ldy, ldy, mul);
    }
}

static int gemm(const float *x, int64_t ldx, const qweight *q, const float *bias, float *y,
                int64_t ldy, int64_t M, int32_t P, int32_t K, int32_t num_threads) {
    const int tiles = (P + TILE_PANELS - 1) / TILE_PANELS;
    const int kc_max = K < KC ? K + 1 : KC; /* room for a 4-bit chunk's odd last input */
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        float *buf = malloc(sizeof(float) * (size_t)kc_max * TILE);
        if (buf == NULL) {
#pragma omp atomic write
            failed = 1;
        }
        /* MC rows of x at a time stay in cache while every tile passes over them; a tile is
         * dequantized again per block of rows, 1/MC of the arithmetic. */
        for (int64_t m0 = 0; m0 < M; m0 += MC) {
            const int64_t rows = M - m0 < MC ? M - m0 : MC;
            const float *xb = x + m0 * ldx;
            float *yb = y + m0 * ldy;
#pragma omp for schedule(static)
            for (int tile = 0; tile < tiles; tile++) {
                if (buf == NULL) continue;
                const int64_t p = (int64_t)tile * TILE_PANELS;
                const int np = P - p < TILE_PANELS ? (int)(P - p) : TILE_PANELS;
                vf mul[NV];
                for (int v = 0; v < NV; v++) {
                    const int64_t col = p * PANEL + v * VW;
                    const int valid = v < np * VPP;
                    mul[v] = q->groups || !valid ? splat(1.0f) : vload(q->scale + col);
                    const vf b = bias && valid ? vload(bias + col) : (vf){0};
                    if (valid)
                        for (int64_t m = 0; m < rows; m++) vstore(yb + m * ldy + col, b);
                }
                for (int k0 = 0; k0 < K; k0 += KC) {
                    const int kc = K - k0 < KC ? K - k0 : KC;
                    dequant_tile(q, p, np, K, k0, kc, buf);
                    tile_product(xb + k0, ldx, rows, buf, kc, np, yb + p * PANEL, ldy, mul);
                }
            }
        }
        free(buf);
    }
    return failed;
}

/* The whole weight as fp32, transposed: out[k * 16 P + n] is weight (n, k), scales applied.
 * Prefill-sized products multiply it with the BLAS GEMM, which is faster at such sizes than
 * the tiles above; writing it costs a pass over N K floats, each row of panels contiguous. */
static void dequantize_kn(const qweight *q, float *out, int32_t P, int32_t K, int32_t num_threads) {
    const int64_t ld = (int64_t)P * PANEL;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int32_t p = 0; p < P; p++) {
        float *dst = out + (int64_t)p * PANEL;
        if (q->groups == 0) {
            const int8_t *w = panel_i8(q, p, K);
            vf s[VPP];
            for (int h = 0; h < VPP; h++) s[h] = vload(q->scale + (int64_t)p * PANEL + h * VW);
            for (int k = 0; k < K; k++) {
                vf wv[VPP];
                from_i8(w + (int64_t)k * PANEL, 0, wv);
                for (int h = 0; h < VPP; h++) vstore(dst + k * ld + h * VW, wv[h] * s[h]);
            }
            continue;
        }
        const uint8_t *w = panel_groups(q, p, K);
        const float *sc = q->scale + (int64_t)p * q->groups * PANEL;
        const float *of = q->offset + (int64_t)p * q->groups * PANEL;
        for (int k = 0; k < K; k += 2) {
            const int g = k / q->group_size; /* even k, even group size: k + 1 in the same */
            vf wv[2][VPP];
            if (k + 1 < K)
                from_pair(w, k, q->bits, 0, wv[0], wv[1]);
            else
                from_one(w, k, q->bits, 0, wv[0]);
            for (int e = 0; e < 2 && k + e < K; e++)
                for (int h = 0; h < VPP; h++) {
                    const vf sv = vload(sc + g * PANEL + h * VW), ov = vload(of + g * PANEL + h * VW);
                    vstore(dst + (k + e) * ld + h * VW, wv[e][h] * sv + ov);
                }
        }
    }
}

void ladle_dequantize_i8(const int8_t *w, const float *scale, float *out, int32_t P, int32_t K,
                         int32_t num_threads) {
    const qweight q = {w, scale, NULL, 0, 0, 8};
    dequantize_kn(&q, out, P, K, num_threads);
}

void ladle_dequantize_groups(const uint8_t *w, const float *scale, const float *offset,
                             float *out, int32_t P, int32_t K, int32_t group_size, int32_t bits,
                             int32_t num_threads) {
    const qweight q = {w, scale, offset, (K + group_size - 1) / group_size, group_size, bits};
    dequantize_kn(&q, out, P, K, num_threads);
}

/* ---------------------------------------------------------------------------------------- */
/* Entry points. x rows are ldx floats apart; y is [M, ldy] with ldy >= 16 P (the padded
 * outputs are written too); bias, padded to 16 P, may be NULL; a group size is a positive
 * multiple of 32 and bits 4 or 8 (the caller checks). Nonzero: out of memory. */

int ladle_linear_i8(const float *x, int64_t ldx, const int8_t *w, const float *scale,
                    const float *bias, float *y, int64_t ldy, int64_t M, int32_t P, int32_t K,
                    int32_t num_threads) {
    const qweight q = {w, scale, NULL, 0, 0, 8};
    if (M == 0) return 0;
    if (M > GEMV_MAX_ROWS) return gemm(x, ldx, &q, bias, y, ldy, M, P, K, num_threads);
    gemv(x, ldx, &q, bias, y, ldy, (int)M, P, K, num_threads);
    return 0;
}

int ladle_linear_groups(const float *x, int64_t ldx, const uint8_t *w, const float *scale,
                        const float *offset, const float *bias, float *y, int64_t ldy, int64_t M,
                        int32_t P, int32_t K, int32_t group_size, int32_t bits,
                        const uint8_t *a8, int32_t num_threads) {
    const qweight q = {w, scale, offset, (K + group_size - 1) / group_size, group_size, bits, a8};
    /* Int8-activation codes serve every decode batch the fused step takes, so that both paths
     * compute the same. */
    const int64_t gemv_rows = a8 != NULL ? LADLE_A8_MAX_ROWS : GEMV_MAX_ROWS;
    if (M == 0) return 0;
    if (M > gemv_rows) return gemm(x, ldx, &q, bias, y, ldy, M, P, K, num_threads);
    gemv(x, ldx, &q, bias, y, ldy, (int)M, P, K, num_threads);
    return 0;
}

/* ---------------------------------------------------------------------------------------- */
/* int8 KV cache: per (token, KV head) symmetric scales, absmax / 127, rounded half up as the
 * Triton store does (floor(x / scale + 0.5)), so both backends write the same bytes.         */

void ladle_quantize_kv_row(const float *row, int8_t *dst, float *scale_out, int32_t head_dim) {
    float amax = 0.0f;
    for (int d = 0; d < head_dim; d++) amax = fmaxf(amax, fabsf(row[d]));
    const float scale = fmaxf(amax / 127.0f, 1e-8f);
    for (int d = 0; d < head_dim; d++) {
        const float qv = floorf(row[d] / scale + 0.5f);
        dst[d] = (int8_t)fminf(fmaxf(qv, -127.0f), 127.0f);
    }
    *scale_out = scale;
}

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
            for (int h = 0; h < num_kv_heads; h++)
                ladle_quantize_kv_row(src + (int64_t)h * head_dim,
                                      cache + (slot * num_kv_heads + h) * head_dim,
                                      scales + slot * num_kv_heads + h, head_dim);
        }
    }
}

/* Decode attention over the int8 cache: the same walk as ladle_paged_decode_attention_f32 (one
 * sequence per task, blocks read front to back), with each key's scale applied to its score
 * and each value's scale folded into its probability, so int8 values are read once and never
 * expanded into a copy. Scales are [num_blocks, block_size, num_kv_heads]. */
int ladle_decode_attention_i8_heads(const float *qs, float *os, const int8_t *key_cache,
                                    const int8_t *value_cache, const float *key_scale,
                                    const float *value_scale, const int32_t *table, int32_t len,
                                    int32_t h0, int32_t h1, int32_t group, int32_t num_kv_heads,
                                    int32_t head_dim, int32_t block_size, float scale) {
    const int64_t token_stride = (int64_t)num_kv_heads * head_dim;
    const int heads = h1 - h0;
    float *scores = malloc(sizeof(float) * (size_t)heads * ((size_t)len + 1));
    if (scores == NULL) return 1;
    float *inv_sum = scores + (size_t)heads * len;
    for (int t = 0; t < len; t++) {
        const int64_t slot = (int64_t)table[t / block_size] * block_size + t % block_size;
        const int8_t *k = key_cache + slot * token_stride;
        const float *ks = key_scale + slot * num_kv_heads;
        for (int head = h0; head < h1; head++) {
            const float *qh = qs + (int64_t)head * head_dim;
            const int kvh = head / group;
            const int8_t *kh = k + (int64_t)kvh * head_dim;
            float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
            for (int d = 0; d < head_dim; d++) acc += qh[d] * (float)kh[d];
            scores[(head - h0) * len + t] = acc * ks[kvh] * scale;
        }
    }
    for (int i = 0; i < heads; i++) {
        float *row = scores + (size_t)i * len;
        float max = -INFINITY;
        for (int t = 0; t < len; t++) max = row[t] > max ? row[t] : max;
        float sum = 0.0f;
        for (int t = 0; t < len; t++) {
            row[t] = expf(row[t] - max);
            sum += row[t];
        }
        inv_sum[i] = 1.0f / sum;
    }
    for (int64_t i = (int64_t)h0 * head_dim; i < (int64_t)h1 * head_dim; i++) os[i] = 0.0f;
    for (int t = 0; t < len; t++) {
        const int64_t slot = (int64_t)table[t / block_size] * block_size + t % block_size;
        const int8_t *v = value_cache + slot * token_stride;
        const float *vs = value_scale + slot * num_kv_heads;
        for (int head = h0; head < h1; head++) {
            const int kvh = head / group;
            const float p = scores[(head - h0) * len + t] * inv_sum[head - h0] * vs[kvh];
            const int8_t *vh = v + (int64_t)kvh * head_dim;
            float *oh = os + (int64_t)head * head_dim;
#pragma omp simd
            for (int d = 0; d < head_dim; d++) oh[d] += p * (float)vh[d];
        }
    }
    free(scores);
    return 0;
}

int ladle_paged_decode_attention_i8(
    const float *q, int64_t q_stride, const int8_t *key_cache, const int8_t *value_cache,
    const float *key_scale, const float *value_scale, const int32_t *block_tables,
    int64_t table_stride, const int32_t *seq_lens, float *out, int32_t num_seqs,
    int32_t num_heads, int32_t num_kv_heads, int32_t head_dim, int32_t block_size, float scale,
    int32_t num_threads) {
    int failed = 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads) if (num_seqs > 1)
    for (int s = 0; s < num_seqs; s++) {
        if (ladle_decode_attention_i8_heads(
                q + (int64_t)s * q_stride, out + (int64_t)s * num_heads * head_dim, key_cache,
                value_cache, key_scale, value_scale, block_tables + s * table_stride, seq_lens[s],
                0, num_heads, num_heads / num_kv_heads, num_kv_heads, head_dim, block_size,
                scale)) {
#pragma omp atomic write
            failed = 1;
        }
    }
    return failed;
}
