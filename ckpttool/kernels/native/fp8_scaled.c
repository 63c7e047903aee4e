/* FP8 e4m3 codes times float32 scales computed per element, in C with AVX2 (kernels/fp8_cpu.dequant_scaled says
 * when it is used): out[i, j] = round(fp32(code[i, j]) * scale[i / b0, j / group]), the product and its rounding
 * as fp8_cpu.library_tables makes every table entry, so the same bits as the table gathers.
 *
 * Where each group of a row has its own scale (FP8 1x128 or 1x32 groups, compressed-tensors' groups, F32 scales
 * that are all distinct), a 256-entry table per scale costs more than the elements it serves; eight elements at a
 * time in AVX2 lanes cost less than one table gather per element. A code's value: its sign and low seven bits
 * placed in a float32's sign and bits 20..26 are the value times 2**-120 (e4m3's subnormals are float32
 * subnormals there), so one exact multiply by 2**120 decodes every code; the caller has refused NaN codes and
 * checked the scales finite, so no product is a NaN (an infinity rounds as one). The loops clear flush-to-zero
 * and denormals-are-zero and set nearest rounding while they run (the IEEE arithmetic the tables do), then put
 * the caller's MXCSR back. kernels/native.py checks every shape, dtype and stride first; strides in elements.
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

SCALED(scaled_bf16, uint16_t, group_bf16)
SCALED(scaled_bf16_f16, uint16_t, group_bf16_f16)
SCALED(scaled_f32, uint32_t, group_f32)
SCALED(scaled_f32_f16, uint32_t, group_f32_f16)
#endif

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
