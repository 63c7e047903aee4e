/* The grouped table gather in C: kernels/grouped.py's loop (its docstring says what it is for), the same
 * bits as its numba and numpy forms. kernels/native.py checks every shape, dtype, stride and index range
 * first. out[i, j] = tables[(which[i, j / group] << 8) | codes[i, j]]; row strides in elements. */
#include <stdint.h>
#include <string.h>

#define RUN(T, G)                                                                                          \
    for (int64_t g = 0; g < full; g++) {                                                                \
        const T *restrict tb = tables + ((int64_t)w[g] << 8);                                           \
        const uint8_t *restrict cb = c + g * (G);                                                       \
        T *restrict ob = o + g * (G);                                                                   \
        for (int64_t j = 0; j < (G); j++) ob[j] = tb[cb[j]];                                            \
    }                                                                                                   \
    break;

#define GROUPED(NAME, T, W)                                                                             \
    void NAME(const uint8_t *restrict codes, int64_t code_stride, const W *restrict which,             \
              int64_t which_stride, const T *restrict tables, T *restrict out, int64_t out_stride,      \
              int64_t rows, int64_t width, int64_t group) {                                             \
        const int64_t full = width / group;                                                             \
        for (int64_t i = 0; i < rows; i++) {                                                            \
            const W *restrict w = which + i * which_stride;                                             \
            const uint8_t *restrict c = codes + i * code_stride;                                        \
            T *restrict o = out + i * out_stride;                                                       \
            switch (group) { /* the published group sizes: constant trip counts the compiler unrolls */ \
            case 8: RUN(T, 8)                                                                              \
            case 16: RUN(T, 16)                                                                            \
            case 32: RUN(T, 32)                                                                            \
            case 64: RUN(T, 64)                                                                            \
            case 128: RUN(T, 128)                                                                          \
            default: RUN(T, group)                                                                         \
            }                                                                                           \
            for (int64_t j = full * group; j < width; j++) o[j] = tables[((int64_t)w[full] << 8) | c[j]]; \
        }                                                                                               \
    }

/* The same with int32 `which`, FP8 codes tested for NaN in the loop (fp8.c's any_over: `add` in every byte, eight
 * codes a 64-bit word, in the integer units the gather leaves idle): the first row holding one (written whole), or
 * -1. Saves a pass over the codes (kernels/grouped.gather_fp8). */
#define GROUPED_CHECKED(NAME, T)                                                                        \
    int64_t NAME(const uint8_t *restrict codes, int64_t code_stride, const int32_t *restrict which,    \
                 int64_t which_stride, const T *restrict tables, T *restrict out, int64_t out_stride,   \
                 int64_t rows, int64_t width, int64_t group, uint64_t add) {                            \
        const int64_t full = width / group;                                                             \
        const uint64_t low = 0x7F7F7F7F7F7F7F7FULL;                                                     \
        for (int64_t i = 0; i < rows; i++) {                                                            \
            const int32_t *restrict w = which + i * which_stride;                                       \
            const uint8_t *restrict c = codes + i * code_stride;                                        \
            T *restrict o = out + i * out_stride;                                                       \
            uint64_t acc = 0;                                                                           \
            switch (group) {                                                                            \
            case 128: RUN(T, 128)                                                                          \
            default: RUN(T, group)                                                                         \
            }                                                                                           \
            int64_t j = 0;                                                                              \
            for (; j + 8 <= width; j += 8) {                                                            \
                uint64_t v;                                                                             \
                memcpy(&v, c + j, sizeof v);                                                            \
                acc |= (v & low) + add;                                                                 \
            }                                                                                           \
            for (; j < width; j++) acc |= ((uint64_t)c[j] & 0x7F) + (add & 0xFF);                       \
            for (int64_t k = full * group; k < width; k++) o[k] = tables[((int64_t)w[full] << 8) | c[k]]; \
            if (acc & 0x8080808080808080ULL) return i;                                                  \
        }                                                                                               \
        return -1;                                                                                      \
    }

GROUPED_CHECKED(ckpttool_grouped_u16_i32_checked, uint16_t)
GROUPED_CHECKED(ckpttool_grouped_u32_i32_checked, uint32_t)

GROUPED(ckpttool_grouped_u16_u8, uint16_t, uint8_t)
GROUPED(ckpttool_grouped_u32_u8, uint32_t, uint8_t)
GROUPED(ckpttool_grouped_u64_u8, uint64_t, uint8_t)
GROUPED(ckpttool_grouped_u16_i32, uint16_t, int32_t)
GROUPED(ckpttool_grouped_u32_i32, uint32_t, int32_t)
GROUPED(ckpttool_grouped_u64_i32, uint64_t, int32_t)
