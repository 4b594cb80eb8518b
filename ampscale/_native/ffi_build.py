"""Build the XLA FFI handlers for JAX (CPU: ``jax_ffi.cc``; CUDA: ``jax_ffi_cuda.cc``) with the host C++ compiler.

Both handlers go into one library; the CUDA one needs no CUDA toolkit to build (its kernels are
compiled at run time by NVRTC, see ``ampscale._native.cuda._jax``).

Standard library only: ``setup.py`` runs it at install time, and the JAX backend on first use.

* At install time, when jaxlib is installed in the build environment, the handler is compiled
  against the FFI headers jaxlib ships (``jax.ffi.include_dir()``) into
  ``ampscale/_native/libampscale_jax_ffi.so``. pip builds in an isolated environment without
  jax by default, so this happens for ``pip install --no-build-isolation`` (and for
  ``python setup.py build_ext --inplace``), not for a plain ``pip install``.
* Otherwise (or when that library was built from other sources or for another jaxlib), the
  first JAX program that needs the handler compiles it into a per-user cache,
  ``$AMPSCALE_CACHE_DIR`` or ``$XDG_CACHE_HOME/ampscale`` (``~/.cache/ampscale``), named by a
  hash of the sources, the jaxlib version, the compiler and its flags. So a user who installs
  a wheel without jax and then installs jax gets the handler compiled once (a few seconds) and
  reused by every later process; a jaxlib upgrade or a new ampscale compiles a new one.

Every library carries the key it was built with (a hash of the sources and the jaxlib version)
twice: in a trailer after the ELF image, with the file's size and SHA-256, which the loader
checks *before* it loads anything (a library runs code as soon as it is loaded), and compiled
into the library itself. The per-user cache is :mod:`ampscale._native._cache`: a directory that
another user could write is never used, a truncated or corrupt file is never loaded (it is
built again), and every write is atomic.
"""

from __future__ import annotations

import hashlib
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
from importlib import metadata, util

if __package__:
    from ampscale._native import _cache
else:  # loaded by path from setup.py, outside the package (which may not import): its sibling by path
    _spec = util.spec_from_file_location(
        "_ampscale_cache", os.path.join(os.path.dirname(os.path.abspath(__file__)), "_cache.py")
    )
    assert _spec is not None
    assert _spec.loader is not None
    _cache = util.module_from_spec(_spec)
    sys.modules[_spec.name] = _cache  # dataclasses looks the module up by name
    _spec.loader.exec_module(_cache)

HERE = os.path.dirname(os.path.abspath(__file__))
#: The files the handlers are compiled from, relative to this directory (the CPU kernels are
#: shared with the NumPy extension; the CUDA handler takes its launch layout from the kernel source).
SOURCES = (
    "cpu/jax_ffi.cc",
    "cpu/jax_ffi_fp8.cc",
    "cuda/jax_ffi_cuda.cc",
    "cuda/jax_ffi_fp8_cuda.cc",
    "cpu/jax_ffi_leaves.h",
    "cpu/kernels.h",
    "cpu/fp8_kernels.h",
    "cuda/jax_kernels.cu",
    "cuda/fp8_kernels.cu",
)
#: The translation units of the library (the loss scaler's handlers, the FP8 pass's handlers).
UNITS = ("cpu/jax_ffi.cc", "cpu/jax_ffi_fp8.cc", "cuda/jax_ffi_cuda.cc", "cuda/jax_ffi_fp8_cuda.cc")
#: The library built at install time, beside the sources.
PREBUILT = os.path.join(HERE, "libampscale_jax_ffi.so")
#: GCC/Clang flags; the kernels' float semantics match the NumPy extension's build.
FLAGS = (
    "-O3",
    "-std=c++17",
    "-shared",
    "-fPIC",
    "-fvisibility=hidden",
    "-fno-math-errno",
    "-fno-trapping-math",
    "-pthread",
)


def jaxlib_headers() -> tuple[str, str] | None:
    """``(include directory, jaxlib version)`` of the installed jaxlib, found without importing it."""
    try:
        spec = util.find_spec("jaxlib")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        include = os.path.join(location, "include")
        if os.path.exists(os.path.join(include, "xla", "ffi", "api", "ffi.h")):
            try:
                return include, metadata.version("jaxlib")
            except metadata.PackageNotFoundError:
                return None
    return None


def build_key(jaxlib_version: str, directory: str = HERE) -> str:
    """What a library must have been built from: a hash of the sources, and the jaxlib version."""
    digest = hashlib.sha256()
    for name in SOURCES:
        with open(os.path.join(directory, name), "rb") as f:
            digest.update(name.encode() + b"\0" + f.read() + b"\0")
    return f"src-{digest.hexdigest()[:16]}-jaxlib-{jaxlib_version}"


def find_compiler() -> list[str] | None:
    """The C++ compiler command: ``$CXX``, else Python's configured one, else c++/g++/clang++."""
    candidates = [os.environ.get("CXX", ""), sysconfig.get_config_var("CXX") or ""]
    for candidate in candidates:
        command = shlex.split(candidate)
        if command and shutil.which(command[0]):
            return command
    for name in ("c++", "g++", "clang++"):
        path = shutil.which(name)
        if path:
            return [path]
    return None


def _compiler_identity(command: list[str]) -> str:
    """The command and its executable's size and time: a compiler upgrade changes the cache name."""
    path = shutil.which(command[0]) or command[0]
    try:
        stat = os.stat(os.path.realpath(path))
        return f"{' '.join(command)}|{stat.st_size}|{stat.st_mtime_ns}"
    except OSError:
        return " ".join(command)


def cache_dir() -> str:
    """Where lazily compiled handlers are kept (per user)."""
    explicit = os.environ.get("AMPSCALE_CACHE_DIR")
    if explicit:
        return explicit
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "ampscale")


def cached_name(key: str, compiler: list[str]) -> str:
    """The file name, in the cache, of the handler built with ``key`` by ``compiler``."""
    identity = "\n".join([key, _compiler_identity(compiler), *FLAGS, sys.platform])
    return f"jax_ffi-{hashlib.sha256(identity.encode()).hexdigest()[:20]}.so"


def cached_library(key: str, compiler: list[str]) -> str:
    """The cache path of the handler built with ``key`` by ``compiler``."""
    return os.path.join(cache_dir(), cached_name(key, compiler))


def _compile(output: str, include_dir: str, key: str, compiler: list[str], directory: str) -> None:
    """Run the compiler, writing the library to ``output``.

    Raises:
        RuntimeError: the compiler failed or could not run (its last lines of output are in the message).
    """
    if sys.platform == "win32":
        raise RuntimeError("the JAX handlers are built with GCC or Clang; Windows is not supported")
    command = [
        *compiler,
        *FLAGS,
        "-isystem",
        include_dir,
        "-I",
        directory,
        f'-DAMPSCALE_FFI_BUILD_KEY="{key}"',
        *(os.path.join(directory, unit) for unit in UNITS),
        "-o",
        output,
    ]
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
    except (OSError, subprocess.SubprocessError) as exc:
        raise RuntimeError(f"{' '.join(command)} could not run: {exc}") from exc
    if result.returncode != 0:
        tail = "\n".join((result.stderr or result.stdout).strip().splitlines()[-15:])
        raise RuntimeError(f"{' '.join(command)} failed (exit {result.returncode}):\n{tail}")


def compile_library(output: str, include_dir: str, key: str, compiler: list[str], directory: str = HERE) -> None:
    """Compile the handlers into ``output`` with their trailer (atomically: concurrent builds each
    write a whole file, and a failed one leaves no temporary file). For the install-time build;
    the per-user cache goes through :func:`cached_handler`.

    Raises:
        RuntimeError: the compiler failed, or the file could not be written.
    """
    out_dir = os.path.dirname(os.path.abspath(output))
    try:
        os.makedirs(out_dir, exist_ok=True)
        _cache.publish(
            out_dir,
            os.path.basename(output),
            key,
            lambda temporary: _compile(temporary, include_dir, key, compiler, directory),
        )
    except OSError as exc:
        raise RuntimeError(f"writing the JAX handler to {output} failed: {exc}") from exc


def open_prebuilt(key: str, path: str | None = None) -> _cache.Entry:
    """The library built at install time, verified for ``key`` before anything loads it.

    Raises:
        FileNotFoundError: there is none.
        ampscale._native._cache.InvalidEntry: it is truncated, corrupt or for another key (or
            was built by an ampscale without trailers).
    """
    return _cache.verify_file(PREBUILT if path is None else path, key, check_owner=False)


def cached_handler(key: str, include_dir: str, compiler: list[str], directory: str = HERE) -> _cache.Entry:
    """The handler for ``key`` from the per-user cache, verified; compiled there first if needed.

    Raises:
        ampscale._native._cache.CacheUnavailable: the cache directory is not the user's own, or
            cannot be created.
        ampscale._native._cache.CacheError: the library could not be written (a full disk) or
            does not verify.
        RuntimeError: the compiler failed.
    """
    return _cache.obtain(
        cache_dir(),
        cached_name(key, compiler),
        key,
        lambda temporary: _compile(temporary, include_dir, key, compiler, directory),
    )


def build_at_install(output_dir: str, source_dir: str = HERE) -> str:
    """Build the handlers for ``setup.py`` when jaxlib and a compiler are present; say what happened."""
    headers = jaxlib_headers()
    if headers is None:
        return "jaxlib not installed in the build environment; compiled on first use instead"
    compiler = find_compiler()
    if compiler is None:
        return "no C++ compiler found (set CXX); compiled on first use if one appears"
    include_dir, version = headers
    output = os.path.join(output_dir, os.path.basename(PREBUILT))
    compile_library(output, include_dir, build_key(version, source_dir), compiler, source_dir)
    return f"built {output} for jaxlib {version}"
