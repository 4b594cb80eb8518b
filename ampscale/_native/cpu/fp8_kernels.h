/*
 * FP8 bookkeeping in one pass over many tensors: each tensor's amax (max |x| as float32) and,
 * optionally, its saturated FP8 payload and a count of the elements the saturation clipped.
 * Shared by the NumPy extension (`_numpy.c`, NumPy arrays and torch CPU tensors) and the JAX CPU
 * handler (`jax_ffi_fp8.cc`); plain C, every function static, like `kernels.h`.
 *
 * The amax is taken on bits, never on floats: the sign bit cleared, each element's magnitude is
 * an unsigned integer whose order is the order of |x| (subnormals and -0 included), and every NaN
 * is larger than +inf. So the integer maximum is the amax, NaN if any element is a NaN, else inf
 * if any is infinite, with no float compare that flush-to-zero, denormals-are-zero or a NaN could
 * disturb. The result is converted to float32 once per tensor (float64: rounded to nearest
 * even, as NumPy's astype does); a NaN becomes the canonical quiet NaN 0x7fc00000, since which
 * element's payload a float max returns differs between libraries and between vector widths.
 *
 * The cast is `saturate(x * scale)` (or `x / scale`): x widened to float32 (float64 rounded to
 * float32 first), one float32 multiply or divide (the one float operation, as in the reference
 * casts of ampscale/fp8/_cast.py, under the caller's floating-point control), then clip to
 * +-fp8_max, then round to nearest even onto the format's grid in integer arithmetic
 * (subnormals included). A NaN stays a NaN, with the product's sign where the format has signed
 * NaNs; its byte is a parameter because libraries differ (E5M2: ml_dtypes and XLA write 0x7e,
 * torch 0x7f). The clipped count is of the products whose magnitude exceeded fp8_max (inf
 * included, NaN not).
 *
 * Work splitting: the concatenation of every tensor's BYTES (tensors of several dtypes travel
 * in one call) is cut into equal ranges, one per thread, each cut on an element boundary. A
 * tensor that a cut crosses has partial results in two pieces; they are merged after the join
 * with max and + (exact integer operations), so the result does not depend on the cut.
 */
#ifndef AMPSCALE_FP8_KERNELS_H
#define AMPSCALE_FP8_KERNELS_H

#include "kernels.h"

enum { FP8_E4M3FN = 0, FP8_E5M2 = 1, FP8_E4M3FNUZ = 2, FP8_E5M2FNUZ = 3, FP8_FORMAT_COUNT = 4 };

/* The magnitude bits of a kind's largest |x| (a float16 / bfloat16 / float32 / float64 bit
 * pattern with the sign cleared), widened to 64 bits. */
typedef uint64_t (*fp8_amax_fn)(const void *data, ptrdiff_t n);
/* The same, and the payload of elements [0, n) written to `out`; `*clipped` gains the count of
 * elements the saturation changed. */
typedef uint64_t (*fp8_cast_fn)(const void *data, uint8_t *out, ptrdiff_t n, float scale, int divide,
                                uint32_t nan_byte, long long *clipped);

/* The float32 amax of a kind's magnitude bits: exact for float16 and bfloat16, float64 rounded
 * under the caller's rounding mode (NumPy's astype), every NaN the canonical quiet NaN. */
static inline float fp8_top_to_f32(int kind, uint64_t top) {
    switch (kind) {
        case KIND_F16:
            return top > 0x7c00u ? bits_f32(0x7fc00000u) : half_to_float((uint16_t)top);
        case KIND_BF16:
            return top > 0x7f80u ? bits_f32(0x7fc00000u) : bf16_to_float((uint16_t)top);
        case KIND_F32:
            return top > 0x7f800000u ? bits_f32(0x7fc00000u) : bits_f32((uint32_t)top);
        default: {
            if (top > 0x7ff0000000000000ull) return bits_f32(0x7fc00000u);
            double d;
            memcpy(&d, &top, sizeof d);
            return (float)d;
        }
    }
}

/* ---------------------------------------------------------------- the encoders
 * One per format: a float32 bit pattern in, the FP8 byte out, branch-free so that the loops
 * below vectorise. `MBITS` mantissa bits, exponent `BIAS`, `MAXBITS` the float32 bits of fp8_max,
 * `FNUZ` formats have no negative zero and one unsigned NaN (0x80).
 *
 * A normal result rounds the float32 mantissa at bit 23 - MBITS (nearest even: add half an ulp
 * minus one, plus the kept bit) and rebiases the exponent; a carry out of the mantissa lands in
 * the exponent, as it should. A subnormal result is the 24-bit mantissa shifted down to units
 * of the format's smallest step, rounded to nearest even; a float32 subnormal or zero gives a
 * shift past every bit, hence 0. No result passes fp8_max: the input was clipped to it, and
 * fp8_max is on the grid. */
#define AMPSCALE_FP8_ENCODER(NAME, MBITS, BIAS, MAXBITS, FNUZ)                                          \
    static inline uint32_t NAME(uint32_t u, uint32_t nan_byte, uint32_t *clipped) {                      \
        const uint32_t sign = (u >> 24) & 0x80u;                                                         \
        uint32_t a = u & 0x7fffffffu;                                                                    \
        const uint32_t nan = a > 0x7f800000u;                                                            \
        const uint32_t over = (a > (MAXBITS)) & !nan;                                                    \
        *clipped += over;                                                                                \
        a = over ? (MAXBITS) : a;                                                                        \
        const uint32_t rounded = a + ((1u << (22 - (MBITS))) - 1u) + ((a >> (23 - (MBITS))) & 1u);      \
        const uint32_t normal = (rounded >> (23 - (MBITS))) - ((127u - (BIAS)) << (MBITS));              \
        const uint32_t exponent = a >> 23;                                                               \
        const uint32_t mantissa = (a & 0x7fffffu) | 0x800000u;                                           \
        int32_t shift = (151 - (BIAS) - (MBITS)) - (int32_t)exponent;                                    \
        shift = shift > 31 ? 31 : (shift < 1 ? 1 : shift);                                               \
        uint32_t q = mantissa >> shift;                                                                  \
        const uint32_t rest = mantissa & ((1u << shift) - 1u), half = 1u << (shift - 1);                 \
        q += (rest > half) | ((rest == half) & q);                                                       \
        const uint32_t magnitude = exponent >= 128u - (BIAS) ? normal : q;                               \
        const uint32_t code = (FNUZ) ? (magnitude ? (sign | magnitude) : 0u) : (sign | magnitude);       \
        return nan ? ((FNUZ) ? nan_byte : (sign | nan_byte)) : code;                                     \
    }

AMPSCALE_FP8_ENCODER(fp8_encode_e4m3fn, 3, 7, 0x43e00000u, 0)    /* fp8_max 448 */
AMPSCALE_FP8_ENCODER(fp8_encode_e5m2, 2, 15, 0x47600000u, 0)     /* 57344 */
AMPSCALE_FP8_ENCODER(fp8_encode_e4m3fnuz, 3, 8, 0x43700000u, 1)  /* 240 */
AMPSCALE_FP8_ENCODER(fp8_encode_e5m2fnuz, 2, 16, 0x47600000u, 1) /* 57344 */
#undef AMPSCALE_FP8_ENCODER

/* ---------------------------------------------------------------- portable kernels
 * The magnitudes are compared as signed integers: the sign bit is cleared, so the order is the
 * same, and baseline x86-64 (SSE2) has a signed 16-bit max where an unsigned one needs SSE4.1. */

#define AMPSCALE_AMAX_LOOP(TYPE, MASK)                                   \
    const TYPE *x = (const TYPE *)data;                                  \
    TYPE top = 0;                                                        \
    for (ptrdiff_t i = 0; i < n; i++) {                                  \
        const TYPE m = (TYPE)(x[i] & (MASK));                            \
        top = m > top ? m : top;                                         \
    }                                                                    \
    return (uint64_t)top;

#define DEFINE_FP8_AMAX_KERNELS(SUFFIX, ATTRIBUTES)                                                               \
    ATTRIBUTES static uint64_t fp8_amax_f16_##SUFFIX(const void *data, ptrdiff_t n) { AMPSCALE_AMAX_LOOP(int16_t, 0x7fff) } \
    ATTRIBUTES static uint64_t fp8_amax_f32_##SUFFIX(const void *data, ptrdiff_t n) {                                     \
        AMPSCALE_AMAX_LOOP(int32_t, 0x7fffffff)                                                                           \
    }                                                                                                                     \
    ATTRIBUTES static uint64_t fp8_amax_f64_##SUFFIX(const void *data, ptrdiff_t n) {                                     \
        AMPSCALE_AMAX_LOOP(int64_t, 0x7fffffffffffffffll)                                                                 \
    }

/* One element widened to float32: the conversions of kernels.h (exact for float16 and bfloat16;
 * float64 rounded by the hardware conversion, under the caller's control, as NumPy's astype). */
#define AMPSCALE_WIDEN_F16(p, i) half_to_float(((const uint16_t *)(p))[i])
#define AMPSCALE_WIDEN_BF16(p, i) bf16_to_float(((const uint16_t *)(p))[i])
#define AMPSCALE_WIDEN_F32(p, i) (((const float *)(p))[i])
#define AMPSCALE_WIDEN_F64(p, i) ((float)((const double *)(p))[i])
/* the magnitude bits of element i, for the amax */
#define AMPSCALE_MAG_F16(p, i) (uint32_t)(((const uint16_t *)(p))[i] & 0x7fffu)
#define AMPSCALE_MAG_BF16(p, i) (uint32_t)(((const uint16_t *)(p))[i] & 0x7fffu)
#define AMPSCALE_MAG_F32(p, i) (((const uint32_t *)(p))[i] & 0x7fffffffu)
#define AMPSCALE_MAG_F64(p, i) (((const uint64_t *)(p))[i] & 0x7fffffffffffffffull)

/* The cast loop of one kind and format; two copies (multiply, divide) so neither tests the
 * other's flag per element. The clipped count is kept in 32 bits per block of 2^30 elements. */
#define AMPSCALE_CAST_KERNEL(NAME, ATTRIBUTES, WIDEN, MAG, MAGTYPE, ENCODE)                                   \
    ATTRIBUTES static uint64_t NAME(const void *data, uint8_t *out, ptrdiff_t n, float scale, int divide,      \
                                    uint32_t nan_byte, long long *clipped) {                                   \
        MAGTYPE top = 0;                                                                                       \
        long long total = 0;                                                                                   \
        for (ptrdiff_t begin = 0; begin < n; begin += (ptrdiff_t)1 << 30) {                                    \
            const ptrdiff_t end = n - begin > ((ptrdiff_t)1 << 30) ? begin + ((ptrdiff_t)1 << 30) : n;         \
            uint32_t count = 0;                                                                                \
            if (divide) {                                                                                      \
                for (ptrdiff_t i = begin; i < end; i++) {                                                      \
                    const MAGTYPE m = MAG(data, i);                                                            \
                    top = m > top ? m : top;                                                                   \
                    out[i] = (uint8_t)ENCODE(f32_bits(WIDEN(data, i) / scale), nan_byte, &count);             \
                }                                                                                              \
            } else {                                                                                           \
                for (ptrdiff_t i = begin; i < end; i++) {                                                      \
                    const MAGTYPE m = MAG(data, i);                                                            \
                    top = m > top ? m : top;                                                                   \
                    out[i] = (uint8_t)ENCODE(f32_bits(WIDEN(data, i) * scale), nan_byte, &count);             \
                }                                                                                              \
            }                                                                                                  \
            total += count;                                                                                    \
        }                                                                                                      \
        *clipped += total;                                                                                     \
        return (uint64_t)top;                                                                                  \
    }

#define DEFINE_FP8_CAST_FORMAT(SUFFIX, ATTRIBUTES, FMT)                                                                 \
    AMPSCALE_CAST_KERNEL(fp8_cast_##FMT##_f16_##SUFFIX, ATTRIBUTES, AMPSCALE_WIDEN_F16, AMPSCALE_MAG_F16, uint32_t,       \
                         fp8_encode_##FMT)                                                                              \
    AMPSCALE_CAST_KERNEL(fp8_cast_##FMT##_bf16_##SUFFIX, ATTRIBUTES, AMPSCALE_WIDEN_BF16, AMPSCALE_MAG_BF16, uint32_t,    \
                         fp8_encode_##FMT)                                                                              \
    AMPSCALE_CAST_KERNEL(fp8_cast_##FMT##_f32_##SUFFIX, ATTRIBUTES, AMPSCALE_WIDEN_F32, AMPSCALE_MAG_F32, uint32_t,       \
                         fp8_encode_##FMT)                                                                              \
    AMPSCALE_CAST_KERNEL(fp8_cast_##FMT##_f64_##SUFFIX, ATTRIBUTES, AMPSCALE_WIDEN_F64, AMPSCALE_MAG_F64, uint64_t,       \
                         fp8_encode_##FMT)

#define DEFINE_FP8_CAST_KERNELS(SUFFIX, ATTRIBUTES)          \
    DEFINE_FP8_CAST_FORMAT(SUFFIX, ATTRIBUTES, e4m3fn)       \
    DEFINE_FP8_CAST_FORMAT(SUFFIX, ATTRIBUTES, e5m2)         \
    DEFINE_FP8_CAST_FORMAT(SUFFIX, ATTRIBUTES, e4m3fnuz)     \
    DEFINE_FP8_CAST_FORMAT(SUFFIX, ATTRIBUTES, e5m2fnuz)

/* A family's cast table, [format][kind], in FP8_* and KIND_* order. */
#define FP8_CAST_ROW(FMT, SUFFIX) \
    {fp8_cast_##FMT##_f16_##SUFFIX, fp8_cast_##FMT##_bf16_##SUFFIX, fp8_cast_##FMT##_f32_##SUFFIX, fp8_cast_##FMT##_f64_##SUFFIX}
#define FP8_CAST_TABLE(SUFFIX) \
    {FP8_CAST_ROW(e4m3fn, SUFFIX), FP8_CAST_ROW(e5m2, SUFFIX), FP8_CAST_ROW(e4m3fnuz, SUFFIX), FP8_CAST_ROW(e5m2fnuz, SUFFIX)}

DEFINE_FP8_AMAX_KERNELS(generic, )
DEFINE_FP8_CAST_KERNELS(generic, )

#if AMPSCALE_X86_DISPATCH
DEFINE_FP8_AMAX_KERNELS(avx2, AVX2_TARGET)
DEFINE_FP8_CAST_KERNELS(avx2, AVX2_TARGET)
/* The AVX-512 family's casts: the same loops, vectorised by the compiler for 512-bit registers. */
DEFINE_FP8_CAST_KERNELS(avx512, AVX512_TARGET)

/* AVX-512 amax: 64 float32 (or 128 16-bit, 32 float64) magnitudes per iteration into four
 * independent maxima, from a 64-byte line boundary on (kernels.h's head_to_line: a load that
 * straddles two lines costs about two), the head and the tail by the AVX2 kernel.
 *
 * Each iteration also prefetches the four lines AMPSCALE_AMAX_PREFETCH bytes ahead. A pass that
 * only reads is bound by how many line fills a core keeps in flight, and the hardware's stream
 * prefetcher stops at every 4 KiB page; prefetching across the page keeps the fills going.
 * Measured on W1 (2 threads, interleaved with L on a shared 2-core Xeon): 0.7-0.76 L without,
 * 1.05-1.2 L at 4 to 8 KiB ahead. A prefetch never faults, so running past the end is harmless. */
#define AMPSCALE_AMAX_PREFETCH 8192
#define AMPSCALE_AMAX512(NAME, LANE_BITS, MASK, SET1, MAX, HEAD_KERNEL, ITEM)                              \
    AVX512_TARGET static uint64_t NAME##_body(const void *data, ptrdiff_t n) {                              \
        const char *x = (const char *)data;                                                                 \
        const ptrdiff_t per_vector = 64 / (ITEM);                                                           \
        const __m512i mask = SET1(MASK);                                                                    \
        __m512i t0 = _mm512_setzero_si512(), t1 = t0, t2 = t0, t3 = t0;                                    \
        ptrdiff_t i = 0;                                                                                    \
        for (; i + 4 * per_vector <= n; i += 4 * per_vector) {                                              \
            const char *p = x + i * (ITEM);                                                                 \
            for (int line = 0; line < 256; line += 64) {                                                    \
                _mm_prefetch(p + AMPSCALE_AMAX_PREFETCH + line, _MM_HINT_T0);                               \
            }                                                                                               \
            t0 = MAX(t0, _mm512_and_si512(_mm512_loadu_si512((const void *)p), mask));                      \
            t1 = MAX(t1, _mm512_and_si512(_mm512_loadu_si512((const void *)(p + 64)), mask));               \
            t2 = MAX(t2, _mm512_and_si512(_mm512_loadu_si512((const void *)(p + 128)), mask));              \
            t3 = MAX(t3, _mm512_and_si512(_mm512_loadu_si512((const void *)(p + 192)), mask));              \
        }                                                                                                   \
        t0 = MAX(MAX(t0, t1), MAX(t2, t3));                                                                 \
        uint##LANE_BITS##_t lanes[64 / (LANE_BITS / 8)];                                                   \
        memcpy(lanes, &t0, sizeof lanes);                                                                   \
        uint64_t top = 0;                                                                                   \
        for (size_t k = 0; k < sizeof lanes / sizeof lanes[0]; k++) top = lanes[k] > top ? lanes[k] : top;  \
        if (i < n) {                                                                                        \
            const uint64_t tail = HEAD_KERNEL(x + i * (ITEM), n - i);                                       \
            top = tail > top ? tail : top;                                                                  \
        }                                                                                                   \
        return top;                                                                                         \
    }                                                                                                       \
    AVX512_TARGET static uint64_t NAME(const void *data, ptrdiff_t n) {                                     \
        const ptrdiff_t head = head_to_line(data, (ITEM), n);                                               \
        const uint64_t first = head ? HEAD_KERNEL(data, head) : 0;                                          \
        const uint64_t rest = NAME##_body((const char *)data + head * (ITEM), n - head);                    \
        return first > rest ? first : rest;                                                                 \
    }

AMPSCALE_AMAX512(fp8_amax_f16_avx512, 16, 0x7fff, _mm512_set1_epi16, _mm512_max_epu16, fp8_amax_f16_avx2, 2)
AMPSCALE_AMAX512(fp8_amax_f32_avx512, 32, 0x7fffffff, _mm512_set1_epi32, _mm512_max_epu32, fp8_amax_f32_avx2, 4)
AMPSCALE_AMAX512(fp8_amax_f64_avx512, 64, 0x7fffffffffffffffll, _mm512_set1_epi64, _mm512_max_epu64,
                 fp8_amax_f64_avx2, 8)
#undef AMPSCALE_AMAX512
#endif

/* A family: the amax kernel of each kind (bfloat16's is float16's: both clear bit 15) and the
 * cast kernel of each format and kind. */
typedef struct {
    const char *isa;
    fp8_amax_fn amax[KIND_COUNT];
    fp8_cast_fn cast[FP8_FORMAT_COUNT][KIND_COUNT];
} Fp8Family;

static const Fp8Family fp8_generic_family = {
    "generic",
    {fp8_amax_f16_generic, fp8_amax_f16_generic, fp8_amax_f32_generic, fp8_amax_f64_generic},
    FP8_CAST_TABLE(generic)};
#if AMPSCALE_X86_DISPATCH
static const Fp8Family fp8_avx2_family = {
    "avx2+f16c", {fp8_amax_f16_avx2, fp8_amax_f16_avx2, fp8_amax_f32_avx2, fp8_amax_f64_avx2}, FP8_CAST_TABLE(avx2)};
static const Fp8Family fp8_avx512_family = {
    "avx512",
    {fp8_amax_f16_avx512, fp8_amax_f16_avx512, fp8_amax_f32_avx512, fp8_amax_f64_avx512},
    FP8_CAST_TABLE(avx512)};
#endif

/* The family of the gradient kernels in use (kernels.h's select_isa, and use_isa in tests):
 * one switch picks both. */
static const Fp8Family *fp8_family(void) {
#if AMPSCALE_X86_DISPATCH
    if (strcmp(kernel_isa, fp8_avx512_family.isa) == 0) return &fp8_avx512_family;
    if (strcmp(kernel_isa, fp8_avx2_family.isa) == 0) return &fp8_avx2_family;
#endif
    return &fp8_generic_family;
}

/* ---------------------------------------------------------------- work splitting */

typedef struct {
    const char *data;
    uint8_t *out;    /* the payload, one byte per element; NULL: amax only */
    ptrdiff_t n;     /* elements */
    ptrdiff_t start; /* bytes of all spans before this one */
    int kind;
    float scale;
} Fp8Span;

typedef struct {
    ptrdiff_t span; /* -1: none */
    uint64_t top;
    long long clipped;
} Fp8Partial;

typedef struct {
    const Fp8Span *spans;
    ptrdiff_t count;
    ptrdiff_t lo, hi; /* bytes [lo, hi) of the concatenation */
    const Fp8Family *family;
    int format; /* FP8_*, or -1: amax only */
    int divide;
    uint32_t nan_byte;
    uint64_t *top;      /* per span, written for the spans this piece covers whole */
    long long *clipped; /* per span, likewise (NULL without a cast) */
    Fp8Partial partial[2]; /* the spans it covers in part: at most its first and its last */
    unsigned int fp_control;
} Fp8Work;

/* The first element of a span at or after byte `at` of the concatenation. */
static inline ptrdiff_t fp8_first_element(const Fp8Span *span, ptrdiff_t at) {
    if (at <= span->start) return 0;
    const ptrdiff_t size = kind_size[span->kind];
    const ptrdiff_t i = (at - span->start + size - 1) / size;
    return i < span->n ? i : span->n;
}

static void fp8_run_work(Fp8Work *w) {
    w->partial[0].span = w->partial[1].span = -1;
    ptrdiff_t a = 0, b = w->count; /* the first span that ends after lo (spans are in order) */
    while (a < b) {
        const ptrdiff_t mid = a + (b - a) / 2;
        const Fp8Span *s = &w->spans[mid];
        if (s->start + s->n * kind_size[s->kind] <= w->lo) a = mid + 1;
        else b = mid;
    }
    int partials = 0;
    for (ptrdiff_t s = a; s < w->count; s++) {
        const Fp8Span *span = &w->spans[s];
        if (span->start >= w->hi) break;
        const ptrdiff_t begin = fp8_first_element(span, w->lo), end = fp8_first_element(span, w->hi);
        if (end <= begin) continue;
        const ptrdiff_t size = kind_size[span->kind];
        const char *p = span->data + begin * size;
        long long clipped = 0;
        uint64_t top;
        if (w->format >= 0) {
            top = w->family->cast[w->format][span->kind](p, span->out + begin, end - begin, span->scale, w->divide,
                                                         w->nan_byte, &clipped);
        } else {
            top = w->family->amax[span->kind](p, end - begin);
        }
        if (begin == 0 && end == span->n) {
            w->top[s] = top;
            if (w->clipped) w->clipped[s] = clipped;
        } else {
            w->partial[partials].span = s;
            w->partial[partials].top = top;
            w->partial[partials].clipped = clipped;
            partials++;
        }
    }
}

static void fp8_run_work_as_caller(Fp8Work *w) {
#if AMPSCALE_X86_DISPATCH
    const unsigned int own = _mm_getcsr();
    if (own != w->fp_control) _mm_setcsr(w->fp_control);
#endif
    fp8_run_work(w);
#if AMPSCALE_X86_DISPATCH
    if (own != w->fp_control) _mm_setcsr(own);
#endif
}

#if AMPSCALE_THREADS
static void *fp8_thread_main(void *arg) {
    fp8_run_work_as_caller((Fp8Work *)arg);
    return NULL;
}
#endif

/* Below this many bytes one thread is faster than starting another (the gradient kernels'
 * threshold, 2^19 float32 elements). */
#define FP8_PARALLEL_BYTES (PARALLEL_THRESHOLD * 2 * 4)

/* Split `spans` (their `start` fields filled, `total` bytes) into `threads` equal byte ranges.
 * `top` (and `clipped`, with a cast) must hold zeros: a span no piece covers whole (an empty one,
 * or one a cut crosses) gets its value from the merge. Returns the number of pieces. */
static int fp8_plan(Fp8Work *work, const Fp8Span *spans, ptrdiff_t count, ptrdiff_t total, int format, int divide,
                    uint32_t nan_byte, uint64_t *top, long long *clipped, int threads) {
    if (threads < 1) threads = 1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (total < FP8_PARALLEL_BYTES) threads = 1;
    const Fp8Family *family = fp8_family();
    const unsigned int fp_control = fp_control_get();
    for (int t = 0; t < threads; t++) {
        Fp8Work *w = &work[t];
        w->spans = spans;
        w->count = count;
        w->lo = total * t / threads;
        w->hi = total * (t + 1) / threads;
        w->family = family;
        w->format = format;
        w->divide = divide;
        w->nan_byte = nan_byte;
        w->top = top;
        w->clipped = clipped;
        w->partial[0].span = w->partial[1].span = -1;
        w->fp_control = fp_control;
    }
    return threads;
}

/* Fold the pieces' partial results into the per-span arrays (max and sum: any order gives the
 * same values). */
static void fp8_merge(const Fp8Work *work, int pieces, uint64_t *top, long long *clipped) {
    for (int t = 0; t < pieces; t++) {
        for (int k = 0; k < 2; k++) {
            const Fp8Partial *p = &work[t].partial[k];
            if (p->span < 0) continue;
            if (p->top > top[p->span]) top[p->span] = p->top;
            if (clipped) clipped[p->span] += p->clipped;
        }
    }
}

/* Run every span, on up to `threads` threads (the calling one included). */
static void fp8_run_all(const Fp8Span *spans, ptrdiff_t count, ptrdiff_t total, int format, int divide,
                        uint32_t nan_byte, uint64_t *top, long long *clipped, int threads) {
    if (!AMPSCALE_THREADS) threads = 1;
    Fp8Work work[MAX_THREADS];
    const int pieces = fp8_plan(work, spans, count, total, format, divide, nan_byte, top, clipped, threads);
#if AMPSCALE_THREADS
    pthread_t handles[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    for (int t = 1; t < pieces; t++) started[t] = pthread_create(&handles[t], NULL, fp8_thread_main, &work[t]) == 0;
    fp8_run_work(&work[0]);
    for (int t = 1; t < pieces; t++) {
        if (started[t]) {
            pthread_join(handles[t], NULL);
        } else {
            fp8_run_work(&work[t]); /* could not start a thread: its share runs here */
        }
    }
#else
    for (int t = 0; t < pieces; t++) fp8_run_work(&work[t]);
#endif
    fp8_merge(work, pieces, top, clipped);
}

#endif /* AMPSCALE_FP8_KERNELS_H */
