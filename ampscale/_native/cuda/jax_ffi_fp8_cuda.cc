/*
 * XLA FFI handlers for JAX on CUDA GPUs: the fused FP8 pass, ampscale_fp8_amax_v1 and
 * ampscale_fp8_amax_cast_v1 (the contract is in ../cpu/jax_ffi_fp8.cc), run as
 * ampscale_fp8_jax_pass (fp8_kernels.cu) on the stream XLA gives the handler.
 *
 * Built by the host C++ compiler into the handler library, against jaxlib's FFI headers, with no
 * CUDA toolkit (the few driver types are declared below), like jax_ffi_cuda.cc. The driver entry
 * points and, per device ordinal, the context and the kernel (NVRTC-compiled from
 * ampscale._native.cuda._fp8.module_source and loaded into the primary context XLA uses) come
 * from a per-process table that Python fills before anything is lowered to these calls
 * (ampscale.fp8._fused_jax).
 *
 * One call: the amax result (and, casting, the count result) is zeroed by a memset on the stream,
 * then the tensors are launched up to AMPSCALE_FP8_JAX_LEAVES at a time, their table passed by
 * value as the launch's parameter; each block max-reduces the float32 magnitude bits of its
 * chunk into its tensor's amax (whose bits they are) and adds its clipped count. Everything is
 * queued on XLA's stream; nothing waits for the device.
 */
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "xla/ffi/api/ffi.h"

#define AMPSCALE_FP8_PARAMS_ONLY
#include "fp8_kernels.cu"

namespace ffi = xla::ffi;

typedef struct CUstream_st* CUstream;
typedef struct CUctx_st* CUcontext;
typedef struct CUfunc_st* CUfunction;
typedef unsigned long long CUdeviceptr;
typedef int CUresult;

static_assert(sizeof(AmpscaleFp8JaxLeaves) + 4 * sizeof(void*) <= 4096,
              "a launch's parameters must fit the 4 KB every CUDA driver accepts");

namespace {

// The driver entry points the handlers call; none of them waits for the device.
struct Fp8Driver {
    CUresult (*launch)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, CUstream,
                       void**, void**);
    CUresult (*memset_d32_async)(CUdeviceptr, unsigned int, size_t, CUstream);
    CUresult (*ctx_get_current)(CUcontext*);
    CUresult (*ctx_push_current)(CUcontext);
    CUresult (*ctx_pop_current)(CUcontext*);
    CUresult (*get_error_string)(CUresult, const char**);
};

struct Fp8Binding {
    CUcontext context;
    CUfunction pass;
};

constexpr int kMaxDevices = 256;
std::atomic<const Fp8Driver*> g_driver{nullptr};
std::atomic<const Fp8Binding*> g_bindings[kMaxDevices];

// One tensor of a call: where it is read, where its payload goes (null: amax only), its size and dtype.
struct Tensor {
    const void* data;
    void* out;
    int64_t count;
    int kind;
};

std::string driver_error(const Fp8Driver& d, const char* target, const char* what, CUresult result) {
    const char* text = nullptr;
    if (d.get_error_string == nullptr || d.get_error_string(result, &text) != 0 || text == nullptr) text = "unknown";
    return std::string(target) + ": " + what + " failed: " + text + " (CUresult " + std::to_string(result) + ")";
}

// Every launch of one call, in the device's context. Returns an empty string, or what went wrong.
std::string launch_all(const char* target, const Fp8Driver& d, const Fp8Binding& b, CUstream stream,
                       const float* scales, float* amaxes, int32_t* clipped, long long options,
                       const std::vector<Tensor>& tensors) {
    CUcontext current = nullptr, popped = nullptr;
    CUresult result = d.ctx_get_current(&current);
    if (result != 0) return driver_error(d, target, "cuCtxGetCurrent", result);
    const bool switched = current != b.context;
    if (switched) {
        result = d.ctx_push_current(b.context);
        if (result != 0) return driver_error(d, target, "cuCtxPushCurrent", result);
    }
    std::string error;
    const size_t n = tensors.size();
    if (n != 0) {
        result = d.memset_d32_async(reinterpret_cast<CUdeviceptr>(amaxes), 0u, n, stream);
        if (result != 0) error = driver_error(d, target, "cuMemsetD32Async (amaxes)", result);
    }
    if (error.empty() && clipped != nullptr && n != 0) {
        result = d.memset_d32_async(reinterpret_cast<CUdeviceptr>(clipped), 0u, n, stream);
        if (result != 0) error = driver_error(d, target, "cuMemsetD32Async (counts)", result);
    }
    AmpscaleFp8JaxLeaves table;
    size_t next = 0;
    while (error.empty() && next < n) {
        table.count = 0;
        table.first_chunk[0] = 0;
        for (; next < n && table.count < AMPSCALE_FP8_JAX_LEAVES; next++) {
            const Tensor& t = tensors[next];
            if (t.count == 0) continue;  // its amax is the 0 of the memset
            const long long i = table.count++;
            table.data[i] = reinterpret_cast<unsigned long long>(t.data);
            table.out[i] = reinterpret_cast<unsigned long long>(t.out);
            table.meta[i] = (static_cast<long long>(t.count) << 8) | t.kind;
            table.slot[i] = static_cast<long long>(next);
            table.first_chunk[i + 1] = table.first_chunk[i] + (t.count + AMPSCALE_FP8_CHUNK - 1) / AMPSCALE_FP8_CHUNK;
        }
        if (table.count == 0) break;
        const long long blocks = table.first_chunk[table.count];
        if (blocks > 0x7fffffffLL) {
            error = std::string(target) + ": " + std::to_string(blocks) +
                    " blocks in one launch, more than a CUDA grid holds (2**31 - 1)";
            break;
        }
        void* params[] = {&table, &scales, &options, &amaxes, &clipped};
        result = d.launch(b.pass, static_cast<unsigned>(blocks), 1, 1, AMPSCALE_FP8_THREADS, 1, 1, 0, stream, params,
                          nullptr);
        if (result != 0) error = driver_error(d, target, "cuLaunchKernel (ampscale_fp8_jax_pass)", result);
    }
    if (switched) d.ctx_pop_current(&popped);
    return error;
}

std::string run(const char* target, int ordinal, CUstream stream, const float* scales, float* amaxes,
                int32_t* clipped, long long options, const std::vector<Tensor>& tensors) {
    const Fp8Driver* d = g_driver.load(std::memory_order_acquire);
    const Fp8Binding* b =
        ordinal >= 0 && ordinal < kMaxDevices ? g_bindings[ordinal].load(std::memory_order_acquire) : nullptr;
    if (d == nullptr || b == nullptr) {
        return std::string(target) + ": ampscale's FP8 CUDA kernel is not loaded for device " +
               std::to_string(ordinal) + " in this process (ampscale.fp8 loads it when it lowers a call)";
    }
    return launch_all(target, *d, *b, stream, scales, amaxes, clipped, options, tensors);
}

int kind_of(ffi::DataType dtype) {
    switch (dtype) {
        case ffi::DataType::F16: return 0;
        case ffi::DataType::BF16: return 1;
        case ffi::DataType::F32: return 2;
        case ffi::DataType::F64: return 3;
        default: return -1;
    }
}

ffi::DataType fp8_type(int format) {
    switch (format) {
        case 0: return ffi::DataType::F8E4M3FN;
        case 1: return ffi::DataType::F8E5M2;
        case 2: return ffi::DataType::F8E4M3FNUZ;
        default: return ffi::DataType::F8E5M2FNUZ;
    }
}

// The options of a cast as the kernel reads them; XLA writes E5M2's NaN as 0x7e (ml_dtypes' byte).
long long cast_options(int format, bool divide) {
    const long long nan = format == 1 ? 0x7e : (format == 0 ? 0x7f : 0x80);
    return AMPSCALE_FP8_CAST | (divide ? AMPSCALE_FP8_DIVIDE : 0) |
           (static_cast<long long>(format) << AMPSCALE_FP8_FORMAT_SHIFT) | (nan << AMPSCALE_FP8_NAN_SHIFT);
}

ffi::Error amax_cuda(CUstream stream, int32_t ordinal, ffi::RemainingArgs args, ffi::ResultBuffer<ffi::F32> amaxes) {
    const char* target = "ampscale_fp8_amax_v1";
    const size_t n = args.size();
    if (amaxes->element_count() != n) return ffi::Error::InvalidArgument(std::string(target) + ": one amax per tensor");
    std::vector<Tensor> tensors(n);
    for (size_t i = 0; i < n; i++) {
        ffi::ErrorOr<ffi::AnyBuffer> in = args.get<ffi::AnyBuffer>(i);
        if (!in.has_value()) return in.error();
        const int kind = kind_of(in.value().element_type());
        if (kind < 0) {
            return ffi::Error::InvalidArgument(std::string(target) + ": tensor " + std::to_string(i) +
                                               " must be float16, bfloat16, float32 or float64");
        }
        tensors[i] = Tensor{in.value().untyped_data(), nullptr, static_cast<int64_t>(in.value().element_count()), kind};
    }
    const std::string error = run(target, ordinal, stream, nullptr, amaxes->typed_data(), nullptr, 0, tensors);
    if (!error.empty()) return ffi::Error::Internal(error);
    return ffi::Error::Success();
}

ffi::Error amax_cast_cuda(CUstream stream, int32_t ordinal, ffi::Buffer<ffi::F32> scales, ffi::RemainingArgs args,
                          ffi::ResultBuffer<ffi::F32> amaxes, ffi::ResultBuffer<ffi::S32> clipped,
                          ffi::RemainingRets payloads, int32_t format, bool divide) {
    const char* target = "ampscale_fp8_amax_cast_v1";
    const size_t n = args.size();
    if (format < 0 || format > 3) {
        return ffi::Error::InvalidArgument(std::string(target) + ": format must be 0 to 3; got " +
                                           std::to_string(format));
    }
    if (scales.element_count() != n || amaxes->element_count() != n || clipped->element_count() != n ||
        payloads.size() != n) {
        return ffi::Error::InvalidArgument(std::string(target) + ": " + std::to_string(n) +
                                           " tensors need as many scales, amaxes, counts and payloads");
    }
    std::vector<Tensor> tensors(n);
    for (size_t i = 0; i < n; i++) {
        ffi::ErrorOr<ffi::AnyBuffer> in = args.get<ffi::AnyBuffer>(i);
        ffi::ErrorOr<ffi::Result<ffi::AnyBuffer>> out = payloads.get<ffi::AnyBuffer>(i);
        if (!in.has_value()) return in.error();
        if (!out.has_value()) return out.error();
        const int kind = kind_of(in.value().element_type());
        ffi::AnyBuffer payload = *out.value();
        if (kind < 0 || payload.element_type() != fp8_type(format) ||
            payload.element_count() != in.value().element_count()) {
            return ffi::Error::InvalidArgument(std::string(target) + ": tensor " + std::to_string(i) +
                                               " must be a float tensor with a payload of the format and its size");
        }
        tensors[i] = Tensor{in.value().untyped_data(), payload.untyped_data(),
                            static_cast<int64_t>(in.value().element_count()), kind};
    }
    const std::string error = run(target, ordinal, stream, scales.typed_data(), amaxes->typed_data(),
                                  clipped->typed_data(), cast_options(format, divide), tensors);
    if (!error.empty()) return ffi::Error::Internal(error);
    return ffi::Error::Success();
}

}  // namespace

#pragma GCC visibility push(default)

XLA_FFI_DEFINE_HANDLER_SYMBOL(ampscale_fp8_amax_v1_cuda, amax_cuda,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<CUstream>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .RemainingArgs()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(ampscale_fp8_amax_cast_v1_cuda, amax_cast_cuda,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<CUstream>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .RemainingArgs()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .RemainingRets()
                                  .Attr<int32_t>("format")
                                  .Attr<bool>("divide"));

// The driver entry points (from libcuda.so.1), once per process. Returns 0, or -1 if one is missing.
extern "C" int ampscale_ffi_fp8_cuda_set_driver(void* launch, void* memset_d32_async, void* ctx_get_current,
                                                void* ctx_push_current, void* ctx_pop_current, void* get_error_string) {
    if (!launch || !memset_d32_async || !ctx_get_current || !ctx_push_current || !ctx_pop_current ||
        !get_error_string) {
        return -1;
    }
    Fp8Driver* d = new Fp8Driver;  // never freed: XLA may run the handlers until the process ends
    std::memcpy(&d->launch, &launch, sizeof(void*));
    std::memcpy(&d->memset_d32_async, &memset_d32_async, sizeof(void*));
    std::memcpy(&d->ctx_get_current, &ctx_get_current, sizeof(void*));
    std::memcpy(&d->ctx_push_current, &ctx_push_current, sizeof(void*));
    std::memcpy(&d->ctx_pop_current, &ctx_pop_current, sizeof(void*));
    std::memcpy(&d->get_error_string, &get_error_string, sizeof(void*));
    g_driver.store(d, std::memory_order_release);
    return 0;
}

// The kernel for device `ordinal`. Returns 0, or -1 for an ordinal out of range or a missing handle.
extern "C" int ampscale_ffi_fp8_cuda_bind(int ordinal, void* context, void* pass) {
    if (ordinal < 0 || ordinal >= kMaxDevices || !context || !pass) return -1;
    g_bindings[ordinal].store(new Fp8Binding{static_cast<CUcontext>(context), static_cast<CUfunction>(pass)},
                              std::memory_order_release);
    return 0;
}

// The handlers' work after the FFI decoding, for the tests (a fake driver on the CPU): one call
// over `n` tensors; `outs` null for the amax alone, else one payload each and `clipped`.
// Returns 0, or -1 with the message in `error`.
extern "C" int ampscale_ffi_fp8_cuda_run(int ordinal, void* stream, long long n, const void* const* sources,
                                         void* const* outs, const long long* counts, const int* kinds,
                                         const float* scales, int format, int divide, float* amaxes, int32_t* clipped,
                                         char* error, size_t error_size) {
    if (n < 0) {
        if (error_size) std::snprintf(error, error_size, "the tensor count must be >= 0; got %lld", n);
        return -1;
    }
    std::vector<Tensor> tensors(static_cast<size_t>(n));
    for (long long i = 0; i < n; i++) {
        if (kinds[i] < 0 || kinds[i] > 3 || counts[i] < 0) {
            if (error_size) std::snprintf(error, error_size, "tensor %lld: dtype code %d or count %lld is invalid", i,
                                          kinds[i], counts[i]);
            return -1;
        }
        tensors[i] = Tensor{sources[i], outs ? outs[i] : nullptr, counts[i], kinds[i]};
    }
    const bool cast = outs != nullptr;
    const std::string message =
        run(cast ? "ampscale_fp8_amax_cast_v1" : "ampscale_fp8_amax_v1", ordinal, static_cast<CUstream>(stream),
            scales, amaxes, cast ? clipped : nullptr, cast ? cast_options(format, divide != 0) : 0, tensors);
    if (message.empty()) return 0;
    if (error_size) std::snprintf(error, error_size, "%s", message.c_str());
    return -1;
}

#pragma GCC visibility pop
