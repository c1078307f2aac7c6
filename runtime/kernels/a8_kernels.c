/* int4 weights times int8 activations with AVX-512 VNNI: the draft model's GEMV.
 *
 * A drafter's numerics sway only how many of its tokens the model accepts, never the output
 * (the model verifies each one), so its decode products may round their activations as
 * llama.cpp's do: each group of x to int8 codes with one step (absmax / 127), then, per
 * instruction (vpdpbusd), 16 lanes of 4 unsigned codes times 4 signed activations summed in
 * exact int32. Per group, the int32 sums take the group's scale times the activations' step,
 * and the offset the group's sum, as in the weight-only GEMV (quant_kernels.c): the result is
 * the dequantized weights times the rounded activations. An instruction does the arithmetic
 * of 64 weights where the fp32 path converts and multiplies 16.
 *
 * The codes are a second copy of the weight's (formats.py, ``pack_a8``): per panel of 16
 * outputs, K / 8 rows of 64 bytes, byte 4 j + t of row r holding input 8 r + t of channel
 * 16 p + j in its low nibble and input 8 r + 4 + t in its high one, so a mask and a shift
 * give two instructions' 64 codes in lane order.
 *
 * Compiled for any x86-64 target and chosen at run time: the images' prebuilt x86-64-v4 level
 * has AVX-512 but not VNNI, and a v3 build may still run on a CPU that has it. Elsewhere
 * ladle_a8_supported() is 0 and no weight carries the copy.
 */
#include <stdint.h>
#include <string.h>

#include "kernels.h"

#define PANEL 16
/* Rows of x per pass over a panel, each with its accumulators in registers. */
#define A8_ROWS 4

#if LADLE_HAVE_A8
#include <immintrin.h>

#define A8_TARGET __attribute__((target("avx512f,avx512bw,avx512vnni")))
#define A8_INLINE static inline __attribute__((always_inline)) A8_TARGET

int ladle_a8_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vnni");
}

/* Each row's groups of x as int8 codes xq[r * K + k], with the group's step xd and the sum
 * of its rounded values xs at [r * groups + g]. Rounding is to nearest even, as torch.round.
 * The offset takes the rounded sum, not x's own: then the product is exactly that of the
 * dequantized weights with the rounded activations, whose error is sum(w e) over the
 * rounding errors e. With x's own sum it would be sum(q s e), codes 0..15 that are not
 * centred, twice the error (llama.cpp's Q4_1 x Q8_1 dot product does the same). */
A8_INLINE void quantize_rows(const float *x, int64_t ldx, int64_t R, int32_t K,
                             const ladle_qweight *q, int8_t *xq, float *xd, float *xs) {
    for (int64_t r = 0; r < R; r++)
        for (int g = 0; g < q->groups; g++) {
            const int k0 = g * q->group_size;
            const int k1 = k0 + q->group_size < K ? k0 + q->group_size : K;
            const float *xr = x + r * ldx;
            float amax = 0.0f;
            for (int k = k0; k < k1; k++) {
                const float a = xr[k] < 0 ? -xr[k] : xr[k];
                amax = a > amax ? a : amax;
            }
            const float step = amax / 127.0f, inv = amax > 0 ? 127.0f / amax : 0.0f;
            int32_t sum = 0;
            for (int k = k0; k < k1; k++) {
                xq[r * K + k] = (int8_t)__builtin_rintf(xr[k] * inv);
                sum += xq[r * K + k];
            }
            xd[r * q->groups + g] = step;
            xs[r * q->groups + g] = step * (float)sum;
        }
}

static inline int32_t four(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* Panel p's 16 outputs for R rows (a constant where this is inlined). */
A8_INLINE void panel_a8(const int8_t *xq, const float *xd, const float *xs, const ladle_qweight *q,
                        int64_t p, int32_t K, int R, __m512 out[A8_ROWS]) {
    const uint8_t *w = q->a8 + p * (int64_t)(K / 8) * 64;
    const float *sc = q->scale + p * q->groups * PANEL, *of = q->offset + p * q->groups * PANEL;
    const __m512i mask = _mm512_set1_epi8(0x0F);
    for (int r = 0; r < R; r++) out[r] = _mm512_setzero_ps();
    for (int g = 0; g < q->groups; g++) {
        const int k0 = g * q->group_size;
        const int k1 = k0 + q->group_size < K ? k0 + q->group_size : K;
        /* Low and high nibbles in separate chains, so two instructions are in flight. */
        __m512i lo_acc[A8_ROWS], hi_acc[A8_ROWS];
        for (int r = 0; r < R; r++) lo_acc[r] = hi_acc[r] = _mm512_setzero_si512();
        for (int k = k0; k < k1; k += 8) {
            const __m512i v = _mm512_loadu_si512(w + (int64_t)(k / 8) * 64);
            const __m512i lo = _mm512_and_si512(v, mask);
            const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), mask);
            for (int r = 0; r < R; r++) {
                const int8_t *xr = xq + (int64_t)r * K + k;
                lo_acc[r] = _mm512_dpbusd_epi32(lo_acc[r], lo, _mm512_set1_epi32(four(xr)));
                hi_acc[r] = _mm512_dpbusd_epi32(hi_acc[r], hi, _mm512_set1_epi32(four(xr + 4)));
            }
        }
        const __m512 s = _mm512_loadu_ps(sc + g * PANEL), o = _mm512_loadu_ps(of + g * PANEL);
        for (int r = 0; r < R; r++) {
            const __m512 dot = _mm512_cvtepi32_ps(_mm512_add_epi32(lo_acc[r], hi_acc[r]));
            const __m512 step = _mm512_mul_ps(s, _mm512_set1_ps(xd[r * q->groups + g]));
            out[r] = _mm512_fmadd_ps(o, _mm512_set1_ps(xs[r * q->groups + g]), out[r]);
            out[r] = _mm512_fmadd_ps(dot, step, out[r]);
        }
    }
}

A8_TARGET void ladle_a8_gemv_panels(const float *x, int64_t ldx, const ladle_qweight *q,
                                    const float *bias, float *y, int64_t ldy, int64_t R,
                                    int32_t p0, int32_t p1, int32_t K) {
    /* On the stack: R * K bytes and 2 R groups floats, some KiB for a decode batch. */
    int8_t xq[R * K + 1];
    float xd[R * q->groups + 1], xs[R * q->groups + 1];
    quantize_rows(x, ldx, R, K, q, xq, xd, xs);
    for (int32_t p = p0; p < p1; p++)
        for (int64_t r0 = 0; r0 < R; r0 += A8_ROWS) {
            const int8_t *xqr = xq + r0 * K;
            const float *xdr = xd + r0 * q->groups, *xsr = xs + r0 * q->groups;
            const int64_t rows = R - r0 < A8_ROWS ? R - r0 : A8_ROWS;
            __m512 out[A8_ROWS];
            switch (rows) { /* constant row counts, so the accumulators stay in registers */
            case 1: panel_a8(xqr, xdr, xsr, q, p, K, 1, out); break;
            case 2: panel_a8(xqr, xdr, xsr, q, p, K, 2, out); break;
            case 3: panel_a8(xqr, xdr, xsr, q, p, K, 3, out); break;
            default: panel_a8(xqr, xdr, xsr, q, p, K, 4, out); break;
            }
            const __m512 b = bias ? _mm512_loadu_ps(bias + p * PANEL) : _mm512_setzero_ps();
            for (int r = 0; r < rows; r++)
                _mm512_storeu_ps(y + (r0 + r) * ldy + p * PANEL, _mm512_add_ps(out[r], b));
        }
}
#else
int ladle_a8_supported(void) { return 0; }
#endif
