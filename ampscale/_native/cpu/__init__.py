"""Host (CPU) kernels: the NumPy extension and the XLA FFI handler for JAX on the CPU.

``kernels.h`` holds the check + unscale loops (generic, AVX2 + F16C, AVX-512 families, picked at
run time) and the two-thread split. ``_numpy.c`` is the NumPy backend's C extension over them
(module :mod:`ampscale._native.cpu._numpy`, built by ``setup.py``); ``jax_ffi.cc`` is the JAX CPU
handler over the same kernels, built by :mod:`ampscale._native.ffi_build`. ``fp8_kernels.h``: the
fused FP8 pass (per-tensor amax and saturating cast, every family), in ``_numpy.c`` and in the
JAX CPU handler ``jax_ffi_fp8.cc`` (:mod:`ampscale.fp8._fused`).
"""
