/* bitsandbytes' dequantization in C: kernels/bnb_cpu.py's loops (its docstring gives the library's formulas),
 * the same bits as its numba and numpy forms. kernels/native.py checks every shape, dtype and stride first.
 *
 * 4-bit: packed bytes of the flat weight, two codes a byte, the HIGH nibble first; blocks of `blocksize` values
 * share one fp32 absmax. Each block's 16 outputs are made once (one fp32 product, one rounding), then every
 * byte is two loads from that table.
 * int8 (LLM.int8()): out[i, j] = round(fp32(fp32(q[i, j] * scb[i]) * (1/127 in fp32))), the two products in
 * bitsandbytes' order.
 * Rounding into the output: bf16.h (nearest even), or to fp16 with `ckpttool_f16_bits` (nearest even, IEEE
 * subnormals, overflow to inf: numpy's astype(float16) and torch's .to(float16) on every finite number). */
#include <stdint.h>
#include <string.h>

#include "bf16.h"

/* float32 -> float16 bits, round to nearest even (F. Giesen's float_to_half_fast3_rtne): the subnormal case
 * lets one fp32 addition do the rounding, so it needs the default rounding mode and no flush-to-zero, which
 * setup.py's flags keep. A NaN becomes the quiet NaN 0x7E00 (never reached: inputs are checked finite). */
static inline uint32_t ckpttool_f16_bits(float x) {
    const uint32_t f16max = (127u + 16u) << 23, infty = 255u << 23;
    const uint32_t magic_u = ((127u - 15u) + (23u - 10u) + 1u) << 23;
    uint32_t u, sign;
    memcpy(&u, &x, sizeof u);
    sign = u & 0x80000000u;
    u ^= sign;
    uint32_t o;
    if (u >= f16max) {
        o = u > infty ? 0x7E00u : 0x7C00u;
    } else if (u < (113u << 23)) {
        float f, magic;
        memcpy(&f, &u, sizeof f);
        memcpy(&magic, &magic_u, sizeof magic);
        f += magic;
        memcpy(&o, &f, sizeof o);
        o -= magic_u;
    } else {
        const uint32_t odd = (u >> 13) & 1u;
        u += ((uint32_t)(15 - 127) << 23) + 0xFFFu;
        u += odd;
        o = u >> 13;
    }
    return o | (sign >> 16);
}

static inline uint32_t ckpttool_f32_bits(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    return u;
}

/* packed [nbytes] -> out [2 * nbytes]; absmax [ceil(2 * nbytes / blocksize)]; code [16]; blocksize even. */
#define BNB4(NAME, T, ROUND)                                                                               \
    void NAME(const uint8_t *restrict packed, int64_t nbytes, const float *restrict absmax,               \
              const float *restrict code, int64_t blocksize, T *restrict out) {                         \
        const int64_t half = blocksize / 2;                                                              \
        T t[16];                                                                                         \
        for (int64_t b = 0, j0 = 0; j0 < nbytes; b++, j0 += half) {                                     \
            const float s = absmax[b];                                                                   \
            for (int k = 0; k < 16; k++) t[k] = (T)ROUND(code[k] * s);                                   \
            const int64_t j1 = j0 + half < nbytes ? j0 + half : nbytes;                                  \
            for (int64_t j = j0; j < j1; j++) {                                                          \
                const uint8_t v = packed[j];                                                             \
                out[2 * j] = t[v >> 4];                                                                  \
                out[2 * j + 1] = t[v & 15];                                                              \
            }                                                                                            \
        }                                                                                                \
    }

BNB4(ckpttool_bnb4_bf16, uint16_t, ckpttool_bf16_bits)
BNB4(ckpttool_bnb4_f16, uint16_t, ckpttool_f16_bits)
BNB4(ckpttool_bnb4_f32, uint32_t, ckpttool_f32_bits)

/* codes [rows, width] int8 (row stride in elements), scb [rows] -> out [rows, width] (row stride in elements). */
#define BNB8(NAME, T, ROUND)                                                                               \
    void NAME(const int8_t *restrict codes, int64_t code_stride, const float *restrict scb, int64_t rows,  \
              int64_t width, T *restrict out, int64_t out_stride) {                                      \
        const float inv127 = 7.874015718698502e-3f;                                                      \
        for (int64_t i = 0; i < rows; i++) {                                                             \
            const int8_t *restrict c = codes + i * code_stride;                                         \
            T *restrict o = out + i * out_stride;                                                        \
            const float s = scb[i];                                                                      \
            for (int64_t j = 0; j < width; j++) {                                                        \
                const float p = (float)c[j] * s;                                                         \
                o[j] = (T)ROUND(p * inv127);                                                             \
            }                                                                                            \
        }                                                                                                \
    }

BNB8(ckpttool_bnb8_bf16, uint16_t, ckpttool_bf16_bits)
BNB8(ckpttool_bnb8_f16, uint16_t, ckpttool_f16_bits)
BNB8(ckpttool_bnb8_f32, uint32_t, ckpttool_f32_bits)
