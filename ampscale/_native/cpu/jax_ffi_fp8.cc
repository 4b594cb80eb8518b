/*
 * XLA FFI handlers for JAX on the CPU: the fused FP8 pass of fp8_kernels.h (the NumPy
 * extension's kernels) as two custom calls over many buffers, read only.
 *
 *   name:     "ampscale_fp8_amax_v1"
 *   operands: 0..n-1: tensors, each float16, bfloat16, float32 or float64, any shape (empty and
 *                     0-d included), dense row-major; dtypes may be mixed in one call
 *   results:  0:      amaxes, float32[n]: max(|x|) of each tensor (NaN if it holds a NaN, the
 *                     canonical quiet NaN; else inf if it holds an inf; 0 if empty), taken on
 *                     bits, so XLA's flushing of subnormals changes nothing
 *
 *   name:     "ampscale_fp8_amax_cast_v1"
 *   operands: 0:      scales, float32[n], one per tensor
 *             1..n:   tensors, as above
 *   results:  0:      amaxes, float32[n], as above (of the inputs)
 *             1:      clipped, int32[n]: elements whose product exceeded fp8_max (saturating)
 *             2..n+1: payloads, each of its tensor's shape, of the FP8 type of `format`
 *   attributes: format (int32: 0 E4M3FN, 1 E5M2, 2 E4M3FNUZ, 3 E5M2FNUZ), divide (pred)
 *   semantics: saturate(float32(x) * scale) (x / scale with divide), as XLA's multiply, clamp
 *             and convert store it (NaN bytes included: E5M2's is 0x7e), computed in the
 *             floating-point environment of the thread XLA runs the call on.
 *
 * Threads: as jax_ffi.cc, the byte range is split into pieces that XLA's intra-op pool and the
 * calling thread claim from a shared counter (the caller never waits for a piece nobody has
 * started), every piece under the caller's floating-point control; partial results merge after.
 */
#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "xla/ffi/api/ffi.h"

extern "C" {
#include "fp8_kernels.h"
}

namespace ffi = xla::ffi;

namespace {

const bool fp8_kernels_selected = (select_kernels(), true);

int kind_of(ffi::DataType dtype) {
    switch (dtype) {
        case ffi::DataType::F16: return KIND_F16;
        case ffi::DataType::BF16: return KIND_BF16;
        case ffi::DataType::F32: return KIND_F32;
        case ffi::DataType::F64: return KIND_F64;
        default: return -1;
    }
}

ffi::DataType fp8_type(int format) {
    switch (format) {
        case FP8_E4M3FN: return ffi::DataType::F8E4M3FN;
        case FP8_E5M2: return ffi::DataType::F8E5M2;
        case FP8_E4M3FNUZ: return ffi::DataType::F8E4M3FNUZ;
        default: return ffi::DataType::F8E5M2FNUZ;
    }
}

// XLA's convert writes a NaN as ml_dtypes does: E5M2 0x7e (with the sign), E4M3FN 0x7f, fnuz 0x80.
uint32_t nan_byte(int format) { return format == FP8_E5M2 ? 0x7eu : (format == FP8_E4M3FN ? 0x7fu : 0x80u); }

// The pieces of one pass, shared with pool tasks that may start after the call has moved on.
struct Pieces {
    std::vector<Fp8Span> spans;
    std::vector<uint64_t> top;
    std::vector<long long> clipped;
    Fp8Work work[MAX_THREADS];
    int count = 0;
    std::atomic<int> next{0};
    std::mutex mutex;
    std::condition_variable finished;
    int done = 0;

    void drain() {
        for (;;) {
            const int piece = next.fetch_add(1, std::memory_order_relaxed);
            if (piece >= count) return;
            fp8_run_work_as_caller(&work[piece]);
            std::lock_guard<std::mutex> lock(mutex);
            if (++done == count) finished.notify_all();
        }
    }
};

// Run the pass over `pieces->spans` and merge; `top` and `clipped` sized and zeroed by the caller.
void run(ffi::ThreadPool& pool, const std::shared_ptr<Pieces>& pieces, int format, int divide) {
    ptrdiff_t total = 0;
    for (Fp8Span& span : pieces->spans) {
        span.start = total;
        total += span.n * kind_size[span.kind];
    }
    const int threads = static_cast<int>(std::min<int64_t>(std::max<int64_t>(pool.num_threads(), 1), MAX_THREADS));
    long long* clipped = format >= 0 ? pieces->clipped.data() : nullptr;
    pieces->count = fp8_plan(pieces->work, pieces->spans.data(), static_cast<ptrdiff_t>(pieces->spans.size()), total,
                             format, divide, format >= 0 ? nan_byte(format) : 0u, pieces->top.data(), clipped,
                             threads);
    for (int t = 1; t < pieces->count; t++) pool.Schedule([pieces] { pieces->drain(); });
    pieces->drain();
    {
        std::unique_lock<std::mutex> lock(pieces->mutex);
        pieces->finished.wait(lock, [&] { return pieces->done == pieces->count; });
    }
    fp8_merge(pieces->work, pieces->count, pieces->top.data(), clipped);
}

ffi::Error bad_tensor(const char* target, size_t i) {
    return ffi::Error::InvalidArgument(std::string(target) + ": tensor " + std::to_string(i) +
                                       " must be float16, bfloat16, float32 or float64");
}

ffi::Error fp8_amax(ffi::ThreadPool pool, ffi::RemainingArgs tensors, ffi::ResultBuffer<ffi::F32> amaxes) {
    (void)fp8_kernels_selected;
    const size_t n = tensors.size();
    if (amaxes->element_count() != n) {
        return ffi::Error::InvalidArgument("ampscale_fp8_amax_v1: " + std::to_string(n) + " tensors but " +
                                           std::to_string(amaxes->element_count()) + " amaxes");
    }
    auto pieces = std::make_shared<Pieces>();
    pieces->spans.resize(n);
    pieces->top.assign(n, 0);
    for (size_t i = 0; i < n; i++) {
        ffi::ErrorOr<ffi::AnyBuffer> in = tensors.get<ffi::AnyBuffer>(i);
        if (!in.has_value()) return in.error();
        const int kind = kind_of(in.value().element_type());
        if (kind < 0) return bad_tensor("ampscale_fp8_amax_v1", i);
        pieces->spans[i] = Fp8Span{static_cast<const char*>(in.value().untyped_data()), nullptr,
                                   static_cast<ptrdiff_t>(in.value().element_count()), 0, kind, 1.0f};
    }
    run(pool, pieces, -1, 0);
    float* out = amaxes->typed_data();
    for (size_t i = 0; i < n; i++) out[i] = fp8_top_to_f32(pieces->spans[i].kind, pieces->top[i]);
    return ffi::Error::Success();
}

ffi::Error fp8_amax_cast(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> scales, ffi::RemainingArgs tensors,
                         ffi::ResultBuffer<ffi::F32> amaxes, ffi::ResultBuffer<ffi::S32> clipped,
                         ffi::RemainingRets payloads, int32_t format, bool divide) {
    (void)fp8_kernels_selected;
    const char* target = "ampscale_fp8_amax_cast_v1";
    const size_t n = tensors.size();
    if (format < 0 || format >= FP8_FORMAT_COUNT) {
        return ffi::Error::InvalidArgument(std::string(target) + ": format must be 0 to 3; got " +
                                           std::to_string(format));
    }
    if (scales.element_count() != n || amaxes->element_count() != n || clipped->element_count() != n ||
        payloads.size() != n) {
        return ffi::Error::InvalidArgument(std::string(target) + ": " + std::to_string(n) +
                                           " tensors need as many scales, amaxes, counts and payloads");
    }
    auto pieces = std::make_shared<Pieces>();
    pieces->spans.resize(n);
    pieces->top.assign(n, 0);
    pieces->clipped.assign(n, 0);
    const float* scale = scales.typed_data();
    for (size_t i = 0; i < n; i++) {
        ffi::ErrorOr<ffi::AnyBuffer> in = tensors.get<ffi::AnyBuffer>(i);
        ffi::ErrorOr<ffi::Result<ffi::AnyBuffer>> out = payloads.get<ffi::AnyBuffer>(i);
        if (!in.has_value()) return in.error();
        if (!out.has_value()) return out.error();
        const int kind = kind_of(in.value().element_type());
        if (kind < 0) return bad_tensor(target, i);
        ffi::AnyBuffer payload = *out.value();
        if (payload.element_type() != fp8_type(format) || payload.element_count() != in.value().element_count()) {
            return ffi::Error::InvalidArgument(std::string(target) + ": payload " + std::to_string(i) +
                                               " must be of the format's FP8 type and its tensor's size");
        }
        pieces->spans[i] = Fp8Span{static_cast<const char*>(in.value().untyped_data()),
                                   static_cast<uint8_t*>(payload.untyped_data()),
                                   static_cast<ptrdiff_t>(in.value().element_count()), 0, kind, scale[i]};
    }
    run(pool, pieces, format, divide ? 1 : 0);
    float* out = amaxes->typed_data();
    int32_t* counts = clipped->typed_data();
    for (size_t i = 0; i < n; i++) {
        out[i] = fp8_top_to_f32(pieces->spans[i].kind, pieces->top[i]);
        counts[i] = static_cast<int32_t>(std::min<long long>(pieces->clipped[i], INT32_MAX));
    }
    return ffi::Error::Success();
}

}  // namespace

#pragma GCC visibility push(default)

XLA_FFI_DEFINE_HANDLER_SYMBOL(ampscale_fp8_amax_v1, fp8_amax,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .RemainingArgs()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(ampscale_fp8_amax_cast_v1, fp8_amax_cast,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .RemainingArgs()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .RemainingRets()
                                  .Attr<int32_t>("format")
                                  .Attr<bool>("divide"));

#pragma GCC visibility pop
