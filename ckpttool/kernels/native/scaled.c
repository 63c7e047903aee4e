/* The compressed-tensors and ModelOpt CPU kernels' loops in C: the same functions and bits as
 * kernels/scaled_numba.py's numba kernels (its docstring says what each one is for); kernels/native.py
 * loads them with ctypes and checks every shape, dtype and stride first. Row strides are in elements,
 * columns contiguous. The "first NaN row" kernels return that row or -1. */
#include <stdint.h>
#include <string.h>

#include "bf16.h"

#if defined(__GNUC__) || defined(__clang__)
#define PREFETCH(p) __builtin_prefetch(p)
#else
#define PREFETCH(p) ((void)0)
#endif

/* out[i, j] = tables[which[i], codes[i, j]]; the first row whose output holds bits above `inf` under
 * `mask` (a NaN), or -1 (the row is written whole first). */
#define FP8_ROWS(NAME, T)                                                                               \
    int64_t NAME(const uint8_t *restrict codes, int64_t code_stride, const T *restrict tables,          \
                 const int32_t *restrict which, T *restrict out, int64_t out_stride, int64_t rows,      \
                 int64_t cols, uint64_t mask, uint64_t inf) {                                           \
        for (int64_t i = 0; i < rows; i++) {                                                            \
            const T *restrict t = tables + ((int64_t)which[i] << 8);                                    \
            const uint8_t *restrict c = codes + i * code_stride;                                        \
            T *restrict o = out + i * out_stride;                                                       \
            T worst = 0;                                                                                \
            for (int64_t j = 0; j < cols; j++) {                                                        \
                const T v = t[c[j]];                                                                    \
                o[j] = v;                                                                               \
                const T w = (T)(v & (T)mask);                                                           \
                worst = w > worst ? w : worst;                                                          \
            }                                                                                           \
            if (worst > (T)inf) return i;                                                               \
        }                                                                                               \
        return -1;                                                                                      \
    }                                                                                                   \
    void NAME##_plain(const uint8_t *restrict codes, int64_t code_stride, const T *restrict tables,     \
                      const int32_t *restrict which, T *restrict out, int64_t out_stride, int64_t rows, \
                      int64_t cols) {                                                                   \
        for (int64_t i = 0; i < rows; i++) {                                                            \
            const T *restrict t = tables + ((int64_t)which[i] << 8);                                    \
            const uint8_t *restrict c = codes + i * code_stride;                                        \
            T *restrict o = out + i * out_stride;                                                       \
            int64_t j = 0;                                                                              \
            /* thousands of scales' tables leave L2: the next row's is fetched while this row runs */    \
            if (i + 1 < rows)                                                                           \
                for (int64_t k = 0; k < 256 * (int64_t)sizeof(T); k += 64)                              \
                    PREFETCH((const char *)(tables + ((int64_t)which[i + 1] << 8)) + k);               \
            for (; j + 128 <= cols; j += 128) /* fp8.c's constant trip count, which gcc unrolls */      \
                for (int q = 0; q < 128; q++) o[j + q] = t[c[j + q]];                                   \
            for (; j < cols; j++) o[j] = t[c[j]];                                                       \
        }                                                                                               \
    }                                                                                                   \
    /* _plain that also finds NaN codes (fp8.c's any_over test, eight codes a 64-bit word, in the integer */  \
    /* units the gather leaves idle): the first row holding one (written whole), or -1. Saves the separate */ \
    /* pass over the codes (0.5 ms of 4 for a [7168, 2048] BF16 output on the 2-core box). */          \
    int64_t NAME##_checked(const uint8_t *restrict codes, int64_t code_stride, const T *restrict tables, \
                           const int32_t *restrict which, T *restrict out, int64_t out_stride, int64_t rows, \
                           int64_t cols, uint64_t add) {                                                \
        const uint64_t low = 0x7F7F7F7F7F7F7F7FULL;                                                     \
        for (int64_t i = 0; i < rows; i++) {                                                            \
            const T *restrict t = tables + ((int64_t)which[i] << 8);                                    \
            const uint8_t *restrict c = codes + i * code_stride;                                        \
            T *restrict o = out + i * out_stride;                                                       \
            uint64_t acc = 0;                                                                           \
            int64_t j = 0;                                                                              \
            if (i + 1 < rows)                                                                           \
                for (int64_t k = 0; k < 256 * (int64_t)sizeof(T); k += 64)                              \
                    PREFETCH((const char *)(tables + ((int64_t)which[i + 1] << 8)) + k);               \
            for (; j + 128 <= cols; j += 128) {                                                         \
                for (int q = 0; q < 128; q++) o[j + q] = t[c[j + q]];                                   \
                for (int q = 0; q < 128; q += 8) {                                                      \
                    uint64_t w;                                                                         \
                    memcpy(&w, c + j + q, sizeof w);                                                    \
                    acc |= (w & low) + add;                                                             \
                }                                                                                       \
            }                                                                                           \
            for (; j < cols; j++) {                                                                     \
                o[j] = t[c[j]];                                                                         \
                acc |= ((uint64_t)c[j] & 0x7F) + (add & 0xFF);                                          \
            }                                                                                           \
            if (acc & 0x8080808080808080ULL) return i;                                                  \
        }                                                                                               \
        return -1;                                                                                      \
    }

FP8_ROWS(ckpttool_fp8_rows_u16, uint16_t)
FP8_ROWS(ckpttool_fp8_rows_u32, uint32_t)

/* packed [rows, width] int32 words of 8 nibbles (q + 8, low first), scale [rows, groups] fp32 with
 * `group` elements each (a multiple of 8) -> out [rows, width * 4] words of two bf16 values. Each
 * group's 16 products are rounded once; the first row holding a NaN output, or -1. `scratch` holds
 * groups * 16 uint32. */
int64_t ckpttool_int4_bf16(const uint32_t *restrict packed, int64_t packed_stride, const float *restrict scale,
                           int64_t scale_stride, int64_t rows, int64_t width, int64_t groups, int64_t group,
                           uint32_t *restrict out, int64_t out_stride, uint32_t *restrict scratch) {
    const int64_t words = group / 8;
    for (int64_t i = 0; i < rows; i++) {
        const float *restrict s = scale + i * scale_stride;
        int nan = 0;
        for (int64_t g = 0; g < groups; g++)
            for (int q = 0; q < 16; q++) {
                const uint32_t t = ckpttool_bf16_bits((float)(q - 8) * s[g]);
                scratch[g * 16 + q] = t;
                nan |= (t & 0x7FFFu) > 0x7F80u;
            }
        const uint32_t *restrict p = packed + i * packed_stride;
        uint32_t *restrict o = out + i * out_stride;
        for (int64_t g = 0; g < groups; g++) {
            const uint32_t *restrict tg = scratch + g * 16;
            for (int64_t k = g * words; k < (g + 1) * words; k++) {
                const uint32_t w = p[k];
                o[4 * k] = tg[w & 15] | (tg[(w >> 4) & 15] << 16);
                o[4 * k + 1] = tg[(w >> 8) & 15] | (tg[(w >> 12) & 15] << 16);
                o[4 * k + 2] = tg[(w >> 16) & 15] | (tg[(w >> 20) & 15] << 16);
                o[4 * k + 3] = tg[(w >> 24) & 15] | (tg[w >> 28] << 16);
            }
        }
        if (nan)
            for (int64_t k = 0; k < width * 4; k++)
                if ((o[k] & 0x7FFFu) > 0x7F80u || ((o[k] >> 16) & 0x7FFFu) > 0x7F80u) return i;
    }
    return -1;
}

/* finite fp32 scales [count] -> out [count * 256]: entry (d << 8 | byte) holds the byte's two int4
 * values (low nibble first) times scale d in bf16, each product and rounding as ckpttool_int4_bf16's. */
void ckpttool_int4_bf16_pairs(const float *restrict scales, int64_t count, uint32_t *restrict out) {
    for (int64_t d = 0; d < count; d++) {
        uint32_t t[16];
        for (int q = 0; q < 16; q++) t[q] = ckpttool_bf16_bits((float)(q - 8) * scales[d]);
        for (int b = 0; b < 256; b++) out[(d << 8) + b] = t[b & 15] | (t[b >> 4] << 16);
    }
}

/* nibbles [rows, groups * half_group] bytes, which [rows, groups] -> out [rows, groups * half_group]:
 * each byte looked up in its group's pair table (ckpttool_int4_bf16_pairs). */
#define BY_PAIRS(N)                                                                                     \
    for (int64_t g = 0; g < groups; g++) {                                                              \
        const uint32_t *restrict tb = pairs + ((int64_t)w[g] << 8);                                     \
        const uint8_t *restrict pb = p + g * (N);                                                       \
        uint32_t *restrict ob = o + g * (N);                                                            \
        for (int64_t j = 0; j < (N); j++) ob[j] = tb[pb[j]];                                            \
    }

void ckpttool_int4_by_pairs(const uint8_t *restrict nibbles, int64_t nibble_stride, const uint32_t *restrict pairs,
                            const int32_t *restrict which, int64_t which_stride, int64_t rows, int64_t groups,
                            int64_t half_group, uint32_t *restrict out, int64_t out_stride) {
    for (int64_t i = 0; i < rows; i++) {
        const uint8_t *restrict p = nibbles + i * nibble_stride;
        const int32_t *restrict w = which + i * which_stride;
        uint32_t *restrict o = out + i * out_stride;
        switch (half_group) { /* groups of 32 and 128 values (compressed-tensors' usual sizes): constant trips */
        case 16: BY_PAIRS(16); break;
        case 64: BY_PAIRS(64); break;
        default: BY_PAIRS(half_group);
        }
    }
}

/* The distinct values of 16-bit `bits` [n] into `values` (ascending; room for 65536), each element's
 * index into them into `which`; returns how many. `seen` is scratch of 65536 int32. */
int64_t ckpttool_distinct16(const uint16_t *restrict bits, int64_t n, uint16_t *restrict values,
                            int32_t *restrict which, int32_t *restrict seen) {
    memset(seen, 0, sizeof(int32_t) << 16);
    for (int64_t k = 0; k < n; k++) seen[bits[k]] = 1;
    int32_t count = 0;
    for (int32_t v = 0; v < 1 << 16; v++)
        if (seen[v]) {
            values[count] = (uint16_t)v;
            seen[v] = count++;
        }
    for (int64_t k = 0; k < n; k++) which[k] = seen[bits[k]];
    return count;
}

/* packed [rows, width] bytes (two e2m1 codes), codes [rows, width / 8] F8_E4M3 scale codes -> out
 * [rows, width]: table[(scale code << 8) | byte], a word of two output values. */
#define NVFP4(NAME, T)                                                                                  \
    void NAME(const uint8_t *restrict packed, int64_t packed_stride, const uint8_t *restrict codes,     \
              int64_t code_stride, const T *restrict table, T *restrict out, int64_t out_stride,        \
              int64_t rows, int64_t width) {                                                            \
        for (int64_t i = 0; i < rows; i++) {                                                            \
            const uint8_t *restrict p = packed + i * packed_stride;                                     \
            const uint8_t *restrict c = codes + i * code_stride;                                        \
            T *restrict o = out + i * out_stride;                                                       \
            const int64_t groups = width >> 3;                                                          \
            for (int64_t g = 0; g < groups; g++) { /* a group's 8 bytes share one scale code's table */ \
                const T *restrict tb = table + ((int64_t)c[g] << 8);                                    \
                for (int j = 0; j < 8; j++) o[(g << 3) + j] = tb[p[(g << 3) + j]];                      \
            }                                                                                           \
            for (int64_t k = groups << 3; k < width; k++) o[k] = table[((int64_t)c[k >> 3] << 8) | p[k]]; \
        }                                                                                               \
    }

NVFP4(ckpttool_nvfp4_u32, uint32_t)
NVFP4(ckpttool_nvfp4_u64, uint64_t)
