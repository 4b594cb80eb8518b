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

// Returns true when the element was inf or nan.
__host__ __device__ inline bool ampscale_process(char* base, long long i, long long kind, float inv, bool multiply) {
    if (kind == AMPSCALE_KIND_F32) {
        unsigned int* p = reinterpret_cast<unsigned int*>(base) + i;
        unsigned int bits = *p;
        if (multiply) *p = ampscale_f32_to_bits(ampscale_bits_to_f32(bits) * inv);
        return ampscale_bad_f32(bits);
    }
    if (kind == AMPSCALE_KIND_F16) {
        __half* p = reinterpret_cast<__half*>(base) + i;
        unsigned short bits = *reinterpret_cast<unsigned short*>(p);
        if (multiply) *p = __float2half_rn(__half2float(*p) * inv);
        return ampscale_bad_f16(bits);
    }
    if (kind == AMPSCALE_KIND_BF16) {
        unsigned short* p = reinterpret_cast<unsigned short*>(base) + i;
        unsigned short bits = *p;
        if (multiply) *p = ampscale_f32_to_bf16(ampscale_bf16_to_f32(bits) * inv);
        return ampscale_bad_bf16(bits);
    }
    unsigned long long* p = reinterpret_cast<unsigned long long*>(base) + i;
    unsigned long long bits = *p;
    if (multiply) *p = ampscale_f64_to_bits(ampscale_bits_to_f64(bits) * static_cast<double>(inv));
    return ampscale_bad_f64(bits);
}

// Elements [first, last) of one chunk, visited by `lane` of `lanes` workers.
__host__ __device__ inline bool ampscale_chunk_part(const AmpscaleChunk& chunk, long long lane, long long lanes, float inv,
                                                    bool multiply) {
    char* base = reinterpret_cast<char*>(chunk.data);
    bool bad = false;
    const long long end = chunk.start + chunk.length;
    if (chunk.kind == AMPSCALE_KIND_F32 && multiply) {
        // float4 loads and stores where the chunk is 16-byte aligned (the common case).
        const long long vec_first = (chunk.start + 3) / 4 * 4;
        const long long vec_end = end / 4 * 4;
        bool aligned = (reinterpret_cast<unsigned long long>(base) % 16 == 0) && vec_first < vec_end;
        if (aligned) {
            for (long long i = chunk.start + lane; i < vec_first; i += lanes) bad |= ampscale_process(base, i, chunk.kind, inv, multiply);
            float4* v = reinterpret_cast<float4*>(base);
            for (long long j = vec_first / 4 + lane; j < vec_end / 4; j += lanes) {
                float4 x = v[j];
                bad |= ampscale_bad_f32(ampscale_f32_to_bits(x.x)) | ampscale_bad_f32(ampscale_f32_to_bits(x.y)) |
                       ampscale_bad_f32(ampscale_f32_to_bits(x.z)) | ampscale_bad_f32(ampscale_f32_to_bits(x.w));
                x.x *= inv;
                x.y *= inv;
                x.z *= inv;
                x.w *= inv;
                v[j] = x;
            }
            for (long long i = vec_end + lane; i < end; i += lanes) bad |= ampscale_process(base, i, chunk.kind, inv, multiply);
            return bad;
        }
    }
    for (long long i = chunk.start + lane; i < end; i += lanes) bad |= ampscale_process(base, i, chunk.kind, inv, multiply);
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
