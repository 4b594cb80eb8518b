"""Build the optional native NumPy kernel; the package installs without it if no C compiler works."""

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
            "ampscale.backends._native",
            sources=["ampscale/backends/_native.c"],
            extra_compile_args=compile_args,
            extra_link_args=link_args,
            optional=True,
        ),
        # the CUDA driver launcher: libcuda.so.1 is opened at run time, no toolkit needed here
        Extension(
            "ampscale._cuda._driver",
            sources=["ampscale/_cuda/_driver.c"],
            extra_compile_args=compile_args,
            extra_link_args=[*link_args, "-ldl"] if sys.platform == "linux" else link_args,
            optional=True,
        ),
    ],
    cmdclass={"build_ext": OptionalBuildExt},
)
