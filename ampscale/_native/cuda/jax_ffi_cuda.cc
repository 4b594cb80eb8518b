/*
 * XLA FFI handler for JAX on CUDA GPUs: ampscale_check_and_unscale_v1 (the contract is in
 * jax_ffi.cc), run as ampscale's multi-tensor kernel on the stream XLA gives the handler.
 *
 * Built by the host C++ compiler with the CPU handler, into the same library, against the FFI
 * headers jaxlib ships: no CUDA toolkit is needed to build it (the few driver types are declared
 * below) nor to run it (the driver is libcuda.so.1, found at run time).
 *
 * Where the kernels and the driver come from: a per-process table filled from Python before
 * anything is lowered to this call (ampscale._native.cuda._jax). ampscale_ffi_cuda_set_driver takes the
 * driver entry points it calls, looked up in libcuda.so.1; ampscale_ffi_cuda_bind takes, for one
 * device ordinal, the primary context and the two kernels of jax_kernels.cu, which NVRTC compiled
 * (cached on disk) and the driver loaded into that context. XLA compiles and runs the call long
 * after that, on its own threads; a device with no entry gets an error that says what to call.
 *
 * One call: the flag is set to 1 by ampscale_jax_begin, then ampscale_jax_unscale runs over the
 * gradients, up to AMPSCALE_JAX_LEAVES per launch, their table passed by value as the launch's
 * parameter (jax_kernels.cu); a result that does not alias its operand is first copied from it
 * on the same stream (cuMemcpyDtoDAsync). Everything is queued on XLA's stream and nothing
 * waits for the device: the handler holds no entry point that synchronises.
 */
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "../cpu/jax_ffi_leaves.h"
#include "xla/ffi/api/ffi.h"

#define AMPSCALE_JAX_PARAMS_ONLY
#include "jax_kernels.cu"

namespace ffi = xla::ffi;

// The CUDA driver's types, as cuda.h declares them (pointers to opaque structs, an int result).
typedef struct CUstream_st* CUstream;
typedef struct CUctx_st* CUcontext;
typedef struct CUfunc_st* CUfunction;
typedef unsigned long long CUdeviceptr;
typedef int CUresult;

static_assert(sizeof(AmpscaleJaxLeaves) + 2 * sizeof(void*) <= 4096,
              "a launch's parameters must fit the 4 KB every CUDA driver accepts");
static_assert(AMPSCALE_JAX_LEAVES * AMPSCALE_JAX_CHUNK < (1LL << 40), "chunk indices fit easily");

namespace {

// The driver entry points the handler calls; none of them waits for the device.
struct Driver {
    CUresult (*launch)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, CUstream,
                       void**, void**);
    CUresult (*ctx_get_current)(CUcontext*);
    CUresult (*ctx_push_current)(CUcontext);
    CUresult (*ctx_pop_current)(CUcontext*);
    CUresult (*memcpy_dtod_async)(CUdeviceptr, CUdeviceptr, size_t, CUstream);
    CUresult (*get_error_string)(CUresult, const char**);
};

// What one device runs: its primary context and the two kernels loaded there.
struct Binding {
    CUcontext context;
    CUfunction begin;
    CUfunction unscale;
};

constexpr int kMaxDevices = 256;
// Written by Python (under its lock) before any lowering uses them, read by XLA's threads
// afterwards: published with release stores, read with acquire loads.
std::atomic<const Driver*> g_driver{nullptr};
std::atomic<const Binding*> g_bindings[kMaxDevices];

std::string driver_error(const Driver& d, const char* what, CUresult result) {
    const char* text = nullptr;
    if (d.get_error_string == nullptr || d.get_error_string(result, &text) != 0 || text == nullptr) text = "unknown";
    return std::string("ampscale_check_and_unscale_v1: ") + what + " failed: " + text + " (CUresult " +
           std::to_string(result) + ")";
}

// The launches of one call, in the device's context (made current for the call if another one
// is). Returns an empty string, or what went wrong.
std::string launch_all(const Driver& d, const Binding& b, CUstream stream, const float* inv_scale,
                       unsigned char* finite, const std::vector<ampscale_ffi::Leaf>& leaves) {
    CUcontext current = nullptr, popped = nullptr;
    CUresult result = d.ctx_get_current(&current);
    if (result != 0) return driver_error(d, "cuCtxGetCurrent", result);
    const bool switched = current != b.context;
    if (switched) {
        result = d.ctx_push_current(b.context);
        if (result != 0) return driver_error(d, "cuCtxPushCurrent", result);
    }
    std::string error;
    for (const ampscale_ffi::Leaf& leaf : leaves) {  // results XLA did not alias: copy, then unscale in place
        if (leaf.target != leaf.source && leaf.bytes != 0) {
            result = d.memcpy_dtod_async(reinterpret_cast<CUdeviceptr>(leaf.target),
                                         reinterpret_cast<CUdeviceptr>(leaf.source), leaf.bytes, stream);
            if (result != 0) {
                error = driver_error(d, "cuMemcpyDtoDAsync", result);
                break;
            }
        }
    }
    if (error.empty()) {
        void* begin_params[] = {&finite};
        result = d.launch(b.begin, 1, 1, 1, 1, 1, 1, 0, stream, begin_params, nullptr);
        if (result != 0) error = driver_error(d, "cuLaunchKernel (ampscale_jax_begin)", result);
    }
    AmpscaleJaxLeaves table;
    size_t next = 0;
    while (error.empty() && next < leaves.size()) {
        // the next launch: up to AMPSCALE_JAX_LEAVES non-empty buffers
        table.count = 0;
        table.first_chunk[0] = 0;
        for (; next < leaves.size() && table.count < AMPSCALE_JAX_LEAVES; next++) {
            const ampscale_ffi::Leaf& leaf = leaves[next];
            if (leaf.count == 0) continue;
            const long long i = table.count++;
            table.data[i] = reinterpret_cast<unsigned long long>(leaf.target);
            table.meta[i] = (static_cast<long long>(leaf.count) << 8) | leaf.kind;
            const long long chunks = (leaf.count + AMPSCALE_JAX_CHUNK - 1) / AMPSCALE_JAX_CHUNK;
            table.first_chunk[i + 1] = table.first_chunk[i] + chunks;
        }
        if (table.count == 0) break;
        const long long blocks = table.first_chunk[table.count];
        if (blocks > 0x7fffffffLL) {
            error = "ampscale_check_and_unscale_v1: " + std::to_string(blocks) +
                    " blocks in one launch, more than a CUDA grid holds (2**31 - 1)";
            break;
        }
        void* params[] = {&inv_scale, &finite, &table};
        result = d.launch(b.unscale, static_cast<unsigned>(blocks), 1, 1, AMPSCALE_JAX_THREADS, 1, 1, 0, stream, params,
                          nullptr);
        if (result != 0) error = driver_error(d, "cuLaunchKernel (ampscale_jax_unscale)", result);
    }
    if (switched) d.ctx_pop_current(&popped);
    return error;
}

std::string run(int ordinal, CUstream stream, const float* inv_scale, unsigned char* finite,
                const std::vector<ampscale_ffi::Leaf>& leaves) {
    const Driver* d = g_driver.load(std::memory_order_acquire);
    const Binding* b = ordinal >= 0 && ordinal < kMaxDevices ? g_bindings[ordinal].load(std::memory_order_acquire)
                                                             : nullptr;
    if (d == nullptr || b == nullptr) {
        return "ampscale_check_and_unscale_v1: ampscale's CUDA kernels are not loaded for device " +
               std::to_string(ordinal) +
               " in this process; call ampscale.backends.jax.register_custom_call() before running code "
               "exported with the custom call";
    }
    return launch_all(*d, *b, stream, inv_scale, finite, leaves);
}

ffi::Error check_and_unscale_cuda(CUstream stream, int32_t ordinal, ffi::BufferR0<ffi::F32> inv_scale,
                                  ffi::RemainingArgs grads, ffi::ResultBufferR0<ffi::PRED> finite,
                                  ffi::RemainingRets outs) {
    const size_t n = grads.size();
    if (ffi::Error error = ampscale_ffi::check_counts(n, outs.size()); error.failure()) return error;
    std::vector<ampscale_ffi::Leaf> leaves(n);
    for (size_t i = 0; i < n; i++) {
        if (ffi::Error error = ampscale_ffi::read_leaf(grads, outs, i, &leaves[i]); error.failure()) return error;
    }
    // both are device pointers: the kernels read the inverse scale and write the flag
    const std::string error = run(ordinal, stream, inv_scale.typed_data(),
                                  reinterpret_cast<unsigned char*>(finite->typed_data()), leaves);
    if (!error.empty()) return ffi::Error::Internal(error);
    return ffi::Error::Success();
}

}  // namespace

#pragma GCC visibility push(default)

// No FFI traits are declared, so XLA runs the call outside its command buffers (CUDA graphs): a
// jitted step runs as a graph before the call and another after it. The handler itself would
// survive a replay (it allocates nothing, waits for nothing, and its launches and copies read
// only the addresses XLA passes, which XLA's traced command buffers key on), so
// XLA_FFI_HANDLER_TRAITS_COMMAND_BUFFER_COMPATIBLE could be declared. It is not, because XLA
// would then record the call by stream capture and replay the recording, a path of XLA's that
// no GPU run has exercised with this handler: declaring it waits for a GPU run that measures
// what the split graphs cost and checks the replayed results.
XLA_FFI_DEFINE_HANDLER_SYMBOL(ampscale_check_and_unscale_v1_cuda, check_and_unscale_cuda,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<CUstream>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::BufferR0<ffi::F32>>()
                                  .RemainingArgs()
                                  .Ret<ffi::BufferR0<ffi::PRED>>()
                                  .RemainingRets());

// The driver entry points (from libcuda.so.1); set once per process, before any binding is used.
// Returns 0, or -1 if one is missing.
extern "C" int ampscale_ffi_cuda_set_driver(void* launch, void* ctx_get_current, void* ctx_push_current,
                                            void* ctx_pop_current, void* memcpy_dtod_async, void* get_error_string) {
    if (!launch || !ctx_get_current || !ctx_push_current || !ctx_pop_current || !memcpy_dtod_async ||
        !get_error_string) {
        return -1;
    }
    Driver* d = new Driver;  // never freed: XLA may run the handler until the process ends
    std::memcpy(&d->launch, &launch, sizeof(void*));
    std::memcpy(&d->ctx_get_current, &ctx_get_current, sizeof(void*));
    std::memcpy(&d->ctx_push_current, &ctx_push_current, sizeof(void*));
    std::memcpy(&d->ctx_pop_current, &ctx_pop_current, sizeof(void*));
    std::memcpy(&d->memcpy_dtod_async, &memcpy_dtod_async, sizeof(void*));
    std::memcpy(&d->get_error_string, &get_error_string, sizeof(void*));
    g_driver.store(d, std::memory_order_release);
    return 0;
}

// The kernels for device `ordinal` (the CUDA ordinal XLA reports to the handler). Returns 0, or
// -1 for an ordinal out of range or a missing handle.
extern "C" int ampscale_ffi_cuda_bind(int ordinal, void* context, void* begin, void* unscale) {
    if (ordinal < 0 || ordinal >= kMaxDevices || !context || !begin || !unscale) return -1;
    g_bindings[ordinal].store(new Binding{static_cast<CUcontext>(context), static_cast<CUfunction>(begin),
                                          static_cast<CUfunction>(unscale)},
                              std::memory_order_release);
    return 0;
}

// The handler's work after the FFI decoding, for the tests (driven on the CPU with a fake
// driver): one call over `n` gradients given as arrays. Returns 0, or -1 with the message in
// `error` (NUL-terminated, at most `error_size` bytes).
extern "C" int ampscale_ffi_cuda_run(int ordinal, void* stream, const float* inv_scale, unsigned char* finite,
                                     long long n, const void* const* sources, void* const* targets,
                                     const long long* counts, const int* kinds, char* error, size_t error_size) {
    if (n < 0) {
        if (error_size) std::snprintf(error, error_size, "the gradient count must be >= 0; got %lld", n);
        return -1;
    }
    std::vector<ampscale_ffi::Leaf> leaves(static_cast<size_t>(n));
    static const size_t item[] = {2, 2, 4, 8};
    for (long long i = 0; i < n; i++) {
        if (kinds[i] < 0 || kinds[i] > 3 || counts[i] < 0) {
            if (error_size) {
                std::snprintf(error, error_size, "gradient %lld: dtype code %d or count %lld is invalid", i, kinds[i],
                              counts[i]);
            }
            return -1;
        }
        const size_t bytes = static_cast<size_t>(counts[i]) * item[kinds[i]];
        leaves[i] = ampscale_ffi::Leaf{sources[i], targets[i], counts[i], bytes, kinds[i]};
    }
    const std::string message = run(ordinal, static_cast<CUstream>(stream), inv_scale, finite, leaves);
    if (message.empty()) return 0;
    if (error_size) std::snprintf(error, error_size, "%s", message.c_str());
    return -1;
}

#pragma GCC visibility pop
