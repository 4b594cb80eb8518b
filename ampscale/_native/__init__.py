"""ampscale's native code, by target: what runs below the Python adapters.

* :mod:`ampscale._native.cpu`: the host kernels (``kernels.h``: the SIMD check + unscale loops and
  the two-thread split), the NumPy extension built from them (``_numpy.c``), and the XLA FFI
  handler for JAX on the CPU (``jax_ffi.cc``), which runs the same kernels.
* :mod:`ampscale._native.cuda`: the CUDA kernels (``kernels.cu`` for CuPy and torch,
  ``jax_kernels.cu`` for XLA), the XLA FFI handler for JAX on CUDA (``jax_ffi_cuda.cc``), NVRTC,
  the driver launcher (``_driver.c``), the launch plan and the packed device record.
* :mod:`ampscale._native.ffi_build`: builds the one XLA FFI library that holds both JAX handlers.

Nothing here imports a framework: the adapters in :mod:`ampscale.backends` load these pieces and
hand them their framework's arrays, streams and devices. The state transition each kernel runs is
not written here: it is emitted as C from :func:`ampscale._core.transition` by
:mod:`ampscale._codegen`.
"""
