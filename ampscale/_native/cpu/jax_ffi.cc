/*
 * XLA FFI handler for JAX on the CPU: ampscale's fused overflow check + unscale, run by XLA as
 * one custom call over many gradient buffers, in place.
 *
 * It runs the very kernels of the NumPy extension (`kernels.h`, the same SIMD inner loops and
 * the same split of the element range across threads), so JAX gets the same arithmetic as
 * ampscale's NumPy backend and as its pure-XLA path: every value times the inverse scale in
 * float32 (float64 for float64 buffers), rounded back to its dtype to nearest-even exactly as
 * XLA's convert does (NaN payloads included), and a flag that is true when every value is
 * finite.
 *
 * The target's contract, shared by every platform's handler (the CUDA handler, jax_ffi_cuda.cc,
 * is registered under the same name with the same operands, results and attributes):
 *
 *   name:     "ampscale_check_and_unscale_v1" (a new operand or result gets a new name)
 *   operands: 0:      inv_scale, float32[] (0-d): the factor every value is multiplied by
 *             1..n:   gradients, each float16, bfloat16, float32 or float64, any shape (empty
 *                     and 0-d included), dense row-major; dtypes may be mixed in one call
 *   results:  0:      finite, pred[] (0-d): true when every value of every gradient is finite
 *             1..n:   the unscaled gradients, result i aliasing operand i (the caller lowers
 *                     the call with operand_output_aliases {i: i}; a result that does not
 *                     alias its operand is first copied from it, then unscaled in place)
 *   attributes: none
 *   semantics: every value is multiplied (also by a factor of exactly 1: XLA's multiply
 *             quiets signalling NaNs and flushes denormals on the CPU, and so does this), in
 *             the floating-point environment of the thread XLA runs the call on; the flag
 *             tests the values stored (a scale below 1 can overflow a finite value to inf).
 *             Each handler stores what XLA's multiply and convert store on its platform (NaN
 *             payloads included), so the results are XLA's there, bit for bit.
 *
 * Threads: above the kernels' parallel threshold the element range is split as the NumPy
 * extension splits it, and the pieces run on XLA's intra-op thread pool. The calling thread
 * takes pieces too and never waits for a piece nobody has started, so the call cannot
 * deadlock when the pool is busy with other work (pieces are claimed from a shared counter; a
 * pool task that starts after all are taken does nothing). Every piece runs under the calling
 * thread's floating-point control (XLA:CPU flushes denormals; a pool thread need not).
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

#include "jax_ffi_leaves.h"
#include "xla/ffi/api/ffi.h"

extern "C" {
#include "kernels.h"
}

namespace ffi = xla::ffi;

static_assert(ampscale_ffi::LEAF_F16 == KIND_F16 && ampscale_ffi::LEAF_BF16 == KIND_BF16 &&
                  ampscale_ffi::LEAF_F32 == KIND_F32 && ampscale_ffi::LEAF_F64 == KIND_F64,
              "the handlers' dtype codes are the kernels'");

#ifndef AMPSCALE_FFI_BUILD_KEY
#define AMPSCALE_FFI_BUILD_KEY "unknown"
#endif

namespace {

const bool kernels_selected = (select_kernels(), true);

// The pieces of one kind's element range, shared with the pool tasks that may outlive the call
// (a task that starts after every piece is taken finds nothing to do and drops its reference).
struct Pieces {
    std::vector<Span> spans;
    Work work[MAX_THREADS];
    int count = 0;
    std::atomic<int> next{0};
    std::mutex mutex;
    std::condition_variable finished;
    int done = 0;

    // Run pieces until none is left to take; returns after finishing the last one it took.
    void drain() {
        for (;;) {
            int piece = next.fetch_add(1, std::memory_order_relaxed);
            if (piece >= count) return;
            run_work_as_caller(&work[piece]);
            std::lock_guard<std::mutex> lock(mutex);
            if (++done == count) finished.notify_all();
        }
    }
};

// Unscale one kind's spans in place; returns 1 if any value stored is not finite.
int run_kind(ffi::ThreadPool& pool, std::vector<Span> spans, ptrdiff_t total, int kind, float inv) {
    int threads = static_cast<int>(std::min<int64_t>(std::max<int64_t>(pool.num_threads(), 1), MAX_THREADS));
    if (threads < 2 || total < PARALLEL_THRESHOLD * 2) {
        Work work[1];
        plan_work(work, spans.data(), static_cast<ptrdiff_t>(spans.size()), total, kind_size[kind], kernels[kind],
                  nullptr, inv, 1, 1);
        run_work(&work[0]);
        return work[0].bad;
    }
    auto pieces = std::make_shared<Pieces>();
    pieces->spans = std::move(spans);
    pieces->count = plan_work(pieces->work, pieces->spans.data(), static_cast<ptrdiff_t>(pieces->spans.size()),
                              total, kind_size[kind], kernels[kind], nullptr, inv, 1, threads);
    for (int t = 1; t < pieces->count; t++) {
        pool.Schedule([pieces] { pieces->drain(); });
    }
    pieces->drain();
    std::unique_lock<std::mutex> lock(pieces->mutex);
    pieces->finished.wait(lock, [&] { return pieces->done == pieces->count; });
    int bad = 0;
    for (int t = 0; t < pieces->count; t++) bad |= pieces->work[t].bad;
    return bad;
}

ffi::Error check_and_unscale(ffi::ThreadPool pool, ffi::BufferR0<ffi::F32> inv_scale, ffi::RemainingArgs grads,
                             ffi::ResultBufferR0<ffi::PRED> finite, ffi::RemainingRets outs) {
    (void)kernels_selected;
    const size_t n = grads.size();
    if (ffi::Error error = ampscale_ffi::check_counts(n, outs.size()); error.failure()) return error;
    const float inv = *inv_scale.typed_data();
    std::vector<Span> spans[KIND_COUNT];
    ptrdiff_t totals[KIND_COUNT] = {0, 0, 0, 0};
    for (size_t i = 0; i < n; i++) {
        ampscale_ffi::Leaf leaf;
        if (ffi::Error error = ampscale_ffi::read_leaf(grads, outs, i, &leaf); error.failure()) return error;
        if (leaf.count == 0) continue;
        if (leaf.target != leaf.source) std::memcpy(leaf.target, leaf.source, leaf.bytes);
        const ptrdiff_t count = static_cast<ptrdiff_t>(leaf.count);
        spans[leaf.kind].push_back(Span{static_cast<char*>(leaf.target), count, totals[leaf.kind]});
        totals[leaf.kind] += leaf.count;
    }
    int bad = 0;
    for (int kind = 0; kind < KIND_COUNT; kind++) {
        if (!spans[kind].empty()) bad |= run_kind(pool, std::move(spans[kind]), totals[kind], kind, inv);
    }
    *finite->typed_data() = !bad;
    return ffi::Error::Success();
}

}  // namespace

// The library is built with hidden visibility (its copy of the FFI headers' inline functions must
// not meet another library's); only these symbols are exported.
#pragma GCC visibility push(default)

XLA_FFI_DEFINE_HANDLER_SYMBOL(ampscale_check_and_unscale_v1, check_and_unscale,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::BufferR0<ffi::F32>>()
                                  .RemainingArgs()
                                  .Ret<ffi::BufferR0<ffi::PRED>>()
                                  .RemainingRets());

// What the loader checks before registering the handler: the key it was built with (a hash of
// these sources and the jaxlib version, so a stale build is never used) and the kernel family.
extern "C" const char* ampscale_ffi_build_key(void) { return AMPSCALE_FFI_BUILD_KEY; }

extern "C" const char* ampscale_ffi_kernel_isa(void) {
    (void)kernels_selected;
    return kernel_isa;
}

#pragma GCC visibility pop
