/* Integer codes with per-group scales and zero points, in C: kernels/window.py's loops (its docstring says
 * what they compute and why), the same bits as its numba and numpy forms. kernels/native.py checks every
 * shape, dtype, stride and index range first; row strides are in elements.
 *
 *   bytes:   out[i, j] = tables[offsets[i, j / group] + codes[i, j]]   (int8: codes[i, j] ^ 0x80)
 *   nibbles: out[i, 2k] = tables[offsets[i, 2k / group] + (codes[i, k] & 15)], out[i, 2k + 1] the high nibble
 *   g_idx:   the same with offsets[i, g_idx[j]]: each column's group read from a table (GPTQ's act-order)
 */
#include <stdint.h>


/* One group's codes in blocks of a constant length (32 bytes, or 16 bytes of nibbles), whatever the group size:
 * with a constant trip count gcc unrolls the block and combines its table words into 16-byte stores; a group-sized
 * loop of another length ran at half the speed (gcc 12, x86-64 baseline: bench/RESULTS.md). */
#define RUN_BLOCKS(T, LEN, STEP, BODY)                                                                     \
    {                                                                                                   \
        int64_t k = 0;                                                                                  \
        for (; k + (STEP) <= (LEN); k += (STEP))                                                        \
            for (int64_t q = k; q < k + (STEP); q++) BODY;                                              \
        for (; k < (LEN); k++) {                                                                        \
            const int64_t q = k;                                                                        \
            BODY;                                                                                       \
        }                                                                                               \
    }

/* FLIP a constant: a runtime one cost two instructions an element (an XOR and a zero extension) */
#define BYTES(NAME, T, FLIP)                                                                            \
    void NAME(const uint8_t *restrict codes, int64_t code_stride, const int32_t *restrict offsets,     \
              int64_t off_stride, const T *restrict tables, T *restrict out, int64_t out_stride,       \
              int64_t rows, int64_t cols, int64_t group) {                                              \
        const int64_t full = cols / group;                                                              \
        for (int64_t i = 0; i < rows; i++) {                                                            \
            const int32_t *restrict w = offsets + i * off_stride;                                       \
            const uint8_t *restrict c = codes + i * code_stride;                                        \
            T *restrict o = out + i * out_stride;                                                       \
            for (int64_t g = 0; g < full; g++) {                                                        \
                const T *restrict tb = tables + w[g];                                                   \
                const uint8_t *restrict cb = c + g * group;                                             \
                T *restrict ob = o + g * group;                                                         \
                if (group == 32) /* the whole group as one constant block */                            \
                    for (int64_t q = 0; q < 32; q++) ob[q] = tb[(uint8_t)(cb[q] ^ (FLIP))];             \
                else                                                                                    \
                    RUN_BLOCKS(T, group, 32, ob[q] = tb[(uint8_t)(cb[q] ^ (FLIP))])                     \
            }                                                                                           \
            for (int64_t j = full * group; j < cols; j++) o[j] = tables[w[full] + (uint8_t)(c[j] ^ (FLIP))]; \
        }                                                                                               \
    }

/* group is even: both nibbles of a byte are in one group */
#define NIBBLES(NAME, T)                                                                                \
    void NAME(const uint8_t *restrict codes, int64_t code_stride, const int32_t *restrict offsets,     \
              int64_t off_stride, const T *restrict tables, T *restrict out, int64_t out_stride,       \
              int64_t rows, int64_t width, int64_t group) {                                             \
        const int64_t half = group / 2, full = width / half;                                            \
        for (int64_t i = 0; i < rows; i++) {                                                            \
            const int32_t *restrict w = offsets + i * off_stride;                                       \
            const uint8_t *restrict c = codes + i * code_stride;                                        \
            T *restrict o = out + i * out_stride;                                                       \
            for (int64_t g = 0; g < full; g++) {                                                        \
                const T *restrict tb = tables + w[g];                                                   \
                const uint8_t *restrict cb = c + g * half;                                              \
                T *restrict ob = o + g * group;                                                         \
                if (half == 8) /* groups of 16 and 32 values: the whole group as one constant block */  \
                    for (int64_t q = 0; q < 8; q++) ob[2 * q] = tb[cb[q] & 15], ob[2 * q + 1] = tb[cb[q] >> 4]; \
                else if (half == 16)                                                                    \
                    for (int64_t q = 0; q < 16; q++) ob[2 * q] = tb[cb[q] & 15], ob[2 * q + 1] = tb[cb[q] >> 4]; \
                else                                                                                    \
                    RUN_BLOCKS(T, half, 16, (ob[2 * q] = tb[cb[q] & 15], ob[2 * q + 1] = tb[cb[q] >> 4])) \
            }                                                                                           \
            for (int64_t k = full * half; k < width; k++) {                                             \
                o[2 * k] = tables[w[full] + (c[k] & 15)];                                               \
                o[2 * k + 1] = tables[w[full] + (c[k] >> 4)];                                           \
            }                                                                                           \
        }                                                                                               \
    }

#define BYTES_GIDX(NAME, T, FLIP)                                                                       \
    void NAME(const uint8_t *restrict codes, int64_t code_stride, const int32_t *restrict offsets,     \
              int64_t off_stride, const int32_t *restrict gidx, const T *restrict tables, T *restrict out, \
              int64_t out_stride, int64_t rows, int64_t cols) {                                         \
        for (int64_t i = 0; i < rows; i++) {                                                            \
            const int32_t *restrict w = offsets + i * off_stride;                                       \
            const uint8_t *restrict c = codes + i * code_stride;                                        \
            T *restrict o = out + i * out_stride;                                                       \
            for (int64_t j = 0; j < cols; j++) o[j] = tables[w[gidx[j]] + (uint8_t)(c[j] ^ (FLIP))];    \
        }                                                                                               \
    }

#define NIBBLES_GIDX(NAME, T)                                                                           \
    void NAME(const uint8_t *restrict codes, int64_t code_stride, const int32_t *restrict offsets,     \
              int64_t off_stride, const int32_t *restrict gidx, const T *restrict tables, T *restrict out, \
              int64_t out_stride, int64_t rows, int64_t width) {                                        \
        for (int64_t i = 0; i < rows; i++) {                                                            \
            const int32_t *restrict w = offsets + i * off_stride;                                       \
            const uint8_t *restrict c = codes + i * code_stride;                                        \
            T *restrict o = out + i * out_stride;                                                       \
            for (int64_t k = 0; k < width; k++) {                                                       \
                const uint8_t b = c[k];                                                                 \
                o[2 * k] = tables[w[gidx[2 * k]] + (b & 15)];                                           \
                o[2 * k + 1] = tables[w[gidx[2 * k + 1]] + (b >> 4)];                                   \
            }                                                                                           \
        }                                                                                               \
    }

BYTES(ckpttool_window_bytes_u16, uint16_t, 0)
BYTES(ckpttool_window_bytes_u32, uint32_t, 0)
BYTES(ckpttool_window_int8_u16, uint16_t, 0x80)
BYTES(ckpttool_window_int8_u32, uint32_t, 0x80)
NIBBLES(ckpttool_window_nibbles_u16, uint16_t)
NIBBLES(ckpttool_window_nibbles_u32, uint32_t)
BYTES_GIDX(ckpttool_window_bytes_gidx_u16, uint16_t, 0)
BYTES_GIDX(ckpttool_window_bytes_gidx_u32, uint32_t, 0)
BYTES_GIDX(ckpttool_window_int8_gidx_u16, uint16_t, 0x80)
BYTES_GIDX(ckpttool_window_int8_gidx_u32, uint32_t, 0x80)
NIBBLES_GIDX(ckpttool_window_nibbles_gidx_u16, uint16_t)
NIBBLES_GIDX(ckpttool_window_nibbles_gidx_u32, uint32_t)
