"""The build and binary caches: never a dead process, never someone else's code.

Both run-time caches (the JAX handler library compiled on first use, NVRTC's CUDA binaries) go
through :mod:`ampscale._native._cache`. Checked here, for the mechanism and for each cache:

* a cache directory, or one above it, that another user owns or may write is neither read nor
  written (this process runs as root here: other owners come from ``os.chown``);
* a truncated, empty, garbage or foreign entry is never loaded (a library runs code when it is
  loaded: a planted one writes a marker file from its constructor) and is built again, once;
* an unwritable or full directory costs the fast path (JAX: the pure-XLA path, one
  ``PerformanceWarning``, the step runs) or a compilation (NVRTC), never the process;
* failed writes leave no temporary file; concurrent builders build an entry once;
* ``jax.export`` artifacts of the documented train step serialize, and run elsewhere.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import pathlib
import shutil
import stat
import subprocess
import sys
import textwrap
from collections.abc import Iterator

import pytest

from ampscale._native import _cache

ROOT = pathlib.Path(__file__).resolve().parent.parent
POSIX = hasattr(os, "geteuid") and sys.platform != "win32"
AS_ROOT = POSIX and os.geteuid() == 0
OTHER_UID = 54321  # no such user: "another user" for os.chown
needs_posix = pytest.mark.skipif(not POSIX, reason="owners and modes are POSIX")
needs_root = pytest.mark.skipif(not AS_ROOT, reason="giving a file to another user needs root")


def _env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), **extra}
    return env


def _temporaries(directory: pathlib.Path) -> list[str]:
    return sorted(p.name for p in directory.rglob("*") if p.name.endswith(".tmp"))


# ------------------------------------------------------------------------------ the rule


@needs_posix
def test_the_users_own_directory_is_accepted_and_missing_ones_are_made_private(tmp_path: pathlib.Path) -> None:
    target = tmp_path / "a" / "b" / "cache"
    real = _cache.prepare_directory(str(target))
    assert real == os.path.realpath(target)
    for directory in (tmp_path / "a", tmp_path / "a" / "b", target):
        assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    assert _cache.check_directory(str(target)) is None


@needs_posix
@pytest.mark.parametrize(
    ("case", "needs"),
    [
        ("cache writable by everyone", None),
        ("cache writable by its group", "root"),
        ("cache owned by another user", "root"),
        ("parent writable by everyone", None),
        ("parent owned by another user", "root"),
        ("cache sticky and writable by everyone", None),
        ("link to a directory writable by everyone", None),
    ],
)
def test_a_directory_another_user_could_write_is_refused(tmp_path: pathlib.Path, case: str, needs: str | None) -> None:
    if needs == "root" and not AS_ROOT:
        pytest.skip("needs root (os.chown)")
    parent = tmp_path / "parent"
    cache = parent / "cache"
    cache.mkdir(parents=True, mode=0o700)
    parent.chmod(0o700)
    cache.chmod(0o700)
    expected = "writable by every user"
    checked = cache
    if case == "cache writable by everyone":
        cache.chmod(0o777)
    elif case == "cache writable by its group":
        os.chown(cache, -1, OTHER_UID)
        cache.chmod(0o770)
        expected = "writable by its group"
    elif case == "cache owned by another user":
        os.chown(cache, OTHER_UID, -1)
        expected = "owned by another user"
    elif case == "parent writable by everyone":
        parent.chmod(0o777)
    elif case == "parent owned by another user":
        os.chown(parent, OTHER_UID, -1)
        expected = "owned by another user"
    elif case == "cache sticky and writable by everyone":
        cache.chmod(0o1777)  # like /tmp itself: anyone may add entries under the names looked up
    else:
        cache.chmod(0o777)
        link = tmp_path / "link"
        link.symlink_to(cache)
        checked = link
    why = _cache.check_directory(str(checked))
    assert why is not None
    assert expected in why, why
    with pytest.raises(_cache.CacheUnavailable, match=expected):
        _cache.prepare_directory(str(checked))
    with pytest.raises(_cache.CacheUnavailable, match=expected):
        _cache.obtain(str(checked), "entry", "key", lambda path: pytest.fail("built in a refused directory"))
    assert [p.name for p in cache.iterdir()] == []  # nothing created, no lock file either


@needs_posix
def test_a_sticky_world_writable_parent_is_fine_and_the_users_private_group_too(tmp_path: pathlib.Path) -> None:
    """``/tmp/<user>-cache``: nobody else can rename or replace what the user owns in ``/tmp``."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    cache = shared / "mine"
    assert _cache.prepare_directory(str(cache)) == os.path.realpath(cache)
    import grp
    import pwd

    user = pwd.getpwuid(os.geteuid())
    try:
        private = grp.getgrnam(user.pw_name)
    except KeyError:
        pytest.skip("this user has no private group")
    if set(private.gr_mem) - {user.pw_name}:
        pytest.skip("this user's group has other members")
    os.chown(cache, -1, private.gr_gid)
    cache.chmod(0o770)  # umask 002 on a user-private-group system
    assert _cache.check_directory(str(cache)) is None


@needs_posix
def test_nothing_is_created_inside_a_directory_that_is_not_safe(tmp_path: pathlib.Path) -> None:
    open_to_all = tmp_path / "open"
    open_to_all.mkdir()
    open_to_all.chmod(0o777)
    with pytest.raises(_cache.CacheUnavailable, match="writable by every user"):
        _cache.prepare_directory(str(open_to_all / "ampscale" / "cache"))
    assert list(open_to_all.iterdir()) == []


# ------------------------------------------------------------------------------ entries


def _write(path: pathlib.Path, data: bytes) -> None:
    path.write_bytes(data)


def test_an_entry_round_trips_and_is_built_once(tmp_path: pathlib.Path) -> None:
    builds = []

    def produce(path: str) -> None:
        builds.append(path)
        _write(pathlib.Path(path), b"payload bytes")

    with _cache.obtain(str(tmp_path), "thing.bin", "key-1", produce) as entry:
        assert entry.payload == b"payload bytes"
    with _cache.obtain(str(tmp_path), "thing.bin", "key-1", produce) as entry:
        assert entry.payload == b"payload bytes"
    assert len(builds) == 1
    assert stat.S_IMODE((tmp_path / "thing.bin").stat().st_mode) == 0o644
    assert _temporaries(tmp_path) == []


def _good_entry(directory: pathlib.Path, name: str = "thing.bin", key: str = "key-1") -> bytes:
    with _cache.obtain(str(directory), name, key, lambda p: _write(pathlib.Path(p), b"x" * 1000)):
        pass
    return (directory / name).read_bytes()


@pytest.mark.parametrize("damage", ["truncated", "empty", "garbage", "flipped byte", "another key", "a link"])
def test_a_damaged_entry_is_never_used_and_is_built_again_once(tmp_path: pathlib.Path, damage: str) -> None:
    whole = _good_entry(tmp_path)
    path = tmp_path / "thing.bin"
    if damage == "truncated":
        path.write_bytes(whole[: len(whole) // 2])
    elif damage == "empty":
        path.write_bytes(b"")
    elif damage == "garbage":
        path.write_bytes(os.urandom(5000))
    elif damage == "flipped byte":
        path.write_bytes(whole[:10] + bytes([whole[10] ^ 1]) + whole[11:])
    elif damage == "another key":
        path.unlink()
        _good_entry(tmp_path, key="key-2")
    else:
        elsewhere = tmp_path / "elsewhere.bin"
        elsewhere.write_bytes(whole)
        path.unlink()
        path.symlink_to(elsewhere)  # never followed, even to a valid entry
    with pytest.raises(_cache.InvalidEntry):
        _cache.read_entry(str(tmp_path), "thing.bin", "key-1")
    builds = []

    def produce(p: str) -> None:
        builds.append(p)
        _write(pathlib.Path(p), b"rebuilt")

    with _cache.obtain(str(tmp_path), "thing.bin", "key-1", produce) as entry:
        assert entry.payload == b"rebuilt"
    assert len(builds) == 1
    assert not path.is_symlink()
    assert _temporaries(tmp_path) == []


@needs_root
@pytest.mark.parametrize("problem", ["owned by another user", "writable by other users"])
def test_an_entry_someone_else_could_have_written_is_not_used(tmp_path: pathlib.Path, problem: str) -> None:
    _good_entry(tmp_path)
    path = tmp_path / "thing.bin"
    if problem == "owned by another user":
        os.chown(path, OTHER_UID, -1)
    else:
        path.chmod(0o666)
    with pytest.raises(_cache.InvalidEntry, match=problem):
        _cache.read_entry(str(tmp_path), "thing.bin", "key-1")


def test_a_failed_build_leaves_no_file(tmp_path: pathlib.Path) -> None:
    def failing(path: str) -> None:
        _write(pathlib.Path(path), b"half a lib")
        raise RuntimeError("the compiler failed")

    with pytest.raises(RuntimeError, match="the compiler failed"):
        _cache.obtain(str(tmp_path), "thing.bin", "key-1", failing)
    assert not (tmp_path / "thing.bin").exists()
    assert _temporaries(tmp_path) == []


def test_a_full_disk_leaves_no_file_and_raises_a_cache_error(tmp_path: pathlib.Path, monkeypatch) -> None:
    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(_cache.os, "fsync", full)
    with pytest.raises(_cache.CacheError, match="No space left on device"):
        _cache.obtain(str(tmp_path), "thing.bin", "key-1", lambda p: _write(pathlib.Path(p), b"data"))
    assert not (tmp_path / "thing.bin").exists()
    assert _temporaries(tmp_path) == []


_BUILDER = textwrap.dedent(
    """
    import os, sys, time
    from ampscale._native import _cache
    directory, log = sys.argv[1], sys.argv[2]
    def produce(path):
        with open(log, "a") as f:
            f.write("built\\n")
        time.sleep(0.5)  # long enough for the others to arrive while this one builds
        with open(path, "wb") as f:
            f.write(b"the one build")
    with _cache.obtain(directory, "shared.bin", "key-1", produce) as entry:
        print(entry.payload.decode())
    """
)


@pytest.mark.skipif(sys.platform == "win32", reason="file locks are POSIX here")
def test_concurrent_builders_build_once_and_all_get_the_whole_entry(tmp_path: pathlib.Path) -> None:
    log = tmp_path / "log"
    cache = tmp_path / "cache"
    runs = [
        subprocess.Popen(
            [sys.executable, "-c", _BUILDER, str(cache), str(log)], stdout=subprocess.PIPE, text=True, env=_env()
        )
        for _ in range(4)
    ]
    outputs = [run.communicate(timeout=120)[0].strip() for run in runs]
    assert [run.returncode for run in runs] == [0] * 4
    assert outputs == ["the one build"] * 4
    assert log.read_text().count("built") == 1
    assert _temporaries(cache) == []


def test_the_trailer_keeps_a_library_loadable(tmp_path: pathlib.Path) -> None:
    """The trailer follows the ELF image: the loader ignores it (checked on a real library)."""
    import ctypes

    compiler = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if compiler is None or sys.platform == "win32":
        pytest.skip("needs a C compiler")
    source = tmp_path / "lib.c"
    source.write_text("int answer(void) { return 42; }\n")

    def produce(path: str) -> None:
        subprocess.run([compiler, "-shared", "-fPIC", "-o", path, str(source)], check=True)

    with _cache.obtain(str(tmp_path / "cache"), "lib.so", "k", produce) as entry:
        assert ctypes.CDLL(entry.load_path()).answer() == 42


# ------------------------------------------------------------------------------ NVRTC's binaries

from ampscale._native.cuda import nvrtc  # noqa: E402

_CUBIN = b"\x7fELF" + bytes(range(256)) * 4  # what the fake NVRTC returns: a whole "cubin"


@pytest.fixture
def fake_nvrtc(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """NVRTC replaced by a counter (no NVRTC library needed): each compile appends to the list."""
    compiles: list[int] = []

    def compile_source(source, arch, options=(), name="ampscale.cu", ptx=False):
        compiles.append(arch)
        return _CUBIN, "cubin"

    monkeypatch.setattr(nvrtc, "version", lambda: (13, 0))
    monkeypatch.setattr(nvrtc, "compile_source", compile_source)
    return compiles


def _nvrtc_entry(directory: pathlib.Path) -> pathlib.Path:
    (entry,) = [p for p in directory.iterdir() if p.suffix == ".cubin"]
    return entry


@pytest.mark.parametrize("damage", ["empty", "truncated", "garbage"])
def test_a_bad_cubin_is_detected_removed_and_compiled_again_once(
    tmp_path: pathlib.Path, monkeypatch, fake_nvrtc: list[int], damage: str
) -> None:
    monkeypatch.setenv("AMPSCALE_CACHE_DIR", str(tmp_path))
    assert nvrtc.compiled("src", 90) == (_CUBIN, "cubin")
    entry = _nvrtc_entry(tmp_path)
    whole = entry.read_bytes()
    entry.write_bytes({"empty": b"", "truncated": whole[: len(_CUBIN) // 2], "garbage": os.urandom(2000)}[damage])
    assert nvrtc.compiled("src", 90) == (_CUBIN, "cubin")  # never the damaged bytes
    assert fake_nvrtc == [90, 90]  # compiled again, once
    assert entry.read_bytes() == whole  # and the entry written again, whole
    assert nvrtc.compiled("src", 90) == (_CUBIN, "cubin")
    assert fake_nvrtc == [90, 90]
    assert _temporaries(tmp_path) == []


def test_an_empty_image_from_nvrtc_is_an_error_not_a_cache_entry(tmp_path: pathlib.Path, monkeypatch) -> None:
    monkeypatch.setenv("AMPSCALE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(nvrtc, "version", lambda: (13, 0))
    monkeypatch.setattr(nvrtc, "compile_source", lambda *a, **k: (b"", "cubin"))
    with pytest.raises(nvrtc.NvrtcError, match="empty or malformed cubin"):
        nvrtc.compiled("src", 90)
    assert [p for p in tmp_path.iterdir() if not p.name.startswith(".")] == []


@needs_posix
def test_a_cubin_planted_in_a_shared_directory_never_reaches_the_driver(
    tmp_path: pathlib.Path, monkeypatch, fake_nvrtc: list[int]
) -> None:
    monkeypatch.setenv("AMPSCALE_CACHE_DIR", str(tmp_path))
    nvrtc.compiled("src", 90)
    entry = _nvrtc_entry(tmp_path)
    planted = b"\x7fELF" + b"planted" * 100
    name = entry.name
    entry.unlink()
    _cache.publish(str(tmp_path), name, name, lambda p: _write(pathlib.Path(p), planted))  # a valid trailer even
    tmp_path.chmod(0o777)
    assert nvrtc.compiled("src", 90) == (_CUBIN, "cubin")
    assert "writable by every user" in (nvrtc.last_cache_problem or "")
    assert (tmp_path / name).read_bytes().startswith(planted)  # not read, not replaced: not ours to touch
    assert fake_nvrtc == [90, 90]


def test_a_full_disk_costs_a_compilation_and_leaves_no_temporary_file(
    tmp_path: pathlib.Path, monkeypatch, fake_nvrtc: list[int]
) -> None:
    monkeypatch.setenv("AMPSCALE_CACHE_DIR", str(tmp_path))

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(_cache.os, "fsync", full)
    assert nvrtc.compiled("src", 90) == (_CUBIN, "cubin")
    assert "No space left" in (nvrtc.last_cache_problem or "")
    assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == []


def _lock_is_held(directory: pathlib.Path) -> bool:
    """Whether a build lock of the cache ``directory`` is held (by another open file: flock
    locks belong to open files, so this sees a lock held by this very process too)."""
    import fcntl

    held = False
    for lock in directory.glob(".*.lock"):
        fd = os.open(lock, os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            held = True
        finally:
            os.close(fd)
    return held


@needs_posix
def test_nvrtc_compiles_under_the_build_lock(tmp_path: pathlib.Path, monkeypatch) -> None:
    """On a cold cache the lock is taken before NVRTC runs, so concurrent processes (xdist's
    workers) compile a source once: the others wait for the entry."""
    monkeypatch.setenv("AMPSCALE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(nvrtc, "version", lambda: (13, 0))
    held_while_compiling: list[bool] = []

    def compile_source(source, arch, options=(), name="ampscale.cu", ptx=False):
        held_while_compiling.append(_lock_is_held(tmp_path))
        return _CUBIN, "cubin"

    monkeypatch.setattr(nvrtc, "compile_source", compile_source)
    assert nvrtc.compiled("src", 90) == (_CUBIN, "cubin")
    assert held_while_compiling == [True]


@needs_posix
def test_nvrtc_reads_the_cache_again_under_the_lock(tmp_path: pathlib.Path, monkeypatch, fake_nvrtc: list[int]) -> None:
    """An entry another process wrote while this one waited for the lock is used, not compiled
    again."""
    monkeypatch.setenv("AMPSCALE_CACHE_DIR", str(tmp_path))
    nvrtc.compiled("src", 90)  # the entry another process will have written
    entry = _nvrtc_entry(tmp_path)
    whole = entry.read_bytes()
    entry.unlink()
    real_lock = _cache.build_lock

    @contextlib.contextmanager
    def lock_won_after_the_other_process(directory: str, name: str):
        with real_lock(directory, name):
            entry.write_bytes(whole)  # the other process finished while this one waited
            yield

    monkeypatch.setattr(_cache, "build_lock", lock_won_after_the_other_process)
    assert nvrtc.compiled("src", 90) == (_CUBIN, "cubin")
    assert fake_nvrtc == [90]  # the first call's compile only


def test_an_unwritable_cache_costs_a_compilation(tmp_path: pathlib.Path, monkeypatch, fake_nvrtc: list[int]) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("AMPSCALE_CACHE_DIR", str(blocker / "cache"))
    assert nvrtc.compiled("src", 90) == (_CUBIN, "cubin")
    assert nvrtc.last_cache_problem is not None


# ------------------------------------------------------------------------------ the JAX handler

jax = pytest.importorskip("jax")
from ampscale._native import ffi_build as _ffi_build  # noqa: E402
from ampscale.backends import _jax_custom_call  # noqa: E402


def _jax_key() -> str:
    import jaxlib

    return _ffi_build.build_key(getattr(jaxlib, "__version__", None) or jax.__version__)


@pytest.fixture(scope="module")
def handler(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """The handler library's ELF image (from the install-time build, or compiled once)."""
    key = _jax_key()
    try:
        with _ffi_build.open_prebuilt(key) as entry:
            payload = entry.payload
    except (FileNotFoundError, _cache.InvalidEntry):
        headers, compiler = _ffi_build.jaxlib_headers(), _ffi_build.find_compiler()
        if headers is None or compiler is None:
            pytest.skip("needs jaxlib's headers and a C++ compiler")
        built = tmp_path_factory.mktemp("built") / "lib.so"
        _ffi_build.compile_library(str(built), headers[0], key, compiler)
        with _ffi_build.open_prebuilt(key, str(built)) as entry:
            payload = entry.payload
    path = tmp_path_factory.mktemp("handler") / "handler.so"
    path.write_bytes(payload)
    return path


@pytest.fixture
def fake_compiler(tmp_path: pathlib.Path, handler: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> pathlib.Path:
    """``$CXX``: a "compiler" that copies the real handler to its ``-o`` and logs each run (so
    the tests build no C++), and no install-time library (every load goes to the cache)."""
    log = tmp_path / "compiler.log"
    script = tmp_path / "fake-c++"
    script.write_text(
        "#!/bin/sh\n"
        f'echo run >> "{log}"\n'
        'while [ $# -gt 0 ]; do if [ "$1" = "-o" ]; then out="$2"; fi; shift; done\n'
        f'cp "{handler}" "$out"\n'
    )
    script.chmod(0o755)
    monkeypatch.setenv("CXX", str(script))
    monkeypatch.setattr(_ffi_build, "PREBUILT", str(tmp_path / "no-install-build.so"))
    return log


@pytest.fixture(scope="module")
def planted(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """A library whose constructor writes ``$PLANTED_MARKER``: it shows whether it was loaded."""
    compiler = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if compiler is None:
        pytest.skip("needs a C compiler")
    directory = tmp_path_factory.mktemp("planted")
    source = directory / "planted.c"
    source.write_text(
        "#include <stdio.h>\n#include <stdlib.h>\n"
        "__attribute__((constructor)) static void planted(void) {\n"
        '  const char *path = getenv("PLANTED_MARKER");\n'
        '  FILE *f = path ? fopen(path, "w") : NULL;\n'
        '  if (f) { fputs("ran", f); fclose(f); }\n}\n'
        'const char *ampscale_ffi_build_key(void) { return "planted"; }\n'
    )
    library = directory / "planted.so"
    subprocess.run([compiler, "-shared", "-fPIC", "-o", str(library), str(source)], check=True)
    return library


def _runs(log: pathlib.Path) -> int:
    return log.read_text().count("run") if log.exists() else 0


@pytest.mark.parametrize("damage", ["empty", "garbage", "another key", "a foreign library"])
def test_a_bad_cached_handler_is_never_loaded_and_is_built_again(
    tmp_path: pathlib.Path, monkeypatch, fake_compiler: pathlib.Path, planted: pathlib.Path, damage: str
) -> None:
    cache = tmp_path / "cache"
    monkeypatch.setenv("AMPSCALE_CACHE_DIR", str(cache))
    marker = tmp_path / "marker"
    monkeypatch.setenv("PLANTED_MARKER", str(marker))
    key = _jax_key()
    compiler = _ffi_build.find_compiler()
    assert compiler is not None
    cache.mkdir(mode=0o700)
    target = cache / _ffi_build.cached_name(key, compiler)
    if damage == "empty":
        target.write_bytes(b"")
    elif damage == "garbage":
        target.write_bytes(os.urandom(100_000))
    elif damage == "another key":  # a whole entry, with the trailer of another build
        _cache.publish(str(cache), target.name, "src-0-jaxlib-0", lambda p: shutil.copy(planted, p))
    else:
        shutil.copy(planted, target)  # a library without ampscale's trailer
    library, path, origin = _jax_custom_call._find_library(key)
    assert library is not None, path
    assert origin == "compiled on first use, cached"
    assert path == str(target)
    assert not marker.exists(), "a library that failed verification was loaded (its code ran)"
    assert _runs(fake_compiler) == 1
    with _cache.read_entry(str(cache), target.name, key) as entry:
        assert entry is not None
    assert _temporaries(cache) == []


_STEP = textwrap.dedent(
    """
    import json, os, warnings
    import ampscale._native.ffi_build as fb
    fb.PREBUILT = os.environ["NO_PREBUILT"]  # every load goes to the cache
    import jax, jax.numpy as jnp, ampscale
    from ampscale.backends import jax as jb
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        scaler = ampscale.create_scaler(backend="jax", init_scale=2.0)
        out, finite = jax.jit(lambda s, g: s.unscale(g))(scaler, [jnp.arange(4.0)])
        out, finite = jax.jit(lambda s, g: s.unscale(g))(scaler, [jnp.arange(4.0)])  # a second trace
    status = jb.custom_call_status()
    print(json.dumps({
        "out": [float(x) for x in out[0]], "finite": bool(finite), "available": status.available,
        "reason": status.reason,
        "warnings": [str(w.message) for w in caught if w.category.__name__ == "PerformanceWarning"],
    }))
    """
)


def _step(env: dict[str, str]) -> dict:
    run = subprocess.run(
        [sys.executable, "-c", _STEP], capture_output=True, text=True, env=env, timeout=300, check=False
    )
    assert run.returncode == 0, f"the training step died (exit {run.returncode}):\n{run.stderr[-3000:]}"
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_a_truncated_cached_handler_does_not_kill_the_process(
    tmp_path: pathlib.Path, fake_compiler: pathlib.Path, handler: pathlib.Path
) -> None:
    """Loading a truncated library maps pages past its end: the first touch of one is SIGBUS."""
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    key = _jax_key()
    compiler = _ffi_build.find_compiler()
    assert compiler is not None
    target = cache / _ffi_build.cached_name(key, compiler)
    _cache.publish(str(cache), target.name, key, lambda p: shutil.copy(handler, p))
    whole = target.read_bytes()
    target.write_bytes(whole[: len(whole) * 3 // 5])
    result = _step(_env(AMPSCALE_CACHE_DIR=str(cache), NO_PREBUILT=str(tmp_path / "none.so")))
    assert result["available"], result["reason"]
    assert result["out"] == [0.0, 0.5, 1.0, 1.5]
    assert result["warnings"] == []
    assert _runs(fake_compiler) == 1  # built again, once
    with _cache.read_entry(str(cache), target.name, key) as entry:
        assert entry is not None


def test_a_planted_handler_in_a_directory_others_can_write_never_runs(
    tmp_path: pathlib.Path, fake_compiler: pathlib.Path, planted: pathlib.Path
) -> None:
    """A shared cache directory: another user's library, even with a trailer for the right key,
    is not loaded; the step runs on the pure-XLA path with one warning saying why."""
    cache = tmp_path / "shared-cache"
    cache.mkdir()
    cache.chmod(0o777)
    key = _jax_key()
    compiler = _ffi_build.find_compiler()
    assert compiler is not None
    name = _ffi_build.cached_name(key, compiler)
    _cache.publish(str(cache), name, key, lambda p: shutil.copy(planted, p))
    shutil.copy(cache / name, cache / "keep")
    before = sorted(p.name for p in cache.iterdir())
    marker = tmp_path / "marker"
    env = _env(AMPSCALE_CACHE_DIR=str(cache), NO_PREBUILT=str(tmp_path / "none.so"), PLANTED_MARKER=str(marker))
    result = _step(env)
    assert not marker.exists(), "the planted library was loaded: its code ran"
    assert not result["available"]
    assert "writable by every user" in result["reason"]
    assert result["out"] == [0.0, 0.5, 1.0, 1.5]
    assert len(result["warnings"]) == 1
    assert "pure-XLA path" in result["warnings"][0]
    assert "AMPSCALE_CACHE_DIR" in result["warnings"][0]
    assert _runs(fake_compiler) == 0
    assert sorted(p.name for p in cache.iterdir()) == before  # nothing read, removed or written


@contextlib.contextmanager
def _mounted_tmpfs(where: pathlib.Path, options: str) -> Iterator[None]:
    """A tmpfs mounted at ``where`` for the block (skips the test where that is not allowed)."""
    where.mkdir(mode=0o700, exist_ok=True)
    if not AS_ROOT or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root")
    made = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)], capture_output=True, check=False
    )
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {made.stderr.decode(errors='replace').strip()}")
    try:
        yield
    finally:
        subprocess.run(["umount", str(where)], check=False)


@pytest.mark.parametrize("cause", ["a file in the way", "a read-only file system"])
def test_an_unwritable_cache_falls_back_to_the_xla_path_with_one_warning(tmp_path: pathlib.Path, cause: str) -> None:
    """The step runs (on the pure-XLA path), and one warning says why and what to do."""
    env = _env(NO_PREBUILT=str(tmp_path / "none.so"))
    if cause == "a file in the way":
        (tmp_path / "cache").write_text("")
        result = _step({**env, "AMPSCALE_CACHE_DIR": str(tmp_path / "cache" / "ampscale")})
    else:
        with _mounted_tmpfs(tmp_path / "ro", "ro,size=64k,mode=0700"):
            result = _step({**env, "AMPSCALE_CACHE_DIR": str(tmp_path / "ro" / "ampscale")})
    assert not result["available"]
    assert "the handler cache cannot be used" in result["reason"]
    assert ("is not a directory" if cause == "a file in the way" else "cannot be created") in result["reason"]
    assert result["out"] == [0.0, 0.5, 1.0, 1.5]
    assert result["finite"]
    assert len(result["warnings"]) == 1
    assert "AMPSCALE_CACHE_DIR" in result["warnings"][0]


def test_a_full_disk_falls_back_and_leaves_no_temporary_file(
    tmp_path: pathlib.Path, fake_compiler: pathlib.Path
) -> None:
    """A real full file system: a 64 KiB tmpfs, smaller than the library."""
    mount = tmp_path / "full"
    with _mounted_tmpfs(mount, "size=64k,mode=0700"):
        result = _step(_env(AMPSCALE_CACHE_DIR=str(mount), NO_PREBUILT=str(tmp_path / "none.so")))
        left = sorted(p.name for p in mount.iterdir() if not p.name.endswith(".lock"))
    assert not result["available"]
    assert result["out"] == [0.0, 0.5, 1.0, 1.5]
    assert len(result["warnings"]) == 1
    assert _runs(fake_compiler) == 1
    assert left == []


def test_the_install_build_is_verified_before_it_is_loaded(tmp_path: pathlib.Path, monkeypatch, planted) -> None:
    """A stale or damaged library beside the package is not loaded either (the cache's is used)."""
    marker = tmp_path / "marker"
    monkeypatch.setenv("PLANTED_MARKER", str(marker))
    stale = tmp_path / "libampscale_jax_ffi.so"
    shutil.copy(planted, stale)  # e.g. built by an ampscale without trailers, or for another jaxlib
    monkeypatch.setattr(_ffi_build, "PREBUILT", str(stale))
    monkeypatch.setattr(_ffi_build, "find_compiler", lambda: None)
    library, why, _ = _jax_custom_call._find_library(_jax_key())
    assert library is None
    assert "the library built at install is not used" in why
    assert "no C++ compiler" in why
    assert not marker.exists()


# ------------------------------------------------------------------------------ jax.export


def _train_step(scaler, grads):  # the documented train step (docs/backends.md)
    grads, finite = scaler.unscale(grads)
    return grads, scaler.update(finite)


_RUN_ELSEWHERE = textwrap.dedent(
    """
    import sys, jax, jax.numpy as jnp
    from jax import export
    import ampscale, ampscale.backends.jax as jax_backend
    exported = export.deserialize(bytes.fromhex(sys.stdin.read()))
    if sys.argv[1] == "custom call":
        jax_backend.register_custom_call()
    args = (ampscale.create_scaler(backend="jax"), {"w": jnp.full(4, 2.0**16)})
    grads, scaler = exported.call(*args)
    print(grads["w"].tolist(), scaler.get_scale())
    """
)


@pytest.mark.parametrize("kind", ["portable", "custom call"])
def test_an_exported_train_step_serializes_and_runs_in_another_process(kind: str) -> None:
    pytest.importorskip("flatbuffers")
    import jax.numpy as jnp
    from jax import export

    import ampscale

    args = (ampscale.create_scaler(backend="jax"), {"w": jnp.full(4, 2.0**16)})

    def train_step(scaler, grads):  # a new function per test: jit keeps a traced function's choice
        return _train_step(scaler, grads)

    if kind == "portable":
        exported = export.export(jax.jit(train_step))(*args)
        assert _jax_custom_call.TARGET not in exported.mlir_module()
    else:
        with _jax_custom_call.use_custom_call(in_exports=True):
            exported = export.export(
                jax.jit(train_step),
                disabled_checks=[export.DisabledSafetyCheck.custom_call(_jax_custom_call.TARGET)],
            )(*args)
        assert _jax_custom_call.TARGET in exported.mlir_module()
    blob = exported.serialize()
    again = export.deserialize(blob)
    assert again.in_tree == exported.in_tree
    run = subprocess.run(
        [sys.executable, "-c", _RUN_ELSEWHERE, kind],
        input=blob.hex(),
        capture_output=True,
        text=True,
        env=_env(XLA_FLAGS=""),
        timeout=300,
        check=False,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip() == "[1.0, 1.0, 1.0, 1.0] 65536.0"


def test_a_scaler_with_a_callback_is_refused_by_serialization_with_a_clear_error() -> None:
    """(``jax.export`` itself refuses the host callback a callable ``on_floor`` traces to; the
    serializer refuses it too, should a scaler holding one appear in another artifact's tree.)"""
    import ampscale

    config = ampscale.create_scaler(backend="jax", on_floor=lambda event: None).config
    with pytest.raises(ValueError, match="on_floor is a callback"):
        _jax_custom_call._serialize_config((config, "jax"))
    plain = ampscale.create_scaler(backend="jax", preset="deepspeed", max_scale=2.0**20).config
    assert _jax_custom_call._deserialize_config(_jax_custom_call._serialize_config((plain, "jax"))) == (plain, "jax")
