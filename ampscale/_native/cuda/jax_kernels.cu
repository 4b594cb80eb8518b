// The CUDA kernels of the JAX XLA FFI handler (ampscale/_native/cuda/jax_ffi_cuda.cc): the check +
// unscale of many buffers in place, on the stream XLA gives the handler, the flag written on the
// device.
//
// The part up to AMPSCALE_JAX_PARAMS_ONLY is plain C++ and is all the handler includes: the
// launch's parameter layout. Each launch takes up to AMPSCALE_JAX_LEAVES buffers, and their
// table (address, size and dtype, first chunk) is passed BY VALUE as a kernel parameter, the
// way torch's multi_tensor_apply passes its tensor lists: the driver copies it with the launch,
// so a call builds it on the host with no device allocation, no copy to the device and no
// host sync. The table stays under the 4 KB every CUDA driver accepts for a launch's parameters.
//
// The rest is compiled by NVRTC after ampscale._native.cuda._plan.module_source(...) (kernels.cu: the
// element, word and chunk code shared with the CuPy and torch kernels), and by the host's C++
// compiler with AMPSCALE_HOST_TEST for the tests, which run it on the CPU.
//
// Semantics (the FFI target's contract, as on the CPU): every value is multiplied by the
// inverse scale, also by exactly 1 (XLA's multiply does so: signalling NaNs come out quiet), in
// float32 (float64 for float64 buffers), rounded back to nearest even; the flag is 1 when every
// value STORED is finite. ampscale_jax_begin sets the flag to 1 first, on the same stream; each
// block that stores an inf or nan writes 0 (a flag only ever goes from 1 to 0).

#ifndef AMPSCALE_JAX_KERNEL_PARAMS
#define AMPSCALE_JAX_KERNEL_PARAMS

// Buffers per launch: the table below is 3,088 bytes. Not raised, although CUDA 12.1+ drivers
// take up to 32,764 bytes of parameters on Volta and later (about 1,300 buffers): a call never
// holds more than ampscale.backends._jax_custom_call.GROUP = 128 leaves (XLA's compile time
// grows faster than linearly with one call's aliased results: 2,000 in one call took about 40 s
// on the CPU), so every call is already one flag launch and one table launch, and a larger table
// would save none. It would also need a driver check and a second table layout, a path no GPU
// has run. Raise it together with GROUP, if the GPU run shows XLA:GPU compiling large calls fast.
#define AMPSCALE_JAX_LEAVES 128
#define AMPSCALE_JAX_CHUNK 65536LL  // elements per block
#define AMPSCALE_JAX_THREADS 512     // threads per block

// dtype codes (kernels.cu's AMPSCALE_KIND_*; checked below where both are visible)
#define AMPSCALE_JAX_F16 0
#define AMPSCALE_JAX_BF16 1
#define AMPSCALE_JAX_F32 2
#define AMPSCALE_JAX_F64 3

// The buffers of one launch. Block b processes chunk b of the concatenation of their chunks:
// buffer i owns the blocks [first_chunk[i], first_chunk[i + 1]). Empty buffers are never listed.
struct AmpscaleJaxLeaves {
    unsigned long long data[AMPSCALE_JAX_LEAVES];  // device address of each buffer
    long long meta[AMPSCALE_JAX_LEAVES];           // element count << 8 | dtype code
    long long first_chunk[AMPSCALE_JAX_LEAVES + 1];
    long long count;  // buffers listed, 1 to AMPSCALE_JAX_LEAVES
};

#endif

#ifndef AMPSCALE_JAX_PARAMS_ONLY

static_assert(AMPSCALE_JAX_F16 == AMPSCALE_KIND_F16 && AMPSCALE_JAX_BF16 == AMPSCALE_KIND_BF16 &&
                  AMPSCALE_JAX_F32 == AMPSCALE_KIND_F32 && AMPSCALE_JAX_F64 == AMPSCALE_KIND_F64,
              "the JAX launch's dtype codes are kernels.cu's");

#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
// Inlined into the kernel, the table is read straight from the parameter space (a function
// taking its address would make every thread copy 3 KB to local memory).
#define AMPSCALE_JAX_FN __host__ __device__ __forceinline__
#else
#define AMPSCALE_JAX_FN inline
#endif

// The chunk block `block` processes: the buffer whose blocks include it (a binary search over
// first_chunk), and the elements of that block.
AMPSCALE_JAX_FN AmpscaleChunk ampscale_jax_chunk(const AmpscaleJaxLeaves& leaves, long long block) {
    long long lo = 0, hi = leaves.count - 1;
    while (lo < hi) {
        const long long mid = (lo + hi + 1) / 2;
        if (leaves.first_chunk[mid] <= block)
            lo = mid;
        else
            hi = mid - 1;
    }
    const long long size = leaves.meta[lo] >> 8;
    AmpscaleChunk chunk;
    chunk.data = leaves.data[lo];
    chunk.start = (block - leaves.first_chunk[lo]) * AMPSCALE_JAX_CHUNK;
    chunk.length = size - chunk.start < AMPSCALE_JAX_CHUNK ? size - chunk.start : AMPSCALE_JAX_CHUNK;
    chunk.kind = leaves.meta[lo] & 0xff;
    return chunk;
}

// float32 -> bfloat16 as XLA:GPU rounds it: the device's own conversion on sm_80 and later
// (XLA lowers the convert to cvt.rn.bf16.f32 there; so does kernels.cu's ampscale_f32_to_bf16),
// the software rounding elsewhere.
AMPSCALE_JAX_FN unsigned short ampscale_jax_f32_to_bf16(float f) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    unsigned short h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
#else
    return ampscale_f32_to_bf16(f);
#endif
}

// A bfloat16 NaN stored as XLA:GPU stores it. Below sm_80 kernels.cu rounds every bfloat16
// product in software, which keeps the product NaN's sign and gives 0x7fc0 (from sm_80 on it
// uses the device's cvt, as XLA does, and this pass rewrites each NaN with the same bits); XLA
// stores the device's conversion of the product. The product of a NaN is the device's canonical NaN whatever the
// NaN multiplied, so the NaN kernels.cu stored, multiplied again and converted by the device,
// is the very value XLA stores. Only a block that found an inf or nan in a bfloat16 chunk runs
// this (never on a finite step); after the block's barrier, so every element is final.
AMPSCALE_JAX_FN void ampscale_jax_bf16_nans(const AmpscaleChunk& chunk, long long lane, long long lanes, float inv) {
    unsigned short* values = reinterpret_cast<unsigned short*>(chunk.data);
    const long long end = chunk.start + chunk.length;
    for (long long i = chunk.start + lane; i < end; i += lanes) {
        const unsigned short v = values[i];
        if ((v & 0x7fffu) > 0x7f80u) values[i] = ampscale_jax_f32_to_bf16(ampscale_bf16_to_f32(v) * inv);
    }
}

#if defined(__CUDACC__) || defined(__CUDACC_RTC__)

// The flag starts true, on the stream of the launches that may clear it.
extern "C" __global__ void ampscale_jax_begin(unsigned char* finite) {
    if (blockIdx.x == 0 && threadIdx.x == 0) *finite = 1;
}

// One block per chunk of the listed buffers: multiply every element by *inv_scale, store it,
// and clear the flag if a stored value is inf or nan.
extern "C" __global__ void ampscale_jax_unscale(const float* inv_scale, unsigned char* finite,
                                                const AmpscaleJaxLeaves leaves) {
    const AmpscaleChunk chunk = ampscale_jax_chunk(leaves, blockIdx.x);
    const float inv = *inv_scale;
    const bool bad = ampscale_chunk_part(chunk, threadIdx.x, blockDim.x, inv, true);
    if (!__syncthreads_or(bad)) return;  // also the barrier before the NaN pass reads other lanes' stores
    if (chunk.kind == AMPSCALE_JAX_BF16) ampscale_jax_bf16_nans(chunk, threadIdx.x, blockDim.x, inv);
    if (threadIdx.x == 0) *finite = 0;
}

#endif

#ifdef AMPSCALE_HOST_TEST
// Host harness (tests only): a launch of ampscale_jax_unscale emulated block after block, lane
// after lane (every lane's first pass, then the barrier, then the NaN pass), and the begin kernel.
extern "C" void ampscale_jax_host_begin(unsigned char* finite) { *finite = 1; }

extern "C" void ampscale_jax_host_unscale(const float* inv_scale, unsigned char* finite,
                                          const AmpscaleJaxLeaves* leaves, long long blocks, int lanes) {
    for (long long block = 0; block < blocks; block++) {
        const AmpscaleChunk chunk = ampscale_jax_chunk(*leaves, block);
        bool bad = false;
        for (int lane = 0; lane < lanes; lane++) bad |= ampscale_chunk_part(chunk, lane, lanes, *inv_scale, true);
        if (!bad) continue;
        if (chunk.kind == AMPSCALE_JAX_BF16) {
            for (int lane = 0; lane < lanes; lane++) ampscale_jax_bf16_nans(chunk, lane, lanes, *inv_scale);
        }
        *finite = 0;
    }
}
#endif

#endif
