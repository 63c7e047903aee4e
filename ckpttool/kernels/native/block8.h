/* 8 x 8 blocks of words transposed (16- and 32-bit) and of 16-bit outputs held one column per vector (lane r: row r)
 * written back row by row: shared by
 * packed.c (GPTQ lanes, AWQ rows8) and ct_gidx.c (compressed-tensors' act-order and 8-bit rows). x86 with AVX2 and
 * F16C only: include it inside those files' x86 block. */
#ifndef CKPTTOOL_BLOCK8_H
#define CKPTTOOL_BLOCK8_H
#include <immintrin.h>
#include <stdint.h>

#define BLOCK8 __attribute__((target("avx2,f16c"), always_inline)) inline

/* h[j] lane i -> t[i] lane j: an 8 x 8 block of 16-bit words transposed */
BLOCK8 static void block8_transpose16(const __m128i h[8], __m128i t[8]) {
    const __m128i a0 = _mm_unpacklo_epi16(h[0], h[1]), a1 = _mm_unpackhi_epi16(h[0], h[1]);
    const __m128i a2 = _mm_unpacklo_epi16(h[2], h[3]), a3 = _mm_unpackhi_epi16(h[2], h[3]);
    const __m128i a4 = _mm_unpacklo_epi16(h[4], h[5]), a5 = _mm_unpackhi_epi16(h[4], h[5]);
    const __m128i a6 = _mm_unpacklo_epi16(h[6], h[7]), a7 = _mm_unpackhi_epi16(h[6], h[7]);
    const __m128i b0 = _mm_unpacklo_epi32(a0, a2), b1 = _mm_unpackhi_epi32(a0, a2);
    const __m128i b2 = _mm_unpacklo_epi32(a1, a3), b3 = _mm_unpackhi_epi32(a1, a3);
    const __m128i b4 = _mm_unpacklo_epi32(a4, a6), b5 = _mm_unpackhi_epi32(a4, a6);
    const __m128i b6 = _mm_unpacklo_epi32(a5, a7), b7 = _mm_unpackhi_epi32(a5, a7);
    t[0] = _mm_unpacklo_epi64(b0, b4), t[1] = _mm_unpackhi_epi64(b0, b4);
    t[2] = _mm_unpacklo_epi64(b1, b5), t[3] = _mm_unpackhi_epi64(b1, b5);
    t[4] = _mm_unpacklo_epi64(b2, b6), t[5] = _mm_unpackhi_epi64(b2, b6);
    t[6] = _mm_unpacklo_epi64(b3, b7), t[7] = _mm_unpackhi_epi64(b3, b7);
}

/* x[r] lane m -> t[m] lane r: an 8 x 8 block of 32-bit words transposed */
BLOCK8 static void block8_transpose32(const __m256i x[8], __m256i t[8]) {
    const __m256i a0 = _mm256_unpacklo_epi32(x[0], x[1]), a1 = _mm256_unpackhi_epi32(x[0], x[1]);
    const __m256i a2 = _mm256_unpacklo_epi32(x[2], x[3]), a3 = _mm256_unpackhi_epi32(x[2], x[3]);
    const __m256i a4 = _mm256_unpacklo_epi32(x[4], x[5]), a5 = _mm256_unpackhi_epi32(x[4], x[5]);
    const __m256i a6 = _mm256_unpacklo_epi32(x[6], x[7]), a7 = _mm256_unpackhi_epi32(x[6], x[7]);
    const __m256i b0 = _mm256_unpacklo_epi64(a0, a2), b1 = _mm256_unpackhi_epi64(a0, a2);
    const __m256i b2 = _mm256_unpacklo_epi64(a1, a3), b3 = _mm256_unpackhi_epi64(a1, a3);
    const __m256i b4 = _mm256_unpacklo_epi64(a4, a6), b5 = _mm256_unpackhi_epi64(a4, a6);
    const __m256i b6 = _mm256_unpacklo_epi64(a5, a7), b7 = _mm256_unpackhi_epi64(a5, a7);
    t[0] = _mm256_permute2x128_si256(b0, b4, 0x20), t[1] = _mm256_permute2x128_si256(b1, b5, 0x20);
    t[2] = _mm256_permute2x128_si256(b2, b6, 0x20), t[3] = _mm256_permute2x128_si256(b3, b7, 0x20);
    t[4] = _mm256_permute2x128_si256(b0, b4, 0x31), t[5] = _mm256_permute2x128_si256(b1, b5, 0x31);
    t[6] = _mm256_permute2x128_si256(b2, b6, 0x31), t[7] = _mm256_permute2x128_si256(b3, b7, 0x31);
}

/* BF16 of eight fp32 values, nearest even in integers (bf16.h; the callers' values are never NaN): the result in
 * each 32-bit lane's high half, the low half garbage */
BLOCK8 static __m256i block8_bf16_high(__m256 p) {
    const __m256i u = _mm256_castps_si256(p);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    return _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb);
}

/* BF16 of p[j] (lane r: row r, column j) stored row by row: each column rounded in 32-bit lanes, two columns'
 * words joined per lane by a blend, the four pairs transposed (two rows a vector). Transposing fp16 words first
 * and rounding each row (a byte shuffle and a permute more per eight) ran awq_gemm at 0.86-0.87x FP8 block */
BLOCK8 static void block8_store_bf16(const __m256 p[8], char *dst, int64_t row_bytes) {
    __m256i v[4];
    for (int j = 0; j < 4; j++) /* lane r: row r's columns 2j (low word) and 2j + 1 (high word) */
        v[j] = _mm256_blend_epi16(_mm256_srli_epi32(block8_bf16_high(p[2 * j]), 16), block8_bf16_high(p[2 * j + 1]),
                                  0xAA);
    const __m256i a0 = _mm256_unpacklo_epi32(v[0], v[1]), a1 = _mm256_unpackhi_epi32(v[0], v[1]);
    const __m256i a2 = _mm256_unpacklo_epi32(v[2], v[3]), a3 = _mm256_unpackhi_epi32(v[2], v[3]);
    const __m256i t[4] = {_mm256_unpacklo_epi64(a0, a2), _mm256_unpackhi_epi64(a0, a2), _mm256_unpacklo_epi64(a1, a3),
                          _mm256_unpackhi_epi64(a1, a3)}; /* rows 0 and 4, 1 and 5, 2 and 6, 3 and 7 */
    for (int i = 0; i < 4; i++) {
        _mm_storeu_si128((__m128i *)(dst + i * row_bytes), _mm256_castsi256_si128(t[i]));
        _mm_storeu_si128((__m128i *)(dst + (i + 4) * row_bytes), _mm256_extracti128_si256(t[i], 1));
    }
}
#endif
