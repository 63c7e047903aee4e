/* Integer codes packed in 32-bit words, one table per distinct group scale: kernels/packed.py's two loops
 * (its docstring says what they are for), the same bits as their numba and numpy forms. packed.py checks
 * every shape, stride and index range first; strides are in elements.
 *
 * out[n, k] = tables[off[n, g(k)] + code(n, k)]: `off` already holds each (row, group)'s table and zero point,
 * so a code is one gather. The loops differ only in where code(n, k) sits:
 *   cols: along the output's columns, words[n * n_stride + r * r_stride] holding k = r * per + j at bits * j
 *         (GPTQ's qweight [K / per, N], read transposed; AWQ GEMV's [N, K / 8]);
 *   rows: along the output's rows, words[k * k_stride + c] holding row c * 8 + order[i] at 4 * i (AWQ GEMM),
 *         in groups of width / groups contiguous columns.
 * cols walks the words in tiles so that a tile's cache lines serve every output row that shares them; rows
 * makes 8 output rows from each word it loads. */
#include <stdint.h>

#define TILE 1024 /* words per tile (cols) */

#define COLS(NAME, T)                                                                                      \
    void NAME(const uint32_t *restrict words, int64_t n_stride, int64_t r_stride, int64_t rows,           \
              int64_t n_words, int32_t bits, const int32_t *restrict off, int64_t groups,                \
              const int32_t *restrict group_of_word, const int32_t *restrict group_of_col,              \
              const T *restrict tables, T *restrict out, int64_t out_stride) {                          \
        const int per = 32 / bits;                                                                      \
        const uint32_t mask = (1u << bits) - 1;                                                         \
        for (int64_t r0 = 0; r0 < n_words; r0 += TILE) {                                                \
            const int64_t r1 = r0 + TILE < n_words ? r0 + TILE : n_words;                               \
            for (int64_t n = 0; n < rows; n++) {                                                        \
                const int32_t *restrict o = off + n * groups;                                           \
                const uint32_t *restrict src = words + n * n_stride;                                    \
                T *restrict dst = out + n * out_stride;                                                 \
                if (group_of_word) { /* every code of a word in one group: one table a word */          \
                    int64_t g = -1;                                                                     \
                    const T *restrict tb = tables;                                                      \
                    for (int64_t r = r0; r < r1; r++) {                                                 \
                        const uint32_t w = src[r * r_stride];                                           \
                        if (group_of_word[r] != g) tb = tables + o[g = group_of_word[r]];               \
                        T *restrict d = dst + r * per;                                                  \
                        if (bits == 4) {                                                                \
                            d[0] = tb[w & 15]; d[1] = tb[(w >> 4) & 15]; d[2] = tb[(w >> 8) & 15];      \
                            d[3] = tb[(w >> 12) & 15]; d[4] = tb[(w >> 16) & 15];                       \
                            d[5] = tb[(w >> 20) & 15]; d[6] = tb[(w >> 24) & 15]; d[7] = tb[w >> 28];   \
                        } else {                                                                        \
                            for (int j = 0; j < per; j++) d[j] = tb[(w >> (bits * j)) & mask];          \
                        }                                                                               \
                    }                                                                                   \
                } else { /* a group index per column (GPTQ's g_idx under desc_act) */                  \
                    for (int64_t r = r0; r < r1; r++) {                                                 \
                        const uint32_t w = src[r * r_stride];                                           \
                        const int32_t *restrict gk = group_of_col + r * per;                            \
                        T *restrict d = dst + r * per;                                                  \
                        for (int j = 0; j < per; j++) d[j] = tables[o[gk[j]] + ((w >> (bits * j)) & mask)]; \
                    }                                                                                   \
                }                                                                                       \
            }                                                                                           \
        }                                                                                               \
    }

#define ROWS(NAME, T)                                                                                      \
    void NAME(const uint32_t *restrict words, int64_t k_stride, int64_t word_cols, int64_t width,         \
              const int32_t *restrict shift_of_row, const int32_t *restrict off, int64_t groups,         \
              const int32_t *restrict group_of_col, const T *restrict tables, T *restrict out,           \
              int64_t out_stride) {                                                                     \
        (void)group_of_col; /* the groups are contiguous: width / groups columns each */                \
        const int64_t group = width / groups;                                                           \
        for (int64_t c = 0; c < word_cols; c++) { /* 8 output rows, one column of words */             \
            const uint32_t *restrict src = words + c;                                                   \
            T *restrict dst[8];                                                                         \
            int s[8];                                                                                   \
            for (int m = 0; m < 8; m++) {                                                               \
                dst[m] = out + (c * 8 + m) * out_stride;                                                \
                s[m] = shift_of_row[m];                                                                 \
            }                                                                                           \
            for (int64_t g = 0; g < groups; g++) {                                                      \
                const T *restrict tb[8];                                                                \
                for (int m = 0; m < 8; m++) tb[m] = tables + off[(c * 8 + m) * groups + g];             \
                for (int64_t k = g * group; k < (g + 1) * group; k++) {                                 \
                    const uint32_t w = src[k * k_stride];                                               \
                    for (int m = 0; m < 8; m++) dst[m][k] = tb[m][(w >> s[m]) & 15];                    \
                }                                                                                       \
            }                                                                                           \
        }                                                                                               \
    }

COLS(ckpttool_packed_cols_u16, uint16_t)
COLS(ckpttool_packed_cols_u32, uint32_t)
ROWS(ckpttool_packed_rows_u16, uint16_t)
ROWS(ckpttool_packed_rows_u32, uint32_t)
