/* The FP8 block dequant's inner loops in C (kernels/native.py loads them with ctypes; setup.py builds
 * them at install where a C compiler is found). The same functions as kernels/fp8_gather.py's numba
 * kernels, the same bits (tests/test_convert.py). No Python headers: the library is plain C, its calls
 * run without the GIL (ctypes releases it), and every shape and stride is checked by the caller.
 *
 * Built with -O3 -funroll-loops for the machine's baseline ISA (x86-64 without AVX): the full-block
 * loop has a constant trip count of 128, which the compiler unrolls into scalar loads and stores. On
 * the H100 machine's Xeon and the 2-core box's EPYC that ran 1.4-1.8x numba's loop per core, and the
 * same loop built for AVX2 or AVX-512 was slower: their vector gathers are slow on both CPUs
 * (bench/RESULTS.md). */
#include <stdint.h>

#include "bf16.h"

/* out[i, j] = tables[i >> shift][((j >> shift) << 8) + codes[i, j]]: each (row block, column block)
 * has its 256 outputs in `tables` (row stride `table_stride` elements); codes and out have row strides
 * `code_stride` and `out_stride` elements and unit column strides. */
#define GATHER(NAME, T)                                                                                 \
    void NAME(const uint8_t *restrict codes, int64_t code_stride, const T *restrict tables,             \
              int64_t table_stride, T *restrict out, int64_t out_stride, int64_t rows, int64_t cols,    \
              int32_t shift) {                                                                          \
        const int64_t blk = (int64_t)1 << shift, full = cols >> shift;                                  \
        for (int64_t i = 0; i < rows; i++) {                                                            \
            const T *restrict t = tables + (i >> shift) * table_stride;                                 \
            const uint8_t *restrict c = codes + i * code_stride;                                        \
            T *restrict o = out + i * out_stride;                                                       \
            if (shift == 7) { /* every published FP8 block checkpoint: a constant trip count */         \
                for (int64_t b = 0; b < full; b++) {                                                    \
                    const T *restrict tb = t + (b << 8);                                                \
                    const uint8_t *restrict cb = c + (b << 7);                                          \
                    T *restrict ob = o + (b << 7);                                                      \
                    for (int j = 0; j < 128; j++) ob[j] = tb[cb[j]];                                    \
                }                                                                                       \
            } else {                                                                                    \
                for (int64_t b = 0; b < full; b++) {                                                    \
                    const T *restrict tb = t + (b << 8);                                                \
                    const uint8_t *restrict cb = c + (b << shift);                                      \
                    T *restrict ob = o + (b << shift);                                                  \
                    for (int64_t j = 0; j < blk; j++) ob[j] = tb[cb[j]];                                \
                }                                                                                       \
            }                                                                                           \
            for (int64_t j = full << shift; j < cols; j++) o[j] = t[((j >> shift) << 8) + c[j]];        \
        }                                                                                               \
    }

GATHER(ckpttool_fp8_gather_u16, uint16_t)
GATHER(ckpttool_fp8_gather_u32, uint32_t)

/* 1 where some byte of words[0:n] has (byte & 0x7F) + (add's byte) >= 0x80, else 0: with add = 0x7F -
 * nan_above in every byte, whether a code's magnitude is above nan_above (a NaN code). */
int32_t ckpttool_fp8_any_over(const uint64_t *restrict words, int64_t n, uint64_t add) {
    const uint64_t low = 0x7F7F7F7F7F7F7F7FULL;
    uint64_t acc = 0;
    for (int64_t k = 0; k < n; k++) acc |= (words[k] & low) + add;
    return (acc & 0x8080808080808080ULL) != 0;
}

/* out[i, k] = bf16 bits of float32(values[k] * scales[i]) (bf16.h: a NaN product stays a NaN). */
void ckpttool_bf16_tables(const float *restrict values, int64_t n, const float *restrict scales, int64_t m,
                          uint16_t *restrict out) {
    for (int64_t i = 0; i < m; i++) {
        const float s = scales[i];
        for (int64_t k = 0; k < n; k++) out[i * n + k] = (uint16_t)ckpttool_bf16_bits(values[k] * s);
    }
}
