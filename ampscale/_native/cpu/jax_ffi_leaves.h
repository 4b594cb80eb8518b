/*
 * The gradients of one call of ampscale_check_and_unscale_v1, read the same way by the CPU
 * handler (jax_ffi.cc) and the CUDA handler (jax_ffi_cuda.cc): operand i + 1 and result i + 1
 * of each gradient, checked against the target's contract (see jax_ffi.cc).
 */
#ifndef AMPSCALE_JAX_FFI_LEAVES_H
#define AMPSCALE_JAX_FFI_LEAVES_H

#include <cstddef>
#include <cstdint>
#include <string>

#include "xla/ffi/api/ffi.h"

namespace ampscale_ffi {

namespace ffi = xla::ffi;

// dtype codes: the same in kernels.h (KIND_*), kernels.cu and jax_kernels.cu (checked there)
enum LeafKind { LEAF_F16 = 0, LEAF_BF16 = 1, LEAF_F32 = 2, LEAF_F64 = 3 };

// One gradient: where it is read, where it is written (the same buffer when the call aliases
// the result to its operand), its element count, bytes and dtype code.
struct Leaf {
    const void* source;
    void* target;
    int64_t count;
    size_t bytes;
    int kind;
};

inline int leaf_kind(ffi::DataType dtype) {
    switch (dtype) {
        case ffi::DataType::F16: return LEAF_F16;
        case ffi::DataType::BF16: return LEAF_BF16;
        case ffi::DataType::F32: return LEAF_F32;
        case ffi::DataType::F64: return LEAF_F64;
        default: return -1;
    }
}

// Every gradient must have one result.
inline ffi::Error check_counts(size_t grads, size_t results) {
    if (grads == results) return ffi::Error::Success();
    return ffi::Error::InvalidArgument("ampscale_check_and_unscale_v1: " + std::to_string(grads) +
                                       " gradients but " + std::to_string(results) +
                                       " gradient results; each gradient has one result");
}

// Gradient i and its result: a supported dtype, the result of the same dtype and size.
inline ffi::Error read_leaf(const ffi::RemainingArgs& grads, const ffi::RemainingRets& outs, size_t i, Leaf* leaf) {
    ffi::ErrorOr<ffi::AnyBuffer> in = grads.get<ffi::AnyBuffer>(i);
    ffi::ErrorOr<ffi::Result<ffi::AnyBuffer>> out = outs.get<ffi::AnyBuffer>(i);
    if (!in.has_value()) return in.error();
    if (!out.has_value()) return out.error();
    const ffi::AnyBuffer& source = in.value();
    ffi::AnyBuffer target = *out.value();
    const int kind = leaf_kind(source.element_type());
    if (kind < 0 || target.element_type() != source.element_type() ||
        target.element_count() != source.element_count()) {
        return ffi::Error::InvalidArgument(
            "ampscale_check_and_unscale_v1: gradient " + std::to_string(i) +
            " must be float16, bfloat16, float32 or float64, with a result of the same dtype and size");
    }
    *leaf = Leaf{source.untyped_data(), target.untyped_data(), static_cast<int64_t>(source.element_count()),
                 source.size_bytes(), kind};
    return ffi::Error::Success();
}

}  // namespace ampscale_ffi

#endif
