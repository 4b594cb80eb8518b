"""CUDA pieces shared by the GPU backends: the kernels, NVRTC, and a launcher with no toolkit.

* ``jax_ffi_cuda.cc``: the XLA FFI handler for JAX on CUDA (built with the CPU one by
  :mod:`ampscale._native.ffi_build`), and :mod:`ampscale._native.cuda._jax`, its NVRTC build.
* :mod:`ampscale._native.cuda._packed`: the packed device record (one small buffer per state) and
  the launch logic the torch and CuPy adapters share.

* ``kernels.cu`` and :mod:`ampscale._native.cuda._plan`: the check + unscale kernel with the state
  transition in its last block, and the one-thread update kernel, for one configuration.
* ``fp8_kernels.cu`` and :mod:`ampscale._native.cuda._fp8`: the fused FP8 pass (every tensor's
  amax, optionally its saturated payload, in one launch; used by :mod:`ampscale.fp8._fused_cuda`).
* :mod:`ampscale._native.cuda.nvrtc`: NVRTC loaded at run time, binaries cached on disk.
* :mod:`ampscale._native.cuda.driver`: modules loaded and kernels launched through the CUDA driver
  (``libcuda.so.1``, found at run time) by a small C extension, :mod:`ampscale._native.cuda._driver`.

Nothing here imports a framework: the CuPy backend loads the binaries NVRTC made here into
CuPy (``cupy.cuda.function.Module().load``; CuPy's own compile would add ``-ftz=true``) and
launches them through CuPy, the torch backend uses NVRTC and the driver launcher here, and the
JAX XLA FFI handler loads the same binaries through the C-level table that ``_driver`` exports.
"""
