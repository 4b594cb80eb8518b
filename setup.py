"""Build the optional native kernels; the package installs without them if no compiler works.

A build that fails is reported (the extension, what runs without it, the compiler's last lines)
and left out; with ``AMPSCALE_REQUIRE_NATIVE=1`` (CI) it fails the build instead.

* ``ampscale._native.cpu._numpy``: the NumPy backend's C extension.
* ``ampscale._native.cuda._driver``: the CUDA driver launcher.
* ``libampscale_jax_ffi.so``: the JAX backend's XLA FFI handler for the CPU, built against the
  FFI headers of the jaxlib installed in the build environment, if there is one (pip's isolated
  builds have none: the handler is then compiled on first use; see
  ``ampscale/_native/ffi_build.py``).
"""

import contextlib
import importlib.util
import os
import sys
import tempfile

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.errors import BaseError

#: what each extension is for, and what runs without it (the warning of a failed build says so)
ROLES = {
    "ampscale._native.cpu._numpy": (
        "the NumPy backend's native kernel; without it the pure-NumPy path runs, several times slower"
    ),
    "ampscale._native.cuda._driver": (
        "the CUDA launcher; without it torch's CUDA steps run as eager torch operations "
        "(about 60 launches per update) and the drop-in's update too"
    ),
}
#: set to 1 (CI does) to make a failed build an error instead of a warning
REQUIRE = "AMPSCALE_REQUIRE_NATIVE"
#: compiler output lines quoted in the warning
TAIL_LINES = 12


@contextlib.contextmanager
def _output_captured(into: list[str]):
    """Send this process's stdout and stderr (the compiler's too: it inherits them) to a file
    while the block runs; ``into`` then holds the text, which is also written out as it was."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as captured:
        os.dup2(captured.fileno(), 1)
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
            captured.seek(0)
            text = captured.read().decode(errors="replace")
            into.append(text)
            sys.stdout.write(text)  # nothing the compiler said is hidden
            sys.stdout.flush()


class OptionalBuildExt(build_ext):
    """Build the extensions; one that does not build is left out, so that the install never fails
    for want of a compiler (ampscale runs without them, slower), but never silently: a warning
    names the extension, what runs without it, and ends with the compiler's last lines.
    ``AMPSCALE_REQUIRE_NATIVE=1`` makes such a failure an error (CI sets it)."""

    def run(self) -> None:
        self.failed: list[str] = []
        try:
            super().run()
        except Exception as exc:  # no compiler at all: nothing was built
            self.failed += [self._warn(ext.name, exc, "") for ext in self.extensions if ext.name not in self.failed]
        self.build_jax_handler()
        if self.failed and os.environ.get(REQUIRE) == "1":
            raise BaseError(f"{REQUIRE}=1 and these extensions did not build: {', '.join(self.failed)} (see above)")

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
        output: list[str] = []
        try:
            with _output_captured(output):
                super().build_extension(ext)
        except Exception as exc:
            self.failed.append(self._warn(ext.name, exc, output[0] if output else ""))

    @staticmethod
    def _warn(name: str, exc: BaseException, output: str) -> str:
        lines = [line for line in output.splitlines() if line.strip()][-TAIL_LINES:]
        quoted = "".join(f"\n    {line}" for line in lines) or "\n    (no compiler output)"
        role = ROLES.get(name, "an optional extension")
        sys.stderr.write(
            f"\nampscale: WARNING: the C extension {name} was not built ({type(exc).__name__}: {exc}).\n"
            f"  It is {role}.\n  The compiler's last lines:{quoted}\n\n"
        )
        sys.stderr.flush()
        return name


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
