/* gpt-oss' MXFP4 experts dequantized straight into transformers' layout, in C: kernels/mxfp4_cpu.py's
 * dequant_transposed (its docstring says why), the same bits as its numba and numpy forms. kernels/native.py checks
 * every shape, dtype and contiguity first.
 *
 * blocks [E, R, G, 16] (two e2m1 codes a byte), scales [E, R, G] (E8M0) -> out [E, G * 32, R]:
 *   out[e, 32 g + 2 k + h, r] = element h of table[(scales[e, r, g] << 8) | blocks[e, r, g, k]]
 * where each table word holds a byte's two output elements, the low nibble's first (mxfp4_cpu.pair_table).
 *
 * In tiles of 128 rows (r) by a few groups (128 output rows): the table words are gathered in the blocks' order into
 * a buffer that stays in L1 (one word store per two elements), then the buffer is transposed 8 x 8 (16-bit) or 4 x 4
 * (32-bit) elements at a time in SSE2 registers, and each output row's 256 bytes are written in one run of
 * non-temporal stores (the output is a buffer bound for pwrite, not read back). The 2-core box, against the C FP8
 * block gather, per output byte (gpt-oss' R = 2880 and 5760, and R = 2048 and 4096): elements stored one by one into
 * their output rows ran at 0.35x; 32-row tiles with cached stores at 0.2-0.7x (a power-of-two R made the rows' stores
 * alias in one cache set); these tiles at 0.85-1.05x. */
#include <stdint.h>
#include <string.h>
#ifdef __SSE2__
#include <emmintrin.h>
#endif

#define TILE_R 128

/* an output row's TILE_R / lanes vectors, streamed where the row is 16-byte aligned */
#ifdef __SSE2__
static inline void put_row(void *row, const __m128i *v, int64_t n) {
    if (((uintptr_t)row & 15) == 0)
        for (int64_t q = 0; q < n; q++) _mm_stream_si128((__m128i *)row + q, v[q]);
    else
        for (int64_t q = 0; q < n; q++) _mm_storeu_si128((__m128i *)row + q, v[q]);
}
#endif

/* tile [TILE_R][tc] -> out rows c (stride `rows`), columns r: 8 x 8 blocks of uint16 */
static void transpose_u16(const uint16_t *restrict tile, int64_t tc, int64_t nr, int64_t nc, uint16_t *restrict out,
                          int64_t rows) {
    int64_t r8 = 0;
#ifdef __SSE2__
    r8 = nr & ~(int64_t)7;
    for (int64_t c8 = 0; c8 < nc; c8 += 8) {
        __m128i lines[8][TILE_R / 8];
        for (int64_t q = 0; q < r8 / 8; q++) {
            __m128i a[8], b[8];
            for (int i = 0; i < 8; i++) a[i] = _mm_loadu_si128((const __m128i *)(tile + (8 * q + i) * tc + c8));
            for (int i = 0; i < 4; i++) {
                b[2 * i] = _mm_unpacklo_epi16(a[2 * i], a[2 * i + 1]);
                b[2 * i + 1] = _mm_unpackhi_epi16(a[2 * i], a[2 * i + 1]);
            }
            for (int i = 0; i < 2; i++)
                for (int j = 0; j < 2; j++) {
                    a[4 * i + 2 * j] = _mm_unpacklo_epi32(b[4 * i + j], b[4 * i + j + 2]);
                    a[4 * i + 2 * j + 1] = _mm_unpackhi_epi32(b[4 * i + j], b[4 * i + j + 2]);
                }
            for (int j = 0; j < 4; j++) {
                lines[2 * j][q] = _mm_unpacklo_epi64(a[j], a[j + 4]);
                lines[2 * j + 1][q] = _mm_unpackhi_epi64(a[j], a[j + 4]);
            }
        }
        for (int i = 0; i < 8; i++) put_row(out + (c8 + i) * rows, lines[i], r8 / 8);
    }
#endif
    for (; r8 < nr; r8++)
        for (int64_t c = 0; c < nc; c++) out[c * rows + r8] = tile[r8 * tc + c];
}

/* the same for uint32 (F32 outputs): 4 x 4 blocks */
static void transpose_u32(const uint32_t *restrict tile, int64_t tc, int64_t nr, int64_t nc, uint32_t *restrict out,
                          int64_t rows) {
    int64_t r4 = 0;
#ifdef __SSE2__
    r4 = nr & ~(int64_t)3;
    for (int64_t c4 = 0; c4 < nc; c4 += 4) {
        __m128i lines[4][TILE_R / 4];
        for (int64_t q = 0; q < r4 / 4; q++) {
            const uint32_t *t = tile + 4 * q * tc + c4;
            __m128i a0 = _mm_loadu_si128((const __m128i *)t), a1 = _mm_loadu_si128((const __m128i *)(t + tc));
            __m128i a2 = _mm_loadu_si128((const __m128i *)(t + 2 * tc));
            __m128i a3 = _mm_loadu_si128((const __m128i *)(t + 3 * tc));
            __m128i b0 = _mm_unpacklo_epi32(a0, a1), b1 = _mm_unpackhi_epi32(a0, a1);
            __m128i b2 = _mm_unpacklo_epi32(a2, a3), b3 = _mm_unpackhi_epi32(a2, a3);
            lines[0][q] = _mm_unpacklo_epi64(b0, b2);
            lines[1][q] = _mm_unpackhi_epi64(b0, b2);
            lines[2][q] = _mm_unpacklo_epi64(b1, b3);
            lines[3][q] = _mm_unpackhi_epi64(b1, b3);
        }
        for (int i = 0; i < 4; i++) put_row(out + (c4 + i) * rows, lines[i], r4 / 4);
    }
#endif
    for (; r4 < nr; r4++)
        for (int64_t c = 0; c < nc; c++) out[c * rows + r4] = tile[r4 * tc + c];
}

/* TG groups a tile: 128 x 128 16-bit elements (32 KiB), or 128 x 64 32-bit ones */
#define TRANSPOSED(NAME, T, W, TG, TRANSPOSE)                                                           \
    void NAME(const uint8_t *restrict blocks, const uint8_t *restrict scales, const W *restrict table,  \
              T *restrict out, int64_t experts, int64_t rows, int64_t groups) {                         \
        W tile[TILE_R * TG * 16];                                                                       \
        for (int64_t e = 0; e < experts; e++) {                                                         \
            const uint8_t *restrict be = blocks + e * rows * groups * 16;                               \
            const uint8_t *restrict se = scales + e * rows * groups;                                    \
            T *restrict oe = out + e * groups * 32 * rows;                                              \
            for (int64_t r0 = 0; r0 < rows; r0 += TILE_R) {                                             \
                const int64_t nr = rows - r0 < TILE_R ? rows - r0 : TILE_R;                             \
                for (int64_t g0 = 0; g0 < groups; g0 += TG) {                                           \
                    const int64_t ng = groups - g0 < TG ? groups - g0 : TG;                             \
                    for (int64_t r = 0; r < nr; r++) {                                                  \
                        const uint8_t *restrict b = be + ((r0 + r) * groups + g0) * 16;                 \
                        const uint8_t *restrict s = se + (r0 + r) * groups + g0;                        \
                        W *restrict t = tile + r * TG * 16;                                             \
                        for (int64_t g = 0; g < ng; g++) {                                              \
                            const W *restrict tb = table + ((int64_t)s[g] << 8);                        \
                            for (int k = 0; k < 16; k++) t[g * 16 + k] = tb[b[g * 16 + k]];             \
                        }                                                                               \
                    }                                                                                   \
                    TRANSPOSE((const T *)tile, TG * 32, nr, ng * 32, oe + g0 * 32 * rows + r0, rows);   \
                }                                                                                       \
            }                                                                                           \
        }                                                                                               \
        SFENCE                                                                                          \
    }

#ifdef __SSE2__
#define SFENCE _mm_sfence(); /* the streamed stores ordered before the caller's next ones (the pwrite) */
#else
#define SFENCE
#endif

TRANSPOSED(ckpttool_mxfp4_transposed_u16, uint16_t, uint32_t, 4, transpose_u16)
TRANSPOSED(ckpttool_mxfp4_transposed_u32, uint32_t, uint64_t, 2, transpose_u32)

/* 16-bit outputs with AVX2: a group's 32 elements looked up, not gathered. An MXFP4 group (one scale) has 16 possible
 * outputs, so its two bytes each are two 16-byte tables (low and high bytes of the pair table's entries with a zero
 * high nibble, made once per call for all 256 scales: 8 KiB, in L1), and the group's 32 nibbles index them by
 * PSHUFB, 32 elements in a dozen instructions where the gather took 16 table loads and 16 stores (the table of 256
 * KiB lives in L2); the tiles and their transpose as above. Returns -2 (nothing written) where the CPU lacks AVX2. */
#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>

__attribute__((target("avx2"))) static void lut_group(const uint8_t *restrict b, const uint8_t *restrict lo,
                                                      const uint8_t *restrict hi, uint16_t *restrict t) {
    const __m128i m = _mm_set1_epi8(15), c = _mm_loadu_si128((const __m128i *)b);
    const __m128i ln = _mm_and_si128(c, m), hn = _mm_and_si128(_mm_srli_epi16(c, 4), m);
    /* element 2k is byte k's low nibble, 2k + 1 its high one: elements 0..15 in the low lane, 16..31 the high */
    const __m256i idx = _mm256_set_m128i(_mm_unpackhi_epi8(ln, hn), _mm_unpacklo_epi8(ln, hn));
    const __m256i l = _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)lo)), idx);
    const __m256i h = _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)hi)), idx);
    const __m256i w0 = _mm256_unpacklo_epi8(l, h), w1 = _mm256_unpackhi_epi8(l, h); /* 0..7 | 16..23, 8..15 | 24..31 */
    _mm256_storeu_si256((__m256i *)t, _mm256_permute2x128_si256(w0, w1, 0x20));
    _mm256_storeu_si256((__m256i *)(t + 16), _mm256_permute2x128_si256(w0, w1, 0x31));
}

__attribute__((target("avx2"))) int32_t ckpttool_mxfp4_transposed_u16_lut(
    const uint8_t *restrict blocks, const uint8_t *restrict scales, const uint32_t *restrict table,
    uint16_t *restrict out, int64_t experts, int64_t rows, int64_t groups) {
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx2")) return -2;
    enum { TG = 4 };
    uint8_t lo[256 * 16], hi[256 * 16];
    for (int s = 0; s < 256; s++)
        for (int k = 0; k < 16; k++) {
            const uint32_t w = table[(s << 8) | k]; /* byte k: its low nibble's element in the low half */
            lo[s * 16 + k] = (uint8_t)w, hi[s * 16 + k] = (uint8_t)(w >> 8);
        }
    uint16_t tile[TILE_R * TG * 32];
    for (int64_t e = 0; e < experts; e++) {
        const uint8_t *restrict be = blocks + e * rows * groups * 16;
        const uint8_t *restrict se = scales + e * rows * groups;
        uint16_t *restrict oe = out + e * groups * 32 * rows;
        for (int64_t r0 = 0; r0 < rows; r0 += TILE_R) {
            const int64_t nr = rows - r0 < TILE_R ? rows - r0 : TILE_R;
            for (int64_t g0 = 0; g0 < groups; g0 += TG) {
                const int64_t ng = groups - g0 < TG ? groups - g0 : TG;
                for (int64_t r = 0; r < nr; r++) {
                    const uint8_t *restrict b = be + ((r0 + r) * groups + g0) * 16;
                    const uint8_t *restrict s = se + (r0 + r) * groups + g0;
                    for (int64_t g = 0; g < ng; g++)
                        lut_group(b + g * 16, lo + 16 * s[g], hi + 16 * s[g], tile + r * TG * 32 + g * 32);
                }
                transpose_u16(tile, TG * 32, nr, ng * 32, oe + g0 * 32 * rows + r0, rows);
            }
        }
    }
    _mm_sfence();
    return 0;
}
#else
int32_t ckpttool_mxfp4_transposed_u16_lut(const uint8_t *blocks, const uint8_t *scales, const uint32_t *table,
                                          uint16_t *out, int64_t experts, int64_t rows, int64_t groups) {
    (void)blocks, (void)scales, (void)table, (void)out, (void)experts, (void)rows, (void)groups;
    return -2;
}
#endif
