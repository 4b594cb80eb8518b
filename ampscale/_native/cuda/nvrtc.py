"""NVRTC at run time, with the compiled binaries cached on disk.

No CUDA toolkit is needed: the NVRTC library is found where the frameworks put it (already
loaded by torch or CuPy, a pip ``nvidia-cuda-nvrtc*`` wheel, ``CUDA_HOME``, the loader's
path). A source is compiled to a cubin for the device's architecture when this NVRTC knows it,
else to PTX for the newest architecture it knows (the driver then finishes the job). Binaries
are cached under ``$AMPSCALE_CACHE_DIR`` (default ``~/.cache/ampscale/cuda``), keyed by the
source, the options, the architecture and the NVRTC version, through the safe cache of
:mod:`ampscale._native._cache` (the user's own directory only, every entry verified before the
driver sees it, atomic writes); a cache that cannot be used only costs a compilation per process.

This module is framework-free: the torch backend uses it today, and a JAX XLA FFI CUDA handler
can use the same :func:`compiled` binaries.
"""

from __future__ import annotations

import ctypes
import glob
import hashlib
import os
import pathlib
import sys
import threading
from collections.abc import Sequence

from ampscale._native import _cache

__all__ = ["NvrtcError", "cache_dir", "compile_source", "compiled", "library_path", "load", "version"]

_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_library_path: str | None = None
_SONAMES = ("libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so.11.2", "libnvrtc.so")


class NvrtcError(RuntimeError):
    """NVRTC refused a source (the message carries its log) or failed."""


def _candidates() -> list[str]:
    """Where NVRTC may be, most likely first (the names the process has already loaded first)."""
    found: list[str] = []
    for base in sys.path:
        for pattern in ("nvidia/cuda_nvrtc/lib/libnvrtc.so.*", "nvidia/cu*/lib/libnvrtc.so.*"):
            found += sorted(glob.glob(os.path.join(base, pattern)), reverse=True)
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home:
            found += sorted(glob.glob(os.path.join(home, "lib64", "libnvrtc.so*")), reverse=True)
    # only the real library (the wheels also ship libnvrtc.alt.so and libnvrtc-builtins)
    return [path for path in found if os.path.basename(path).split(".so")[0] == "libnvrtc"]


def load() -> ctypes.CDLL:
    """The NVRTC library (loaded once). Raises ``OSError`` naming every place tried."""
    global _library, _library_path
    with _lock:
        if _library is not None:
            return _library
        tried = []
        no_load = getattr(os, "RTLD_NOLOAD", 0)
        attempts = [(name, no_load) for name in _SONAMES] if no_load else []
        attempts += [(path, 0) for path in _candidates()] + [(name, 0) for name in _SONAMES]
        for name, mode in attempts:
            try:
                library = ctypes.CDLL(name, mode=mode | getattr(os, "RTLD_GLOBAL", 0))
                library.nvrtcVersion  # noqa: B018 - the symbol must be there
            except (OSError, AttributeError) as exc:
                if not mode:
                    tried.append(f"{name} ({exc})")
                continue
            _bind(library)
            _library, _library_path = library, name
            return library
        raise OSError("the NVRTC library (libnvrtc) was not found; tried " + "; ".join(tried[-6:]))


def library_path() -> str | None:
    """The name or path NVRTC was loaded from (``None`` before :func:`load`)."""
    return _library_path


def _bind(library: ctypes.CDLL) -> None:
    p, i, c = ctypes.c_void_p, ctypes.c_int, ctypes.c_char_p
    size_p = ctypes.POINTER(ctypes.c_size_t)
    int_p = ctypes.POINTER(ctypes.c_int)
    strings = ctypes.POINTER(ctypes.c_char_p)
    signatures = {
        "nvrtcVersion": [int_p, int_p],
        "nvrtcCreateProgram": [ctypes.POINTER(p), c, c, i, strings, strings],
        "nvrtcCompileProgram": [p, i, strings],
        "nvrtcGetProgramLogSize": [p, size_p],
        "nvrtcGetProgramLog": [p, ctypes.c_char_p],
        "nvrtcGetPTXSize": [p, size_p],
        "nvrtcGetPTX": [p, ctypes.c_char_p],
        "nvrtcGetCUBINSize": [p, size_p],
        "nvrtcGetCUBIN": [p, ctypes.c_char_p],
        "nvrtcDestroyProgram": [ctypes.POINTER(p)],
        "nvrtcGetNumSupportedArchs": [int_p],
        "nvrtcGetSupportedArchs": [int_p],
    }
    for name, argtypes in signatures.items():
        function = getattr(library, name, None)
        if function is None:  # older NVRTC: no cubin or arch query (handled by the callers)
            continue
        function.argtypes = argtypes
        function.restype = i
    library.nvrtcGetErrorString.argtypes = [i]
    library.nvrtcGetErrorString.restype = c


def _check(library: ctypes.CDLL, result: int, what: str) -> None:
    if result != 0:
        message = library.nvrtcGetErrorString(result).decode(errors="replace")
        raise NvrtcError(f"{what} failed: {message} (nvrtcResult {result})")


def version() -> tuple[int, int]:
    """NVRTC's version, ``(major, minor)``."""
    library = load()
    major, minor = ctypes.c_int(), ctypes.c_int()
    _check(library, library.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
    return major.value, minor.value


def _supported_archs(library: ctypes.CDLL) -> list[int]:
    if not hasattr(library, "nvrtcGetSupportedArchs"):
        return []
    count = ctypes.c_int()
    _check(library, library.nvrtcGetNumSupportedArchs(ctypes.byref(count)), "nvrtcGetNumSupportedArchs")
    archs = (ctypes.c_int * count.value)()
    _check(library, library.nvrtcGetSupportedArchs(archs), "nvrtcGetSupportedArchs")
    return sorted(archs)


def compile_source(
    source: str, arch: int, options: Sequence[str] = (), name: str = "ampscale.cu", ptx: bool = False
) -> tuple[bytes, str]:
    """Compile ``source`` for compute capability ``arch`` (e.g. 90): ``(image, "cubin" | "ptx")``.

    A cubin for ``sm_{arch}`` when this NVRTC supports that architecture (and ``ptx`` is not
    asked for); else PTX for it, or for the newest architecture it supports below it (loadable
    by a driver that knows the device).

    Raises:
        NvrtcError: the compilation failed (the message holds NVRTC's log).
    """
    library = load()
    supported = _supported_archs(library)
    known = not supported or arch in supported
    cubin = not ptx and known and hasattr(library, "nvrtcGetCUBIN")
    if cubin:
        target = f"--gpu-architecture=sm_{arch}"
    elif known:
        target = f"--gpu-architecture=compute_{arch}"
    else:
        below = [a for a in supported if a <= arch] or supported[:1]
        target = f"--gpu-architecture=compute_{below[-1] if below else arch}"
    program = ctypes.c_void_p()
    _check(
        library,
        library.nvrtcCreateProgram(ctypes.byref(program), source.encode(), name.encode(), 0, None, None),
        "nvrtcCreateProgram",
    )
    try:
        encoded = [target.encode(), *(option.encode() for option in options)]
        array = (ctypes.c_char_p * len(encoded))(*encoded)
        result = library.nvrtcCompileProgram(program, len(encoded), array)
        if result != 0:
            size = ctypes.c_size_t()
            library.nvrtcGetProgramLogSize(program, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value + 1)
            library.nvrtcGetProgramLog(program, log)
            message = library.nvrtcGetErrorString(result).decode(errors="replace")
            text = log.value.decode(errors="replace")
            raise NvrtcError(f"NVRTC could not compile {name} ({target}): {message}\n{text}")
        getter = "CUBIN" if cubin else "PTX"
        size = ctypes.c_size_t()
        _check(library, getattr(library, f"nvrtcGet{getter}Size")(program, ctypes.byref(size)), f"nvrtcGet{getter}Size")
        image = ctypes.create_string_buffer(size.value)
        _check(library, getattr(library, f"nvrtcGet{getter}")(program, image), f"nvrtcGet{getter}")
        return image.raw, "cubin" if cubin else "ptx"
    finally:
        library.nvrtcDestroyProgram(ctypes.byref(program))


def cache_dir() -> pathlib.Path:
    """Where compiled binaries are kept: ``$AMPSCALE_CACHE_DIR`` or ``~/.cache/ampscale/cuda``."""
    configured = os.environ.get("AMPSCALE_CACHE_DIR")
    if configured:
        return pathlib.Path(configured)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "ampscale" / "cuda"


#: Why the disk cache was last not used (``None``: it was); for diagnostics and tests.
last_cache_problem: str | None = None
_CACHE_FORMAT = "ampscale nvrtc cache 2"  # in the key: entries of another layout are never read


def _valid_image(image: bytes, kind: str) -> bool:
    """A whole cubin (an ELF image) or PTX text (NUL-terminated, as NVRTC returns it)."""
    if kind == "cubin":
        return len(image) > 64 and image[:4] == b"\x7fELF"
    return len(image) > 1 and image.endswith(b"\0") and b".version" in image


def _cached(directory: str, key: str) -> tuple[bytes, str] | None:
    """The verified cubin or PTX for ``key`` in the checked cache ``directory``; ``None`` if there
    is none. A truncated, foreign or malformed entry is removed (it is then built again)."""
    for kind in ("cubin", "ptx"):
        entry_name = f"{key}.{kind}"
        try:
            entry = _cache.read_entry(directory, entry_name, entry_name)
        except _cache.InvalidEntry:
            entry = None
            _cache.remove_entry(directory, entry_name)  # truncated, empty or foreign: built again
        if entry is not None:
            with entry:
                if _valid_image(entry.payload, kind):
                    return entry.payload, kind
            _cache.remove_entry(directory, entry_name)
    return None


def compiled(source: str, arch: int, options: Sequence[str] = (), name: str = "ampscale.cu") -> tuple[bytes, str]:
    """:func:`compile_source`, through the disk cache (keyed by source, options, arch, NVRTC).

    The cache is :mod:`ampscale._native._cache`: a directory another user could write is not
    used, an entry is checked (size, hash, key, a whole cubin or PTX image) before it reaches
    the driver, a bad one is removed and compiled again once, and writes are atomic. On a cold
    cache one process compiles a source while the others wait for its entry (the build lock is
    taken before NVRTC runs, and the cache read again under it). Where the
    cache cannot be used (not the user's, unwritable, a full disk) the binary is compiled in
    memory for this process only (:data:`last_cache_problem` says why).

    Raises:
        NvrtcError: the compilation failed, or NVRTC returned an empty or malformed image.
    """
    global last_cache_problem
    key = hashlib.sha256(
        "\0".join([_CACHE_FORMAT, source, *options, str(arch), "nvrtc {}.{}".format(*version()), name]).encode()
    ).hexdigest()
    fresh: list[tuple[bytes, str]] = []

    def build() -> tuple[bytes, str]:
        if not fresh:
            image, kind = compile_source(source, arch, options, name)
            if not _valid_image(image, kind):
                raise NvrtcError(f"NVRTC returned an empty or malformed {kind} image for {name} ({len(image)} bytes)")
            fresh.append((image, kind))
        return fresh[0]

    try:
        directory = _cache.prepare_directory(str(cache_dir()))
        found = _cached(directory, key)
        if found is not None:
            last_cache_problem = None
            return found
        # The build lock first, then NVRTC: on a cold cache every process that needs this module
        # (pytest-xdist's workers, a job's ranks) would otherwise compile it at once, each about
        # a second of CPU. The lock is the key's (not one entry's: the kind, cubin or PTX, is
        # known only after the compile), and the cache is read again under it, since another
        # process may have built the entry while this one waited.
        with _cache.build_lock(directory, key):
            found = _cached(directory, key)
            if found is not None:
                last_cache_problem = None
                return found
            image, kind = build()
            name_of_entry = f"{key}.{kind}"
            _cache.publish(directory, name_of_entry, name_of_entry, lambda path: _cache.write_bytes(path, image))
            try:
                entry = _cache.read_entry(directory, name_of_entry, name_of_entry)
            except _cache.InvalidEntry as exc:
                raise _cache.CacheError(f"the entry just written does not verify: {exc}") from exc
            if entry is None:
                raise _cache.CacheError(f"{name_of_entry} vanished right after it was written")
            with entry:
                if not _valid_image(entry.payload, kind):  # a valid trailer over a bad image: never ours
                    raise _cache.CacheError(f"{entry.path} holds a malformed {kind} image")
                last_cache_problem = None
                return entry.payload, kind
    except _cache.CacheError as exc:  # no cache (CacheUnavailable included): compile in memory
        last_cache_problem = str(exc)
        return build()
