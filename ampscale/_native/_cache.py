"""A safe on-disk cache for the binaries ampscale builds at run time (standard library only).

Two caches use it: the JAX XLA FFI handler library compiled on first use
(:mod:`ampscale._native.ffi_build`, loaded by ``ampscale.backends._jax_custom_call``) and the
CUDA binaries NVRTC compiles (:mod:`ampscale._native.cuda.nvrtc`). A library runs code as soon
as it is loaded and a cubin runs on the GPU, so an entry is used only when all of this holds:

* **The directory is the user's own.** The cache directory, with symbolic links resolved, must
  be owned by the user (or by root), and neither it nor any directory above it may be writable
  by another user: no write bit for "others", and no group write bit unless the group is the
  user's own private group (named after the user, no other member). A directory above it may
  be writable by everyone if it has the sticky bit (``/tmp``: nobody else can rename or
  replace what the user owns there); the cache directory itself may not. This is pip's rule
  (``pip._internal.utils.filesystem.check_path_owner``: a cache not owned by the user is
  disabled, with a warning) made strict about write bits, and the reason torch keeps its
  extension builds in a per-user directory (``torch.utils.cpp_extension.get_default_build_root``)
  rather than a shared ``/tmp/torch_extensions``. A directory that fails is not read, not
  written and not created in; the caller is told why (:class:`CacheUnavailable`). Missing
  directories are created with mode ``0o700``.
* **The file is what was written, for this key.** Every entry carries a trailer written with
  it: the key it was built for (the caller's build key: sources, versions, flags), its size
  and its SHA-256. Before an entry is used (before a library is ``dlopen``-ed, before a cubin
  reaches the driver) the whole file is read through a descriptor opened without following
  links, checked to be a regular file the user (or root) owns that nobody else may write, and
  its key, size and hash compared. A truncated, empty or foreign entry is never used: it is
  removed and built again, once. (Loading a truncated library is what would kill the process:
  the loader maps pages past the end of the file, and the first read of one raises SIGBUS.)
  :meth:`Entry.load_path` names the verified descriptor itself (``/proc/self/fd/N``), so the
  bytes loaded are the bytes checked.
* **Writes are atomic and clean.** An entry is written to a private temporary file in the same
  directory, flushed to disk, then renamed over the final name; a failed write (a full disk, a
  compiler error) removes its temporary file. Concurrent builders of one entry take a lock
  file, so one builds while the others wait and then use its result; without working locks
  (some network file systems) each builds its own and the last rename wins, every one whole.

The trailer follows the payload, so a library stays a valid ELF file (the loader ignores bytes
past its segments) and a cubin's payload is what :meth:`Entry.payload` returns.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import stat
import struct
import sys
import tempfile
from collections.abc import Callable, Iterator

__all__ = [
    "MAGIC",
    "CacheError",
    "CacheUnavailable",
    "Entry",
    "InvalidEntry",
    "build_lock",
    "check_directory",
    "obtain",
    "prepare_directory",
    "publish",
    "read_entry",
    "remove_entry",
    "verify_file",
    "write_bytes",
]

#: The last bytes of every entry (a format change gets a new one).
MAGIC = b"\0ampscale-cache1"
_LENGTH = struct.Struct("<Q")
#: Entries larger than this are not read (ampscale's binaries are a few hundred KiB).
MAX_ENTRY_BYTES = 256 << 20
_POSIX = hasattr(os, "geteuid") and sys.platform != "win32"


class CacheError(OSError):
    """The cache could not be used for this entry (the message says why)."""


class CacheUnavailable(CacheError):
    """The cache directory is not the user's own, or cannot be created or written."""


class InvalidEntry(CacheError):
    """An entry exists but is truncated, corrupt, built for another key, or not the user's."""


# ------------------------------------------------------------------------------ directories


def _own_private_group(gid: int, uid: int) -> bool:
    """Whether ``gid`` is ``uid``'s private group: named after the user, no other member."""
    try:
        import grp
        import pwd

        user = pwd.getpwuid(uid)
        group = grp.getgrgid(gid)
    except (ImportError, KeyError):
        return False
    return group.gr_name == user.pw_name and set(group.gr_mem) <= {user.pw_name}


def _why_unsafe(path: str, info: os.stat_result, uid: int, is_cache: bool) -> str | None:
    """Why the directory ``path`` (its ``lstat``) may hold code another user planted; ``None``: it cannot."""
    if not stat.S_ISDIR(info.st_mode):
        return f"{path} is not a directory"
    if info.st_uid not in (uid, 0):
        return f"{path} is owned by another user (uid {info.st_uid}; this process runs as uid {uid})"
    mode = stat.S_IMODE(info.st_mode)
    sticky = bool(mode & stat.S_ISVTX)
    if mode & stat.S_IWOTH and (is_cache or not sticky):
        return f"{path} is writable by every user (mode {mode:o})"
    if mode & stat.S_IWGRP and not sticky and not _own_private_group(info.st_gid, uid):
        return f"{path} is writable by its group (gid {info.st_gid}, mode {mode:o})"
    return None


def check_directory(path: str, parent_only: bool = False) -> str | None:
    """Why the existing directory ``path`` is not a safe cache (``None``: it is).

    Checks the directory (links resolved) and every directory above it; see the module's
    docstring for the rule. ``parent_only``: ``path`` is to hold the cache directory, not be
    it (so it may be sticky and writable by all, like ``/tmp``). Always ``None`` where the
    platform has no owners (Windows).
    """
    if not _POSIX:
        return None
    real = os.path.realpath(path)
    uid = os.geteuid()
    current, is_cache = real, not parent_only
    while True:
        try:
            info = os.lstat(current)
        except OSError as exc:
            return f"{current} cannot be examined ({exc.strerror or exc})"
        why = _why_unsafe(current, info, uid, is_cache)
        if why is not None:
            return why
        parent = os.path.dirname(current)
        if parent == current:
            return None
        current, is_cache = parent, False


def prepare_directory(path: str) -> str:
    """The cache directory ``path``, created (mode ``0o700``) where missing, resolved and checked.

    Returns the real path to use from then on (a link is resolved once, never followed again).

    Raises:
        CacheUnavailable: a directory on the way is not the user's own, or cannot be created.
    """
    absolute = os.path.abspath(os.path.expanduser(path))
    missing = []
    current = absolute
    while not os.path.lexists(current):
        missing.append(current)
        parent = os.path.dirname(current)
        if parent == current:
            break
        current = parent
    if missing:
        # the first directory that exists must be safe before anything is created inside it
        why = check_directory(current, parent_only=True)
        if why is not None:
            raise CacheUnavailable(f"cache directory {absolute} not used: {why}")
        for directory in reversed(missing):
            try:
                os.mkdir(directory, 0o700)
            except FileExistsError:
                pass  # another process made it: it is checked below like any other
            except OSError as exc:
                raise CacheUnavailable(f"cache directory {absolute} cannot be created ({exc.strerror or exc})") from exc
    why = check_directory(absolute)
    if why is not None:
        raise CacheUnavailable(f"cache directory {absolute} not used: {why}")
    return os.path.realpath(absolute)


# ------------------------------------------------------------------------------ entries


@dataclasses.dataclass
class Entry:
    """A verified cache entry, its file kept open so that what is used is what was checked.

    Attributes:
        path: the entry's path.
        payload: the entry's bytes without the trailer.
        fd: the open, verified descriptor (closed by :meth:`close`, unless it was handed to the
            loader by :meth:`load_path`).
    """

    path: str
    payload: bytes
    fd: int
    _pinned: bool = dataclasses.field(default=False, repr=False)

    def load_path(self) -> str:
        """A path to the verified bytes for ``dlopen``: the descriptor itself where the system
        names descriptors (Linux's ``/proc/self/fd``), else the entry's path.

        The descriptor then stays open for the life of the process: the loader knows a library
        by the name it was opened with, and a closed descriptor's number reused for another
        file would make a later ``dlopen`` of that name return this library.
        """
        by_descriptor = f"/proc/self/fd/{self.fd}"
        if self.fd >= 0 and os.path.exists(by_descriptor):
            self._pinned = True
            return by_descriptor
        return self.path

    def close(self) -> None:
        if self.fd >= 0 and not self._pinned:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> Entry:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _trailer(payload_hash: str, size: int, key: str) -> bytes:
    meta = json.dumps({"key": key, "size": size, "sha256": payload_hash}, sort_keys=True).encode()
    return meta + _LENGTH.pack(len(meta)) + MAGIC


def _parse(data: bytes, key: str, path: str) -> bytes:
    """The payload of an entry's bytes, if its trailer matches them and ``key``."""
    tail = len(MAGIC) + _LENGTH.size
    if len(data) < tail or not data.endswith(MAGIC):
        raise InvalidEntry(f"{path} is not a complete ampscale cache entry ({len(data)} bytes; truncated or foreign)")
    (meta_length,) = _LENGTH.unpack_from(data, len(data) - tail)
    if meta_length > len(data) - tail:
        raise InvalidEntry(f"{path} has a corrupt trailer")
    meta_start = len(data) - tail - meta_length
    try:
        meta = json.loads(data[meta_start : len(data) - tail])
        recorded_key, size, digest = meta["key"], meta["size"], meta["sha256"]
    except (ValueError, KeyError, TypeError):
        raise InvalidEntry(f"{path} has a corrupt trailer") from None
    payload = data[:meta_start]
    if size != len(payload) or hashlib.sha256(payload).hexdigest() != digest:
        raise InvalidEntry(f"{path} does not match the size and hash recorded when it was written (corrupt)")
    if recorded_key != key:
        raise InvalidEntry(f"{path} was built for another key ({recorded_key}; need {key})")
    return payload


def verify_file(path: str, key: str, check_owner: bool = True) -> Entry:
    """Open ``path`` without following links and verify it as an entry for ``key``.

    ``check_owner``: also require a regular file owned by the user (or root) that nobody else
    may write (off for a file installed with the package, whose directory is as trusted as the
    package's own code). The caller closes the returned :class:`Entry`.

    Raises:
        InvalidEntry: the file is missing, truncated, corrupt, for another key, or not the user's.
    """
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise InvalidEntry(f"{path} cannot be opened ({exc.strerror or exc}; a link is never followed)") from exc
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise InvalidEntry(f"{path} is not a regular file")
        if check_owner and _POSIX:
            mode = stat.S_IMODE(info.st_mode)
            if info.st_uid not in (os.geteuid(), 0):
                raise InvalidEntry(f"{path} is owned by another user (uid {info.st_uid})")
            if mode & (stat.S_IWGRP | stat.S_IWOTH):
                raise InvalidEntry(f"{path} is writable by other users (mode {mode:o})")
        if info.st_size > MAX_ENTRY_BYTES:
            raise InvalidEntry(f"{path} is {info.st_size} bytes, larger than any ampscale binary")
        chunks = []
        while True:
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                break
            chunks.append(chunk)
        payload = _parse(b"".join(chunks), key, path)
    except BaseException:
        os.close(fd)
        raise
    return Entry(path, payload, fd)


def read_entry(directory: str, name: str, key: str) -> Entry | None:
    """The verified entry ``name`` of a checked ``directory``; ``None`` if there is none.

    Raises:
        InvalidEntry: an entry is there but must not be used (see :func:`verify_file`).
    """
    try:
        return verify_file(os.path.join(directory, name), key)
    except FileNotFoundError:
        return None


def remove_entry(directory: str, name: str) -> None:
    """Remove the entry ``name`` of a checked ``directory`` (nothing if it is not there)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(directory, name))


def publish(directory: str, name: str, key: str, produce: Callable[[str], None]) -> str:
    """Write an entry atomically: ``produce(path)`` writes the payload to a temporary file in
    ``directory``; the trailer is appended, the file flushed and renamed to ``name``.

    Returns the entry's path. A failure of ``produce`` or of the write (a full disk, a
    permission) removes the temporary file and is raised again (``OSError`` as
    :class:`CacheError`).
    """
    handle, temporary = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=directory)
    os.close(handle)
    final = os.path.join(directory, name)
    try:
        produce(temporary)
        digest = hashlib.sha256()
        size = 0
        with open(temporary, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
                size += len(chunk)
        with open(temporary, "ab") as f:
            f.write(_trailer(digest.hexdigest(), size, key))
            f.flush()
            os.fsync(f.fileno())
        os.chmod(temporary, 0o644)  # readable (a library is mapped), writable by the owner alone
        os.replace(temporary, final)
    except OSError as exc:
        raise CacheError(f"writing {final} failed ({exc.strerror or exc})") from exc
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
    return final


def write_bytes(path: str, data: bytes) -> None:
    """A ``produce`` for :func:`publish` that writes ``data``."""
    with open(path, "wb") as f:
        f.write(data)


@contextlib.contextmanager
def build_lock(directory: str, name: str) -> Iterator[None]:
    """Hold ``directory``'s lock for ``name`` (a no-op where files cannot be locked): one
    builder per name across processes. A caller that builds under it looks at the cache again
    once it holds the lock, since another process may have built the entry while it waited."""
    try:
        import fcntl
    except ImportError:  # Windows: no lock, every builder writes a whole file
        yield
        return
    flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(os.path.join(directory, f".{name}.lock"), flags, 0o600)
    except OSError:
        yield
        return
    try:
        with contextlib.suppress(OSError):  # no locks here (some network file systems): build without one
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def obtain(directory: str, name: str, key: str, produce: Callable[[str], None]) -> Entry:
    """The verified entry ``name`` for ``key`` in the cache ``directory``, built if needed.

    The directory is created and checked (:func:`prepare_directory`); an entry that is there but
    fails verification is removed and built again, once, by ``produce`` (see :func:`publish`),
    under the entry's lock so that concurrent builders build it once.

    Raises:
        CacheUnavailable: the directory is not the user's own or cannot be created.
        CacheError: the entry could not be written, or what was written does not verify.
        Exception: whatever ``produce`` raises (a compiler error), its temporary file removed.
    """
    directory = prepare_directory(directory)
    with contextlib.suppress(InvalidEntry):
        entry = read_entry(directory, name, key)
        if entry is not None:
            return entry
    with build_lock(directory, name):
        try:
            entry = read_entry(directory, name, key)  # built by another process meanwhile?
            if entry is not None:
                return entry
        except InvalidEntry:
            remove_entry(directory, name)  # in the user's own directory: built again, once
        publish(directory, name, key, produce)
        try:
            entry = read_entry(directory, name, key)
        except InvalidEntry as exc:
            raise CacheError(f"the entry just written does not verify: {exc}") from exc
        if entry is None:
            raise CacheError(f"{os.path.join(directory, name)} vanished right after it was written")
        return entry
