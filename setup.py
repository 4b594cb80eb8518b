"""Build the optional native kernels; the package installs without them if no compiler works.

* ``ampscale._native.cpu._numpy``: the NumPy backend's C extension.
* ``ampscale._native.cuda._driver``: the CUDA driver launcher.
* ``libampscale_jax_ffi.so``: the JAX backend's XLA FFI handler for the CPU, built against the
  FFI headers of the jaxlib installed in the build environment, if there is one (pip's isolated
  builds have none: the handler is then compiled on first use; see
  ``ampscale/_native/ffi_build.py``).
"""

import importlib.util
import os
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


class OptionalBuildExt(build_ext):
    """Build extensions, but never fail the install because a compiler is missing."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as exc:
            print(f"ampscale: native NumPy kernel not built ({exc}); the pure-NumPy path will be used")
        self.build_jax_handler()

    def build_jax_handler(self) -> None:
        """The JAX CPU handler, when jaxlib is importable here; never fails the install."""
        sources = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ampscale", "_native")
        target = sources if self.inplace else os.path.join(self.build_lib, "ampscale", "_native")
        try:
            spec = importlib.util.spec_from_file_location("_ampscale_ffi_build", os.path.join(sources, "ffi_build.py"))
            assert spec is not None
            assert spec.loader is not None
            builder = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(builder)
            print(f"ampscale: JAX CPU custom call: {builder.build_at_install(target, sources)}")
        except Exception as exc:
            print(f"ampscale: JAX CPU custom call not built at install ({exc}); it is compiled on first use")

    def build_extension(self, ext: Extension) -> None:
        try:
            super().build_extension(ext)
        except Exception as exc:
            print(f"ampscale: native NumPy kernel not built ({exc}); the pure-NumPy path will be used")


if sys.platform == "win32":
    compile_args = ["/O2"]
    link_args: list[str] = []
else:
    compile_args = ["-O3", "-std=c11", "-fno-math-errno", "-fno-trapping-math"]
    link_args = ["-pthread"]

setup(
    ext_modules=[
        Extension(
            "ampscale._native.cpu._numpy",
            sources=["ampscale/_native/cpu/_numpy.c"],
            depends=["ampscale/_native/cpu/kernels.h", "ampscale/_native/cpu/fp8_kernels.h"],
            extra_compile_args=compile_args,
            extra_link_args=link_args,
            optional=True,
        ),
        # the CUDA driver launcher: libcuda.so.1 is opened at run time, no toolkit needed here
        Extension(
            "ampscale._native.cuda._driver",
            sources=["ampscale/_native/cuda/_driver.c"],
            extra_compile_args=compile_args,
            extra_link_args=[*link_args, "-ldl"] if sys.platform == "linux" else link_args,
            optional=True,
        ),
    ],
    cmdclass={"build_ext": OptionalBuildExt},
)
