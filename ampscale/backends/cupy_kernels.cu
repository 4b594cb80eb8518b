// ampscale's fused multi-tensor overflow check + unscale for CuPy (loaded with cupy.RawModule).
//
// One launch per step covers every gradient array, of any dtype: the host builds a table of
// chunks (pointer, first element, length, dtype code), cached while the arrays stay the same,
// and block b processes chunk b. Each element is read once and written once: its exponent bits
// are tested for inf/nan (exact: no sum or norm that a finite input could overflow), it is
// multiplied by the inverse scale in float32 opmath (float64 for double) and rounded back to
// nearest-even, as torch's _amp_foreach_non_finite_check_and_unscale_ does. The inverse scale
// and the flag stay in device memory: no host synchronisation.
//
// The element code is __host__ __device__ so that tests can run it on the CPU
// (AMPSCALE_HOST_TEST builds a host harness that emulates the grid), and the file compiles
// with nvcc (tests build PTX for sm_80 and sm_90) as well as with NVRTC through CuPy.

#include <cuda_fp16.h>  // CuPy ships it for NVRTC; bfloat16 needs no header (bit arithmetic below)

#define AMPSCALE_KIND_F16 0
#define AMPSCALE_KIND_BF16 1
#define AMPSCALE_KIND_F32 2
#define AMPSCALE_KIND_F64 3

// One row of the chunk table (32 bytes, naturally aligned).
struct AmpscaleChunk {
    unsigned long long data;  // device address of the array's first element
    long long start;          // first element of this chunk
    long long length;         // elements in this chunk
    long long kind;           // AMPSCALE_KIND_*
};

// ------------------------------------------------------------------ per element

__host__ __device__ inline bool ampscale_bad_f32(unsigned int bits) {
    return (bits & 0x7f800000u) == 0x7f800000u;
}

__host__ __device__ inline bool ampscale_bad_f64(unsigned long long bits) {
    return (bits & 0x7ff0000000000000ull) == 0x7ff0000000000000ull;
}

__host__ __device__ inline bool ampscale_bad_f16(unsigned short bits) { return (bits & 0x7c00u) == 0x7c00u; }

__host__ __device__ inline bool ampscale_bad_bf16(unsigned short bits) { return (bits & 0x7f80u) == 0x7f80u; }

__host__ __device__ inline float ampscale_bits_to_f32(unsigned int bits) {
    union { unsigned int u; float f; } v;
    v.u = bits;
    return v.f;
}

__host__ __device__ inline unsigned int ampscale_f32_to_bits(float f) {
    union { unsigned int u; float f; } v;
    v.f = f;
    return v.u;
}

__host__ __device__ inline double ampscale_bits_to_f64(unsigned long long bits) {
    union { unsigned long long u; double f; } v;
    v.u = bits;
    return v.f;
}

__host__ __device__ inline unsigned long long ampscale_f64_to_bits(double f) {
    union { unsigned long long u; double f; } v;
    v.f = f;
    return v.u;
}

// bfloat16 is the top half of a float32: exact widening, round-to-nearest-even narrowing
// (nan becomes the canonical quiet nan), as c10::BFloat16 and ml_dtypes do.
__host__ __device__ inline float ampscale_bf16_to_f32(unsigned short b) {
    return ampscale_bits_to_f32(static_cast<unsigned int>(b) << 16);
}

__host__ __device__ inline unsigned short ampscale_f32_to_bf16(float f) {
    unsigned int x = ampscale_f32_to_bits(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<unsigned short>(((x >> 16) & 0x8000u) | 0x7fc0u);
    return static_cast<unsigned short>((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

__host__ __device__ inline float ampscale_f16_to_f32(unsigned short b) {
    __half_raw r;
    r.x = b;
    return __half2float(__half(r));
}

__host__ __device__ inline unsigned short ampscale_f32_to_f16(float f) {
    const __half_raw r = __float2half_rn(f);
    return r.x;
}

// One 16-bit element (float16 or bfloat16) as bits: returns the new bits, sets `bad` on inf/nan.
__host__ __device__ inline unsigned int ampscale_half_bits(unsigned int bits, long long kind, float inv, bool multiply,
                                                           bool& bad) {
    const unsigned short b = static_cast<unsigned short>(bits);
    if (kind == AMPSCALE_KIND_F16) {
        bad |= ampscale_bad_f16(b);
        return multiply ? ampscale_f32_to_f16(ampscale_f16_to_f32(b) * inv) : b;
    }
    bad |= ampscale_bad_bf16(b);
    return multiply ? ampscale_f32_to_bf16(ampscale_bf16_to_f32(b) * inv) : b;
}

__host__ __device__ inline unsigned int ampscale_f32_bits(unsigned int bits, float inv, bool multiply, bool& bad) {
    bad |= ampscale_bad_f32(bits);
    return multiply ? ampscale_f32_to_bits(ampscale_bits_to_f32(bits) * inv) : bits;
}

__host__ __device__ inline unsigned long long ampscale_f64_bits(unsigned long long bits, float inv, bool multiply,
                                                                bool& bad) {
    bad |= ampscale_bad_f64(bits);
    return multiply ? ampscale_f64_to_bits(ampscale_bits_to_f64(bits) * static_cast<double>(inv)) : bits;
}

// Element i of an array. Returns true when the element was inf or nan.
__host__ __device__ inline bool ampscale_process(char* base, long long i, long long kind, float inv, bool multiply) {
    bool bad = false;
    if (kind == AMPSCALE_KIND_F32) {
        unsigned int* p = reinterpret_cast<unsigned int*>(base) + i;
        const unsigned int out = ampscale_f32_bits(*p, inv, multiply, bad);
        if (multiply) *p = out;
    } else if (kind == AMPSCALE_KIND_F64) {
        unsigned long long* p = reinterpret_cast<unsigned long long*>(base) + i;
        const unsigned long long out = ampscale_f64_bits(*p, inv, multiply, bad);
        if (multiply) *p = out;
    } else {
        unsigned short* p = reinterpret_cast<unsigned short*>(base) + i;
        const unsigned int out = ampscale_half_bits(*p, kind, inv, multiply, bad);
        if (multiply) *p = static_cast<unsigned short>(out);
    }
    return bad;
}

// Two 16-bit elements packed in 32 bits (little-endian: the lower address in the low half).
__host__ __device__ inline unsigned int ampscale_half_pair(unsigned int two, long long kind, float inv, bool multiply,
                                                           bool& bad) {
    const unsigned int lo = ampscale_half_bits(two & 0xffffu, kind, inv, multiply, bad);
    const unsigned int hi = ampscale_half_bits(two >> 16, kind, inv, multiply, bad);
    return lo | (hi << 16);
}

// One 16-byte word: 4 float32, 2 float64 or 8 float16/bfloat16 elements. Integer lanes only,
// so the same code is exact on the host (no type punning of the word itself).
__host__ __device__ inline bool ampscale_word(uint4& w, long long kind, float inv, bool multiply) {
    bool bad = false;
    if (kind == AMPSCALE_KIND_F32) {
        w.x = ampscale_f32_bits(w.x, inv, multiply, bad);
        w.y = ampscale_f32_bits(w.y, inv, multiply, bad);
        w.z = ampscale_f32_bits(w.z, inv, multiply, bad);
        w.w = ampscale_f32_bits(w.w, inv, multiply, bad);
    } else if (kind == AMPSCALE_KIND_F64) {
        const unsigned long long a =
            ampscale_f64_bits((static_cast<unsigned long long>(w.y) << 32) | w.x, inv, multiply, bad);
        const unsigned long long b =
            ampscale_f64_bits((static_cast<unsigned long long>(w.w) << 32) | w.z, inv, multiply, bad);
        w.x = static_cast<unsigned int>(a);
        w.y = static_cast<unsigned int>(a >> 32);
        w.z = static_cast<unsigned int>(b);
        w.w = static_cast<unsigned int>(b >> 32);
    } else {
        w.x = ampscale_half_pair(w.x, kind, inv, multiply, bad);
        w.y = ampscale_half_pair(w.y, kind, inv, multiply, bad);
        w.z = ampscale_half_pair(w.z, kind, inv, multiply, bad);
        w.w = ampscale_half_pair(w.w, kind, inv, multiply, bad);
    }
    return bad;
}

__host__ __device__ inline long long ampscale_item_size(long long kind) {
    return kind == AMPSCALE_KIND_F64 ? 8 : (kind == AMPSCALE_KIND_F32 ? 4 : 2);
}

// Elements [start, start + length) of one chunk, visited by `lane` of `lanes` workers: 16-byte
// loads and stores, four in flight per worker, where the array is 16-byte aligned (CuPy's
// allocations are); element by element for the unaligned head and tail.
__host__ __device__ inline bool ampscale_chunk_part(const AmpscaleChunk& chunk, long long lane, long long lanes, float inv,
                                                    bool multiply) {
    char* base = reinterpret_cast<char*>(chunk.data);
    const long long kind = chunk.kind;
    const long long end = chunk.start + chunk.length;
    const long long per_word = 16 / ampscale_item_size(kind);
    const long long vec_first = (chunk.start + per_word - 1) / per_word * per_word;
    const long long vec_end = end / per_word * per_word;
    bool bad = false;
    if (chunk.data % 16 == 0 && vec_first < vec_end) {
        for (long long i = chunk.start + lane; i < vec_first; i += lanes) bad |= ampscale_process(base, i, kind, inv, multiply);
        uint4* words = reinterpret_cast<uint4*>(base);
        long long j = vec_first / per_word + lane;
        const long long last = vec_end / per_word;
        for (; j + 3 * lanes < last; j += 4 * lanes) {
            uint4 a = words[j];
            uint4 b = words[j + lanes];
            uint4 c = words[j + 2 * lanes];
            uint4 d = words[j + 3 * lanes];
            bad |= ampscale_word(a, kind, inv, multiply);
            bad |= ampscale_word(b, kind, inv, multiply);
            bad |= ampscale_word(c, kind, inv, multiply);
            bad |= ampscale_word(d, kind, inv, multiply);
            if (multiply) {
                words[j] = a;
                words[j + lanes] = b;
                words[j + 2 * lanes] = c;
                words[j + 3 * lanes] = d;
            }
        }
        for (; j < last; j += lanes) {
            uint4 a = words[j];
            bad |= ampscale_word(a, kind, inv, multiply);
            if (multiply) words[j] = a;
        }
        for (long long i = vec_end + lane; i < end; i += lanes) bad |= ampscale_process(base, i, kind, inv, multiply);
        return bad;
    }
    for (long long i = chunk.start + lane; i < end; i += lanes) bad |= ampscale_process(base, i, kind, inv, multiply);
    return bad;
}

// ------------------------------------------------------------------ the kernel

extern "C" __global__ void ampscale_check_and_unscale(const AmpscaleChunk* chunks, const float* inv_scale,
                                                      float* found_inf, int multiply) {
    const AmpscaleChunk chunk = chunks[blockIdx.x];
    const float inv = *inv_scale;
    const bool do_multiply = multiply && inv != 1.0f;
    const bool bad = ampscale_chunk_part(chunk, threadIdx.x, blockDim.x, inv, do_multiply);
    // One store per block that saw an inf or nan: found_inf only ever goes from 0 to 1.
    if (__syncthreads_or(bad) && threadIdx.x == 0) *found_inf = 1.0f;
}

#ifdef AMPSCALE_HOST_TEST
// Host harness: the same chunk code, with the grid emulated sequentially (tests only).
extern "C" int ampscale_host_check_and_unscale(const AmpscaleChunk* chunks, int num_chunks, float inv, int multiply,
                                               int lanes) {
    bool bad = false;
    const bool do_multiply = multiply && inv != 1.0f;
    for (int b = 0; b < num_chunks; b++) {
        for (int lane = 0; lane < lanes; lane++) bad |= ampscale_chunk_part(chunks[b], lane, lanes, inv, do_multiply);
    }
    return bad ? 1 : 0;
}
#endif
