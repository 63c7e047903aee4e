/* FP8 e4m3 codes times float32 scales computed per element, in C with AVX2 (kernels/fp8_cpu.dequant_scaled says
 * when it is used): out[i, j] = round(fp32(code[i, j]) * scale[i / b0, j / group]), the product and its rounding
 * as fp8_cpu.library_tables makes every table entry, so the same bits as the table gathers.
 *
 * A table of 256 outputs per distinct scale costs more than the elements it serves where each group of a row has
 * its own scale (FP8 1x128 or 1x32 groups, F32 scales all distinct), and even where it does not, its gather is one
 * scalar load and store per element. Two loops here: for BF16 out with one rounding, a lookup of sixteen entries
 * per group by byte shuffles (group_bf16_lut: 32 codes a step, about twice the speed of FP8 block's table gather);
 * else eight elements a step in float32 lanes. A code's value there: its sign and low seven bits placed in a
 * float32's sign and bits 20..26 are the value times 2**-120 (e4m3's subnormals are float32 subnormals there), so
 * one exact multiply by 2**120 decodes every code. NaN codes are found in the same pass (the caller refuses the
 * row); the caller has checked the scales finite, so no product is a NaN (an infinity rounds as one). The loops
 * clear flush-to-zero and denormals-are-zero and set nearest rounding while they run (the IEEE arithmetic the
 * tables do), then put the caller's MXCSR back. kernels/native.py checks every shape, dtype and stride first;
 * strides in elements.
 *
 * kind: 0 BF16 (the product rounded once), 1 BF16 of the product rounded to fp16 first (a library multiplying in
 * fp16: F16 scales), 2 F32 (the product's bits), 3 F32 of the product rounded to fp16. */
#include <stdint.h>
#include <string.h>


#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#define FP8S_X86 1
#include <immintrin.h>
#endif

static inline float e4m3_value(uint8_t c) {
    const uint32_t b = ((uint32_t)(c & 0x80u) << 24) | ((uint32_t)(c & 0x7Fu) << 20);
    float f;
    memcpy(&f, &b, sizeof f);
    return f * 0x1p120f;
}

/* bf16.h's rounding without its NaN branch (no product here is a NaN), so that the loops vectorize */
static inline uint32_t bf16_finite(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    return (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
}

static inline uint32_t f32_word(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    return u;
}


#ifdef FP8S_X86
#define AVX2 __attribute__((target("avx2,f16c")))

/* Eight codes' values times 2**-120 in float32 lanes: sign-extended bytes shifted left 20 they have the
 * sign in bit 31 (and 27..30, cleared) and the seven low bits in 20..26 */
AVX2 static inline __m256 values8(const uint8_t *c) {
    const __m256i x = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)c)); /* one load-and-extend */
    return _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(x, 20), _mm256_set1_epi32((int)0x87F00000u)));
}

/* The exact product of eight codes' values and a scale, one rounding: by s * 2**120 where that is exact (it is
 * finite), else by 2**120 (exact) then by s */
AVX2 static inline __m256 product8(const uint8_t *c, __m256 s120, __m256 s, int two) {
    const __m256 v = values8(c);
    return two ? _mm256_mul_ps(_mm256_mul_ps(v, _mm256_set1_ps(0x1p120f)), s) : _mm256_mul_ps(v, s120);
}

/* fp16's rounding of eight products, kept in float32: F16C's conversion (nearest even, subnormals, overflow to
 * infinity), there and back */
AVX2 static inline __m256 via_f16(__m256 p) { return _mm256_cvtph_ps(_mm256_cvtps_ph(p, _MM_FROUND_TO_NEAREST_INT)); }

/* bf16 bits of eight finite-or-infinite float32 lanes, nearest even, as signed 32-bit lanes (the arithmetic shift
 * keeps each in int16's range, so that packs_epi32 keeps the bits) */
AVX2 static inline __m256i bf16_lanes(__m256 p) {
    const __m256i u = _mm256_castps_si256(p);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    return _mm256_srai_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb), 16);
}

/* The top bit of each byte of eight codes set where the code is NaN (fp8.c's ckpttool_fp8_any_over with
 * e4m3fn's 0x7F: the low seven bits plus one carry into the top bit only from 0x7F), in scalar registers: the vector
 * units are the loop's bottleneck, and a vector test there slowed it by a quarter */
static inline uint64_t nan_bytes(const uint8_t *c) {
    uint64_t w;
    memcpy(&w, c, sizeof w);
    return (w & 0x7F7F7F7F7F7F7F7FULL) + 0x0101010101010101ULL;
}

/* sixteen codes at a time: their NaN codes (e4m3fn's S.1111.111) ORed into `nan`, their outputs stored */
#define STORE_BF16(F16)                                                                                 \
    for (; q + 16 <= n; q += 16) {                                                                      \
        nan |= nan_bytes(c + q) | nan_bytes(c + q + 8);                                                 \
        __m256 a = product8(c + q, s120v, sv, two), b = product8(c + q + 8, s120v, sv, two); \
        if (F16) a = via_f16(a), b = via_f16(b);                                                        \
        const __m256i w = _mm256_packs_epi32(bf16_lanes(a), bf16_lanes(b));                            \
        _mm256_storeu_si256((__m256i *)(o + q), _mm256_permute4x64_epi64(w, 0xD8));                     \
    }
#define STORE_F32(F16)                                                                                  \
    for (; q + 16 <= n; q += 16) {                                                                      \
        nan |= nan_bytes(c + q) | nan_bytes(c + q + 8);                                                 \
        __m256 a = product8(c + q, s120v, sv, two), b = product8(c + q + 8, s120v, sv, two); \
        if (F16) a = via_f16(a), b = via_f16(b);                                                        \
        _mm256_storeu_ps((float *)(o + q), a);                                                          \
        _mm256_storeu_ps((float *)(o + q + 8), b);                                                      \
    }

/* one group: n codes at c, one scale, into o; the tail (under 16 codes) one at a time, the same arithmetic.
 * Returns whether a code was NaN. */
#define GROUP_FN(NAME, T, STORE, F16, ROUND)                                                            \
    AVX2 static inline int NAME(const uint8_t *restrict c, T *restrict o, int64_t n, float s) {         \
        const float s120 = s * 0x1p120f;                                                                \
        const int two = !(s120 - s120 == 0.0f); /* s * 2**120 overflowed: inf - inf is NaN */           \
        const __m256 sv = _mm256_set1_ps(s), s120v = _mm256_set1_ps(s120);                              \
        uint64_t nan = 0;                                                                               \
        int64_t q = 0, tail = 0;                                                                        \
        STORE(F16)                                                                                      \
        for (; q < n; q++) {                                                                            \
            const float p = e4m3_value(c[q]) * s;                                                       \
            tail |= (c[q] & 0x7F) == 0x7F;                                                              \
            o[q] = (T)ROUND(F16 ? _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtps_ph(_mm_set_ss(p), 0))) : p);   \
        }                                                                                               \
        return tail | ((nan & 0x8080808080808080ULL) != 0);                                             \
    }

GROUP_FN(group_bf16, uint16_t, STORE_BF16, 0, bf16_finite)
GROUP_FN(group_bf16_f16, uint16_t, STORE_BF16, 1, bf16_finite)
GROUP_FN(group_f32, uint32_t, STORE_F32, 0, f32_word)
GROUP_FN(group_f32_f16, uint32_t, STORE_F32, 1, f32_word)

/* BF16 out, one rounding, by a lookup of sixteen entries per group: a normal code's value is 2**(e - 1) times its
 * mantissa's value at e = 1, and while every product of the group is a normal float32 below 2**127 (scales from
 * 2**-120 to under 2**118) that power of two is exact in the fp32 product and in its bf16 rounding, whose bits then
 * differ from the e = 1 product's by (e - 1) << 7; a negative code's by the sign bit alone. So a group needs eight
 * e = 1 products and the eight subnormal codes' products (zero included), rounded as everywhere here, and each code
 * is two byte shuffles (the entries' low and high bytes) indexed by its mantissa (subnormals: 8 + m), its sign
 * XORed and its exponent added: about 0.8 instructions a code against 1.3 computed. 32 codes a step; the rest, and
 * scales out of that range, computed (group_bf16). */
AVX2 static inline int group_bf16_lut(const uint8_t *restrict c, uint16_t *restrict o, int64_t n, float s) {
    const float a = s < 0 ? -s : s;
    if (!(a >= 0x1p-120f && a < 0x1p118f) || n < 32) return group_bf16(c, o, n, s);
    const __m256 sv = _mm256_set1_ps(s);
    const __m256 normal = _mm256_setr_ps(0x1p-6f, 0x1.2p-6f, 0x1.4p-6f, 0x1.6p-6f, 0x1.8p-6f, 0x1.ap-6f, 0x1.cp-6f,
                                         0x1.ep-6f);
    const __m256 subnormal = _mm256_setr_ps(0.0f, 0x1p-9f, 0x2p-9f, 0x3p-9f, 0x4p-9f, 0x5p-9f, 0x6p-9f, 0x7p-9f);
    /* the sixteen entries as words in order (lane 0: 0-7, lane 1: 8-15), then low bytes to qwords 0 and 2, high
     * bytes to 1 and 3, gathered into one 16-byte table each, both lanes */
    const __m256i w = _mm256_permute4x64_epi64(_mm256_packs_epi32(bf16_lanes(_mm256_mul_ps(normal, sv)),
                                                                  bf16_lanes(_mm256_mul_ps(subnormal, sv))), 0xD8);
    const __m256i split = _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15, 0, 2, 4, 6, 8, 10, 12,
                                           14, 1, 3, 5, 7, 9, 11, 13, 15);
    const __m256i bytes = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(w, split), 0xD8);
    const __m256i tlo = _mm256_permute2x128_si256(bytes, bytes, 0x00), thi = _mm256_permute2x128_si256(bytes, bytes, 0x11);
    const __m256i zero = _mm256_setzero_si256(), low7 = _mm256_set1_epi8(0x7F), sign = _mm256_set1_epi8((char)0x80);
    const __m256i fifteen = _mm256_set1_epi8(15), seven = _mm256_set1_epi8(7), eight = _mm256_set1_epi8(8);
    const __m256i one = _mm256_set1_epi8(1);
    __m256i nan = zero;
    int64_t q = 0;
    for (; q + 32 <= n; q += 32) {
        const __m256i x = _mm256_loadu_si256((const __m256i *)(c + q));
        nan = _mm256_or_si256(nan, _mm256_cmpeq_epi8(_mm256_and_si256(x, low7), low7));
        const __m256i e = _mm256_and_si256(_mm256_srli_epi16(x, 3), fifteen);
        const __m256i idx = _mm256_or_si256(_mm256_and_si256(x, seven), _mm256_and_si256(_mm256_cmpeq_epi8(e, zero), eight));
        const __m256i lo = _mm256_shuffle_epi8(tlo, idx);
        const __m256i hi = _mm256_xor_si256(_mm256_shuffle_epi8(thi, idx), _mm256_and_si256(x, sign));
        const __m256i up = _mm256_subs_epu8(e, one); /* e - 1, subnormals 0 */
        const __m256i w0 = _mm256_add_epi16(_mm256_unpacklo_epi8(lo, hi), _mm256_slli_epi16(_mm256_unpacklo_epi8(up, zero), 7));
        const __m256i w1 = _mm256_add_epi16(_mm256_unpackhi_epi8(lo, hi), _mm256_slli_epi16(_mm256_unpackhi_epi8(up, zero), 7));
        _mm256_storeu_si256((__m256i *)(o + q), _mm256_permute2x128_si256(w0, w1, 0x20));
        _mm256_storeu_si256((__m256i *)(o + q + 16), _mm256_permute2x128_si256(w0, w1, 0x31));
    }
    const int bad = !_mm256_testz_si256(nan, nan);
    return bad | (q < n ? group_bf16(c + q, o + q, n - q, s) : 0);
}

/* the first row holding a NaN code (written whole, its NaN codes' outputs finite: the caller refuses it), or -1 */
#define SCALED(NAME, T, GROUP)                                                                          \
    AVX2 static int64_t NAME(const uint8_t *restrict codes, int64_t code_stride, const float *restrict scales, \
                             int64_t scale_stride, T *restrict out, int64_t out_stride, int64_t rows, int64_t cols, \
                             int64_t b0, int64_t group) {                                               \
        for (int64_t i = 0; i < rows; i++) {                                                            \
            const float *restrict s = scales + (i / b0) * scale_stride;                                 \
            const uint8_t *restrict c = codes + i * code_stride;                                        \
            T *restrict o = out + i * out_stride;                                                       \
            int nan = 0;                                                                                \
            for (int64_t j = 0, g = 0; j < cols; j += group, g++)                                       \
                nan |= GROUP(c + j, o + j, cols - j < group ? cols - j : group, s[g]);                  \
            if (nan) return i;                                                                          \
        }                                                                                               \
        return -1;                                                                                      \
    }

SCALED(scaled_bf16, uint16_t, group_bf16_lut)
SCALED(scaled_bf16_f16, uint16_t, group_bf16_f16)
SCALED(scaled_f32, uint32_t, group_f32)
SCALED(scaled_f32_f16, uint32_t, group_f32_f16)
#endif

#ifdef FP8S_X86
/* 4-bit codes (two a byte, low nibble first, offset binary q + 8) with a scale and an offset-binary zero code per
 * group of `group` values (a multiple of 32) -> BF16: each group's 16 outputs ROUND((q - z) * s) made in two
 * float32 vectors (one fp32 product, exact for 4-bit differences; rounded to fp16 first where `f16`, a library
 * multiplying in fp16: window.tables' entries), then each 16 bytes (32 values) four byte shuffles of them, the
 * low and high bytes of the even and the odd values, interleaved. kernels/window.py's nibble windows, a lookup
 * of a group's 16 entries instead of a gather from thousands of scales' tables. */
AVX2 static void int4_lut_bf16(const uint8_t *restrict codes, int64_t code_stride, const float *restrict scales,
                               int64_t scale_stride, const int32_t *restrict zeros, int64_t zero_stride, int64_t rows,
                               int64_t groups, int64_t group, int32_t f16, uint16_t *restrict out, int64_t out_stride) {
    const __m256 q_lo = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7), q_hi = _mm256_setr_ps(8, 9, 10, 11, 12, 13, 14, 15);
    const __m256i split = _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15, 0, 2, 4, 6, 8, 10, 12,
                                           14, 1, 3, 5, 7, 9, 11, 13, 15);
    const __m128i fifteen = _mm_set1_epi8(15);
    for (int64_t i = 0; i < rows; i++) {
        const float *restrict s = scales + i * scale_stride;
        const int32_t *restrict z = zeros + i * zero_stride;
        const uint8_t *restrict c = codes + i * code_stride;
        uint16_t *restrict o = out + i * out_stride;
        for (int64_t g = 0; g < groups; g++) {
            const __m256 zv = _mm256_set1_ps((float)z[g]), sv = _mm256_set1_ps(s[g]);
            __m256 a = _mm256_mul_ps(_mm256_sub_ps(q_lo, zv), sv), b = _mm256_mul_ps(_mm256_sub_ps(q_hi, zv), sv);
            if (f16) a = via_f16(a), b = via_f16(b);
            const __m256i w = _mm256_permute4x64_epi64(_mm256_packs_epi32(bf16_lanes(a), bf16_lanes(b)), 0xD8);
            const __m256i bytes = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(w, split), 0xD8);
            const __m128i tlo = _mm256_castsi256_si128(bytes), thi = _mm256_extracti128_si256(bytes, 1);
            const uint8_t *restrict cb = c + g * (group / 2);
            uint16_t *restrict ob = o + g * group;
            for (int64_t k = 0; k < group / 2; k += 16) {
                const __m128i x = _mm_loadu_si128((const __m128i *)(cb + k));
                const __m128i lo = _mm_and_si128(x, fifteen), hi = _mm_and_si128(_mm_srli_epi16(x, 4), fifteen);
                const __m128i lo_l = _mm_shuffle_epi8(tlo, lo), lo_h = _mm_shuffle_epi8(thi, lo);
                const __m128i hi_l = _mm_shuffle_epi8(tlo, hi), hi_h = _mm_shuffle_epi8(thi, hi);
                /* even values (low nibbles) and odd ones as words, then interleaved in the codes' order */
                const __m128i e0 = _mm_unpacklo_epi8(lo_l, lo_h), e1 = _mm_unpackhi_epi8(lo_l, lo_h);
                const __m128i d0 = _mm_unpacklo_epi8(hi_l, hi_h), d1 = _mm_unpackhi_epi8(hi_l, hi_h);
                _mm_storeu_si128((__m128i *)(ob + 2 * k), _mm_unpacklo_epi16(e0, d0));
                _mm_storeu_si128((__m128i *)(ob + 2 * k + 8), _mm_unpackhi_epi16(e0, d0));
                _mm_storeu_si128((__m128i *)(ob + 2 * k + 16), _mm_unpacklo_epi16(e1, d1));
                _mm_storeu_si128((__m128i *)(ob + 2 * k + 24), _mm_unpackhi_epi16(e1, d1));
            }
        }
    }
}
#endif

/* 0 where it ran, -2 where this build or CPU has no AVX2 and F16C loop (nothing written) */
int64_t ckpttool_int4_lut_bf16(const uint8_t *restrict codes, int64_t code_stride, const float *restrict scales,
                               int64_t scale_stride, const int32_t *restrict zeros, int64_t zero_stride, int64_t rows,
                               int64_t groups, int64_t group, int32_t f16, uint16_t *restrict out, int64_t out_stride) {
#ifdef FP8S_X86
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("f16c")) return -2;
    const unsigned int csr = _mm_getcsr();
    _mm_setcsr(csr & ~0xE040u);
    int4_lut_bf16(codes, code_stride, scales, scale_stride, zeros, zero_stride, rows, groups, group, f16, out,
                  out_stride);
    _mm_setcsr(csr);
    return 0;
#else
    (void)codes, (void)code_stride, (void)scales, (void)scale_stride, (void)zeros, (void)zero_stride, (void)rows;
    (void)groups, (void)group, (void)f16, (void)out, (void)out_stride;
    return -2;
#endif
}

/* The first row holding a NaN code, -1 where there is none, or -2 where this build or CPU has no AVX2 and F16C loop
 * (nothing written: the caller gathers from tables) */
int64_t ckpttool_fp8_scaled(const uint8_t *restrict codes, int64_t code_stride, const float *restrict scales,
                            int64_t scale_stride, void *restrict out, int64_t out_stride, int64_t rows, int64_t cols,
                            int64_t b0, int64_t group, int32_t kind) {
#ifdef FP8S_X86
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("f16c")) return -2;
    const unsigned int csr = _mm_getcsr();
    _mm_setcsr(csr & ~0xE040u); /* FTZ (bit 15) and DAZ (bit 6) off, round to nearest (bits 13-14 zero) */
    int64_t bad;
    if (kind == 0) bad = scaled_bf16(codes, code_stride, scales, scale_stride, out, out_stride, rows, cols, b0, group);
    else if (kind == 1)
        bad = scaled_bf16_f16(codes, code_stride, scales, scale_stride, out, out_stride, rows, cols, b0, group);
    else if (kind == 2) bad = scaled_f32(codes, code_stride, scales, scale_stride, out, out_stride, rows, cols, b0, group);
    else bad = scaled_f32_f16(codes, code_stride, scales, scale_stride, out, out_stride, rows, cols, b0, group);
    _mm_setcsr(csr);
    return bad;
#else
    (void)codes, (void)code_stride, (void)scales, (void)scale_stride, (void)out, (void)out_stride, (void)rows;
    (void)cols, (void)b0, (void)group, (void)kind;
    return -2;
#endif
}
