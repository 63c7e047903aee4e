/* Integer codes with per-group scales and zero points, in C: kernels/window.py's loops (its docstring says
 * what they compute and why), the same bits as its numba and numpy forms. kernels/native.py checks every
 * shape, dtype, stride and index range first; row strides are in elements.
 *
 *   bytes:   out[i, j] = tables[offsets[i, j / group] + codes[i, j]]   (int8: codes[i, j] ^ 0x80)
 *   nibbles: out[i, 2k] = tables[offsets[i, 2k / group] + (codes[i, k] & 15)], out[i, 2k + 1] the high nibble
 *   g_idx:   the same with offsets[i, g_idx[j]]: each column's group read from a table (GPTQ's act-order)
 */
#include <stdint.h>
#include <string.h>

#include "bf16.h"

#if defined(__GNUC__) || defined(__clang__)
#define PREFETCH(p) __builtin_prefetch(p)
#else
#define PREFETCH(p) ((void)0)
#endif


/* One group's codes in blocks of a constant length (32 bytes, or 16 bytes of nibbles), whatever the group size:
 * with a constant trip count gcc unrolls the block and combines its table words into 16-byte stores; a group-sized
 * loop of another length ran at half the speed (gcc 12, x86-64 baseline: bench/RESULTS.md). */
#define RUN_BLOCKS(T, LEN, STEP, BODY)                                                                     \
    {                                                                                                   \
        int64_t k = 0;                                                                                  \
        for (; k + (STEP) <= (LEN); k += (STEP))                                                        \
            for (int64_t q = k; q < k + (STEP); q++) BODY;                                              \
        for (; k < (LEN); k++) {                                                                        \
            const int64_t q = k;                                                                        \
            BODY;                                                                                       \
        }                                                                                               \
    }

/* FLIP a constant: a runtime one cost two instructions an element (an XOR and a zero extension) */
/* FLIP a constant: a runtime one cost two instructions an element (an XOR and a zero extension). int8 codes flip
 * their sign bit eight at a time in a 64-bit word: gcc's vector XOR of 16 codes, each code then spilled and reloaded
 * to index the table, ran at 0.6-0.7x the loop without it (gcc 12, x86-64 baseline, the 2-core box). */
#define FLIP8(T, FLIP, q, dst, src, tb)                                                                   \
    {                                                                                                   \
        uint64_t v;                                                                                     \
        memcpy(&v, (src) + (q), 8);                                                                     \
        v ^= 0x0101010101010101ULL * (uint64_t)(FLIP);                                                  \
        for (int b = 0; b < 8; b++) (dst)[(q) + b] = (tb)[(uint8_t)(v >> (8 * b))];                     \
    }

#define BYTES(NAME, T, FLIP)                                                                            \
    void NAME(const uint8_t *restrict codes, int64_t code_stride, const int32_t *restrict offsets,     \
              int64_t off_stride, const T *restrict tables, T *restrict out, int64_t out_stride,       \
              int64_t rows, int64_t cols, int64_t group) {                                              \
        const int64_t full = cols / group;                                                              \
        for (int64_t i = 0; i < rows; i++) {                                                            \
            const int32_t *restrict w = offsets + i * off_stride;                                       \
            const uint8_t *restrict c = codes + i * code_stride;                                        \
            T *restrict o = out + i * out_stride;                                                       \
            for (int64_t g = 0; g < full; g++) {                                                        \
                const T *restrict tb = tables + w[g];                                                   \
                const uint8_t *restrict cb = c + g * group;                                             \
                T *restrict ob = o + g * group;                                                         \
                if (FLIP) {                                                                             \
                    int64_t q = 0;                                                                      \
                    for (; q + 8 <= group; q += 8) FLIP8(T, FLIP, q, ob, cb, tb)                        \
                    for (; q < group; q++) ob[q] = tb[(uint8_t)(cb[q] ^ (FLIP))];                       \
                } else if (group == 32) /* the whole group as one constant block */                     \
                    for (int64_t q = 0; q < 32; q++) ob[q] = tb[cb[q]];                                 \
                else                                                                                    \
                    RUN_BLOCKS(T, group, 32, ob[q] = tb[cb[q]])                                         \
            }                                                                                           \
            for (int64_t j = full * group; j < cols; j++) o[j] = tables[w[full] + (uint8_t)(c[j] ^ (FLIP))]; \
        }                                                                                               \
    }

/* group is even: both nibbles of a byte are in one group */
#define NIBBLES(NAME, T)                                                                                \
    void NAME(const uint8_t *restrict codes, int64_t code_stride, const int32_t *restrict offsets,     \
              int64_t off_stride, const T *restrict tables, T *restrict out, int64_t out_stride,       \
              int64_t rows, int64_t width, int64_t group) {                                             \
        const int64_t half = group / 2, full = width / half;                                            \
        for (int64_t i = 0; i < rows; i++) {                                                            \
            const int32_t *restrict w = offsets + i * off_stride;                                       \
            const uint8_t *restrict c = codes + i * code_stride;                                        \
            T *restrict o = out + i * out_stride;                                                       \
            for (int64_t g = 0; g < full; g++) {                                                        \
                /* a group's window is under 64 bytes, and thousands of scales' windows leave L1: fetch   \
                 * four groups ahead (0.65x -> 0.74x the FP8 gather at 6000 scales, groups of 32) */       \
                if (g + 4 < full) PREFETCH(tables + w[g + 4]);                                        \
                const T *restrict tb = tables + w[g];                                                   \
                const uint8_t *restrict cb = c + g * half;                                              \
                T *restrict ob = o + g * group;                                                         \
                if (half == 8) /* groups of 16 and 32 values: the whole group as one constant block */  \
                    for (int64_t q = 0; q < 8; q++) ob[2 * q] = tb[cb[q] & 15], ob[2 * q + 1] = tb[cb[q] >> 4]; \
                else if (half == 16)                                                                    \
                    for (int64_t q = 0; q < 16; q++) ob[2 * q] = tb[cb[q] & 15], ob[2 * q + 1] = tb[cb[q] >> 4]; \
                else                                                                                    \
                    RUN_BLOCKS(T, half, 16, (ob[2 * q] = tb[cb[q] & 15], ob[2 * q + 1] = tb[cb[q] >> 4])) \
            }                                                                                           \
            for (int64_t k = full * half; k < width; k++) {                                             \
                o[2 * k] = tables[w[full] + (c[k] & 15)];                                               \
                o[2 * k + 1] = tables[w[full] + (c[k] >> 4)];                                           \
            }                                                                                           \
        }                                                                                               \
    }

/* With a group index the group changes column by column: nibbles four rows at a time, so that each column's group is read
 * once for four outputs */
#define ROW_POINTERS(T, R)                                                                              \
    const int32_t *restrict w##R = offsets + (i + R) * off_stride;                                      \
    const uint8_t *restrict c##R = codes + (i + R) * code_stride;                                       \
    T *restrict o##R = out + (i + R) * out_stride;

#define BYTE_OUT(R, FLIP) o##R[j] = tables[w##R[g] + (uint8_t)(c##R[j] ^ (FLIP))];

/* Bytes with a group index: one row at a time. Four rows at a time held their 64 tables of 256 entries (32 KiB, the
 * whole L1) at once: the 8-bit act-order row ran 0.39x FP8 block per output byte, one row 0.51-0.53x (the 2-core
 * box; visiting the columns group by group, 0.43x) */
#define BYTES_GIDX(NAME, T, FLIP)                                                                       \
    void NAME(const uint8_t *restrict codes, int64_t code_stride, const int32_t *restrict offsets,     \
              int64_t off_stride, const int32_t *restrict gidx, const T *restrict tables, T *restrict out, \
              int64_t out_stride, int64_t rows, int64_t cols) {                                         \
        for (int64_t i = 0; i < rows; i++) {                                                            \
            ROW_POINTERS(T, 0)                                                                          \
            for (int64_t j = 0; j < cols; j++) {                                                        \
                const int32_t g = gidx[j];                                                              \
                BYTE_OUT(0, FLIP)                                                                       \
            }                                                                                           \
        }                                                                                               \
    }

#define NIBBLE_OUT(R)                                                                                   \
    {                                                                                                   \
        const uint8_t b = c##R[k];                                                                      \
        o##R[2 * k] = tables[w##R[ga] + (b & 15)];                                                      \
        o##R[2 * k + 1] = tables[w##R[gb] + (b >> 4)];                                                  \
    }

#define NIBBLES_GIDX(NAME, T)                                                                           \
    void NAME(const uint8_t *restrict codes, int64_t code_stride, const int32_t *restrict offsets,     \
              int64_t off_stride, const int32_t *restrict gidx, const T *restrict tables, T *restrict out, \
              int64_t out_stride, int64_t rows, int64_t width) {                                        \
        int64_t i = 0;                                                                                  \
        for (; i + 4 <= rows; i += 4) {                                                                 \
            ROW_POINTERS(T, 0) ROW_POINTERS(T, 1) ROW_POINTERS(T, 2) ROW_POINTERS(T, 3)                 \
            for (int64_t k = 0; k < width; k++) {                                                       \
                const int32_t ga = gidx[2 * k], gb = gidx[2 * k + 1];                                   \
                NIBBLE_OUT(0) NIBBLE_OUT(1) NIBBLE_OUT(2) NIBBLE_OUT(3)                                 \
            }                                                                                           \
        }                                                                                               \
        for (; i < rows; i++) {                                                                         \
            ROW_POINTERS(T, 0)                                                                          \
            for (int64_t k = 0; k < width; k++) {                                                       \
                const int32_t ga = gidx[2 * k], gb = gidx[2 * k + 1];                                   \
                NIBBLE_OUT(0)                                                                           \
            }                                                                                           \
        }                                                                                               \
    }

BYTES(ckpttool_window_bytes_u16, uint16_t, 0)
BYTES(ckpttool_window_bytes_u32, uint32_t, 0)
BYTES(ckpttool_window_int8_u16, uint16_t, 0x80)
BYTES(ckpttool_window_int8_u32, uint32_t, 0x80)
NIBBLES(ckpttool_window_nibbles_u16, uint16_t)
NIBBLES(ckpttool_window_nibbles_u32, uint32_t)
BYTES_GIDX(ckpttool_window_bytes_gidx_u16, uint16_t, 0)
BYTES_GIDX(ckpttool_window_bytes_gidx_u32, uint32_t, 0)
BYTES_GIDX(ckpttool_window_int8_gidx_u16, uint16_t, 0x80)
BYTES_GIDX(ckpttool_window_int8_gidx_u32, uint32_t, 0x80)
NIBBLES_GIDX(ckpttool_window_nibbles_gidx_u16, uint16_t)
NIBBLES_GIDX(ckpttool_window_nibbles_gidx_u32, uint32_t)

/* float32 -> float16 bits, round to nearest even (numpy's and torch's conversion): the normal range by rounding away
 * 13 mantissa bits, subnormals (multiples of 2**-24) by rounding the significand, 65520 and up to infinity; a NaN
 * stays a NaN (quiet). */
static inline uint16_t f16_bits(float f) {
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    const uint32_t sign = (x >> 16) & 0x8000u, ax = x & 0x7FFFFFFFu;
    if (ax > 0x7F800000u) return (uint16_t)(sign | 0x7E00u | ((ax >> 13) & 0x3FFu));
    if (ax >= 0x477FF000u) return (uint16_t)(sign | 0x7C00u);
    if (ax >= 0x38800000u) {
        const uint32_t r = ax - 0x38000000u;
        return (uint16_t)(sign | ((r + 0xFFFu + ((r >> 13) & 1u)) >> 13));
    }
    if (ax <= 0x33000000u) return (uint16_t)sign; /* at most 2**-25, half the smallest subnormal: even, zero */
    const uint32_t shift = 126u - (ax >> 23), m = (ax & 0x7FFFFFu) | 0x800000u;
    const uint32_t rem = m & ((1u << shift) - 1u), half = 1u << (shift - 1u);
    uint32_t q = m >> shift;
    if (rem > half || (rem == half && (q & 1u))) q++;
    return (uint16_t)(sign | q);
}

/* A finite float32 rounded to float16's precision (nearest even), kept in float32, without branches: adding and
 * subtracting c, a power of two 13 binades above x's (at least 2**-1: float16's subnormals are multiples of 2**-24),
 * of x's sign, rounds x to c's ulp; the sign put back keeps -0.0; 65520 and up become infinity; a NaN stays one
 * (a NaN scale must reach the kernels' NaN test, not become an infinity). */
static inline float f16_rounded(float x) {
    uint32_t u, cu, ru;
    memcpy(&u, &x, sizeof u);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) { /* a NaN stays a NaN, as f16_bits then back to float32 make it */
        ru = (u & 0x80000000u) | 0x7F800000u | ((0x200u | ((u >> 13) & 0x3FFu)) << 13);
        float r;
        memcpy(&r, &ru, sizeof r);
        return r;
    }
    const uint32_t e = u & 0x7F800000u;
    cu = ((e > 0x38800000u ? e : 0x38800000u) + (13u << 23)) | (u & 0x80000000u);
    float c, r;
    memcpy(&c, &cu, sizeof c);
    r = (x + c) - c;
    memcpy(&ru, &r, sizeof ru);
    ru |= u & 0x80000000u;
    if ((ru & 0x7FFFFFFFu) > 0x477FE000u) ru = (u & 0x80000000u) | 0x7F800000u; /* past 65504 */
    memcpy(&r, &ru, sizeof r);
    return r;
}

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define WINDOW_F16C 1

/* ckpttool_f16_tables' rows eight entries at a time with F16C's conversion (nearest even, subnormals, overflow to
 * infinity: f16_bits' and f16_rounded's results on every finite product); the tail of a row one at a time. A table
 * per distinct F16 scale of a per-channel FP8 row took 0.82 ms of its 4.35 (7168 rows, 3116 scales) one at a time.
 * MXCSR is cleared of FTZ and DAZ while it runs (f16_bits rounds subnormals as IEEE does). */
__attribute__((target("avx2,f16c"))) static void f16_tables_f16c(const float *restrict values, int64_t n,
                                                                  const float *restrict scales, int64_t m, void *out,
                                                                  int32_t kind) {
    const unsigned int csr = _mm_getcsr();
    _mm_setcsr(csr & ~0xE040u);
    for (int64_t i = 0; i < m; i++) {
        const __m256 s = _mm256_set1_ps(scales[i]);
        int64_t k = 0;
        for (; k + 8 <= n; k += 8) {
            const __m128i h = _mm256_cvtps_ph(_mm256_mul_ps(_mm256_loadu_ps(values + k), s), _MM_FROUND_TO_NEAREST_INT);
            if (kind == 0) {
                _mm_storeu_si128((__m128i *)((uint16_t *)out + i * n + k), h);
                continue;
            }
            const __m256 f = _mm256_cvtph_ps(h);
            if (kind == 2) {
                _mm256_storeu_ps((float *)out + i * n + k, f);
                continue;
            }
            /* bf16 bits, nearest even (bf16.h without its NaN branch: the products are finite), as int16 lanes */
            const __m256i u = _mm256_castps_si256(f);
            const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
            const __m256i r = _mm256_srai_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb), 16);
            _mm_storeu_si128((__m128i *)((uint16_t *)out + i * n + k),
                             _mm_packs_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
        }
        for (; k < n; k++) {
            const float p = values[k] * scales[i];
            if (kind == 0) ((uint16_t *)out)[i * n + k] = f16_bits(p);
            else if (kind == 1) ((uint16_t *)out)[i * n + k] = (uint16_t)ckpttool_bf16_bits(f16_rounded(p));
            else {
                const float v = f16_rounded(p);
                memcpy((uint32_t *)out + i * n + k, &v, sizeof v);
            }
        }
    }
    _mm_setcsr(csr);
}
#endif

/* out[i, k] = the fp16 product values[k] * scales[i] (a library multiplying in fp16: fp8_cpu.library_tables), then
 * in the output's bits: kind 0 F16, 1 BF16 (uint16), 2 F32 (uint32). `simd` 2 or more: F16C's loop where the CPU has
 * AVX2 and F16C (CKPTTOOL_SIMD caps it, so the tests run both) and every scale is finite and every value finite,
 * infinite or a NaN without payload (an FP8 format's NaN codes), so that a NaN product has no payload either and
 * both loops give it the same bits; else the scalar loop. */
void ckpttool_f16_tables(const float *restrict values, int64_t n, const float *restrict scales, int64_t m, void *out,
                         int32_t kind, int32_t simd) {
#ifdef WINDOW_F16C
    if (simd >= 2 && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c")) {
        int plain = 1; /* finite scales; values finite, infinite or the payload-free NaN (an FP8 format's) */
        for (int64_t k = 0; k < n; k++) {
            uint32_t u;
            memcpy(&u, values + k, sizeof u);
            plain &= (u & 0x7FFFFFFFu) <= 0x7F800000u || (u & 0x7FFFFFFFu) == 0x7FC00000u;
        }
        for (int64_t i = 0; i < m; i++) plain &= scales[i] - scales[i] == 0.0f;
        if (plain) {
            f16_tables_f16c(values, n, scales, m, out, kind);
            return;
        }
    }
#endif
    (void)simd;
    for (int64_t i = 0; i < m; i++) {
        const float s = scales[i];
        if (kind == 0)
            for (int64_t k = 0; k < n; k++) ((uint16_t *)out)[i * n + k] = f16_bits(values[k] * s);
        else if (kind == 1)
            for (int64_t k = 0; k < n; k++)
                ((uint16_t *)out)[i * n + k] = (uint16_t)ckpttool_bf16_bits(f16_rounded(values[k] * s));
        else
            for (int64_t k = 0; k < n; k++) {
                const float v = f16_rounded(values[k] * s);
                memcpy((uint32_t *)out + i * n + k, &v, sizeof v);
            }
    }
}
