// The fused FP8 pass on CUDA: one launch over many tensors giving each tensor's amax (float32) and,
// optionally, its saturated FP8 payload and a count of the elements the saturation clipped; the
// CPU version is ampscale/_native/cpu/fp8_kernels.h, and the two give the same bits.
//
// Appended to kernels.cu (its conversions and AMPSCALE_HD are used) by
// ampscale._native.cuda._fp8.module_source; compiled by NVRTC with kernels.cu's options
// (--fmad=false --ftz=false: the one float operation, x * scale, is IEEE and keeps subnormals),
// and by the host C++ compiler with AMPSCALE_HOST_TEST for the tests, which emulate the grid.
//
// The launch: block b processes row b of a chunk table (address, payload offset, first element,
// length, slot << 8 | dtype code), built on the host and cached while the tensors stay the same:
// every payload lives in one buffer given per launch (each at a 16-byte aligned offset), so a
// new buffer per call needs no new table.
// Every thread keeps the largest float32 magnitude bits it has seen (an f16/bf16 magnitude
// widened exactly, an f64 one rounded to float32 as NumPy's astype does, any NaN the canonical
// 0x7fc00000: every NaN above +inf, so the integer maximum is NaN, else inf, else max |x|, with no
// float compare that flushing could change) and its clipped count; the block reduces both and
// one thread updates the slot's scratch with atomicMax / atomicAdd. Each block then takes a ticket;
// the block that draws the last one writes every slot's float32 amax, its count and the
// all-finite flag, and resets the scratch for the next launch on the stream (atomicExch reads
// and clears in one step), so the pass needs no memset and no second launch. The grid has at
// least one block, so a pass over empty tensors still writes its zeros.
//
// ampscale_fp8_pass_step (compiled where AMPSCALE_FP8_TRANSITION is defined, after the emitted
// FP8 transition and its per-slot update on the state's arrays, ampscale.fp8._codegen's
// c_transition and c_state_update): the same pass, then the same last block runs the update of
// every slot on the amaxes it just wrote, one slot per thread, the step count on thread 0: the
// bookkeeping of a step in one launch.

// The part up to AMPSCALE_FP8_PARAMS_ONLY is plain C++, the launches' layouts: the JAX CUDA
// handler (jax_ffi_fp8_cuda.cc) includes only it.
#ifndef AMPSCALE_FP8_PARAMS
#define AMPSCALE_FP8_PARAMS

#define AMPSCALE_FP8_THREADS 512        // threads per block
#define AMPSCALE_FP8_CHUNK 65536LL      // elements per row of the table
#define AMPSCALE_FP8_CAST 1LL           // options: write the payload
#define AMPSCALE_FP8_DIVIDE 2LL         // options: x / scale (else x * scale)
#define AMPSCALE_FP8_FORMAT_SHIFT 4     // options: bits 4-7 the format (0 E4M3FN, 1 E5M2, 2 E4M3FNUZ, 3 E5M2FNUZ)
#define AMPSCALE_FP8_NAN_SHIFT 8        // options: bits 8-15 the NaN byte (before its sign)

// One row of the table (40 bytes, naturally aligned).
struct AmpscaleFp8Chunk {
    unsigned long long data;  // device address of the tensor's first element
    unsigned long long out;   // byte offset of its payload's first byte in the launch's payload buffer
    long long start;          // first element of this chunk
    long long length;         // elements in this chunk
    long long meta;           // slot << 8 | AMPSCALE_KIND_*
};

// ampscale_fp8_jax_pass (the JAX CUDA handler's kernel): the tensors of one launch, passed BY
// VALUE as a kernel parameter (the driver copies it with the launch: no device allocation, no
// copy, no sync), as jax_kernels.cu passes its table. Block b processes chunk b of the
// concatenation: tensor i owns blocks [first_chunk[i], first_chunk[i + 1]). Empty tensors are
// never listed (their slot's amax is the 0 the handler's memset wrote).
#define AMPSCALE_FP8_JAX_LEAVES 64  // tensors per launch: the table is 2,576 bytes
struct AmpscaleFp8JaxLeaves {
    unsigned long long data[AMPSCALE_FP8_JAX_LEAVES];  // device address of each tensor
    unsigned long long out[AMPSCALE_FP8_JAX_LEAVES];   // device address of its payload (a cast)
    long long meta[AMPSCALE_FP8_JAX_LEAVES];           // element count << 8 | dtype code
    long long slot[AMPSCALE_FP8_JAX_LEAVES];           // its slot in the call's outputs
    long long first_chunk[AMPSCALE_FP8_JAX_LEAVES + 1];
    long long count;  // tensors listed, 1 to AMPSCALE_FP8_JAX_LEAVES
};

#endif

#ifndef AMPSCALE_FP8_PARAMS_ONLY

#if !defined(__CUDACC__) && !defined(__CUDACC_RTC__)
struct uint2 {
    unsigned int x, y;
};
#endif

// ------------------------------------------------------------------ per element

// The float32 magnitude bits of one element given as its bits (see the head of the file).
AMPSCALE_HD inline unsigned int ampscale_fp8_magnitude(unsigned long long bits, long long kind) {
    if (kind == AMPSCALE_KIND_F32) {
        const unsigned int m = static_cast<unsigned int>(bits) & 0x7fffffffu;
        return m > 0x7f800000u ? 0x7fc00000u : m;
    }
    if (kind == AMPSCALE_KIND_F64) {
        const unsigned long long m = bits & 0x7fffffffffffffffull;
        if (m > 0x7ff0000000000000ull) return 0x7fc00000u;
        return ampscale_f32_to_bits(static_cast<float>(ampscale_bits_to_f64(m)));
    }
    const unsigned short h = static_cast<unsigned short>(bits) & 0x7fffu;
    if (kind == AMPSCALE_KIND_BF16) return h > 0x7f80u ? 0x7fc00000u : static_cast<unsigned int>(h) << 16;
    return h > 0x7c00u ? 0x7fc00000u : ampscale_f32_to_bits(ampscale_f16_to_f32(h));
}

// One element given as its bits, widened to float32 (float64 rounded to nearest even).
AMPSCALE_HD inline float ampscale_fp8_widen(unsigned long long bits, long long kind) {
    if (kind == AMPSCALE_KIND_F32) return ampscale_bits_to_f32(static_cast<unsigned int>(bits));
    if (kind == AMPSCALE_KIND_F64) return static_cast<float>(ampscale_bits_to_f64(bits));
    const unsigned short h = static_cast<unsigned short>(bits);
    return kind == AMPSCALE_KIND_BF16 ? ampscale_bf16_to_f32(h) : ampscale_f16_to_f32(h);
}

// The bits of element i.
AMPSCALE_HD inline unsigned long long ampscale_fp8_load(const char* base, long long i, long long kind) {
    if (kind == AMPSCALE_KIND_F32) return reinterpret_cast<const unsigned int*>(base)[i];
    if (kind == AMPSCALE_KIND_F64) return reinterpret_cast<const unsigned long long*>(base)[i];
    return reinterpret_cast<const unsigned short*>(base)[i];
}

// The elements of one 16-byte word (little-endian: the lower address first); returns their count.
AMPSCALE_HD inline int ampscale_fp8_unpack(const uint4& w, long long kind, unsigned long long* bits) {
    if (kind == AMPSCALE_KIND_F64) {
        bits[0] = (static_cast<unsigned long long>(w.y) << 32) | w.x;
        bits[1] = (static_cast<unsigned long long>(w.w) << 32) | w.z;
        return 2;
    }
    const unsigned int parts[4] = {w.x, w.y, w.z, w.w};
    if (kind == AMPSCALE_KIND_F32) {
        for (int k = 0; k < 4; k++) bits[k] = parts[k];
        return 4;
    }
    for (int k = 0; k < 4; k++) {
        bits[2 * k] = parts[k] & 0xffffu;
        bits[2 * k + 1] = parts[k] >> 16;
    }
    return 8;
}

// float32 bits -> the FP8 byte of `format`, saturating: the CPU encoder of fp8_kernels.h (clip to
// fp8_max, round to nearest even in integer arithmetic, subnormals included; NaN -> nan_byte with
// the sign where the format has one; the fnuz formats have no -0). `clipped` counts the products
// the clip changed (inf included, NaN not).
AMPSCALE_HD inline unsigned int ampscale_fp8_encode(unsigned int u, long long format, unsigned int nan_byte,
                                                    unsigned int& clipped) {
    const unsigned int mbits = (format == 0 || format == 2) ? 3u : 2u;
    const unsigned int bias = format == 0 ? 7u : (format == 1 ? 15u : (format == 2 ? 8u : 16u));
    const unsigned int max_bits = format == 0 ? 0x43e00000u : (format == 2 ? 0x43700000u : 0x47600000u);
    const bool fnuz = format >= 2;
    const unsigned int sign = (u >> 24) & 0x80u;
    unsigned int a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return fnuz ? nan_byte : (sign | nan_byte);
    if (a > max_bits) {
        clipped++;
        a = max_bits;
    }
    const unsigned int exponent = a >> 23;
    unsigned int magnitude;
    if (exponent >= 128u - bias) {  // a normal result: round at bit 23 - mbits, rebias
        const unsigned int rounded = a + ((1u << (22u - mbits)) - 1u) + ((a >> (23u - mbits)) & 1u);
        magnitude = (rounded >> (23u - mbits)) - ((127u - bias) << mbits);
    } else {  // subnormal: the 24-bit mantissa in units of the smallest step, to nearest even
        const unsigned int mantissa = (a & 0x7fffffu) | 0x800000u;
        int shift = static_cast<int>(151u - bias - mbits) - static_cast<int>(exponent);
        shift = shift > 31 ? 31 : shift;
        unsigned int q = mantissa >> shift;
        const unsigned int rest = mantissa & ((1u << shift) - 1u), half = 1u << (shift - 1);
        q += (rest > half || (rest == half && (q & 1u))) ? 1u : 0u;
        magnitude = q;
    }
    if (fnuz && magnitude == 0u) return 0u;
    return sign | magnitude;
}

// What one element contributes: its magnitude to `top` and, casting, its payload byte.
AMPSCALE_HD inline unsigned int ampscale_fp8_element(unsigned long long bits, long long kind, bool cast, bool divide,
                                                     float scale, long long format, unsigned int nan_byte,
                                                     unsigned int& top, unsigned int& clipped) {
    const unsigned int m = ampscale_fp8_magnitude(bits, kind);
    top = m > top ? m : top;
    if (!cast) return 0u;
    const float x = ampscale_fp8_widen(bits, kind);
    return ampscale_fp8_encode(ampscale_f32_to_bits(divide ? x / scale : x * scale), format, nan_byte, clipped);
}

// ------------------------------------------------------------------ per chunk

// Elements [start, start + length) of one chunk, visited by `lane` of `lanes` workers: the
// amax bits of what it saw (its clipped count added to `clipped`). Where the input reaches a
// 16-byte boundary inside the chunk with its payload byte at a multiple of the word's element
// count (buffers from an allocator always do; views may not), each lane takes whole 16-byte
// words (one aligned load, one store of their payload bytes); the head and the tail, or the whole
// chunk otherwise, element by element.
AMPSCALE_HD inline unsigned int ampscale_fp8_chunk_part(const AmpscaleFp8Chunk& chunk, unsigned char* payload,
                                                         long long lane, long long lanes, float scale,
                                                         long long options, unsigned int& clipped) {
    const char* base = reinterpret_cast<const char*>(chunk.data);
    unsigned char* out = payload + chunk.out;  // out[i]: element i's byte (a cast only)
    const long long kind = chunk.meta & 0xff;
    const long long size = ampscale_item_size(kind);
    const bool cast = (options & AMPSCALE_FP8_CAST) != 0;
    const bool divide = (options & AMPSCALE_FP8_DIVIDE) != 0;
    const long long format = (options >> AMPSCALE_FP8_FORMAT_SHIFT) & 0xf;
    const unsigned int nan_byte = static_cast<unsigned int>((options >> AMPSCALE_FP8_NAN_SHIFT) & 0xff);
    const long long end = chunk.start + chunk.length;
    const long long per_word = 16 / size;
    unsigned int top = 0;
    long long vec_first = end, vec_end = end;  // no words: every element by the scalar loop
    if (chunk.data % size == 0) {
        const unsigned long long first_address = chunk.data + static_cast<unsigned long long>(chunk.start * size);
        const long long first = chunk.start + static_cast<long long>((16 - first_address % 16) % 16) / size;
        const unsigned long long out_address = reinterpret_cast<unsigned long long>(out) + first;
        const bool payload_aligned = !cast || out_address % per_word == 0;
        if (payload_aligned && first + per_word <= end) {
            vec_first = first;
            vec_end = first + (end - first) / per_word * per_word;
        }
    }
    for (long long i = chunk.start + lane; i < vec_first; i += lanes) {
        const unsigned int byte = ampscale_fp8_element(ampscale_fp8_load(base, i, kind), kind, cast, divide, scale,
                                                       format, nan_byte, top, clipped);
        if (cast) out[i] = static_cast<unsigned char>(byte);
    }
    const uint4* words = reinterpret_cast<const uint4*>(base + vec_first * size);
    for (long long w = lane; w < (vec_end - vec_first) / per_word; w += lanes) {
        unsigned long long bits[8];
        const int count = ampscale_fp8_unpack(words[w], kind, bits);
        unsigned long long packed = 0;
        for (int k = 0; k < count; k++) {
            const unsigned int byte =
                ampscale_fp8_element(bits[k], kind, cast, divide, scale, format, nan_byte, top, clipped);
            packed |= static_cast<unsigned long long>(byte) << (8 * k);
        }
        if (!cast) continue;
        unsigned char* target = out + vec_first + w * per_word;
        if (count == 8) {
            uint2 two;
            two.x = static_cast<unsigned int>(packed);
            two.y = static_cast<unsigned int>(packed >> 32);
            *reinterpret_cast<uint2*>(target) = two;
        } else if (count == 4) {
            *reinterpret_cast<unsigned int*>(target) = static_cast<unsigned int>(packed);
        } else {
            *reinterpret_cast<unsigned short*>(target) = static_cast<unsigned short>(packed);
        }
    }
    for (long long i = vec_end + lane; i < end; i += lanes) {
        const unsigned int byte = ampscale_fp8_element(ampscale_fp8_load(base, i, kind), kind, cast, divide, scale,
                                                       format, nan_byte, top, clipped);
        if (cast) out[i] = static_cast<unsigned char>(byte);
    }
    return top;
}

// The last block's work, thread `lane` of `lanes`: every slot's float32 amax and count from the
// scratch (read and reset in one atomic step on the device), and whether this lane saw only
// finite amaxes.
AMPSCALE_HD inline bool ampscale_fp8_finish(unsigned int* top, unsigned long long* clipped, long long slots,
                                            float* amax_out, long long* clipped_out, long long lane,
                                            long long lanes) {
    bool finite = true;
    for (long long s = lane; s < slots; s += lanes) {
#if defined(__CUDA_ARCH__)
        const unsigned int bits = atomicExch(top + s, 0u);
        const unsigned long long count = clipped ? atomicExch(clipped + s, 0ull) : 0ull;
#else
        const unsigned int bits = top[s];
        const unsigned long long count = clipped ? clipped[s] : 0ull;
        top[s] = 0u;
        if (clipped) clipped[s] = 0ull;
#endif
        amax_out[s] = ampscale_bits_to_f32(bits);
        if (clipped_out) clipped_out[s] = static_cast<long long>(count);
        finite = finite && bits < 0x7f800000u;
    }
    return finite;
}

// The tensor whose blocks include `block` (a binary search over first_chunk) and its chunk; the
// chunk's payload offset is 0 (the payload is the tensor's own buffer, leaves.out[*leaf]).
AMPSCALE_HD inline AmpscaleFp8Chunk ampscale_fp8_jax_chunk(const AmpscaleFp8JaxLeaves& leaves, long long block,
                                                           long long& leaf) {
    long long lo = 0, hi = leaves.count - 1;
    while (lo < hi) {
        const long long mid = (lo + hi + 1) / 2;
        if (leaves.first_chunk[mid] <= block)
            lo = mid;
        else
            hi = mid - 1;
    }
    leaf = lo;
    const long long size = leaves.meta[lo] >> 8;
    AmpscaleFp8Chunk chunk;
    chunk.data = leaves.data[lo];
    chunk.out = 0;
    chunk.start = (block - leaves.first_chunk[lo]) * AMPSCALE_FP8_CHUNK;
    chunk.length = size - chunk.start < AMPSCALE_FP8_CHUNK ? size - chunk.start : AMPSCALE_FP8_CHUNK;
    chunk.meta = (leaves.slot[lo] << 8) | (leaves.meta[lo] & 0xff);
    return chunk;
}

// ------------------------------------------------------------------ the kernels
#if defined(__CUDACC__) || defined(__CUDACC_RTC__)

// The block's largest magnitude bits and clipped count, on thread 0 (block-wide: every thread
// calls it).
__device__ inline void ampscale_fp8_block_reduce(unsigned int mine, unsigned int count, unsigned int& block_top,
                                                 unsigned long long& block_clipped) {
    __shared__ unsigned int warp_top[32];
    __shared__ unsigned int warp_clipped[32];
    for (int offset = 16; offset > 0; offset /= 2) {
        const unsigned int other = __shfl_xor_sync(0xffffffffu, mine, offset);
        mine = other > mine ? other : mine;
        count += __shfl_xor_sync(0xffffffffu, count, offset);
    }
    const unsigned int warp = threadIdx.x / 32, warps = (blockDim.x + 31) / 32;
    if (threadIdx.x % 32 == 0) {
        warp_top[warp] = mine;
        warp_clipped[warp] = count;
    }
    __syncthreads();
    block_top = 0;
    block_clipped = 0;
    if (threadIdx.x == 0) {
        for (unsigned int w = 0; w < warps; w++) {
            block_top = warp_top[w] > block_top ? warp_top[w] : block_top;
            block_clipped += warp_clipped[w];
        }
    }
}

// The pass of one block over its row; true in the block (every thread) that drew the last
// ticket. Block-wide: every thread of the block must call it.
__device__ inline bool ampscale_fp8_block(const AmpscaleFp8Chunk* chunks, long long chunk_count, unsigned char* payload,
                                          const float* scales, long long options, unsigned int* top,
                                          unsigned long long* clipped, unsigned int* ticket) {
    __shared__ bool last;
    unsigned int mine = 0, count = 0;
    long long slot = -1;
    if (blockIdx.x < chunk_count) {
        const AmpscaleFp8Chunk chunk = chunks[blockIdx.x];
        slot = chunk.meta >> 8;
        const float scale = (options & AMPSCALE_FP8_CAST) ? scales[slot] : 1.0f;
        mine = ampscale_fp8_chunk_part(chunk, payload, threadIdx.x, blockDim.x, scale, options, count);
    }
    unsigned int block_top;
    unsigned long long block_clipped;
    ampscale_fp8_block_reduce(mine, count, block_top, block_clipped);
    if (threadIdx.x == 0) {
        if (slot >= 0) {
            if (block_top) atomicMax(top + slot, block_top);
            if (block_clipped && clipped) atomicAdd(clipped + slot, block_clipped);
        }
        __threadfence();  // this block's maxima are visible everywhere before its ticket is
        last = atomicAdd(ticket, 1u) == gridDim.x - 1;
        if (last) *ticket = 0u;  // every ticket is drawn: reset for the next launch on the stream
    }
    __syncthreads();
    if (last) __threadfence();  // every block's maxima are visible to this one now
    return last;
}

// One launch: the amaxes (and with AMPSCALE_FP8_CAST the payloads and counts) of every row's
// tensor; `finite` (when not null) 1 if every amax is finite. Every parameter is 8 bytes.
extern "C" __global__ void ampscale_fp8_pass(const AmpscaleFp8Chunk* chunks, long long chunk_count,
                                             unsigned char* payload, const float* scales, long long slots,
                                             long long options,
                                             unsigned int* top, unsigned long long* clipped, unsigned int* ticket,
                                             float* amax_out, long long* clipped_out, unsigned char* finite) {
    if (!ampscale_fp8_block(chunks, chunk_count, payload, scales, options, top, clipped, ticket)) return;
    const bool mine = ampscale_fp8_finish(top, (options & AMPSCALE_FP8_CAST) ? clipped : nullptr, slots, amax_out,
                                          (options & AMPSCALE_FP8_CAST) ? clipped_out : nullptr, threadIdx.x,
                                          blockDim.x);
    const int all = __syncthreads_and(mine);
    if (finite && threadIdx.x == 0) *finite = static_cast<unsigned char>(all != 0);
}

// The JAX CUDA handler's launch: up to AMPSCALE_FP8_JAX_LEAVES tensors, their table by value.
// `top` is the call's float32 amax result and `clipped` its int32 counts, both zeroed by the
// handler (a memset on the stream) before the first launch: the maximum float32 magnitude bits
// ARE the float32 amax (a NaN's are the canonical 0x7fc00000), so no last block is needed.
extern "C" __global__ void ampscale_fp8_jax_pass(const AmpscaleFp8JaxLeaves leaves, const float* scales,
                                                 long long options, unsigned int* top, unsigned int* clipped) {
    long long leaf;
    const AmpscaleFp8Chunk chunk = ampscale_fp8_jax_chunk(leaves, blockIdx.x, leaf);
    const long long slot = chunk.meta >> 8;
    const float scale = (options & AMPSCALE_FP8_CAST) ? scales[slot] : 1.0f;
    unsigned int count = 0;
    const unsigned int mine = ampscale_fp8_chunk_part(chunk, reinterpret_cast<unsigned char*>(leaves.out[leaf]),
                                                      threadIdx.x, blockDim.x, scale, options, count);
    unsigned int block_top;
    unsigned long long block_clipped;
    ampscale_fp8_block_reduce(mine, count, block_top, block_clipped);
    if (threadIdx.x == 0) {
        if (block_top) atomicMax(top + slot, block_top);
        if (block_clipped && clipped) atomicAdd(clipped + slot, static_cast<unsigned int>(block_clipped));
    }
}

#if defined(AMPSCALE_FP8_TRANSITION)
// The pass, then the FP8 update of every slot in the last block (one slot per thread): the
// bookkeeping of a step in one launch. After the pass's parameters, the state's arrays in and out
// (AMPSCALE_FP8_STATE_PARAMS: every field of Fp8State, the ring's head and the step count
// included; out may be in), each slot's format maximum, the step's flag (a bool byte or a value
// by its kind, as ampscale_fp8_read_flag reads it) and `updated` (bytes, may be null). Every
// parameter is 8 bytes.
extern "C" __global__ void ampscale_fp8_pass_step(const AmpscaleFp8Chunk* chunks, long long chunk_count,
                                                  unsigned char* payload, const float* scales, long long slots,
                                                  long long options, unsigned int* top, unsigned long long* clipped,
                                                  unsigned int* ticket, float* amax_out, long long* clipped_out,
                                                  unsigned char* finite, AMPSCALE_FP8_STATE_PARAMS,
                                                  const float* fp8_max, const void* step_ok, long long step_ok_kind,
                                                  unsigned char* updated) {
    if (!ampscale_fp8_block(chunks, chunk_count, payload, scales, options, top, clipped, ticket)) return;
    const bool mine = ampscale_fp8_finish(top, (options & AMPSCALE_FP8_CAST) ? clipped : nullptr, slots, amax_out,
                                          (options & AMPSCALE_FP8_CAST) ? clipped_out : nullptr, threadIdx.x,
                                          blockDim.x);
    const int all = __syncthreads_and(mine);  // also: every amax of this block's threads is written
    if (finite && threadIdx.x == 0) *finite = static_cast<unsigned char>(all != 0);
    for (long long s = threadIdx.x; s < slots; s += blockDim.x) {
        ampscale_fp8_thread(s, AMPSCALE_FP8_STATE_ARGS, amax_out, fp8_max, step_ok, step_ok_kind, updated, slots);
    }
}
#endif

#endif

#ifdef AMPSCALE_HOST_TEST
// Host harness (tests only): a launch of ampscale_fp8_pass emulated block after block, lane after
// lane, with the same scratch, ticket and last-block logic. Returns the block that finished.
extern "C" int ampscale_fp8_host_pass(const AmpscaleFp8Chunk* chunks, long long chunk_count, long long blocks,
                                      unsigned char* payload, const float* scales, long long slots, long long options, unsigned int* top,
                                      unsigned long long* clipped, unsigned int* ticket, float* amax_out,
                                      long long* clipped_out, unsigned char* finite, int lanes) {
    int finished = -1;
    for (long long block = 0; block < blocks; block++) {
        unsigned int block_top = 0;
        unsigned long long block_clipped = 0;
        long long slot = -1;
        if (block < chunk_count) {
            const AmpscaleFp8Chunk& chunk = chunks[block];
            slot = chunk.meta >> 8;
            const float scale = (options & AMPSCALE_FP8_CAST) ? scales[slot] : 1.0f;
            for (int lane = 0; lane < lanes; lane++) {
                unsigned int count = 0;
                const unsigned int mine = ampscale_fp8_chunk_part(chunk, payload, lane, lanes, scale, options, count);
                block_top = mine > block_top ? mine : block_top;
                block_clipped += count;
            }
        }
        if (slot >= 0) {
            top[slot] = block_top > top[slot] ? block_top : top[slot];
            if (clipped) clipped[slot] += block_clipped;
        }
        if ((*ticket)++ != blocks - 1) continue;
        *ticket = 0u;
        bool all = true;
        for (int lane = 0; lane < lanes; lane++) {
            all = ampscale_fp8_finish(top, (options & AMPSCALE_FP8_CAST) ? clipped : nullptr, slots, amax_out,
                                      (options & AMPSCALE_FP8_CAST) ? clipped_out : nullptr, lane, lanes) &&
                  all;
        }
        if (finite) *finite = all ? 1 : 0;
        finished = static_cast<int>(block);
    }
    return finished;
}

// ampscale_fp8_jax_pass emulated: `blocks` blocks of `lanes` lanes over one table.
extern "C" void ampscale_fp8_jax_host_pass(const AmpscaleFp8JaxLeaves* leaves, long long blocks, const float* scales,
                                           long long options, unsigned int* top, unsigned int* clipped, int lanes) {
    for (long long block = 0; block < blocks; block++) {
        long long leaf;
        const AmpscaleFp8Chunk chunk = ampscale_fp8_jax_chunk(*leaves, block, leaf);
        const long long slot = chunk.meta >> 8;
        const float scale = (options & AMPSCALE_FP8_CAST) ? scales[slot] : 1.0f;
        unsigned char* payload = reinterpret_cast<unsigned char*>(leaves->out[leaf]);
        for (int lane = 0; lane < lanes; lane++) {
            unsigned int count = 0;
            const unsigned int mine = ampscale_fp8_chunk_part(chunk, payload, lane, lanes, scale, options, count);
            top[slot] = mine > top[slot] ? mine : top[slot];
            if (clipped) clipped[slot] += count;
        }
    }
}

#if defined(AMPSCALE_FP8_TRANSITION)
// ampscale_fp8_pass_step emulated: `blocks` blocks of `lanes` lanes, then the update of every slot
// (in the last block). The kernel's parameters follow `blocks` and `lanes`, in its order.
extern "C" int ampscale_fp8_host_pass_step(long long blocks, int lanes, const AmpscaleFp8Chunk* chunks,
                                           long long chunk_count, unsigned char* payload, const float* scales,
                                           long long slots, long long options, unsigned int* top,
                                           unsigned long long* clipped, unsigned int* ticket, float* amax_out,
                                           long long* clipped_out, unsigned char* finite, AMPSCALE_FP8_STATE_PARAMS,
                                           const float* fp8_max, const void* step_ok, long long step_ok_kind,
                                           unsigned char* updated) {
    const int finished = ampscale_fp8_host_pass(chunks, chunk_count, blocks, payload, scales, slots, options, top,
                                                clipped, ticket, amax_out, clipped_out, finite, lanes);
    for (long long s = 0; s < slots; s++) {
        ampscale_fp8_thread(s, AMPSCALE_FP8_STATE_ARGS, amax_out, fp8_max, step_ok, step_ok_kind, updated, slots);
    }
    return finished;
}
#endif
#endif

#endif  // AMPSCALE_FP8_PARAMS_ONLY
