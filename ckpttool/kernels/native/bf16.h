/* float32 -> bfloat16 bits, round to nearest even in integers: fp8_cpu.round_to_bf16's arithmetic, so the
 * same bits as torch and CUDA's cvt.rn.bf16.f32 for every number. A NaN stays a NaN (its sign and top
 * payload bits, made quiet): the rounding's 32-bit sum would wrap a NaN whose low bits are high to 0x0000,
 * a zero, and then nothing downstream could refuse it. */
#ifndef CKPTTOOL_BF16_H
#define CKPTTOOL_BF16_H
#include <stdint.h>
#include <string.h>

static inline uint32_t ckpttool_bf16_bits(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (u >> 16) | 0x40u;
    return (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
}
#endif
