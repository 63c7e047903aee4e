/* bitsandbytes' dequantization in C: kernels/bnb_cpu.py's loops (its docstring gives the library's formulas),
 * the same bits as its numba and numpy forms. kernels/native.py checks every shape, dtype and stride first.
 *
 * 4-bit: packed bytes of the flat weight, two codes a byte, the HIGH nibble first; blocks of `blocksize` values
 * share one fp32 absmax. Each block's 16 outputs are made once (one fp32 product, one rounding), then every byte
 * becomes two outputs looked up in them: on x86 with SSSE3 or AVX2, sixteen bytes at a time by byte shuffles
 * (the table's low and high bytes as two 16-byte tables, PSHUFB indexed by the nibbles), else one at a time.
 * int8 (LLM.int8()): out[i, j] = round(fp32(fp32(q[i, j] * scb[i]) * (1/127 in fp32))), the two products in
 * bitsandbytes' order; with AVX2 computed per element (the compiler vectorizes it; no FMA: AVX2 does not include
 * it, and -std=c99 contracts nothing), else per row's 256 codes and gathered.
 * `simd` caps the instruction sets used (0: none, 1: SSSE3, 2: AVX2; CKPTTOOL_SIMD), so the tests run each;
 * every level gives the same bits.
 * Rounding into the output: bf16.h's (nearest even, here without a branch), or to fp16 with `f16_bits` (nearest even, IEEE subnormals,
 * overflow to inf: numpy's astype(float16) and torch's .to(float16) on every number). */
#include <stdint.h>
#include <string.h>

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#define BNB_X86 1
#include <immintrin.h>
#endif

/* float32 -> float16 bits, round to nearest even (F. Giesen's float_to_half_fast3_rtne): in the subnormal range
 * one fp32 addition does the rounding, so it needs the default rounding mode and no flush-to-zero (setup.py's
 * flags keep both). A NaN becomes the quiet NaN 0x7E00 (never reached: inputs are checked finite). */
static inline uint32_t f16_bits(float x) {
    const uint32_t f16max = (127u + 16u) << 23, infty = 255u << 23, magic_u = 126u << 23;
    uint32_t u, o;
    memcpy(&u, &x, sizeof u);
    const uint32_t sign = u & 0x80000000u;
    u ^= sign;
    if (u >= f16max) {
        o = u > infty ? 0x7E00u : 0x7C00u;
    } else if (u < (113u << 23)) {
        float f, magic;
        memcpy(&f, &u, sizeof f);
        memcpy(&magic, &magic_u, sizeof magic);
        f += magic;
        memcpy(&o, &f, sizeof o);
        o -= magic_u;
    } else {
        o = (u - (112u << 23) + 0xFFFu + ((u >> 13) & 1u)) >> 13;
    }
    return o | (sign >> 16);
}

/* bf16.h's rounding without a branch, so that the compiler vectorizes the loops that call it */
static inline uint32_t bf16_bits(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    const uint32_t r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16, nan = (u >> 16) | 0x40u;
    return (u & 0x7FFFFFFFu) > 0x7F800000u ? nan : r;
}

static inline uint32_t f32_bits(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    return u;
}

int32_t ckpttool_simd_level(void) {
#ifdef BNB_X86
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") ? 2 : __builtin_cpu_supports("ssse3") ? 1 : 0;
#else
    return 0;
#endif
}

/* -- 4-bit -------------------------------------------------------------------------------------------- */
#define TB 64 /* blocks whose tables are made in one loop (4 KiB of tables at most: L1) */

/* tables[b][k] = round(code[k] * absmax[b]) for b < nb; kind 0: BF16, 1: F16 */
static inline void tables16(const float *restrict absmax, int64_t nb, const float *restrict code, int32_t kind,
                            uint16_t tables[][16]) {
    if (kind == 0) {
        for (int64_t b = 0; b < nb; b++)
            for (int k = 0; k < 16; k++) tables[b][k] = (uint16_t)bf16_bits(code[k] * absmax[b]);
    } else {
        for (int64_t b = 0; b < nb; b++)
            for (int k = 0; k < 16; k++) tables[b][k] = (uint16_t)f16_bits(code[k] * absmax[b]);
    }
}

static inline void lookup16(const uint8_t *restrict p, int64_t j0, int64_t j1, const uint16_t *restrict t,
                            uint16_t *restrict out) {
    for (int64_t j = j0; j < j1; j++) {
        const uint8_t v = p[j];
        out[2 * j] = t[v >> 4];
        out[2 * j + 1] = t[v & 15];
    }
}

static void bnb4_u16_scalar(const uint8_t *restrict packed, int64_t nbytes, const float *restrict absmax,
                            const float *restrict code, int64_t half, int32_t kind, uint16_t *restrict out) {
    uint16_t t[TB][16];
    const int64_t nblocks = (nbytes + half - 1) / half;
    for (int64_t b0 = 0; b0 < nblocks; b0 += TB) {
        const int64_t nb = nblocks - b0 < TB ? nblocks - b0 : TB;
        tables16(absmax + b0, nb, code, kind, t);
        for (int64_t b = 0; b < nb; b++) {
            const int64_t j0 = (b0 + b) * half, j1 = j0 + half < nbytes ? j0 + half : nbytes;
            lookup16(packed, j0, j1, t[b], out);
        }
    }
}

#ifdef BNB_X86
/* The same, sixteen bytes (32 outputs) per step: the table's low bytes and high bytes are two 16-byte tables,
 * the nibbles (high first, interleaved) index both with PSHUFB, and the two results interleave into words. */
#define BNB4_SHUFFLE(NAME, TARGET)                                                                          \
    __attribute__((target(TARGET))) static void NAME(const uint8_t *restrict packed, int64_t nbytes,         \
                                                     const float *restrict absmax, const float *restrict code, \
                                                     int64_t half, int32_t kind, uint16_t *restrict out) {     \
        uint16_t t[TB][16] __attribute__((aligned(16)));                                                    \
        const __m128i even = _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, -1, -1, -1, -1, -1, -1, -1, -1);      \
        const __m128i odd = _mm_setr_epi8(1, 3, 5, 7, 9, 11, 13, 15, -1, -1, -1, -1, -1, -1, -1, -1);       \
        const __m128i low4 = _mm_set1_epi8(0x0F);                                                           \
        const int64_t nblocks = (nbytes + half - 1) / half;                                                 \
        for (int64_t b0 = 0; b0 < nblocks; b0 += TB) {                                                      \
            const int64_t nb = nblocks - b0 < TB ? nblocks - b0 : TB;                                       \
            tables16(absmax + b0, nb, code, kind, t);                                                       \
            for (int64_t b = 0; b < nb; b++) {                                                              \
                const __m128i w0 = _mm_load_si128((const __m128i *)t[b]);                                   \
                const __m128i w1 = _mm_load_si128((const __m128i *)(t[b] + 8));                             \
                const __m128i lo_t = _mm_unpacklo_epi64(_mm_shuffle_epi8(w0, even), _mm_shuffle_epi8(w1, even)); \
                const __m128i hi_t = _mm_unpacklo_epi64(_mm_shuffle_epi8(w0, odd), _mm_shuffle_epi8(w1, odd)); \
                const int64_t j0 = (b0 + b) * half, j1 = j0 + half < nbytes ? j0 + half : nbytes;           \
                int64_t j = j0;                                                                             \
                for (; j + 16 <= j1; j += 16) {                                                             \
                    const __m128i v = _mm_loadu_si128((const __m128i *)(packed + j));                       \
                    const __m128i hi = _mm_and_si128(_mm_srli_epi16(v, 4), low4), lo = _mm_and_si128(v, low4); \
                    const __m128i i0 = _mm_unpacklo_epi8(hi, lo), i1 = _mm_unpackhi_epi8(hi, lo);           \
                    const __m128i l0 = _mm_shuffle_epi8(lo_t, i0), h0 = _mm_shuffle_epi8(hi_t, i0);         \
                    const __m128i l1 = _mm_shuffle_epi8(lo_t, i1), h1 = _mm_shuffle_epi8(hi_t, i1);         \
                    __m128i *o = (__m128i *)(out + 2 * j);                                                  \
                    _mm_storeu_si128(o, _mm_unpacklo_epi8(l0, h0));                                         \
                    _mm_storeu_si128(o + 1, _mm_unpackhi_epi8(l0, h0));                                     \
                    _mm_storeu_si128(o + 2, _mm_unpacklo_epi8(l1, h1));                                     \
                    _mm_storeu_si128(o + 3, _mm_unpackhi_epi8(l1, h1));                                     \
                }                                                                                           \
                lookup16(packed, j, j1, t[b], out);                                                         \
            }                                                                                               \
        }                                                                                                   \
    }

BNB4_SHUFFLE(bnb4_u16_ssse3, "ssse3")
BNB4_SHUFFLE(bnb4_u16_avx2, "avx2") /* the same code; AVX2's encoding and 8-wide table loops run faster */
#endif

/* packed [nbytes] -> out [2 * nbytes] BF16 (kind 0) or F16 (kind 1) words; absmax [ceil(2 * nbytes / blocksize)];
 * code [16]; blocksize even. */
void ckpttool_bnb4_u16(const uint8_t *restrict packed, int64_t nbytes, const float *restrict absmax,
                       const float *restrict code, int64_t blocksize, int32_t kind, int32_t simd,
                       uint16_t *restrict out) {
#ifdef BNB_X86
    const int32_t level = ckpttool_simd_level() < simd ? ckpttool_simd_level() : simd;
    if (level == 2) {
        bnb4_u16_avx2(packed, nbytes, absmax, code, blocksize / 2, kind, out);
        return;
    }
    if (level == 1) {
        bnb4_u16_ssse3(packed, nbytes, absmax, code, blocksize / 2, kind, out);
        return;
    }
#endif
    (void)simd;
    bnb4_u16_scalar(packed, nbytes, absmax, code, blocksize / 2, kind, out);
}

/* The same into F32 words (the products' own bits). */
void ckpttool_bnb4_u32(const uint8_t *restrict packed, int64_t nbytes, const float *restrict absmax,
                       const float *restrict code, int64_t blocksize, uint32_t *restrict out) {
    const int64_t half = blocksize / 2;
    uint32_t t[16];
    for (int64_t b = 0, j0 = 0; j0 < nbytes; b++, j0 += half) {
        for (int k = 0; k < 16; k++) t[k] = f32_bits(code[k] * absmax[b]);
        const int64_t j1 = j0 + half < nbytes ? j0 + half : nbytes;
        for (int64_t j = j0; j < j1; j++) {
            const uint8_t v = packed[j];
            out[2 * j] = t[v >> 4];
            out[2 * j + 1] = t[v & 15];
        }
    }
}

/* -- int8 --------------------------------------------------------------------------------------------- */
/* codes [rows, width] int8 (row stride in elements), scb [rows] -> out [rows, width] (row stride in elements).
 * AVX2: each element computed (8 at a time, as the compiler vectorizes it); else each row's 256 outputs (one per
 * code) first, then a gather (the FP8 block loop), which runs faster than scalar arithmetic per element. */
#define BNB8_DIRECT(NAME, T, ROUND, ATTR)                                                                   \
    ATTR static void NAME(const int8_t *restrict codes, int64_t code_stride, const float *restrict scb,     \
                          int64_t rows, int64_t width, T *restrict out, int64_t out_stride) {               \
        const float inv127 = 7.874015718698502e-3f;                                                         \
        for (int64_t i = 0; i < rows; i++) {                                                                \
            const int8_t *restrict c = codes + i * code_stride;                                             \
            T *restrict o = out + i * out_stride;                                                           \
            const float s = scb[i];                                                                         \
            for (int64_t j = 0; j < width; j++) {                                                           \
                const float p = (float)c[j] * s;                                                            \
                o[j] = (T)ROUND(p * inv127);                                                                \
            }                                                                                               \
        }                                                                                                   \
    }

#define BNB8_TABLE(NAME, T, ROUND)                                                                          \
    static void NAME(const int8_t *restrict codes, int64_t code_stride, const float *restrict scb, int64_t rows, \
                     int64_t width, T *restrict out, int64_t out_stride) {                                  \
        const float inv127 = 7.874015718698502e-3f;                                                         \
        T t[256];                                                                                           \
        for (int64_t i = 0; i < rows; i++) {                                                                \
            const float s = scb[i];                                                                         \
            for (int k = 0; k < 256; k++) {                                                                 \
                const float p = (float)(k < 128 ? k : k - 256) * s;                                         \
                t[k] = (T)ROUND(p * inv127);                                                                \
            }                                                                                               \
            const uint8_t *restrict c = (const uint8_t *)(codes + i * code_stride);                         \
            T *restrict o = out + i * out_stride;                                                           \
            for (int64_t j = 0; j < width; j++) o[j] = t[c[j]];                                             \
        }                                                                                                   \
    }

BNB8_TABLE(bnb8_bf16, uint16_t, bf16_bits)
BNB8_TABLE(bnb8_f16, uint16_t, f16_bits)
BNB8_TABLE(bnb8_f32, uint32_t, f32_bits)
#ifdef BNB_X86
BNB8_DIRECT(bnb8_bf16_avx2, uint16_t, bf16_bits, __attribute__((target("avx2"))))
BNB8_DIRECT(bnb8_f32_avx2, uint32_t, f32_bits, __attribute__((target("avx2"))))
#endif

/* kind 0: BF16, 1: F16 (out uint16), 2: F32 (out uint32) */
void ckpttool_bnb8(const int8_t *restrict codes, int64_t code_stride, const float *restrict scb, int64_t rows,
                   int64_t width, int32_t kind, int32_t simd, void *restrict out, int64_t out_stride) {
#ifdef BNB_X86
    if (simd >= 2 && ckpttool_simd_level() == 2 && kind != 1) {
        if (kind == 0) bnb8_bf16_avx2(codes, code_stride, scb, rows, width, out, out_stride);
        else bnb8_f32_avx2(codes, code_stride, scb, rows, width, out, out_stride);
        return;
    }
#endif
    (void)simd;
    if (kind == 0) bnb8_bf16(codes, code_stride, scb, rows, width, out, out_stride);
    else if (kind == 1) bnb8_f16(codes, code_stride, scb, rows, width, out, out_stride);
    else bnb8_f32(codes, code_stride, scb, rows, width, out, out_stride);
}
