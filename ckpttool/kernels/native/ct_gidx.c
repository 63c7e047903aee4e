/* compressed-tensors' act-order rows (a g_idx: column j's group is g_idx[j]) and 8-bit rows (their groups as the
 * index j / group: 0.92-1.16x FP8 block by the tables, 1.39-1.53x here), computed per element in C with AVX2 and
 * F16C, the same bits as kernels/window.py's tables: out[i, j] = round_out(round_sdt(fp32(q - z) * s)), s the float32
 * scale of row i, group g_idx[j], q and z offset-binary codes (z = 2^(bits-1) when symmetric), the fp32
 * product rounded to fp16 first for F16 scales (f16 = 1: a library multiplying in fp16), then to the output.
 * kernels/window.dequant says when it is used; window.computed_gidx checks every shape, dtype, stride and index first.
 *
 * Why not the tables: each output there is a load of the column's group, of that group's table offset for the row and
 * of the table entry (0.50x FP8 block per output byte), and a per-row lookup by shuffles cannot share one group's
 * table across a vector of columns. GPTQ's act-order loop (native/packed.c, `lanes`) shows the way out: eight rows
 * in the lanes of a vector, one column per vector, so a column's group is one load of its eight rows' scales (and
 * zero points) from a small buffer made once per block of rows (64 bytes a group), whatever g_idx holds. Here the
 * codes run along the rows (compressed-tensors packs along the input dimension), so the block's eight rows' next 32
 * bytes of codes are loaded and transposed as 8 x 8 words (a lane then holds one row's word: eight 4-bit codes or
 * four bytes), and the outputs go back into the rows: BF16 words of two columns joined per lane by a blend and the
 * four pairs transposed (F16: an 8 x 8 transpose of words). The next block's rows are prefetched: eight streams of
 * 1 KiB the hardware prefetcher found too late. 0.50x -> 1.45x FP8 block per output byte (bench/RESULTS.md);
 * AVX2's gathers instead of the loads and transpose ran 0.34-0.45x, eight scalar loads a word 0.8x, and the
 * buffers' fill written as one loop over (group, row) (gcc made it masked vector loads) cost a third of the time.
 *
 * kind: 0 F16 out, 1 BF16 out (uint16 words). Rows past the last block of eight and columns past the last eight are
 * done one at a time, with the same scalar arithmetic. MXCSR: flush-to-zero and denormals-are-zero off, nearest
 * rounding, while it runs (the IEEE arithmetic of the tables), then the caller's put back. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#include "block8.h"
#define CT_AVX2 __attribute__((target("avx2,f16c")))
#define CT_INLINE __attribute__((always_inline)) inline

CT_AVX2 static inline uint16_t word1(int32_t q, int32_t z, float s, const int kind, const int f16) {
    float p = (float)(q - z) * s;
    if (kind == 0) return _cvtss_sh(p, _MM_FROUND_TO_NEAREST_INT);
    if (f16) p = _cvtsh_ss(_cvtss_sh(p, _MM_FROUND_TO_NEAREST_INT));
    uint32_t u;
    memcpy(&u, &p, sizeof u);
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

/* code j of a row (offset binary; int8 storage flipped) */
static inline int32_t code1(const uint8_t *c, int64_t j, const int bits, uint32_t flip) {
    return bits == 4 ? (c[j / 2] >> (4 * (j % 2))) & 15 : (uint8_t)(c[j] ^ flip);
}

/* columns k0 .. k0 + 7 of the block's eight rows: w0 (and w1 for 8-bit codes) hold each row's codes of them in its
 * lane, g8 their groups. BF16: each pair of columns' words joined in one vector by a blend (row r's pair in 32-bit
 * lane r), the four pairs transposed into the rows (two rows a vector); F16: the 8 x 8 words transposed. */
CT_AVX2 CT_INLINE static void cols8(__m256i w0, __m256i w1, const int32_t *restrict g8, const int bits,
                                    const float *restrict sbuf, const int32_t *restrict zbuf, const int kind,
                                    const int f16, uint16_t *restrict dst, int64_t out_stride) {
    const int per = 32 / bits;
    const __m256i vmask = _mm256_set1_epi32((1 << bits) - 1);
    __m256 p[8];
#pragma GCC unroll 8
    for (int j = 0; j < 8; j++) { /* column j: its group's scales and zero codes, made per block of rows */
        const int64_t g = g8[j];
        const __m256i wj = _mm256_srli_epi32(j < per ? w0 : w1, bits * (j % per));
        const __m256i q = j % per == per - 1 ? wj : _mm256_and_si256(wj, vmask); /* the top code: no mask */
        const __m256i z = _mm256_loadu_si256((const __m256i *)(zbuf + 8 * g));
        p[j] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(q, z)), _mm256_loadu_ps(sbuf + 8 * g));
        if (f16 && kind == 1) /* rounded to fp16 first */
            p[j] = _mm256_cvtph_ps(_mm256_cvtps_ph(p[j], _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    }
    if (kind == 0) {
        __m128i h[8], t[8];
        for (int j = 0; j < 8; j++) h[j] = _mm256_cvtps_ph(p[j], _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        block8_transpose16(h, t);
        for (int r = 0; r < 8; r++) _mm_storeu_si128((__m128i *)(dst + r * out_stride), t[r]);
        return;
    }
    block8_store_bf16(p, (char *)dst, 2 * out_stride);
}

/* the loop, `bits`, `kind` and `f16` constants after inlining, so that the eight columns unroll */
CT_AVX2 CT_INLINE static void gidx_rows(const uint8_t *restrict codes, int64_t code_stride, int64_t rows, int64_t cols,
                                        const int bits, uint32_t flip, const float *restrict scales, int64_t s_stride,
                                        const int32_t *restrict zeros, int64_t z_stride, int64_t groups,
                                        const int32_t *restrict gidx, const int kind, const int f16,
                                        float *restrict sbuf, int32_t *restrict zbuf, uint16_t *restrict out,
                                        int64_t out_stride) {
    const int32_t sym = 1 << (bits - 1);
    const int64_t span = 256 / bits; /* columns of 32 bytes of codes */
    const int64_t blocks = cols / span * span, whole = cols / 8 * 8;
    const __m256i vflip = _mm256_set1_epi32((int)(flip * 0x01010101u));
    int64_t i0 = 0;
    for (; i0 + 8 <= rows; i0 += 8) {
        /* each group's scales and zero codes of the block's eight rows, as vectors: a column's group is then two
         * loads whatever g_idx holds */
        for (int r = 0; r < 8; r++) { /* (a loop over g inside one over r: gcc made the other masked loads) */
            const float *restrict sr = scales + (i0 + r) * s_stride;
            const int32_t *restrict zr = zeros ? zeros + (i0 + r) * z_stride : 0;
            for (int64_t g = 0; g < groups; g++) sbuf[8 * g + r] = sr[g];
            for (int64_t g = 0; g < groups; g++) zbuf[8 * g + r] = zr ? zr[g] : sym;
        }
        const uint8_t *restrict c0 = codes + i0 * code_stride;
        uint16_t *restrict dst = out + i0 * out_stride;
        int64_t k0 = 0;
        for (; k0 < blocks; k0 += span) { /* 32 bytes of each row, transposed: t[m] lane r holds row r's word m */
            __m256i x[8], t[8];
            if (i0 + 16 <= rows && (k0 * bits / 8) % 64 == 0) /* the next block's rows, a line of each */
                for (int r = 0; r < 8; r++)
                    __builtin_prefetch(c0 + (8 + r) * code_stride + k0 * bits / 8);
            for (int r = 0; r < 8; r++)
                x[r] = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(c0 + r * code_stride + k0 * bits / 8)),
                                        vflip);
            block8_transpose32(x, t);
            if (bits == 4)
                for (int m = 0; m < 8; m++)
                    cols8(t[m], t[m], gidx + k0 + 8 * m, 4, sbuf, zbuf, kind, f16, dst + k0 + 8 * m, out_stride);
            else
                for (int m = 0; m < 4; m++)
                    cols8(t[2 * m], t[2 * m + 1], gidx + k0 + 8 * m, 8, sbuf, zbuf, kind, f16, dst + k0 + 8 * m,
                          out_stride);
        }
        for (; k0 < whole; k0 += 8) { /* eight columns at a time past the last 32 bytes */
            int32_t lo[8], hi[8];
            for (int r = 0; r < 8; r++) {
                memcpy(lo + r, c0 + r * code_stride + k0 * bits / 8, 4);
                memcpy(hi + r, c0 + r * code_stride + k0 * bits / 8 + (bits == 8 ? 4 : 0), 4);
            }
            cols8(_mm256_xor_si256(_mm256_loadu_si256((const __m256i *)lo), vflip),
                  _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)hi), vflip), gidx + k0, bits, sbuf, zbuf, kind,
                  f16, dst + k0, out_stride);
        }
        for (int r = 0; r < 8; r++) /* columns past the last eight */
            for (int64_t j = whole; j < cols; j++) {
                const int64_t g = gidx[j];
                dst[r * out_stride + j] = word1(code1(c0 + r * code_stride, j, bits, flip), zbuf[8 * g + r],
                                                sbuf[8 * g + r], kind, f16);
            }
    }
    for (int64_t i = i0; i < rows; i++) /* rows past the last block of eight */
        for (int64_t j = 0; j < cols; j++) {
            const int64_t g = gidx[j];
            out[i * out_stride + j] = word1(code1(codes + i * code_stride, j, bits, flip),
                                            zeros ? zeros[i * z_stride + g] : sym, scales[i * s_stride + g], kind, f16);
        }
}

#define GIDX(BITS, KIND, F16)                                                                                       \
    gidx_rows(codes, code_stride, rows, cols, BITS, flip, scales, s_stride, zeros, z_stride, groups, gidx, KIND, F16, \
              sbuf, zbuf, out, out_stride)
#define GIDX_KIND(BITS) \
    (kind == 0 ? GIDX(BITS, 0, 0) : f16 ? GIDX(BITS, 1, 1) : GIDX(BITS, 1, 0))

/* codes uint8 [rows, cols / 2 bytes (4-bit, low nibble first) or cols bytes], scales float32 and zeros int32 (or
 * NULL: symmetric) [rows, groups] (a row stride 0 broadcasts one row), gidx int32 [cols] below `groups`, out uint16
 * [rows, cols]. Returns 0, -1 where memory for the buffers ran out, -2 where the CPU has no AVX2 and F16C (nothing
 * written either way). */
CT_AVX2 int32_t ckpttool_ct_gidx(const uint8_t *restrict codes, int64_t code_stride, int64_t rows, int64_t cols,
                                 int32_t bits, int32_t flip, const float *restrict scales, int64_t s_stride,
                                 const int32_t *restrict zeros, int64_t z_stride, int64_t groups,
                                 const int32_t *restrict gidx, int32_t kind, int32_t f16, uint16_t *restrict out,
                                 int64_t out_stride) {
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("f16c")) return -2;
    float *sbuf = malloc(sizeof(float) * 8 * (size_t)(groups > 0 ? groups : 1));
    int32_t *zbuf = malloc(sizeof(int32_t) * 8 * (size_t)(groups > 0 ? groups : 1));
    if (!sbuf || !zbuf) {
        free(sbuf), free(zbuf);
        return -1;
    }
    const unsigned int csr = _mm_getcsr();
    _mm_setcsr(csr & ~0xE040u); /* FTZ (bit 15) and DAZ (bit 6) off, round to nearest (bits 13-14 zero) */
    if (bits == 4) GIDX_KIND(4);
    else GIDX_KIND(8);
    _mm_setcsr(csr);
    free(sbuf), free(zbuf);
    return 0;
}
#else
int32_t ckpttool_ct_gidx(const uint8_t *codes, int64_t code_stride, int64_t rows, int64_t cols, int32_t bits,
                         int32_t flip, const float *scales, int64_t s_stride, const int32_t *zeros, int64_t z_stride,
                         int64_t groups, const int32_t *gidx, int32_t kind, int32_t f16, uint16_t *out,
                         int64_t out_stride) {
    (void)codes, (void)code_stride, (void)rows, (void)cols, (void)bits, (void)flip, (void)scales, (void)s_stride;
    (void)zeros, (void)z_stride, (void)groups, (void)gidx, (void)kind, (void)f16, (void)out, (void)out_stride;
    return -2;
}
#endif
