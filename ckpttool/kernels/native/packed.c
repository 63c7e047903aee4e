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
#include <stdlib.h>
#include <string.h>

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

/* -- computed, not looked up (x86 with AVX2 and F16C) ---------------------------------------------------
 * The libraries' arithmetic done per element, eight at a time: fp16(s * (q - z)) is the fp32 product of an F16
 * scale and an integer below 2**8 in magnitude (exact) rounded once by VCVTPS2PH (nearest even, IEEE subnormals,
 * overflow to infinity, whatever MXCSR says), then the output: the fp16 bits (F16), VCVTPH2PS (F32, exact), or
 * that rounded to BF16 (nearest even, bf16.h's sum). The same bits as the tables above; no table, no numpy
 * preparation: the loops read the scales (F16) and the packed zero points (plus `zero_add`: GPTQ v1's
 * 0x11111111, carries and all) as stored.
 *   lanes: GPTQ's [K / per, N] words, eight output rows at once (a 32-byte load along N), one column per vector,
 *          each 8 x 8 block of fp16 transposed into the eight rows; column k's group group_of_col[k], its eight
 *          rows' scales and zero points made once per block of rows
 *   rows8: AWQ GEMM's [K, C] words, a word's 8 nibbles the 8 rows of a vector, 8 words (columns) a block
 *   bcast: AWQ GEMV's [N, K / 8] words, a word's 8 nibbles 8 consecutive outputs of one row
 *   shuffled: lanes for 4-bit codes in groups of a multiple of 64 columns, F16/BF16 out: a (row, group)'s 16
 *          outputs as two 16-byte tables, two outputs a byte by PSHUFB
 * kind: 0 F16, 1 BF16 (uint16 out), 2 F32 (uint32 out). Rows (lanes) or columns (rows8) past the last whole
 * block of eight are computed one at a time with the scalar F16C conversions. */
#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#include "block8.h"
#define PACKED_F16C __attribute__((target("avx2,f16c")))
#define INLINE __attribute__((always_inline)) inline

int32_t ckpttool_packed_f16c_ok(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
}

/* eight fp16 products of one vector. (Not s * q - s * z in one FMA, exact as it is: where q == z under a negative
 * scale it gives +0.0, the libraries' s * (q - z) -0.0.) */
PACKED_F16C INLINE static __m128i f16_products(__m256i codes, __m256i zeros, __m256 scales) {
    const __m256 p = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(codes, zeros)), scales);
    return _mm256_cvtps_ph(p, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

/* eight fp16 values as BF16 words */
PACKED_F16C INLINE static __m128i bf16_of(__m128i h) {
    const __m256i u = _mm256_castps_si256(_mm256_cvtph_ps(h));
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb);
    /* each sum's high half: bytes 2, 3 of each word to the low 8 bytes of each 128-bit lane, then those joined */
    const __m256i hi = _mm256_shuffle_epi8(r, _mm256_setr_epi8(2, 3, 6, 7, 10, 11, 14, 15, -1, -1, -1, -1, -1, -1, -1, -1,
                                                               2, 3, 6, 7, 10, 11, 14, 15, -1, -1, -1, -1, -1, -1, -1, -1));
    return _mm256_castsi256_si128(_mm256_permute4x64_epi64(hi, 0x08));
}

/* eight fp16 values as the output's words at dst */
PACKED_F16C INLINE static void store8(__m128i h, int32_t kind, void *dst) {
    if (kind == 0) _mm_storeu_si128((__m128i *)dst, h);
    else if (kind == 2) _mm256_storeu_ps((float *)dst, _mm256_cvtph_ps(h));
    else _mm_storeu_si128((__m128i *)dst, bf16_of(h));
}

PACKED_F16C static inline void store1(float p, int32_t kind, void *out, int64_t i) {
    const uint16_t h = _cvtss_sh(p, _MM_FROUND_TO_NEAREST_INT);
    if (kind == 0) {
        ((uint16_t *)out)[i] = h;
    } else {
        const float f = _cvtsh_ss(h);
        uint32_t u;
        memcpy(&u, &f, sizeof u);
        if (kind == 2) ((uint32_t *)out)[i] = u;
        else ((uint16_t *)out)[i] = (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
    }
}

/* BF16 of h[j] (lane i: row i, column j, fp16 words) stored row by row (block8.h) */
PACKED_F16C INLINE static void store_block_bf16(const __m128i h[8], char *dst, int64_t row_bytes) {
    __m256 p[8];
    for (int j = 0; j < 8; j++) p[j] = _mm256_cvtph_ps(h[j]);
    block8_store_bf16(p, dst, row_bytes);
}

/* h[j] lane i -> row i's column j, stored row by row */
PACKED_F16C INLINE static void store_block(__m128i h[8], int32_t kind, char *dst, int64_t row_bytes) {
    if (kind == 1) {
        store_block_bf16(h, dst, row_bytes);
        return;
    }
    __m128i t[8];
    block8_transpose16(h, t);
    for (int i = 0; i < 8; i++) store8(t[i], kind, dst + i * row_bytes);
}

/* the scales (F16, contiguous along the rows) and zero points of rows n0 .. n0 + 7 in group g (lanes, rows8) */
PACKED_F16C INLINE static __m256 scales8(const uint16_t *restrict scales, int64_t at) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(scales + at)));
}

PACKED_F16C INLINE static __m256i zeros8(const uint32_t *restrict zw, int32_t bits, uint32_t add, __m256i shifts) {
    const __m256i w = bits == 4 ? _mm256_set1_epi32((int)(zw[0] + add))
                                : _mm256_set_m128i(_mm_set1_epi32((int)(zw[1] + add)), _mm_set1_epi32((int)(zw[0] + add)));
    return _mm256_and_si256(_mm256_srlv_epi32(w, shifts), _mm256_set1_epi32((1 << bits) - 1));
}

/* lanes' loop, `bits` and `kind` constants after inlining, so that the eight columns unroll */
PACKED_F16C INLINE static void lanes_rows(
    const uint32_t *restrict words, int64_t rows, int64_t n_words, const int bits, const uint16_t *restrict scales,
    const uint32_t *restrict zeros, uint32_t zero_add, int64_t groups, const int32_t *restrict group_of_col,
    float *restrict sbuf, int32_t *restrict zbuf, int32_t kind, void *restrict out, int64_t out_stride) {
    const int per = 32 / bits;
    const uint32_t mask = (1u << bits) - 1;
    const int64_t cols = n_words * per, zrow = rows / per, size = kind == 2 ? 4 : 2;
    const __m256i shifts = bits == 4 ? _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28)
                                     : _mm256_setr_epi32(0, 8, 16, 24, 0, 8, 16, 24);
    const __m256i vmask = _mm256_set1_epi32((int)mask);
    int64_t n0 = 0;
    for (; n0 + 8 <= rows; n0 += 8) {
        char *dst = (char *)out + n0 * out_stride * size;
        /* each group's scales and zero points of the block's rows, as vectors (64 bytes a group): a column's group
         * then costs two loads, whatever g_idx holds (desc_act ran as fast as contiguous groups so, and those no
         * slower than with a branch per word that reloaded them) */
        for (int64_t g = 0; g < groups; g++) {
            _mm256_storeu_ps(sbuf + 8 * g, scales8(scales, g * rows + n0));
            _mm256_storeu_si256((__m256i *)(zbuf + 8 * g), zeros8(zeros + g * zrow + n0 / per, bits, zero_add, shifts));
        }
        for (int64_t k0 = 0; k0 < cols; k0 += 8) { /* 8 columns: one word of 4-bit codes, two of 8-bit */
            const int64_t r = k0 / per;
            const __m256i w0 = _mm256_loadu_si256((const __m256i *)(words + r * rows + n0));
            const __m256i w1 = bits == 8 ? _mm256_loadu_si256((const __m256i *)(words + (r + 1) * rows + n0)) : w0;
            __m128i h[8];
#pragma GCC unroll 8
            for (int j = 0; j < 8; j++) { /* column k0 + j: its group's scales and zero points, made above */
                const int64_t g = group_of_col[k0 + j];
                const __m256i wj = _mm256_srli_epi32(j < per ? w0 : w1, bits * (j % per));
                const __m256i q = j % per == per - 1 ? wj : _mm256_and_si256(wj, vmask); /* the top code: no mask */
                h[j] = f16_products(q, _mm256_loadu_si256((const __m256i *)(zbuf + 8 * g)), _mm256_loadu_ps(sbuf + 8 * g));
            }
            store_block(h, kind, dst + k0 * size, out_stride * size);
        }
    }
    for (int64_t n = n0; n < rows; n++) /* rows past the last block of 8 (8-bit codes: 4 of them at most) */
        for (int64_t k = 0; k < cols; k++) {
            const int64_t g = group_of_col[k];
            const uint32_t z = ((zeros[g * zrow + n / per] + zero_add) >> (bits * (n % per))) & mask;
            const uint32_t q = (words[(k / per) * rows + n] >> (bits * (k % per))) & mask;
            store1(_cvtsh_ss(scales[g * rows + n]) * (float)((int32_t)q - (int32_t)z), kind, out, n * out_stride + k);
        }
}

#define LANES(BITS, KIND) \
    lanes_rows(words, rows, n_words, BITS, scales, zeros, zero_add, groups, group_of_col, sbuf, zbuf, KIND, out, out_stride)
#define LANES_KIND(BITS) (kind == 0 ? LANES(BITS, 0) : kind == 1 ? LANES(BITS, 1) : LANES(BITS, 2))

/* one copy of the loop for each (bits, kind), each with its constants folded */
PACKED_F16C int32_t ckpttool_packed_lanes(const uint32_t *restrict words, int64_t rows, int64_t n_words, int32_t bits,
                                          const uint16_t *restrict scales, const uint32_t *restrict zeros,
                                          uint32_t zero_add, int64_t groups, const int32_t *restrict group_of_col,
                                          int32_t kind, void *restrict out, int64_t out_stride) {
    float *sbuf = malloc(sizeof(float) * 8 * (size_t)groups);
    int32_t *zbuf = malloc(sizeof(int32_t) * 8 * (size_t)groups);
    if (!sbuf || !zbuf) { /* packed.py raises MemoryError */
        free(sbuf), free(zbuf);
        return -1;
    }
    if (bits == 4) LANES_KIND(4);
    else LANES_KIND(8);
    free(sbuf), free(zbuf);
    return 0;
}

/* rows8's loop, `kind` a constant after inlining. Groups are whole blocks of eight columns (or one group) */
PACKED_F16C INLINE static void rows8_kind(const uint32_t *restrict words, int64_t width, int64_t word_cols,
                                          const int32_t *restrict shift_of_row, const uint16_t *restrict scales,
                                          const uint32_t *restrict zeros, int64_t groups, int32_t kind,
                                          void *restrict out, int64_t out_stride) {
    const int64_t group = width / groups, size = kind == 2 ? 4 : 2, rows = word_cols * 8;
    const __m256i shifts = _mm256_loadu_si256((const __m256i *)shift_of_row), vmask = _mm256_set1_epi32(15);
    const int64_t whole = width / 8 * 8;
    for (int64_t k1 = 0; k1 < whole; k1 += TILE) { /* a tile of columns: its words' lines serve 16 word columns */
        const int64_t k2 = k1 + TILE < whole ? k1 + TILE : whole;
        for (int64_t c = 0; c < word_cols; c++) {
            char *dst = (char *)out + c * 8 * out_stride * size;
            int64_t g = k1 / group, next = (g + 1) * group; /* no division a block: the next group's start */
            __m256 vs = scales8(scales, g * rows + c * 8);
            __m256i vz = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)zeros[g * word_cols + c]), shifts),
                                          vmask);
            for (int64_t k0 = k1; k0 < k2; k0 += 8) {
                if (k0 == next) {
                    g++, next += group;
                    vs = scales8(scales, g * rows + c * 8);
                    vz = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)zeros[g * word_cols + c]), shifts),
                                          vmask);
                }
                __m128i h[8];
#pragma GCC unroll 8
                for (int j = 0; j < 8; j++) {
                    const __m256i q = _mm256_and_si256(
                        _mm256_srlv_epi32(_mm256_set1_epi32((int)words[(k0 + j) * word_cols + c]), shifts), vmask);
                    h[j] = f16_products(q, vz, vs);
                }
                store_block(h, kind, dst + k0 * size, out_stride * size);
            }
        }
    }
    for (int64_t n = 0; n < rows; n++) /* columns past the last block of 8 */
        for (int64_t k = whole; k < width; k++) {
            const int64_t g = k / group, c = n / 8, sh = shift_of_row[n % 8];
            const uint32_t z = (zeros[g * word_cols + c] >> sh) & 15u, q = (words[k * word_cols + c] >> sh) & 15u;
            store1(_cvtsh_ss(scales[g * rows + n]) * (float)((int32_t)q - (int32_t)z), kind, out, n * out_stride + k);
        }
}

PACKED_F16C void ckpttool_packed_rows8(const uint32_t *restrict words, int64_t width, int64_t word_cols,
                                       const int32_t *restrict shift_of_row, const uint16_t *restrict scales,
                                       const uint32_t *restrict zeros, int64_t groups, int32_t kind,
                                       void *restrict out, int64_t out_stride) {
#define ROWS8(KIND) rows8_kind(words, width, word_cols, shift_of_row, scales, zeros, groups, KIND, out, out_stride)
    if (kind == 0) ROWS8(0);
    else if (kind == 1) ROWS8(1);
    else ROWS8(2);
}

/* GPTQ 4-bit, contiguous groups of a multiple of 64 columns (any group size ending at K too), F16 or BF16 out:
 * lanes' products made once per (row, group) as a 16-entry table of output words (its low and high bytes
 * two 16-byte tables), then each byte of codes two outputs by byte shuffles, 32 bytes at a time (bitsandbytes'
 * loop in bnb.c does the same). The words come 8 rows x 8 words at a time, transposed so that a row's 8 words,
 * 64 codes, sit in one vector. */
PACKED_F16C INLINE static void shuffled_kind(const uint32_t *restrict words, int64_t rows, int64_t n_words,
                                             const uint16_t *restrict scales, const uint32_t *restrict zeros,
                                             uint32_t zero_add, int64_t group, int32_t kind, void *restrict out,
                                             int64_t out_stride) {
    const int64_t zrow = rows / 8, per_group = group / 8;
    const __m256i shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28), low = _mm256_set1_epi8(0x0F);
    const __m128i split = _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
    for (int64_t n0 = 0; n0 < rows; n0 += 8) { /* rows: a multiple of 8 (checked) */
        uint16_t *dst0 = (uint16_t *)out + n0 * out_stride;
        for (int64_t r0 = 0, g = 0; r0 < n_words; r0 += per_group, g++) {
            __m128i tlo[8], thi[8];
            { /* the 8 rows' tables: product q of row i, for q < 16, as output words, then split into bytes */
                const __m256 vs = scales8(scales, g * rows + n0);
                const __m256i vz = zeros8(zeros + g * zrow + n0 / 8, 4, zero_add, shifts);
                __m128i h[16], t0[8], t1[8];
                for (int q = 0; q < 16; q++) {
                    h[q] = f16_products(_mm256_set1_epi32(q), vz, vs);
                    if (kind == 1) h[q] = bf16_of(h[q]);
                }
                block8_transpose16(h, t0);
                block8_transpose16(h + 8, t1);
                for (int i = 0; i < 8; i++) {
                    const __m128i a = _mm_shuffle_epi8(t0[i], split), b = _mm_shuffle_epi8(t1[i], split);
                    tlo[i] = _mm_unpacklo_epi64(a, b), thi[i] = _mm_unpackhi_epi64(a, b);
                }
            }
            for (int64_t r = r0; r < r0 + per_group; r += 8) {
                __m256i w[8];
                for (int j = 0; j < 8; j++) w[j] = _mm256_loadu_si256((const __m256i *)(words + (r + j) * rows + n0));
                __m256i R[8]; /* 8 x 8 words transposed: R[i] = row n0 + i's words r .. r + 7 */
                block8_transpose32(w, R);
                for (int i = 0; i < 8; i++) { /* byte b of R[i]: columns 8r + 2b (low nibble) and 8r + 2b + 1 */
                    const __m256i TL = _mm256_broadcastsi128_si256(tlo[i]), TH = _mm256_broadcastsi128_si256(thi[i]);
                    const __m256i lo = _mm256_and_si256(R[i], low), hi = _mm256_and_si256(_mm256_srli_epi16(R[i], 4), low);
                    const __m256i e0 = _mm256_unpacklo_epi8(_mm256_shuffle_epi8(TL, lo), _mm256_shuffle_epi8(TH, lo));
                    const __m256i e1 = _mm256_unpackhi_epi8(_mm256_shuffle_epi8(TL, lo), _mm256_shuffle_epi8(TH, lo));
                    const __m256i o0 = _mm256_unpacklo_epi8(_mm256_shuffle_epi8(TL, hi), _mm256_shuffle_epi8(TH, hi));
                    const __m256i o1 = _mm256_unpackhi_epi8(_mm256_shuffle_epi8(TL, hi), _mm256_shuffle_epi8(TH, hi));
                    /* per 128-bit lane, x0: bytes 0-3 (lane 1: 16-19) -> 8 columns; x1 bytes 4-7; x2 8-11; x3 12-15 */
                    const __m256i x0 = _mm256_unpacklo_epi16(e0, o0), x1 = _mm256_unpackhi_epi16(e0, o0);
                    const __m256i x2 = _mm256_unpacklo_epi16(e1, o1), x3 = _mm256_unpackhi_epi16(e1, o1);
                    uint16_t *d = dst0 + i * out_stride + r * 8;
                    _mm256_storeu_si256((__m256i *)d, _mm256_permute2x128_si256(x0, x1, 0x20));
                    _mm256_storeu_si256((__m256i *)(d + 16), _mm256_permute2x128_si256(x2, x3, 0x20));
                    _mm256_storeu_si256((__m256i *)(d + 32), _mm256_permute2x128_si256(x0, x1, 0x31));
                    _mm256_storeu_si256((__m256i *)(d + 48), _mm256_permute2x128_si256(x2, x3, 0x31));
                }
            }
        }
    }
}

PACKED_F16C void ckpttool_packed_shuffled(const uint32_t *restrict words, int64_t rows, int64_t n_words,
                                          const uint16_t *restrict scales, const uint32_t *restrict zeros,
                                          uint32_t zero_add, int64_t group, int32_t kind, void *restrict out,
                                          int64_t out_stride) {
    if (kind == 0) shuffled_kind(words, rows, n_words, scales, zeros, zero_add, group, 0, out, out_stride);
    else shuffled_kind(words, rows, n_words, scales, zeros, zero_add, group, 1, out, out_stride);
}

/* 4-bit, groups of whole words (group % 8 == 0): a word's codes share one scale and zero point */
PACKED_F16C INLINE static void bcast_kind(const uint32_t *restrict words, int64_t rows, int64_t n_words,
                                          const uint16_t *restrict scales, int64_t scale_stride,
                                          const uint32_t *restrict zeros, int64_t zero_stride, int64_t group,
                                          int32_t kind, void *restrict out, int64_t out_stride) {
    const int64_t size = kind == 2 ? 4 : 2, per_group = group / 8;
    const __m256i shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28), vmask = _mm256_set1_epi32(15);
    for (int64_t n = 0; n < rows; n++) {
        const uint32_t *restrict src = words + n * n_words;
        char *dst = (char *)out + n * out_stride * size;
        for (int64_t r0 = 0, g = 0; r0 < n_words; r0 += per_group, g++) {
            const __m256 vs = _mm256_set1_ps(_cvtsh_ss(scales[n * scale_stride + g]));
            const __m256i vz = _mm256_set1_epi32((int)((zeros[n * zero_stride + g / 8] >> (4 * (g % 8))) & 15u));
            const int64_t r1 = r0 + per_group < n_words ? r0 + per_group : n_words;
            for (int64_t r = r0; r < r1; r++) {
                const __m256i q = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)src[r]), shifts), vmask);
                store8(f16_products(q, vz, vs), kind, dst + r * 8 * size);
            }
        }
    }
}
PACKED_F16C void ckpttool_packed_bcast(const uint32_t *restrict words, int64_t rows, int64_t n_words,
                                       const uint16_t *restrict scales, int64_t scale_stride,
                                       const uint32_t *restrict zeros, int64_t zero_stride, int64_t group,
                                       int32_t kind, void *restrict out, int64_t out_stride) {
#define BCAST(KIND) bcast_kind(words, rows, n_words, scales, scale_stride, zeros, zero_stride, group, KIND, out, out_stride)
    if (kind == 0) BCAST(0);
    else if (kind == 1) BCAST(1);
    else BCAST(2);
}
#else
/* elsewhere the symbols kernels/native.py binds exist, and packed.computed() keeps Python from calling them */
int32_t ckpttool_packed_f16c_ok(void) { return 0; }
int32_t ckpttool_packed_lanes(const uint32_t *words, int64_t rows, int64_t n_words, int32_t bits,
                              const uint16_t *scales, const uint32_t *zeros, uint32_t zero_add, int64_t groups,
                              const int32_t *group_of_col, int32_t kind, void *out, int64_t out_stride) {
    (void)words, (void)rows, (void)n_words, (void)bits, (void)scales, (void)zeros, (void)zero_add, (void)groups;
    (void)group_of_col, (void)kind, (void)out, (void)out_stride;
    return -2;
}
void ckpttool_packed_shuffled(const uint32_t *words, int64_t rows, int64_t n_words, const uint16_t *scales,
                              const uint32_t *zeros, uint32_t zero_add, int64_t group, int32_t kind, void *out,
                              int64_t out_stride) {
    (void)words, (void)rows, (void)n_words, (void)scales, (void)zeros, (void)zero_add, (void)group, (void)kind;
    (void)out, (void)out_stride;
}
void ckpttool_packed_rows8(const uint32_t *words, int64_t width, int64_t word_cols, const int32_t *shift_of_row,
                           const uint16_t *scales, const uint32_t *zeros, int64_t groups, int32_t kind, void *out,
                           int64_t out_stride) {
    (void)words, (void)width, (void)word_cols, (void)shift_of_row, (void)scales, (void)zeros, (void)groups;
    (void)kind, (void)out, (void)out_stride;
}
void ckpttool_packed_bcast(const uint32_t *words, int64_t rows, int64_t n_words, const uint16_t *scales,
                           int64_t scale_stride, const uint32_t *zeros, int64_t zero_stride, int64_t group,
                           int32_t kind, void *out, int64_t out_stride) {
    (void)words, (void)rows, (void)n_words, (void)scales, (void)scale_stride, (void)zeros, (void)zero_stride;
    (void)group, (void)kind, (void)out, (void)out_stride;
}
#endif
