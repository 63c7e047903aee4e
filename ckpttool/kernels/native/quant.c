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
