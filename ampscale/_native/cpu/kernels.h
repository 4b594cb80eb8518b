/*
 * ampscale's fused overflow check + unscale kernels, shared by every host entry point: the
 * NumPy extension (`_numpy.c`) and the XLA FFI handler for JAX on the CPU (`jax_ffi.cc`).
 * Plain C (also valid C++), no Python or XLA types; every function is static, so each entry
 * point compiles its own copy of the same source.
 *
 * A kernel reads every element once, multiplies it by the inverse scale in float32 (float64 for
 * double arrays), rounds it to nearest-even in its own dtype, writes it back once and tests the
 * exponent bits of the value stored for inf/nan (exact: no sum or norm that a finite input could
 * overflow). `run_all` splits the concatenation of many buffers by element count across
 * threads; `plan_work` and `run_work_as_caller` are its parts, for entry points that bring their
 * own threads.
 */
#ifndef AMPSCALE_KERNELS_H
#define AMPSCALE_KERNELS_H

#include <stddef.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if !defined(_WIN32)
#include <pthread.h>
#define AMPSCALE_THREADS 1
#else
#define AMPSCALE_THREADS 0
#endif

#if defined(AMPSCALE_EMULATE_AVX512)
/* Test builds only (tests/test_native_emulated.py): every SIMD kernel, the AVX-512 ones included,
 * compiled with SIMDe's portable versions of the intrinsics, so that a CPU without AVX-512 runs
 * and tests them. Never a release build: emulated intrinsics are many times slower. */
#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>
#include <simde/x86/f16c.h>
#include <simde/x86/fma.h>
#define AMPSCALE_X86_DISPATCH 1
#define AMPSCALE_CPU_HAS(feature) 1
#define AVX2_TARGET
#define AVX512_TARGET
typedef simde__mmask8 __mmask8;
typedef simde__mmask16 __mmask16;
typedef simde__mmask32 __mmask32;
#ifndef _MM_FROUND_NO_EXC
#define _MM_FROUND_NO_EXC SIMDE_MM_FROUND_NO_EXC
#endif
#elif (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define AMPSCALE_X86_DISPATCH 1
#define AMPSCALE_CPU_HAS(feature) __builtin_cpu_supports(feature)
#define AVX2_TARGET __attribute__((target("avx2,fma,f16c")))
#define AVX512_TARGET __attribute__((target("avx512f,avx512bw,avx2,fma,f16c")))
#else
#define AMPSCALE_X86_DISPATCH 0
#endif

enum { KIND_F16 = 0, KIND_BF16 = 1, KIND_F32 = 2, KIND_F64 = 3, KIND_COUNT = 4 };
static const ptrdiff_t kind_size[KIND_COUNT] = {2, 2, 4, 8};

/* A kernel checks elements [0, n) of `data`, unscales them when `multiply`, and returns 1 if any
 * element was inf or nan. */
typedef int (*kernel_fn)(void *data, ptrdiff_t n, float inv_scale, int multiply);

/* ---------------------------------------------------------------- scalar conversions */

static inline uint32_t f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static inline float bits_f32(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* IEEE half -> float, exact for every input. Subnormal halves go through an exact int->float
 * conversion so that no subnormal float arithmetic is needed (correct even with DAZ/FTZ set). */
static inline float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t em = h & 0x7fffu;
    float magnitude;
    if (em >= 0x7c00u) {
        magnitude = bits_f32((em << 13) | 0x7f800000u); /* inf or nan, payload kept */
    } else if (em >= 0x0400u) {
        magnitude = bits_f32((em << 13) + 0x38000000u); /* normal: rebias exponent 15 -> 127 */
    } else {
        magnitude = (float)em * 0x1p-24f; /* subnormal or zero: exact */
    }
    return bits_f32(f32_bits(magnitude) | sign);
}

/* float -> IEEE half, round to nearest even; overflow gives inf, nan stays a quiet nan. */
static inline uint16_t float_to_half(float f) {
    uint32_t x = f32_bits(f);
    uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
    uint32_t ax = x & 0x7fffffffu;
    if (ax > 0x7f800000u) {
        return (uint16_t)(sign | 0x7e00u | ((ax >> 13) & 0x3ffu));
    }
    if (ax >= 0x477ff000u) { /* >= 65520 rounds to inf */
        return (uint16_t)(sign | 0x7c00u);
    }
    if (ax < 0x38800000u) {
        /* The result is a half subnormal or zero: adding 0.5f makes the float unit rounding
         * land exactly on the half subnormal step 2^-24 (round to nearest even). */
        float t = bits_f32(ax) + 0.5f;
        return (uint16_t)(sign | (uint16_t)(f32_bits(t) - 0x3f000000u));
    }
    uint32_t odd = (ax >> 13) & 1u;
    ax += 0xc8000fffu + odd; /* rebias 127 -> 15 and add the rounding bias */
    return (uint16_t)(sign | (uint16_t)(ax >> 13));
}

static inline float bf16_to_float(uint16_t b) { return bits_f32((uint32_t)b << 16); }

/* Same rounding as c10::BFloat16 and ml_dtypes: nearest even, nan -> canonical quiet nan. */
static inline uint16_t float_to_bf16(float f) {
    uint32_t x = f32_bits(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) {
        return (uint16_t)(((x >> 16) & 0x8000u) | 0x7fc0u);
    }
    return (uint16_t)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

#if defined(AMPSCALE_EMULATE_AVX512)
/* The few AVX-512 intrinsics SIMDe 0.7 lacks, lane by lane (conversions as the instructions do
 * them: half <-> float round to nearest even, 32 -> 16 bits truncate). */
#define EMULATED_LANES(type, name, count, src) \
    type name[count];                          \
    memcpy(name, &(src), sizeof name)
static inline __m512 emulated_cvtph_ps(__m256i h) {
    EMULATED_LANES(uint16_t, in, 16, h);
    float out[16];
    for (int k = 0; k < 16; k++) out[k] = half_to_float(in[k]);
    __m512 r;
    memcpy(&r, out, sizeof out);
    return r;
}
static inline __m256i emulated_cvtps_ph(__m512 f, int rounding) {
    (void)rounding;
    EMULATED_LANES(float, in, 16, f);
    uint16_t out[16];
    for (int k = 0; k < 16; k++) out[k] = float_to_half(in[k]);
    __m256i r;
    memcpy(&r, out, sizeof out);
    return r;
}
static inline __mmask32 emulated_cmpeq_epi16_mask(__m512i a, __m512i b) {
    EMULATED_LANES(uint16_t, x, 32, a);
    EMULATED_LANES(uint16_t, y, 32, b);
    __mmask32 m = 0;
    for (int k = 0; k < 32; k++) m |= (__mmask32)(x[k] == y[k]) << k;
    return m;
}
static inline __m512i emulated_cvtepu16_epi32(__m256i a) {
    EMULATED_LANES(uint16_t, in, 16, a);
    uint32_t out[16];
    for (int k = 0; k < 16; k++) out[k] = in[k];
    __m512i r;
    memcpy(&r, out, sizeof out);
    return r;
}
static inline __m256i emulated_cvtepi32_epi16(__m512i a) {
    EMULATED_LANES(uint32_t, in, 16, a);
    uint16_t out[16];
    for (int k = 0; k < 16; k++) out[k] = (uint16_t)in[k];
    __m256i r;
    memcpy(&r, out, sizeof out);
    return r;
}
static inline int emulated_reduce_add_epi32(__m512i a) {
    EMULATED_LANES(uint32_t, in, 16, a);
    uint32_t sum = 0;
    for (int k = 0; k < 16; k++) sum += in[k];
    return (int)sum;
}
/* SIMDe 0.7.4's testz answers 1 for some non-zero operands: replaced too. */
static inline int emulated_testz_si128(__m128i a, __m128i b) {
    EMULATED_LANES(uint64_t, x, 2, a);
    EMULATED_LANES(uint64_t, y, 2, b);
    return ((x[0] & y[0]) | (x[1] & y[1])) == 0;
}
static inline int emulated_testz_si256(__m256i a, __m256i b) {
    EMULATED_LANES(uint64_t, x, 4, a);
    EMULATED_LANES(uint64_t, y, 4, b);
    return ((x[0] & y[0]) | (x[1] & y[1]) | (x[2] & y[2]) | (x[3] & y[3])) == 0;
}
static inline __mmask16 emulated_testn_epi32_mask(__m512i a, __m512i b) {
    EMULATED_LANES(uint32_t, x, 16, a);
    EMULATED_LANES(uint32_t, y, 16, b);
    __mmask16 m = 0;
    for (int k = 0; k < 16; k++) m |= (__mmask16)(((x[k] & y[k]) == 0) << k);
    return m;
}
static inline __mmask32 emulated_testn_epi16_mask(__m512i a, __m512i b) {
    EMULATED_LANES(uint16_t, x, 32, a);
    EMULATED_LANES(uint16_t, y, 32, b);
    __mmask32 m = 0;
    for (int k = 0; k < 32; k++) m |= (__mmask32)(((x[k] & y[k]) == 0) ? 1u << k : 0u);
    return m;
}
#undef _mm_testz_si128
#undef _mm256_testz_si256
#undef _mm512_testn_epi32_mask
#undef _mm512_testn_epi16_mask
#define _mm_testz_si128 emulated_testz_si128
#define _mm256_testz_si256 emulated_testz_si256
#define _mm512_cvtph_ps emulated_cvtph_ps
#define _mm512_cvtps_ph emulated_cvtps_ph
#define _mm512_cmpeq_epi16_mask emulated_cmpeq_epi16_mask
#define _mm512_cvtepu16_epi32 emulated_cvtepu16_epi32
#define _mm512_cvtepi32_epi16 emulated_cvtepi32_epi16
#define _mm512_reduce_add_epi32 emulated_reduce_add_epi32
#define _mm512_testn_epi32_mask emulated_testn_epi32_mask
#define _mm512_testn_epi16_mask emulated_testn_epi16_mask
#endif

/* ---------------------------------------------------------------- portable kernels
 * Written so that compilers vectorise them: the flag is an OR of comparisons, no early exit. */

#define DEFINE_PORTABLE_KERNELS(SUFFIX, ATTRIBUTES)                                              \
    ATTRIBUTES static int kernel_f32_##SUFFIX(void *data, ptrdiff_t n, float inv, int multiply) { \
        float *x = (float *)data;                                                                \
        uint32_t bad = 0;                                                                        \
        if (multiply) {                                                                          \
            for (ptrdiff_t i = 0; i < n; i++) {                                                 \
                float r = x[i] * inv;                                                            \
                bad |= (uint32_t)((f32_bits(r) & 0x7f800000u) == 0x7f800000u);                   \
                x[i] = r;                                                                        \
            }                                                                                    \
        } else {                                                                                 \
            for (ptrdiff_t i = 0; i < n; i++) {                                                 \
                bad |= (uint32_t)((f32_bits(x[i]) & 0x7f800000u) == 0x7f800000u);                \
            }                                                                                    \
        }                                                                                        \
        return bad != 0;                                                                         \
    }                                                                                            \
    ATTRIBUTES static int kernel_f64_##SUFFIX(void *data, ptrdiff_t n, float inv, int multiply) { \
        double *x = (double *)data;                                                              \
        const double inv64 = (double)inv;                                                        \
        uint64_t bad = 0;                                                                        \
        for (ptrdiff_t i = 0; i < n; i++) {                                                     \
            double v = multiply ? x[i] * inv64 : x[i];                                           \
            uint64_t u;                                                                          \
            memcpy(&u, &v, sizeof u);                                                            \
            bad |= (uint64_t)((u & 0x7ff0000000000000ull) == 0x7ff0000000000000ull);             \
            if (multiply) x[i] = v;                                                              \
        }                                                                                        \
        return bad != 0;                                                                         \
    }                                                                                            \
    ATTRIBUTES static int kernel_bf16_##SUFFIX(void *data, ptrdiff_t n, float inv, int multiply) { \
        uint16_t *x = (uint16_t *)data;                                                          \
        uint32_t bad = 0;                                                                        \
        if (multiply) {                                                                          \
            for (ptrdiff_t i = 0; i < n; i++) {                                                 \
                uint16_t r = float_to_bf16(bf16_to_float(x[i]) * inv);                          \
                bad |= (uint32_t)((r & 0x7f80u) == 0x7f80u);                                     \
                x[i] = r;                                                                        \
            }                                                                                    \
        } else {                                                                                 \
            for (ptrdiff_t i = 0; i < n; i++) bad |= (uint32_t)((x[i] & 0x7f80u) == 0x7f80u);   \
        }                                                                                        \
        return bad != 0;                                                                         \
    }                                                                                            \
    ATTRIBUTES static int kernel_f16_##SUFFIX(void *data, ptrdiff_t n, float inv, int multiply) { \
        uint16_t *x = (uint16_t *)data;                                                          \
        uint32_t bad = 0;                                                                        \
        if (multiply) {                                                                          \
            for (ptrdiff_t i = 0; i < n; i++) {                                                 \
                uint16_t r = float_to_half(half_to_float(x[i]) * inv);                           \
                bad |= (uint32_t)((r & 0x7c00u) == 0x7c00u);                                     \
                x[i] = r;                                                                        \
            }                                                                                    \
        } else {                                                                                 \
            for (ptrdiff_t i = 0; i < n; i++) bad |= (uint32_t)((x[i] & 0x7c00u) == 0x7c00u);   \
        }                                                                                        \
        return bad != 0;                                                                         \
    }

/* Counting variants (underflow tracking): also count the elements whose exponent bits are all
 * zero, i.e. zeros and subnormals of the input dtype. Separate functions, so that the common
 * path pays nothing for the option. */
typedef long long (*count_kernel_fn)(void *data, ptrdiff_t n, float inv_scale, int multiply, int *bad);

#define DEFINE_COUNTING_KERNELS(SUFFIX, ATTRIBUTES)                                                   \
    ATTRIBUTES static long long count_f32_##SUFFIX(void *data, ptrdiff_t n, float inv, int multiply, int *bad) { \
        float *x = (float *)data;                                                                     \
        uint32_t flags = 0;                                                                           \
        long long tiny = 0;                                                                           \
        for (ptrdiff_t i = 0; i < n; i++) {                                                          \
            float v = x[i];                                                                           \
            tiny += ((f32_bits(v) & 0x7f800000u) == 0);                                               \
            if (multiply) x[i] = v = v * inv;                                                         \
            flags |= (uint32_t)((f32_bits(v) & 0x7f800000u) == 0x7f800000u);                          \
        }                                                                                             \
        *bad = flags != 0;                                                                            \
        return tiny;                                                                                  \
    }                                                                                                 \
    ATTRIBUTES static long long count_f64_##SUFFIX(void *data, ptrdiff_t n, float inv, int multiply, int *bad) { \
        double *x = (double *)data;                                                                   \
        const double inv64 = (double)inv;                                                             \
        uint64_t flags = 0;                                                                           \
        long long tiny = 0;                                                                           \
        for (ptrdiff_t i = 0; i < n; i++) {                                                          \
            double v = x[i];                                                                          \
            uint64_t u;                                                                               \
            memcpy(&u, &v, sizeof u);                                                                 \
            tiny += ((u & 0x7ff0000000000000ull) == 0);                                               \
            if (multiply) {                                                                           \
                x[i] = v = v * inv64;                                                                 \
                memcpy(&u, &v, sizeof u);                                                             \
            }                                                                                         \
            flags |= (uint64_t)((u & 0x7ff0000000000000ull) == 0x7ff0000000000000ull);               \
        }                                                                                             \
        *bad = flags != 0;                                                                            \
        return tiny;                                                                                  \
    }                                                                                                 \
    ATTRIBUTES static long long count_bf16_##SUFFIX(void *data, ptrdiff_t n, float inv, int multiply, int *bad) { \
        uint16_t *x = (uint16_t *)data;                                                               \
        uint32_t flags = 0;                                                                           \
        long long tiny = 0;                                                                           \
        for (ptrdiff_t i = 0; i < n; i++) {                                                          \
            uint16_t b = x[i];                                                                        \
            tiny += ((b & 0x7f80u) == 0);                                                             \
            if (multiply) x[i] = b = float_to_bf16(bf16_to_float(b) * inv);                           \
            flags |= (uint32_t)((b & 0x7f80u) == 0x7f80u);                                            \
        }                                                                                             \
        *bad = flags != 0;                                                                            \
        return tiny;                                                                                  \
    }                                                                                                 \
    ATTRIBUTES static long long count_f16_##SUFFIX(void *data, ptrdiff_t n, float inv, int multiply, int *bad) { \
        uint16_t *x = (uint16_t *)data;                                                               \
        uint32_t flags = 0;                                                                           \
        long long tiny = 0;                                                                           \
        for (ptrdiff_t i = 0; i < n; i++) {                                                          \
            uint16_t h = x[i];                                                                        \
            tiny += ((h & 0x7c00u) == 0);                                                             \
            if (multiply) x[i] = h = float_to_half(half_to_float(h) * inv);                           \
            flags |= (uint32_t)((h & 0x7c00u) == 0x7c00u);                                            \
        }                                                                                             \
        *bad = flags != 0;                                                                            \
        return tiny;                                                                                  \
    }

DEFINE_PORTABLE_KERNELS(generic, )
DEFINE_COUNTING_KERNELS(generic, )

#if AMPSCALE_X86_DISPATCH
DEFINE_PORTABLE_KERNELS(avx2, AVX2_TARGET)
DEFINE_COUNTING_KERNELS(avx2, AVX2_TARGET)

/* Half precision with the F16C conversion instructions: 16 elements per iteration. */
AVX2_TARGET static int kernel_f16_f16c(void *data, ptrdiff_t n, float inv, int multiply) {
    uint16_t *x = (uint16_t *)data;
    const __m128i exponent = _mm_set1_epi16(0x7c00);
    const __m256 vinv = _mm256_set1_ps(inv);
    __m128i flags = _mm_setzero_si128();
    ptrdiff_t i = 0;
    if (multiply) {
        for (; i + 16 <= n; i += 16) {
            __m128i a = _mm_loadu_si128((const __m128i *)(x + i));
            __m128i b = _mm_loadu_si128((const __m128i *)(x + i + 8));
            __m128i ra = _mm256_cvtps_ph(_mm256_mul_ps(_mm256_cvtph_ps(a), vinv), _MM_FROUND_TO_NEAREST_INT);
            __m128i rb = _mm256_cvtps_ph(_mm256_mul_ps(_mm256_cvtph_ps(b), vinv), _MM_FROUND_TO_NEAREST_INT);
            flags = _mm_or_si128(flags, _mm_cmpeq_epi16(_mm_and_si128(ra, exponent), exponent));
            flags = _mm_or_si128(flags, _mm_cmpeq_epi16(_mm_and_si128(rb, exponent), exponent));
            _mm_storeu_si128((__m128i *)(x + i), ra);
            _mm_storeu_si128((__m128i *)(x + i + 8), rb);
        }
    } else {
        for (; i + 16 <= n; i += 16) {
            __m128i a = _mm_loadu_si128((const __m128i *)(x + i));
            __m128i b = _mm_loadu_si128((const __m128i *)(x + i + 8));
            flags = _mm_or_si128(flags, _mm_cmpeq_epi16(_mm_and_si128(a, exponent), exponent));
            flags = _mm_or_si128(flags, _mm_cmpeq_epi16(_mm_and_si128(b, exponent), exponent));
        }
    }
    int bad = !_mm_testz_si128(flags, flags);
    if (i < n) bad |= kernel_f16_avx2(x + i, n - i, inv, multiply);
    return bad;
}

/* float32 with explicit AVX2: 32 elements per iteration, two flag accumulators. */
AVX2_TARGET static int kernel_f32_avx2x(void *data, ptrdiff_t n, float inv, int multiply) {
    float *x = (float *)data;
    const __m256i exponent = _mm256_set1_epi32(0x7f800000);
    const __m256 vinv = _mm256_set1_ps(inv);
    __m256i f0 = _mm256_setzero_si256(), f1 = _mm256_setzero_si256();
    ptrdiff_t i = 0;
#define AMPSCALE_F32_FLAG(v, f) \
    f = _mm256_or_si256(f, _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_castps_si256(v), exponent), exponent))
    if (multiply) {
        for (; i + 32 <= n; i += 32) {
            __m256 a = _mm256_mul_ps(_mm256_loadu_ps(x + i), vinv), b = _mm256_mul_ps(_mm256_loadu_ps(x + i + 8), vinv);
            __m256 c = _mm256_mul_ps(_mm256_loadu_ps(x + i + 16), vinv);
            __m256 d = _mm256_mul_ps(_mm256_loadu_ps(x + i + 24), vinv);
            AMPSCALE_F32_FLAG(a, f0); AMPSCALE_F32_FLAG(b, f1); AMPSCALE_F32_FLAG(c, f0); AMPSCALE_F32_FLAG(d, f1);
            _mm256_storeu_ps(x + i, a);
            _mm256_storeu_ps(x + i + 8, b);
            _mm256_storeu_ps(x + i + 16, c);
            _mm256_storeu_ps(x + i + 24, d);
        }
    } else {
        for (; i + 32 <= n; i += 32) {
            __m256 a = _mm256_loadu_ps(x + i), b = _mm256_loadu_ps(x + i + 8);
            __m256 c = _mm256_loadu_ps(x + i + 16), d = _mm256_loadu_ps(x + i + 24);
            AMPSCALE_F32_FLAG(a, f0); AMPSCALE_F32_FLAG(b, f1); AMPSCALE_F32_FLAG(c, f0); AMPSCALE_F32_FLAG(d, f1);
        }
    }
#undef AMPSCALE_F32_FLAG
    f0 = _mm256_or_si256(f0, f1);
    int bad = !_mm256_testz_si256(f0, f0);
    if (i < n) bad |= kernel_f32_avx2(x + i, n - i, inv, multiply);
    return bad;
}

/* Counting variants of the two explicit AVX2 kernels. Without them underflow tracking on an
 * AVX2 CPU fell back to the portable loops: half precision then converted in software, about
 * fifteen times slower than the plain kernel. The count is of the inputs' "exponent bits all
 * zero" lanes (a compare gives -1 per lane, subtracted from a lane counter); the flag is of the
 * values stored, as in the plain kernels. */
AVX2_TARGET static long long count_f16_f16c(void *data, ptrdiff_t n, float inv, int multiply, int *bad) {
    uint16_t *x = (uint16_t *)data;
    const __m128i exponent = _mm_set1_epi16(0x7c00), zero = _mm_setzero_si128();
    const __m256 vinv = _mm256_set1_ps(inv);
    __m128i flags = _mm_setzero_si128();
    long long tiny = 0;
    ptrdiff_t i = 0;
    while (i + 16 <= n) {
        /* each 16-bit lane counter gains at most 2 per iteration: flushed every 16384 */
        ptrdiff_t block_end = i + ((n - i) / 16 < 16384 ? (n - i) / 16 : 16384) * 16;
        __m128i counts = _mm_setzero_si128();
        for (; i < block_end; i += 16) {
            __m128i a = _mm_loadu_si128((const __m128i *)(x + i));
            __m128i b = _mm_loadu_si128((const __m128i *)(x + i + 8));
            counts = _mm_sub_epi16(counts, _mm_cmpeq_epi16(_mm_and_si128(a, exponent), zero));
            counts = _mm_sub_epi16(counts, _mm_cmpeq_epi16(_mm_and_si128(b, exponent), zero));
            if (multiply) {
                a = _mm256_cvtps_ph(_mm256_mul_ps(_mm256_cvtph_ps(a), vinv), _MM_FROUND_TO_NEAREST_INT);
                b = _mm256_cvtps_ph(_mm256_mul_ps(_mm256_cvtph_ps(b), vinv), _MM_FROUND_TO_NEAREST_INT);
                _mm_storeu_si128((__m128i *)(x + i), a);
                _mm_storeu_si128((__m128i *)(x + i + 8), b);
            }
            flags = _mm_or_si128(flags, _mm_cmpeq_epi16(_mm_and_si128(a, exponent), exponent));
            flags = _mm_or_si128(flags, _mm_cmpeq_epi16(_mm_and_si128(b, exponent), exponent));
        }
        /* widen the eight unsigned 16-bit lanes to 32 bits and add them up */
        __m128i wide = _mm_add_epi32(_mm_unpacklo_epi16(counts, zero), _mm_unpackhi_epi16(counts, zero));
        wide = _mm_add_epi32(wide, _mm_shuffle_epi32(wide, 0x4e));
        wide = _mm_add_epi32(wide, _mm_shuffle_epi32(wide, 0xb1));
        tiny += (long long)(uint32_t)_mm_cvtsi128_si32(wide);
    }
    int tail_bad = 0;
    if (i < n) tiny += count_f16_avx2(x + i, n - i, inv, multiply, &tail_bad);
    *bad = (!_mm_testz_si128(flags, flags)) | tail_bad;
    return tiny;
}

AVX2_TARGET static long long count_f32_avx2x(void *data, ptrdiff_t n, float inv, int multiply, int *bad) {
    float *x = (float *)data;
    const __m256i exponent = _mm256_set1_epi32(0x7f800000), zero = _mm256_setzero_si256();
    const __m256 vinv = _mm256_set1_ps(inv);
    __m256i f0 = _mm256_setzero_si256(), f1 = _mm256_setzero_si256();
    /* two lane counters, each gaining at most 2 per iteration: 32 bits hold 2**30 iterations,
     * flushed every 2**24 */
    long long tiny = 0;
    ptrdiff_t i = 0;
#define AMPSCALE_F32_COUNT(v, c) \
    c = _mm256_sub_epi32(c, _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_castps_si256(v), exponent), zero))
#define AMPSCALE_F32_FLAG(v, f) \
    f = _mm256_or_si256(f, _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_castps_si256(v), exponent), exponent))
    while (i + 32 <= n) {
        ptrdiff_t block_end = i + ((n - i) / 32 < ((ptrdiff_t)1 << 24) ? (n - i) / 32 : ((ptrdiff_t)1 << 24)) * 32;
        __m256i c0 = _mm256_setzero_si256(), c1 = _mm256_setzero_si256();
        for (; i < block_end; i += 32) {
            __m256 a = _mm256_loadu_ps(x + i), b = _mm256_loadu_ps(x + i + 8);
            __m256 c = _mm256_loadu_ps(x + i + 16), d = _mm256_loadu_ps(x + i + 24);
            AMPSCALE_F32_COUNT(a, c0); AMPSCALE_F32_COUNT(b, c1); AMPSCALE_F32_COUNT(c, c0); AMPSCALE_F32_COUNT(d, c1);
            if (multiply) {
                a = _mm256_mul_ps(a, vinv); b = _mm256_mul_ps(b, vinv);
                c = _mm256_mul_ps(c, vinv); d = _mm256_mul_ps(d, vinv);
                _mm256_storeu_ps(x + i, a);
                _mm256_storeu_ps(x + i + 8, b);
                _mm256_storeu_ps(x + i + 16, c);
                _mm256_storeu_ps(x + i + 24, d);
            }
            AMPSCALE_F32_FLAG(a, f0); AMPSCALE_F32_FLAG(b, f1); AMPSCALE_F32_FLAG(c, f0); AMPSCALE_F32_FLAG(d, f1);
        }
        __m256i sum = _mm256_add_epi32(c0, c1);
        __m128i half = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
        half = _mm_add_epi32(half, _mm_shuffle_epi32(half, 0x4e));
        half = _mm_add_epi32(half, _mm_shuffle_epi32(half, 0xb1));
        tiny += (long long)(uint32_t)_mm_cvtsi128_si32(half);
    }
#undef AMPSCALE_F32_COUNT
#undef AMPSCALE_F32_FLAG
    f0 = _mm256_or_si256(f0, f1);
    int tail_bad = 0;
    if (i < n) tiny += count_f32_avx2(x + i, n - i, inv, multiply, &tail_bad);
    *bad = (!_mm256_testz_si256(f0, f0)) | tail_bad;
    return tiny;
}

/* AVX-512: 64 float32 (or 32 float16/bfloat16, 32 float64) elements per iteration. */

/* How many of the first elements to leave to the AVX2 kernel so that the AVX-512 loop starts on
 * a 64-byte boundary (0 where it cannot: an address that is not a multiple of the element
 * size). NumPy and torch align large buffers to 16 bytes only, and on Intel cores a 64-byte
 * load or store that straddles two cache lines costs about twice one that does not: every
 * vector of the loop would straddle, which made this family slower than AVX2 on float32. */
static inline ptrdiff_t head_to_line(const void *data, size_t size, ptrdiff_t n) {
    uintptr_t address = (uintptr_t)data;
    if (address % size) return 0;
    ptrdiff_t head = (ptrdiff_t)(((64 - address % 64) % 64) / size);
    return head < n ? head : n;
}

AVX512_TARGET static int kernel_f32_avx512_body(void *data, ptrdiff_t n, float inv, int multiply) {
    float *x = (float *)data;
    const __m512i exponent = _mm512_set1_epi32(0x7f800000);
    const __m512 vinv = _mm512_set1_ps(inv);
    /* the largest exponent field seen (unsigned): all ones at the end means an inf or a nan */
    __m512i top0 = _mm512_setzero_si512(), top1 = top0;
    ptrdiff_t i = 0;
#define AMPSCALE_TOP(v, top) top = _mm512_max_epu32(top, _mm512_and_si512(_mm512_castps_si512(v), exponent))
    if (multiply) {
        for (; i + 64 <= n; i += 64) {
            __m512 a = _mm512_mul_ps(_mm512_loadu_ps(x + i), vinv), b = _mm512_mul_ps(_mm512_loadu_ps(x + i + 16), vinv);
            __m512 c = _mm512_mul_ps(_mm512_loadu_ps(x + i + 32), vinv);
            __m512 d = _mm512_mul_ps(_mm512_loadu_ps(x + i + 48), vinv);
            AMPSCALE_TOP(a, top0); AMPSCALE_TOP(b, top1); AMPSCALE_TOP(c, top0); AMPSCALE_TOP(d, top1);
            _mm512_storeu_ps(x + i, a);
            _mm512_storeu_ps(x + i + 16, b);
            _mm512_storeu_ps(x + i + 32, c);
            _mm512_storeu_ps(x + i + 48, d);
        }
    } else {
        for (; i + 64 <= n; i += 64) {
            __m512 a = _mm512_loadu_ps(x + i), b = _mm512_loadu_ps(x + i + 16);
            __m512 c = _mm512_loadu_ps(x + i + 32), d = _mm512_loadu_ps(x + i + 48);
            AMPSCALE_TOP(a, top0); AMPSCALE_TOP(b, top1); AMPSCALE_TOP(c, top0); AMPSCALE_TOP(d, top1);
        }
    }
#undef AMPSCALE_TOP
    int bad = _mm512_cmpeq_epi32_mask(_mm512_max_epu32(top0, top1), exponent) != 0;
    if (i < n) bad |= kernel_f32_avx2(x + i, n - i, inv, multiply);
    return bad;
}

AVX512_TARGET static int kernel_f64_avx512_body(void *data, ptrdiff_t n, float inv, int multiply) {
    double *x = (double *)data;
    const __m512i exponent = _mm512_set1_epi64(0x7ff0000000000000ll);
    const __m512d vinv = _mm512_set1_pd((double)inv);
    __mmask8 flags = 0;
    ptrdiff_t i = 0;
    for (; i + 32 <= n; i += 32) {
        __m512d v[4];
        for (int k = 0; k < 4; k++) {
            v[k] = _mm512_loadu_pd(x + i + 8 * k);
            if (multiply) v[k] = _mm512_mul_pd(v[k], vinv);
            flags |= _mm512_cmpeq_epi64_mask(_mm512_and_si512(_mm512_castpd_si512(v[k]), exponent), exponent);
        }
        if (multiply) {
            for (int k = 0; k < 4; k++) _mm512_storeu_pd(x + i + 8 * k, v[k]);
        }
    }
    int bad = flags != 0;
    if (i < n) bad |= kernel_f64_avx2(x + i, n - i, inv, multiply);
    return bad;
}

/* 32 halves times the inverse scale in float32, rounded back to nearest even. */
AVX512_TARGET static inline __m512i f16x32_unscale(__m512i a, __m512 vinv) {
    __m256i lo = _mm512_cvtps_ph(_mm512_mul_ps(_mm512_cvtph_ps(_mm512_castsi512_si256(a)), vinv),
                                 _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256i hi = _mm512_cvtps_ph(_mm512_mul_ps(_mm512_cvtph_ps(_mm512_extracti64x4_epi64(a, 1)), vinv),
                                 _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

AVX512_TARGET static int kernel_f16_avx512_body(void *data, ptrdiff_t n, float inv, int multiply) {
    uint16_t *x = (uint16_t *)data;
    const __m512i exponent = _mm512_set1_epi16(0x7c00);
    const __m512 vinv = _mm512_set1_ps(inv);
    __mmask32 flags = 0;
    ptrdiff_t i = 0;
    for (; i + 64 <= n; i += 64) {
        __m512i a = _mm512_loadu_si512((const void *)(x + i));
        __m512i b = _mm512_loadu_si512((const void *)(x + i + 32));
        if (multiply) {
            a = f16x32_unscale(a, vinv);
            b = f16x32_unscale(b, vinv);
            _mm512_storeu_si512((void *)(x + i), a);
            _mm512_storeu_si512((void *)(x + i + 32), b);
        }
        flags |= _mm512_cmpeq_epi16_mask(_mm512_and_si512(a, exponent), exponent);
        flags |= _mm512_cmpeq_epi16_mask(_mm512_and_si512(b, exponent), exponent);
    }
    int bad = flags != 0;
    if (i < n) bad |= kernel_f16_f16c(x + i, n - i, inv, multiply);
    return bad;
}

AVX512_TARGET static int kernel_bf16_avx512_body(void *data, ptrdiff_t n, float inv, int multiply) {
    uint16_t *x = (uint16_t *)data;
    const __m512i exponent = _mm512_set1_epi16(0x7f80);
    const __m512 vinv = _mm512_set1_ps(inv);
    const __m512i bias = _mm512_set1_epi32(0x7fff), one = _mm512_set1_epi32(1);
    const __m512i magnitude = _mm512_set1_epi32(0x7fffffff), infinity = _mm512_set1_epi32(0x7f800000);
    const __m512i sign = _mm512_set1_epi32((int)0x80000000u), quiet = _mm512_set1_epi32(0x7fc00000);
    __mmask32 flags = 0;
    ptrdiff_t i = 0;
    for (; i + 32 <= n; i += 32) {
        __m512i a = _mm512_loadu_si512((const void *)(x + i));
        if (!multiply) {
            flags |= _mm512_cmpeq_epi16_mask(_mm512_and_si512(a, exponent), exponent);
        } else {
            for (int k = 0; k < 2; k++) {
                __m256i half = k ? _mm512_extracti64x4_epi64(a, 1) : _mm512_castsi512_si256(a);
                __m512i wide = _mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16);
                __m512i u = _mm512_castps_si512(_mm512_mul_ps(_mm512_castsi512_ps(wide), vinv));
                /* nan -> canonical quiet nan with its sign, then round to nearest even */
                __mmask16 nan = _mm512_cmpgt_epi32_mask(_mm512_and_si512(u, magnitude), infinity);
                __m512i rounded = _mm512_add_epi32(u, _mm512_add_epi32(bias, _mm512_and_si512(_mm512_srli_epi32(u, 16), one)));
                rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_or_si512(_mm512_and_si512(u, sign), quiet));
                /* the stored bfloat16 is the top half: its exponent bits are bits 23-30 here */
                flags |= _mm512_cmpeq_epi32_mask(_mm512_and_si512(rounded, infinity), infinity);
                _mm256_storeu_si256((__m256i *)(x + i + 16 * k), _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16)));
            }
        }
    }
    int bad = flags != 0;
    if (i < n) bad |= kernel_bf16_avx2(x + i, n - i, inv, multiply);
    return bad;
}

/* AVX-512 counting variants: the main loops plus a popcount of the "exponent bits all zero"
 * mask per vector, so underflow tracking rides the same pass at almost no cost. */
AVX512_TARGET static long long count_f32_avx512_body(void *data, ptrdiff_t n, float inv, int multiply, int *bad) {
    float *x = (float *)data;
    const __m512i exponent = _mm512_set1_epi32(0x7f800000);
    const __m512i one = _mm512_set1_epi32(1);
    const __m512 vinv = _mm512_set1_ps(inv);
    /* per-lane tiny counts (n / 64 per lane fits), four independent accumulators so the
     * counting adds no dependency chain across the loop's four vectors */
    __m512i counts0 = _mm512_setzero_si512(), counts1 = counts0, counts2 = counts0, counts3 = counts0;
    /* the largest exponent field seen (unsigned): all ones at the end means an inf or a nan */
    __m512i top0 = _mm512_setzero_si512(), top1 = top0;
    ptrdiff_t i = 0;
    /* the count is of the inputs (one test: exponent bits all zero); the flag of the values
     * stored (the inputs when not multiplying) */
#define AMPSCALE_COUNT(v, counts) \
    counts = _mm512_mask_add_epi32(counts, _mm512_testn_epi32_mask(_mm512_castps_si512(v), exponent), counts, one)
#define AMPSCALE_TOP(v, top) top = _mm512_max_epu32(top, _mm512_and_si512(_mm512_castps_si512(v), exponent))
    for (; i + 64 <= n; i += 64) {
        __m512 a = _mm512_loadu_ps(x + i), b = _mm512_loadu_ps(x + i + 16);
        __m512 c = _mm512_loadu_ps(x + i + 32), d = _mm512_loadu_ps(x + i + 48);
        AMPSCALE_COUNT(a, counts0); AMPSCALE_COUNT(b, counts1); AMPSCALE_COUNT(c, counts2); AMPSCALE_COUNT(d, counts3);
        if (multiply) {
            a = _mm512_mul_ps(a, vinv);
            b = _mm512_mul_ps(b, vinv);
            c = _mm512_mul_ps(c, vinv);
            d = _mm512_mul_ps(d, vinv);
            _mm512_storeu_ps(x + i, a);
            _mm512_storeu_ps(x + i + 16, b);
            _mm512_storeu_ps(x + i + 32, c);
            _mm512_storeu_ps(x + i + 48, d);
        }
        AMPSCALE_TOP(a, top0); AMPSCALE_TOP(b, top1); AMPSCALE_TOP(c, top0); AMPSCALE_TOP(d, top1);
    }
#undef AMPSCALE_COUNT
#undef AMPSCALE_TOP
    __mmask16 flags = _mm512_cmpeq_epi32_mask(_mm512_max_epu32(top0, top1), exponent);
    long long tiny = (long long)_mm512_reduce_add_epi32(counts0) + _mm512_reduce_add_epi32(counts1) +
                     _mm512_reduce_add_epi32(counts2) + _mm512_reduce_add_epi32(counts3);
    int tail_bad = 0;
    if (i < n) tiny += count_f32_avx2(x + i, n - i, inv, multiply, &tail_bad);
    *bad = (flags != 0) | tail_bad;
    return tiny;
}

/* The sum of the 32 unsigned 16-bit lanes of `counts`. */
AVX512_TARGET static inline long long u16_lanes_sum(__m512i counts) {
    const __m512i low = _mm512_set1_epi32(0xffff);
    return _mm512_reduce_add_epi32(_mm512_add_epi32(_mm512_and_si512(counts, low), _mm512_srli_epi32(counts, 16)));
}

AVX512_TARGET static long long count_f16_avx512_body(void *data, ptrdiff_t n, float inv, int multiply, int *bad) {
    uint16_t *x = (uint16_t *)data;
    const __m512i exponent = _mm512_set1_epi16(0x7c00);
    const __m512i one = _mm512_set1_epi16(1);
    const __m512 vinv = _mm512_set1_ps(inv);
    /* the largest exponent field seen (unsigned): all ones at the end means an inf or a nan */
    __m512i top0 = _mm512_setzero_si512(), top1 = top0;
    long long tiny = 0;
    ptrdiff_t i = 0;
    /* 16-bit lanes, two accumulators each gaining at most 1 an iteration, flushed to `tiny`
     * every 2^15 iterations: a lane then holds up to 32768, which only an unsigned read gets
     * right (a signed 16-bit read, as _mm512_madd_epi16 does, makes it -32768), so the flush
     * adds the two unsigned halves of each 32-bit lane. */
    __m512i counts0 = _mm512_setzero_si512(), counts1 = counts0;
    ptrdiff_t since_flush = 0;
#define AMPSCALE_COUNT(v, counts) counts = _mm512_mask_add_epi16(counts, _mm512_testn_epi16_mask(v, exponent), counts, one)
#define AMPSCALE_TOP(v, top) top = _mm512_max_epu16(top, _mm512_and_si512(v, exponent))
    for (; i + 64 <= n; i += 64) {
        __m512i a = _mm512_loadu_si512((const void *)(x + i));
        __m512i b = _mm512_loadu_si512((const void *)(x + i + 32));
        AMPSCALE_COUNT(a, counts0);
        AMPSCALE_COUNT(b, counts1);
        if (++since_flush == 32768) {
            tiny += u16_lanes_sum(counts0) + u16_lanes_sum(counts1);
            counts0 = counts1 = _mm512_setzero_si512();
            since_flush = 0;
        }
        if (multiply) {
            a = f16x32_unscale(a, vinv);
            b = f16x32_unscale(b, vinv);
            _mm512_storeu_si512((void *)(x + i), a);
            _mm512_storeu_si512((void *)(x + i + 32), b);
        }
        AMPSCALE_TOP(a, top0);
        AMPSCALE_TOP(b, top1);
    }
#undef AMPSCALE_COUNT
#undef AMPSCALE_TOP
    tiny += u16_lanes_sum(counts0) + u16_lanes_sum(counts1);
    __mmask32 flags = _mm512_cmpeq_epi16_mask(_mm512_max_epu16(top0, top1), exponent);
    int tail_bad = 0;
    if (i < n) tiny += count_f16_avx2(x + i, n - i, inv, multiply, &tail_bad);
    *bad = (flags != 0) | tail_bad;
    return tiny;
}
#endif

#if AMPSCALE_X86_DISPATCH
/* The AVX-512 kernels: the head up to a cache line by the AVX2 kernel, the rest by the loop. */
#define AMPSCALE_LINE_ALIGNED(name, head_kernel, size)                                       \
    AVX512_TARGET static int name(void *data, ptrdiff_t n, float inv, int multiply) {        \
        ptrdiff_t head = head_to_line(data, size, n);                                        \
        int bad = head ? head_kernel(data, head, inv, multiply) : 0;                         \
        return bad | name##_body((char *)data + head * size, n - head, inv, multiply);       \
    }
#define AMPSCALE_LINE_ALIGNED_COUNT(name, head_kernel, size)                                          \
    AVX512_TARGET static long long name(void *data, ptrdiff_t n, float inv, int multiply, int *bad) { \
        ptrdiff_t head = head_to_line(data, size, n);                                                 \
        int head_bad = 0;                                                                             \
        long long tiny = head ? head_kernel(data, head, inv, multiply, &head_bad) : 0;                \
        tiny += name##_body((char *)data + head * size, n - head, inv, multiply, bad);                \
        *bad |= head_bad;                                                                             \
        return tiny;                                                                                  \
    }
AMPSCALE_LINE_ALIGNED(kernel_f32_avx512, kernel_f32_avx2, 4)
AMPSCALE_LINE_ALIGNED(kernel_f64_avx512, kernel_f64_avx2, 8)
AMPSCALE_LINE_ALIGNED(kernel_f16_avx512, kernel_f16_f16c, 2)
AMPSCALE_LINE_ALIGNED(kernel_bf16_avx512, kernel_bf16_avx2, 2)
AMPSCALE_LINE_ALIGNED_COUNT(count_f32_avx512, count_f32_avx2, 4)
AMPSCALE_LINE_ALIGNED_COUNT(count_f16_avx512, count_f16_avx2, 2)
#undef AMPSCALE_LINE_ALIGNED
#undef AMPSCALE_LINE_ALIGNED_COUNT
#endif

/* A kernel family: the plain and the counting kernel of each kind, in KIND_* order. */
typedef struct {
    const char *isa;
    kernel_fn plain[KIND_COUNT];
    count_kernel_fn counting[KIND_COUNT];
} KernelFamily;

#define GENERIC_PLAIN {kernel_f16_generic, kernel_bf16_generic, kernel_f32_generic, kernel_f64_generic}
#define GENERIC_COUNTING {count_f16_generic, count_bf16_generic, count_f32_generic, count_f64_generic}

static const KernelFamily generic_family = {"generic", GENERIC_PLAIN, GENERIC_COUNTING};
#if AMPSCALE_X86_DISPATCH
static const KernelFamily avx2_family = {
    "avx2+f16c",
    {kernel_f16_f16c, kernel_bf16_avx2, kernel_f32_avx2x, kernel_f64_avx2},
    {count_f16_f16c, count_bf16_avx2, count_f32_avx2x, count_f64_avx2}};
/* bfloat16 and float64 counting have no AVX-512 kernels: the AVX2 ones serve */
static const KernelFamily avx512_family = {
    "avx512",
    {kernel_f16_avx512, kernel_bf16_avx512, kernel_f32_avx512, kernel_f64_avx512},
    {count_f16_avx512, count_bf16_avx2, count_f32_avx512, count_f64_avx2}};
#endif

/* The kernels in use (the portable family until select_isa() runs). */
static kernel_fn kernels[KIND_COUNT] = GENERIC_PLAIN;
static count_kernel_fn count_kernels[KIND_COUNT] = GENERIC_COUNTING;
static const char *kernel_isa = "generic";

/* Ceilings for select_isa(), in order: each family is used only where the CPU has its instructions. */
enum { ISA_GENERIC = 0, ISA_AVX2 = 1, ISA_BEST = 2 };

/* Install the fastest family up to `ceiling` that this CPU supports, every plain and counting
 * kernel together. Returns 0, or -1 (nothing changed) when `ceiling` is ISA_AVX2 and the CPU
 * lacks AVX2/FMA/F16C. */
static int select_isa(int ceiling) {
    const KernelFamily *family = &generic_family;
#if AMPSCALE_X86_DISPATCH
    __builtin_cpu_init();
    int avx2 = AMPSCALE_CPU_HAS("avx2") && AMPSCALE_CPU_HAS("fma") && AMPSCALE_CPU_HAS("f16c");
    if (ceiling == ISA_AVX2 && !avx2) return -1;
    if (ceiling >= ISA_AVX2 && avx2) family = &avx2_family;
    if (ceiling >= ISA_BEST && avx2 && AMPSCALE_CPU_HAS("avx512f") && AMPSCALE_CPU_HAS("avx512bw")) {
        family = &avx512_family;
    }
#else
    if (ceiling == ISA_AVX2) return -1;
#endif
    memcpy(kernels, family->plain, sizeof kernels);
    memcpy(count_kernels, family->counting, sizeof count_kernels);
    kernel_isa = family->isa;
    return 0;
}

static void select_kernels(void) { (void)select_isa(ISA_BEST); }

/* ---------------------------------------------------------------- work splitting */

typedef struct {
    char *data;
    ptrdiff_t n;       /* elements */
    ptrdiff_t offset;  /* elements before this span, over all spans */
} Span;

typedef struct {
    const Span *spans;
    ptrdiff_t count;
    ptrdiff_t lo, hi; /* element range [lo, hi) of the concatenation */
    ptrdiff_t itemsize;
    kernel_fn kernel;
    count_kernel_fn counter; /* non-NULL: count tiny elements too */
    float inv;
    int multiply;
    unsigned int fp_control; /* the caller's MXCSR (x86): denormal flushing, rounding */
    int bad;
    long long tiny;
} Work;

static void run_work(Work *w) {
    /* Find the first span that ends after lo (spans are sorted by offset). */
    ptrdiff_t a = 0, b = w->count;
    while (a < b) {
        ptrdiff_t mid = a + (b - a) / 2;
        if (w->spans[mid].offset + w->spans[mid].n <= w->lo) a = mid + 1;
        else b = mid;
    }
    int bad = 0;
    long long tiny = 0;
    for (ptrdiff_t s = a; s < w->count; s++) {
        const Span *span = &w->spans[s];
        if (span->offset >= w->hi) break;
        ptrdiff_t start = w->lo > span->offset ? w->lo - span->offset : 0;
        ptrdiff_t end = span->offset + span->n < w->hi ? span->n : w->hi - span->offset;
        if (end > start) {
            char *p = span->data + start * w->itemsize;
            if (w->counter != NULL) {
                int part = 0;
                tiny += w->counter(p, end - start, w->inv, w->multiply, &part);
                bad |= part;
            } else {
                bad |= w->kernel(p, end - start, w->inv, w->multiply);
            }
        }
    }
    w->bad = bad;
    w->tiny = tiny;
}

/* The calling thread's floating-point control (x86 MXCSR: flush-to-zero, denormals-are-zero,
 * rounding), so that worker threads compute exactly as the caller does. XLA:CPU runs with
 * denormals flushed; a thread started by a kernel, or a pool thread, need not. */
static inline unsigned int fp_control_get(void) {
#if AMPSCALE_X86_DISPATCH
    return _mm_getcsr();
#else
    return 0;
#endif
}

/* Run `w` under its caller's floating-point control, restoring this thread's afterwards. */
static void run_work_as_caller(Work *w) {
#if AMPSCALE_X86_DISPATCH
    unsigned int own = _mm_getcsr();
    if (own != w->fp_control) _mm_setcsr(w->fp_control);
#endif
    run_work(w);
#if AMPSCALE_X86_DISPATCH
    if (own != w->fp_control) _mm_setcsr(own);
#endif
}

#if AMPSCALE_THREADS
static void *thread_main(void *arg) {
    run_work_as_caller((Work *)arg);
    return NULL;
}
#endif

#define MAX_THREADS 64
/* Below this many elements one thread is faster than starting another. */
#define PARALLEL_THRESHOLD ((ptrdiff_t)1 << 18)

/* Split the concatenation of `spans` (`total` elements) into `threads` equal element ranges,
 * one Work each, all computing under the calling thread's floating-point control. Returns the
 * number of ranges: 1 below the parallel threshold. */
static int plan_work(Work *work, const Span *spans, ptrdiff_t count, ptrdiff_t total, ptrdiff_t itemsize,
                     kernel_fn kernel, count_kernel_fn counter, float inv, int multiply, int threads) {
    if (threads < 1) threads = 1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (total < PARALLEL_THRESHOLD * 2) threads = 1;
    const unsigned int fp_control = fp_control_get();
    for (int t = 0; t < threads; t++) {
        work[t].spans = spans;
        work[t].count = count;
        work[t].lo = total * t / threads;
        work[t].hi = total * (t + 1) / threads;
        work[t].itemsize = itemsize;
        work[t].kernel = kernel;
        work[t].counter = counter;
        work[t].tiny = 0;
        work[t].inv = inv;
        work[t].multiply = multiply;
        work[t].fp_control = fp_control;
        work[t].bad = 0;
    }
    return threads;
}

static int run_all(const Span *spans, ptrdiff_t count, ptrdiff_t total, ptrdiff_t itemsize,
                   kernel_fn kernel, count_kernel_fn counter, float inv, int multiply, int threads,
                   long long *tiny_out) {
    if (!AMPSCALE_THREADS) threads = 1;
    Work work[MAX_THREADS];
    threads = plan_work(work, spans, count, total, itemsize, kernel, counter, inv, multiply, threads);
#if AMPSCALE_THREADS
    pthread_t handles[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    for (int t = 1; t < threads; t++) {
        started[t] = pthread_create(&handles[t], NULL, thread_main, &work[t]) == 0;
    }
    run_work(&work[0]);
    int bad = work[0].bad;
    long long tiny = work[0].tiny;
    for (int t = 1; t < threads; t++) {
        if (started[t]) {
            pthread_join(handles[t], NULL);
        } else {
            run_work(&work[t]); /* could not start a thread: do its share here */
        }
        bad |= work[t].bad;
        tiny += work[t].tiny;
    }
    *tiny_out = tiny;
    return bad;
#else
    int bad = 0;
    long long tiny = 0;
    for (int t = 0; t < threads; t++) {
        run_work(&work[t]);
        bad |= work[t].bad;
        tiny += work[t].tiny;
    }
    *tiny_out = tiny;
    return bad;
#endif
}

#endif /* AMPSCALE_KERNELS_H */
