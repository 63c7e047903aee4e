/* compressed-tensors 0.20's integer group quantization of BF16 rows in C: kernels/quant_ct.py's `min_max`,
 * `qparams`, `quantize` and `pack_to_int32` for pack-quantized INT4/INT8 (W4A16, W4A16_ASYM, W8A16), the same
 * operations in the same dtypes, so the same bits. kernels/quant_native.py checks every shape, dtype and stride.
 *
 * The library computes in the weight's dtype: every BF16 operation is an fp32 operation on BF16 values rounded
 * once to BF16 (nearest even), as torch's CPU kernels compute it. Per group of `group` columns of a row:
 *   lo = min(amin, 0), hi = max(amax, 0)
 *   symmetric:  scale = bf16(max(-lo, hi) / bf16(bf16(range) / 2)), zero 0
 *   asymmetric: scale = bf16(bf16(hi - lo) / bf16(range)), zero = round(clamp(bf16(qmin - bf16(lo / scale))))
 *   (range = qmax - qmin: 15 or 255); a scale of 0 becomes BF16's eps 2**-7 (symmetric; an asymmetric group whose
 *   scale is 0 makes the library divide 0 by 0: the kernel stops and returns its row, and the caller runs torch)
 *   q = round_half_even(clamp(bf16(bf16(x / scale) + zero), qmin, qmax)) + 2**(bits - 1), 32 / bits a word, the
 *   lowest column in the lowest bits. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

static inline float from_bf16(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline float bf(float x) { return from_bf16((uint16_t)ckpttool_bf16_bits(x)); }

/* w: BF16 bits [rows, cols] (row stride ldw), cols a multiple of group and of 32 / bits; packed: int32 words
 * [rows, cols * bits / 32] (ldp); scale: BF16 bits [rows, cols / group] (lds); zero: int8 [rows, cols / group]
 * (ldz), written where not symmetric; packed NULL: the scales and zero points only. Returns -1, or the first row holding an asymmetric group of range 0 (the
 * rows before it are written). */
int64_t ckpttool_quant_int_bf16(const uint16_t *restrict w, int64_t ldw, int64_t rows, int64_t cols, int64_t group,
                                int32_t bits, int32_t symmetric, uint32_t *restrict packed, int64_t ldp,
                                uint16_t *restrict scale, int64_t lds, int8_t *restrict zero, int64_t ldz) {
    const float qmin = -(float)(1 << (bits - 1)), qmax = (float)((1 << (bits - 1)) - 1);
    const float range = bf(qmax - qmin), half = bf(range / 2.0f);
    const uint32_t offset = 1u << (bits - 1), mask = (bits == 32) ? 0xFFFFFFFFu : ((1u << bits) - 1u);
    const int64_t per = 32 / bits, groups = cols / group;
    float x[256];
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *row = w + r * ldw;
        uint32_t *out = packed ? packed + r * ldp : 0;
        for (int64_t g = 0; g < groups; g++) {
            const uint16_t *src = row + g * group;
            float lo = 0.0f, hi = 0.0f; /* min(amin, 0), max(amax, 0) */
            for (int64_t j = 0; j < group; j++) {
                const float v = from_bf16(src[j]);
                x[j] = v;
                lo = v < lo ? v : lo;
                hi = v > hi ? v : hi;
            }
            float s, z = 0.0f;
            if (symmetric) {
                const float top = -lo > hi ? -lo : hi;
                s = bf(top / half);
                if (s == 0.0f) s = 0.0078125f; /* torch.finfo(bfloat16).eps */
            } else {
                s = bf(bf(hi - lo) / range);
                if (s == 0.0f) return r;
                float t = bf(qmin - bf(lo / s));
                t = t < qmin ? qmin : (t > qmax ? qmax : t);
                z = nearbyintf(t);
                zero[r * ldz + g] = (int8_t)z;
            }
            scale[r * lds + g] = (uint16_t)ckpttool_bf16_bits(s);
            if (!packed) continue; /* a scale's or zero point's task computes no codes */
            uint32_t *words = out + g * group / per;
            for (int64_t k = 0; k < group / per; k++) {
                uint32_t word = 0;
                for (int64_t i = 0; i < per; i++) {
                    float t = bf(x[k * per + i] / s);
                    if (!symmetric) t = bf(t + z);
                    t = t < qmin ? qmin : (t > qmax ? qmax : t);
                    const uint32_t q = (uint32_t)((int32_t)nearbyintf(t) + (int32_t)offset) & mask;
                    word |= q << (i * bits);
                }
                words[k] = word;
            }
        }
    }
    return -1;
}

/* -- FP4 (E2M1) groups: compressed-tensors' NVFP4 (groups of 16, an FP8 e4m3 scale under a global scale) and MXFP4
 * (groups of 32, an E8M0 scale): kernels/quant_ct.py's qparams, quantize_fp4_grouped and fp4_packed.
 *   NVFP4: scale = e4m3(clamp(fp32(gs * bf16(top / 6)), 448)) (0 -> 0.125); t = clamp(fp32(x / fp32(scale / gs)))
 *   MXFP4: p2 = top rounded at E2M1's precision to a power of two (`_mx_exponent`), code = clamp(round(127 +
 *          log2(p2) - 2), 0, 255), scale = 2**(code - 127) in BF16; t = clamp(bf16(x / scale))
 *   each code: E2M1 magnitude index by the library's thresholds (bucketize: how many lie strictly below |t|), sign
 *   bit where t < 0; two codes a byte, the even column in the low nibble. */
static const float FP4_BOUNDS[7] = {0.25f, 0x1.7ffffep-1f, 1.25f, 0x1.bffffep+0f, 2.5f, 0x1.bffffep+1f, 5.0f};

/* v in [0, 448] -> its nearest e4m3 value (ties to even; subnormals below 2**-6 in steps of 2**-9) and its code */
static inline float e4m3(float v, uint8_t *code) {
    if (v == 0.0f) {
        *code = 0;
        return 0.0f;
    }
    int ex;
    frexpf(v, &ex);
    int e = ex - 1 < -6 ? -6 : ex - 1;
    const float step = ldexpf(1.0f, e - 3), q = nearbyintf(v / step) * step;
    frexpf(q, &ex);
    e = ex - 1;
    if (e < -6) {
        *code = (uint8_t)(q / 0x1p-9f);
    } else {
        *code = (uint8_t)(((e + 7) << 3) | ((int)(q / ldexpf(1.0f, e - 3)) - 8));
    }
    return q;
}

static inline uint8_t fp4_code(float t) {
    const float a = fabsf(t);
    uint8_t idx = 0;
    for (int k = 0; k < 7; k++) idx += a > FP4_BOUNDS[k];
    return (uint8_t)(idx | ((t < 0.0f) << 3));
}

/* w: BF16 bits [rows, cols] (ldw), cols a multiple of the group (16 NVFP4, 32 MXFP4); packed: bytes [rows, cols / 2]
 * (ldp), NULL for the scales only; scale: bytes [rows, cols / group] (lds): e4m3 codes (NVFP4) or E8M0 (MXFP4). */
void ckpttool_quant_fp4_bf16(const uint16_t *restrict w, int64_t ldw, int64_t rows, int64_t cols, int32_t mx,
                             float gs, uint8_t *restrict packed, int64_t ldp, uint8_t *restrict scale, int64_t lds) {
    const int64_t group = mx ? 32 : 16, groups = cols / group;
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *row = w + r * ldw;
        for (int64_t g = 0; g < groups; g++) {
            const uint16_t *src = row + g * group;
            float lo = 0.0f, hi = 0.0f;
            for (int64_t j = 0; j < group; j++) {
                const float v = from_bf16(src[j]);
                lo = v < lo ? v : lo;
                hi = v > hi ? v : hi;
            }
            const float top = -lo > hi ? -lo : hi;
            float divisor; /* what each value is divided by, in the library's dtype */
            if (!mx) {
                float s = gs * bf(top / 6.0f);
                s = s > 448.0f ? 448.0f : s;
                uint8_t code;
                s = e4m3(s, &code);
                if (s == 0.0f) {
                    s = 0.125f;
                    code = 0x20; /* 0.125 = 2**-3: exponent field 4 */
                }
                scale[r * lds + g] = code;
                divisor = s / gs;
            } else {
                uint16_t h = (uint16_t)ckpttool_bf16_bits(top);
                const uint16_t p2bits = (uint16_t)(((uint32_t)h + (1u << 5)) & 0xFF80u);
                const float p2 = from_bf16(p2bits);
                float c;
                if (p2 == 0.0f) {
                    c = 0.0f; /* -inf, clamped to 0 */
                } else if (isinf(p2)) {
                    c = 255.0f;
                } else {
                    int ex;
                    frexpf(p2, &ex);
                    c = (float)(127 + (ex - 1) - 2);
                    c = c < 0.0f ? 0.0f : (c > 255.0f ? 255.0f : c);
                }
                scale[r * lds + g] = (uint8_t)c;
                divisor = bf(ldexpf(1.0f, (int)c - 127));
            }
            if (!packed) continue;
            uint8_t *out = packed + r * ldp + g * group / 2;
            for (int64_t j = 0; j < group; j += 2) {
                float t0 = from_bf16(src[j]) / divisor, t1 = from_bf16(src[j + 1]) / divisor;
                if (mx) {
                    t0 = bf(t0);
                    t1 = bf(t1);
                }
                t0 = t0 < -6.0f ? -6.0f : (t0 > 6.0f ? 6.0f : t0);
                t1 = t1 < -6.0f ? -6.0f : (t1 > 6.0f ? 6.0f : t1);
                out[j / 2] = (uint8_t)(fp4_code(t0) | (fp4_code(t1) << 4));
            }
        }
    }
}

/* -- exact repack: MXFP4 (E2M1 codes, low nibble first, an E8M0 scale per 32 along a row) -> FP8 e4m3 codes under
 * one power-of-two scale per b0 x b1 block (kernels/repack.py's mxfp4_values, block_exponents and fp8_codes, the
 * same numbers): each block's exponent ceil(log2(amax / 448)) in double (0 for an all-zero block, within
 * [-127, 127]), each value divided by 2**exponent in float32 (a multiply by 2**-exponent: the same correctly rounded
 * quotient, both powers of two being floats) and written as the e4m3 code holding it exactly (a -0.0 as 0x80).
 * Each block row's values are decoded once into `buf` (b0 x cols floats), its exponents taken from them, then its
 * codes, row-major, so the first value refused is the row-major first, as before. packed [rows, cols / 2], e8m0
 * [rows, cols / 32], codes [rows, cols], exps [ceil(rows / b0), ceil(cols / b1)] int32, all contiguous. Returns -1,
 * -2 where `buf` cannot be allocated, or the row-major index of the first value no e4m3 code holds (codes before it,
 * and the exponents of its block row and those above, are written). */
static const float E2M1[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                               -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

int64_t ckpttool_repack_mxfp4_fp8(const uint8_t *restrict packed, const uint8_t *restrict e8m0, int64_t rows,
                                  int64_t cols, int64_t b0, int64_t b1, uint8_t *restrict codes,
                                  int32_t *restrict exps) {
    const int64_t nb1 = (cols + b1 - 1) / b1;
    float *buf = malloc((size_t)(b0 < rows ? b0 : rows) * (size_t)cols * sizeof(float));
    if (buf == NULL) return -2;
    for (int64_t bi = 0; bi * b0 < rows; bi++) {
        const int64_t r0 = bi * b0, r1 = r0 + b0 < rows ? r0 + b0 : rows;
        for (int64_t i = r0; i < r1; i++) {  /* decode: a table of 16 values times the group's power of two */
            const uint8_t *p = packed + i * (cols / 2), *s = e8m0 + i * (cols / 32);
            float *v = buf + (i - r0) * cols;
            for (int64_t g = 0; g < cols / 32; g++) {
                const float scale = ldexpf(1.0f, (int)s[g] - 127);
                for (int64_t k = 0; k < 16; k++) {
                    const uint8_t b = p[g * 16 + k];
                    v[g * 32 + 2 * k] = E2M1[b & 0x0F] * scale;
                    v[g * 32 + 2 * k + 1] = E2M1[b >> 4] * scale;
                }
            }
        }
        for (int64_t bj = 0; bj < nb1; bj++) {
            float amax = 0.0f;
            const int64_t c0 = bj * b1, c1 = c0 + b1 < cols ? c0 + b1 : cols;
            for (int64_t i = 0; i < r1 - r0; i++)
                for (int64_t j = c0; j < c1; j++) {
                    const float a = fabsf(buf[i * cols + j]);
                    amax = a > amax ? a : amax;
                }
            double e = amax > 0.0f ? ceil(log2((double)amax / 448.0)) : 0.0;
            e = e < -127.0 ? -127.0 : (e > 127.0 ? 127.0 : e);
            exps[bi * nb1 + bj] = (int32_t)e;
        }
        for (int64_t i = r0; i < r1; i++) {
            const float *v = buf + (i - r0) * cols;
            for (int64_t bj = 0; bj < nb1; bj++) {
                const float inv = ldexpf(1.0f, -exps[bi * nb1 + bj]);
                const int64_t c1 = (bj + 1) * b1 < cols ? (bj + 1) * b1 : cols;
                for (int64_t j = bj * b1; j < c1; j++) {
                    const float q = v[j] * inv, a = fabsf(q);
                    uint8_t code = 0;
                    if (a != 0.0f && (a > 448.0f || e4m3(a, &code) != a)) {
                        free(buf);
                        return i * cols + j;
                    }
                    codes[i * cols + j] = (uint8_t)(code | (signbit(q) ? 0x80 : 0));
                }
            }
        }
    }
    free(buf);
    return -1;
}
