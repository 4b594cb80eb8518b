// ampscale's CUDA kernels: the fused multi-tensor check + unscale, with the state transition in
// its last block, and the one-thread state update. Compiled by ampscale._native.cuda.nvrtc (for
// torch, CuPy and JAX alike: CuPy only loads the binary) or nvcc, with --fmad=false --ftz=false;
// no header is included.
//
// The source is prefixed, per configuration, with ampscale._codegen.C_PRELUDE and
// c_transition(config): they define struct ampscale_State (the packed state: every field, the
// next step's inv_scale, the flags of the step that produced it, and scratch) and
// ampscale_transition(in, out, finite, loss_finite).
//
// ampscale_step: one launch per step. The host builds a table of chunks (pointer, first element,
// length, dtype code), cached while the arrays stay the same, and block b processes chunk b;
// the blocks past the table check the loss. Each element is read once and written once: it is
// multiplied by the inverse scale in float32 opmath (float64 for double) and rounded back to
// nearest-even, as torch's _amp_foreach_non_finite_check_and_unscale_ does, and the STORED
// value's exponent bits are tested for inf/nan. So the flag says that every unscaled value is
// finite: for an inverse scale in (0, 1] the same as testing the inputs (the product of a finite
// value cannot grow), and for a scale below 1 it also catches a finite value that overflows.
// A check without multiply tests the inputs. Each block that saw an inf or nan stores 1.0 in
// its flag; then each block takes a ticket (threadfence + atomicAdd), and the block that draws
// the last one runs the transition on one thread: it writes the next state, its inv_scale and
// flags, and resets the scratch for the next launch on the stream.
//
// ampscale_update: one thread; the transition for a flag already on the device (a caller's
// flag, one agreed across devices, or torch's found_inf).
//
// ampscale_update_fields: one thread; the drop-in GradScaler's update, in place on torch's
// _scale and _growth_tracker and a record of the other fields.
//
// The element and chunk code is AMPSCALE_HD (__host__ __device__ under CUDA), so that the tests
// build the file with a host C++ compiler (AMPSCALE_HOST_TEST) and run it on the CPU.

#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
#define AMPSCALE_HD __host__ __device__
#else
#define AMPSCALE_HD
struct uint4 {
    unsigned int x, y, z, w;
};
#endif

#define AMPSCALE_KIND_F16 0
#define AMPSCALE_KIND_BF16 1
#define AMPSCALE_KIND_F32 2
#define AMPSCALE_KIND_F64 3

#define AMPSCALE_MULTIPLY 1LL  // options: multiply by the inverse scale (else check only)
#define AMPSCALE_TAIL 2LL      // options: the last block runs the transition

// One row of the chunk table (32 bytes, naturally aligned).
struct AmpscaleChunk {
    unsigned long long data;  // device address of the array's first element
    long long start;          // first element of this chunk
    long long length;         // elements in this chunk
    long long kind;           // AMPSCALE_KIND_*
};

// ------------------------------------------------------------------ bits and conversions

AMPSCALE_HD inline bool ampscale_bad_f32(unsigned int bits) { return (bits & 0x7f800000u) == 0x7f800000u; }

AMPSCALE_HD inline bool ampscale_bad_f64(unsigned long long bits) {
    return (bits & 0x7ff0000000000000ull) == 0x7ff0000000000000ull;
}

AMPSCALE_HD inline bool ampscale_bad_f16(unsigned short bits) { return (bits & 0x7c00u) == 0x7c00u; }

AMPSCALE_HD inline bool ampscale_bad_bf16(unsigned short bits) { return (bits & 0x7f80u) == 0x7f80u; }

AMPSCALE_HD inline float ampscale_bits_to_f32(unsigned int bits) {
    union {
        unsigned int u;
        float f;
    } v;
    v.u = bits;
    return v.f;
}

AMPSCALE_HD inline unsigned int ampscale_f32_to_bits(float f) {
    union {
        unsigned int u;
        float f;
    } v;
    v.f = f;
    return v.u;
}

AMPSCALE_HD inline double ampscale_bits_to_f64(unsigned long long bits) {
    union {
        unsigned long long u;
        double f;
    } v;
    v.u = bits;
    return v.f;
}

AMPSCALE_HD inline unsigned long long ampscale_f64_to_bits(double f) {
    union {
        unsigned long long u;
        double f;
    } v;
    v.f = f;
    return v.u;
}

// bfloat16 is the top half of a float32: exact widening, round-to-nearest-even narrowing. On
// sm_80 and later the narrowing is the device's own conversion (cvt.rn.bf16.f32, what torch's
// c10::BFloat16 and XLA use there: a nan becomes 0x7fff); elsewhere, and on the host, the same
// rounding in software, where a nan becomes the quiet nan 0x7fc0 with its sign (as c10's
// software path and ml_dtypes do). Finite values and infinities round alike on both.
AMPSCALE_HD inline float ampscale_bf16_to_f32(unsigned short b) {
    return ampscale_bits_to_f32(static_cast<unsigned int>(b) << 16);
}

AMPSCALE_HD inline unsigned short ampscale_f32_to_bf16(float f) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    unsigned short h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
#else
    unsigned int x = ampscale_f32_to_bits(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<unsigned short>(((x >> 16) & 0x8000u) | 0x7fc0u);
    return static_cast<unsigned short>((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
#endif
}

// float16: the GPU's own conversions (PTX cvt, as cuda_fp16.h uses), and exact software ones on
// the host (IEEE round to nearest even, subnormals kept).
AMPSCALE_HD inline float ampscale_f16_to_f32(unsigned short h) {
#ifdef __CUDA_ARCH__
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
#else
    const unsigned int sign = static_cast<unsigned int>(h & 0x8000u) << 16;
    unsigned int exponent = (h >> 10) & 0x1fu;
    unsigned int mantissa = h & 0x3ffu;
    if (exponent == 0x1fu) return ampscale_bits_to_f32(sign | 0x7f800000u | (mantissa << 13));
    if (exponent == 0) {
        if (mantissa == 0) return ampscale_bits_to_f32(sign);
        exponent = 113;  // a subnormal half: normalise it (2**-24 units)
        while (!(mantissa & 0x400u)) {
            mantissa <<= 1;
            exponent--;
        }
        return ampscale_bits_to_f32(sign | (exponent << 23) | ((mantissa & 0x3ffu) << 13));
    }
    return ampscale_bits_to_f32(sign | ((exponent + 112) << 23) | (mantissa << 13));
#endif
}

AMPSCALE_HD inline unsigned short ampscale_f32_to_f16(float f) {
#ifdef __CUDA_ARCH__
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
#else
    const unsigned int x = ampscale_f32_to_bits(f);
    const unsigned short sign = static_cast<unsigned short>((x >> 16) & 0x8000u);
    const unsigned int ax = x & 0x7fffffffu;
    if (ax > 0x7f800000u) return static_cast<unsigned short>(sign | 0x7e00u);  // nan
    if (ax >= 0x477ff000u) return static_cast<unsigned short>(sign | 0x7c00u);  // 65520 and up: inf
    if (ax >= 0x38800000u) {  // a normal half: rebias the exponent, round at bit 13
        unsigned int r = ax - 0x38000000u;
        r += 0xfffu + ((r >> 13) & 1u);
        return static_cast<unsigned short>(sign | (r >> 13));
    }
    if (ax <= 0x33000000u) return sign;  // at most 2**-25: rounds to zero (the tie goes to even)
    const unsigned int mantissa = (ax & 0x7fffffu) | 0x800000u;
    const unsigned int shift = 126u - (ax >> 23);  // to 2**-24 units
    unsigned int q = mantissa >> shift;
    const unsigned int rest = mantissa & ((1u << shift) - 1u);
    const unsigned int half = 1u << (shift - 1u);
    if (rest > half || (rest == half && (q & 1u))) q++;
    return static_cast<unsigned short>(sign | q);
#endif
}

// ------------------------------------------------------------------ per element

// One 16-bit element (float16 or bfloat16): returns the new bits, sets `bad` when the stored
// value (the input when not multiplying) is inf or nan.
AMPSCALE_HD inline unsigned int ampscale_half_bits(unsigned int bits, long long kind, float inv, bool multiply,
                                                   bool& bad) {
    const unsigned short b = static_cast<unsigned short>(bits);
    if (kind == AMPSCALE_KIND_F16) {
        const unsigned short out = multiply ? ampscale_f32_to_f16(ampscale_f16_to_f32(b) * inv) : b;
        bad |= ampscale_bad_f16(out);
        return out;
    }
    const unsigned short out = multiply ? ampscale_f32_to_bf16(ampscale_bf16_to_f32(b) * inv) : b;
    bad |= ampscale_bad_bf16(out);
    return out;
}

AMPSCALE_HD inline unsigned int ampscale_f32_bits(unsigned int bits, float inv, bool multiply, bool& bad) {
    const unsigned int out = multiply ? ampscale_f32_to_bits(ampscale_bits_to_f32(bits) * inv) : bits;
    bad |= ampscale_bad_f32(out);
    return out;
}

AMPSCALE_HD inline unsigned long long ampscale_f64_bits(unsigned long long bits, float inv, bool multiply, bool& bad) {
    const unsigned long long out =
        multiply ? ampscale_f64_to_bits(ampscale_bits_to_f64(bits) * static_cast<double>(inv)) : bits;
    bad |= ampscale_bad_f64(out);
    return out;
}

// Element i of an array. Returns true when the stored element is inf or nan.
AMPSCALE_HD inline bool ampscale_process(char* base, long long i, long long kind, float inv, bool multiply) {
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
AMPSCALE_HD inline unsigned int ampscale_half_pair(unsigned int two, long long kind, float inv, bool multiply,
                                                   bool& bad) {
    const unsigned int lo = ampscale_half_bits(two & 0xffffu, kind, inv, multiply, bad);
    const unsigned int hi = ampscale_half_bits(two >> 16, kind, inv, multiply, bad);
    return lo | (hi << 16);
}

// One 16-byte word: 4 float32, 2 float64 or 8 float16/bfloat16 elements. Integer lanes only,
// so the same code is exact on the host (no type punning of the word itself).
AMPSCALE_HD inline bool ampscale_word(uint4& w, long long kind, float inv, bool multiply) {
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

AMPSCALE_HD inline long long ampscale_item_size(long long kind) {
    return kind == AMPSCALE_KIND_F64 ? 8 : (kind == AMPSCALE_KIND_F32 ? 4 : 2);
}

#ifdef AMPSCALE_HOST_TEST
// Host harness only: 16-byte words processed, so that the tests see which path a chunk took.
long long ampscale_host_words = 0;
#define AMPSCALE_COUNT_WORDS(n) (ampscale_host_words += (n))
#else
#define AMPSCALE_COUNT_WORDS(n) ((void)0)
#endif

// Elements [start, start + length) of one chunk, visited by `lane` of `lanes` workers: a head
// element by element up to the first 16-byte boundary of the chunk's memory, then 16-byte loads
// and stores (four in flight per worker), then the tail element by element. The boundary is
// taken on the absolute address, so a view into a flat buffer (Megatron/DeepSpeed contiguous
// gradient buffers, FSDP's flat parameters, split/narrow views) at any element offset keeps the
// vector path; only an array whose base is not even element-aligned goes element by element.
AMPSCALE_HD inline bool ampscale_chunk_part(const AmpscaleChunk& chunk, long long lane, long long lanes, float inv,
                                            bool multiply) {
    char* base = reinterpret_cast<char*>(chunk.data);
    const long long kind = chunk.kind;
    const long long size = ampscale_item_size(kind);
    const long long end = chunk.start + chunk.length;
    const long long per_word = 16 / size;
    bool bad = false;
    if (chunk.data % size == 0) {
        // the first element at a 16-byte boundary, then as many whole words as fit
        const unsigned long long first_address = chunk.data + static_cast<unsigned long long>(chunk.start * size);
        const long long head = static_cast<long long>((16 - first_address % 16) % 16) / size;
        const long long vec_first = chunk.start + head;
        const long long words_n = vec_first < end ? (end - vec_first) / per_word : 0;
        if (words_n > 0) {
            const long long vec_end = vec_first + words_n * per_word;
            for (long long i = chunk.start + lane; i < vec_first; i += lanes) bad |= ampscale_process(base, i, kind, inv, multiply);
            uint4* words = reinterpret_cast<uint4*>(base + vec_first * size);
            long long j = lane;
            for (; j + 3 * lanes < words_n; j += 4 * lanes) {
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
                AMPSCALE_COUNT_WORDS(4);
            }
            for (; j < words_n; j += lanes) {
                uint4 a = words[j];
                bad |= ampscale_word(a, kind, inv, multiply);
                if (multiply) words[j] = a;
                AMPSCALE_COUNT_WORDS(1);
            }
            for (long long i = vec_end + lane; i < end; i += lanes) bad |= ampscale_process(base, i, kind, inv, multiply);
            return bad;
        }
    }
    for (long long i = chunk.start + lane; i < end; i += lanes) bad |= ampscale_process(base, i, kind, inv, multiply);
    return bad;
}

// Chunk `block` of a launch: a row of the table, or (past the table) a piece of the loss, which
// is only checked. `loss_meta` is the loss's element count << 8 | its dtype code.
AMPSCALE_HD inline AmpscaleChunk ampscale_block_chunk(const AmpscaleChunk* chunks, long long grad_chunks,
                                                      unsigned long long loss_data, long long loss_meta,
                                                      long long block, long long chunk_elements, bool& is_loss) {
    is_loss = block >= grad_chunks;
    if (!is_loss) return chunks[block];
    AmpscaleChunk chunk;
    const long long size = loss_meta >> 8;
    chunk.data = loss_data;
    chunk.start = (block - grad_chunks) * chunk_elements;
    chunk.length = size - chunk.start < chunk_elements ? size - chunk.start : chunk_elements;
    chunk.kind = loss_meta & 0xff;
    return chunk;
}

// The next state for a step's flags: the transition, then the flags that produced it and zero
// scratch.
AMPSCALE_HD inline void ampscale_write_next(const struct ampscale_State* in, struct ampscale_State* out, int finite,
                                            int loss_finite) {
    ampscale_transition(in, out, finite, loss_finite);
    out->finite = static_cast<unsigned char>(finite);
    out->loss_finite = static_cast<unsigned char>(loss_finite);
    out->found_inf = 0.0f;
    out->loss_found_inf = 0.0f;
    out->ticket = 0u;
}

AMPSCALE_HD inline void ampscale_reset(struct ampscale_State* scratch) {
    scratch->found_inf = 0.0f;
    scratch->loss_found_inf = 0.0f;
    scratch->ticket = 0u;
}

// The step's last act, on one thread: read the flags, write the next state and reset the
// scratch for the next launch on the stream.
AMPSCALE_HD inline void ampscale_finish(struct ampscale_State* scratch, const struct ampscale_State* in,
                                        struct ampscale_State* out) {
    // volatile: the flags were stored by other blocks (other SMs' caches are not coherent)
    const float found = *static_cast<volatile float*>(&scratch->found_inf);
    const float loss_found = *static_cast<volatile float*>(&scratch->loss_found_inf);
    const int loss_finite = loss_found == 0.0f;
    ampscale_write_next(in, out, found == 0.0f && loss_finite, loss_finite);
    ampscale_reset(scratch);
}

// A flag given by the caller: `kind` 0 true (no pointer), 1 a bool byte (nonzero: finite), 2 a
// float32 found_inf (zero: finite), 3 false (no pointer), 4 a bool byte (nonzero: NOT finite,
// the drop-in GradScaler's loss flag).
AMPSCALE_HD inline int ampscale_read_flag(const void* flag, long long kind) {
    if (kind == 1) return *static_cast<const unsigned char*>(flag) != 0;
    if (kind == 2) return *static_cast<const float*>(flag) == 0.0f;
    if (kind == 4) return *static_cast<const unsigned char*>(flag) == 0;
    return kind != 3;
}

// The drop-in GradScaler's update, in place: the scale and the growth tracker are torch's own
// tensors (read and written through their pointers, as torch's _amp_update_scale_ does), every
// other field lives in `record`, which is rewritten whole (the transition computes every output
// before the first store, so in and out may be one record). The kernel touches only these fixed
// buffers, but the drop-in refuses CUDA graph capture all the same: its host side (the scale's
// lower bound, the per-optimizer flags) would not move on a replay.
AMPSCALE_HD inline void ampscale_update_in_place(void* scale, int* growth_tracker, struct ampscale_State* record,
                                                 const void* finite_flag, long long finite_kind, const void* loss_flag,
                                                 long long loss_kind) {
    typedef decltype(record->scale) ampscale_scale_t;
    struct ampscale_State in = *record;
    in.scale = *static_cast<ampscale_scale_t*>(scale);
    in.growth_tracker = *growth_tracker;
    struct ampscale_State out = in;
    const int loss_finite = ampscale_read_flag(loss_flag, loss_kind);
    ampscale_write_next(&in, &out, ampscale_read_flag(finite_flag, finite_kind) && loss_finite, loss_finite);
    *record = out;
    *static_cast<ampscale_scale_t*>(scale) = out.scale;
    *growth_tracker = out.growth_tracker;
}

// ------------------------------------------------------------------ the kernels
#if defined(__CUDACC__) || defined(__CUDACC_RTC__)

// Every parameter is 8 bytes (pointers and long long), so a launcher needs no signature.
extern "C" __global__ void ampscale_step(const AmpscaleChunk* chunks, long long grad_chunks,
                                         unsigned long long loss_data, long long loss_meta, const float* inv_scale,
                                         struct ampscale_State* scratch, const struct ampscale_State* in,
                                         struct ampscale_State* out, long long options) {
    bool is_loss;
    const AmpscaleChunk chunk =
        ampscale_block_chunk(chunks, grad_chunks, loss_data, loss_meta, blockIdx.x, AMPSCALE_CHUNK, is_loss);
    const float inv = *inv_scale;
    const bool multiply = (options & AMPSCALE_MULTIPLY) && !is_loss && inv != 1.0f;
    const bool bad = ampscale_chunk_part(chunk, threadIdx.x, blockDim.x, inv, multiply);
    // One store per block that saw an inf or nan: a flag only ever goes from 0 to 1.
    if (__syncthreads_or(bad) && threadIdx.x == 0) {
        if (is_loss)
            scratch->loss_found_inf = 1.0f;
        else
            scratch->found_inf = 1.0f;
    }
    if (!(options & AMPSCALE_TAIL) || threadIdx.x != 0) return;
    __threadfence();  // this block's flag is visible everywhere before its ticket is
    const unsigned int ticket = atomicAdd(&scratch->ticket, 1u);
    if (ticket != gridDim.x - 1) return;
    __threadfence();  // the last ticket: every block's flag is visible now
    ampscale_finish(scratch, in, out);
}

// The transition for flags already on the device, on one thread. `scratch`, when not null, is
// reset after the flags are read (they may point into it: torch's found_inf).
extern "C" __global__ void ampscale_update(const struct ampscale_State* in, struct ampscale_State* out,
                                           const void* finite_flag, long long finite_kind, const void* loss_flag,
                                           long long loss_kind, struct ampscale_State* scratch) {
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    const int loss_finite = ampscale_read_flag(loss_flag, loss_kind);
    ampscale_write_next(in, out, ampscale_read_flag(finite_flag, finite_kind) && loss_finite, loss_finite);
    if (scratch) ampscale_reset(scratch);
}

// ampscale_update_in_place on one thread (the drop-in GradScaler's update(): one launch).
extern "C" __global__ void ampscale_update_fields(void* scale, int* growth_tracker, struct ampscale_State* record,
                                                  const void* finite_flag, long long finite_kind,
                                                  const void* loss_flag, long long loss_kind) {
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    ampscale_update_in_place(scale, growth_tracker, record, finite_flag, finite_kind, loss_flag, loss_kind);
}

#endif

#ifdef AMPSCALE_HOST_TEST
// Host harness (tests only): the launch of ampscale_step emulated sequentially, block after
// block, lane after lane, with the same ticket logic. Returns the number of the block that ran
// the transition (-1: none).
extern "C" int ampscale_host_step(const AmpscaleChunk* chunks, long long grad_chunks, unsigned long long loss_data,
                                  long long loss_meta, long long blocks, long long chunk_elements, float inv,
                                  struct ampscale_State* scratch, const struct ampscale_State* in,
                                  struct ampscale_State* out, long long options, int lanes) {
    int ran = -1;
    for (long long block = 0; block < blocks; block++) {
        bool is_loss;
        const AmpscaleChunk chunk =
            ampscale_block_chunk(chunks, grad_chunks, loss_data, loss_meta, block, chunk_elements, is_loss);
        const bool multiply = (options & AMPSCALE_MULTIPLY) && !is_loss && inv != 1.0f;
        bool bad = false;
        for (int lane = 0; lane < lanes; lane++) bad |= ampscale_chunk_part(chunk, lane, lanes, inv, multiply);
        if (bad) {
            if (is_loss)
                scratch->loss_found_inf = 1.0f;
            else
                scratch->found_inf = 1.0f;
        }
        if (!(options & AMPSCALE_TAIL)) continue;
        const unsigned int ticket = scratch->ticket++;
        if (ticket == blocks - 1) {
            ampscale_finish(scratch, in, out);
            ran = static_cast<int>(block);
        }
    }
    return ran;
}

extern "C" void ampscale_host_update(const struct ampscale_State* in, struct ampscale_State* out,
                                     const void* finite_flag, long long finite_kind, const void* loss_flag,
                                     long long loss_kind, struct ampscale_State* scratch) {
    const int loss_finite = ampscale_read_flag(loss_flag, loss_kind);
    ampscale_write_next(in, out, ampscale_read_flag(finite_flag, finite_kind) && loss_finite, loss_finite);
    if (scratch) ampscale_reset(scratch);
}
extern "C" void ampscale_host_update_fields(void* scale, int* growth_tracker, struct ampscale_State* record,
                                            const void* finite_flag, long long finite_kind, const void* loss_flag,
                                            long long loss_kind) {
    ampscale_update_in_place(scale, growth_tracker, record, finite_flag, finite_kind, loss_flag, loss_kind);
}

extern "C" long long ampscale_host_word_count(void) { return ampscale_host_words; }
#endif
