"""CUDA pieces shared by the GPU backends: the kernels, NVRTC, and a launcher with no toolkit.

* ``kernels.cu`` and :mod:`ampscale._cuda._plan`: the check + unscale kernel with the state
  transition in its last block, and the one-thread update kernel, for one configuration.
* :mod:`ampscale._cuda.nvrtc`: NVRTC loaded at run time, binaries cached on disk.
* :mod:`ampscale._cuda.driver`: modules loaded and kernels launched through the CUDA driver
  (``libcuda.so.1``, found at run time) by a small C extension, :mod:`ampscale._cuda._driver`.

Nothing here imports a framework: CuPy compiles and launches the kernels itself (NVRTC through
``cupy.RawModule``), the torch backend uses NVRTC and the driver launcher here, and a JAX XLA
FFI handler can load the same binaries through the C-level table that ``_driver`` exports.
"""
