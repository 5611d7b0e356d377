"""Where tensorx keeps what it builds on first use (the UCX binding, the sparse SGD kernel),
and loading from there only what this user built.

The cache is ``$TENSORX_CACHE_DIR``, else ``$XDG_CACHE_HOME/tensorx``, else
``~/.cache/tensorx``. A shared object runs its constructors as whoever loads it (root, in
a shard), so the cache is trusted as the checkpoint directory is, and only so far:

* the cache folder, the folder in it and the object (and the digest beside it) must each be
  this user's alone (:func:`~tensorx._owned.why_not_ours`: a real folder or regular file,
  not a link, owned by our euid, writable by no group or other user); folders tensorx
  creates are made 0700, files 0600;
* each is opened relative to the one above it with ``O_NOFOLLOW`` and checked on its own
  descriptor, and the object is loaded through that descriptor (``/proc/self/fd/N``): what
  was checked is what is mapped, whatever is renamed or swapped meanwhile;
* the object's SHA-256 is recorded beside it when it is built and must match before it is
  loaded; one that does not is rebuilt in its place, with one WARNING;
* a cache that fails a check is neither loaded from nor written to: the object is built
  privately for this process (a fresh 0700 temporary folder, removed once the object is
  open), with one WARNING naming the path and why.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import secrets
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from tensorx._owned import Kind, why_not_ours
from tensorx._text import printable

__all__ = ["Built", "built", "cache_root", "read_data", "update_data"]

logger = logging.getLogger("tensorx.cache")

DIGEST = ".sha256"  # suffix of the digest recorded beside an object
_MAX_DIGEST = 256


def cache_root() -> Path:
    base = os.environ.get("TENSORX_CACHE_DIR")
    if base:
        return Path(base)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "tensorx"


@dataclass(frozen=True)
class Built:
    """A built object, open and checked: load it by :attr:`path`, never by ``origin``.

    ``fd`` (``O_PATH``) is never closed: the dynamic loader knows the object by its
    ``/proc/self/fd`` name, and a number closed and reused would make a later load of
    another object there return this one. Pass it to a child that loads the object too."""

    fd: int
    origin: Path  # where it was found or built (a private build's folder is gone): for messages

    @property
    def path(self) -> str:
        return f"/proc/self/fd/{self.fd}"


class _Untrusted(Exception):
    def __init__(self, path: Path, why: str) -> None:
        super().__init__(f"{path} {why}")
        self.path, self.why = path, why


def built(folder: str, name: str, build: Callable[[Path], Path], what: str) -> Built:
    """``folder/name`` in the cache, built by ``build`` where missing or not as recorded
    (concurrent processes build it once); built privately where the cache fails a check.

    ``build(tmp)`` compiles into ``tmp``, a fresh private folder, and returns the object's
    path. ``what`` names the object in log lines. OSError (a cache or temporary folder this
    process cannot write) and whatever ``build`` raises propagate."""
    try:
        return _from_cache(folder, name, build, what)
    except _Untrusted as exc:
        logger.warning("not using the build cache for %s: %s %s; building a private copy for "
                       "this process (a cache only this user can write keeps the build)",
                       what, printable(str(exc.path)), exc.why)
    return _private(build)


def read_data(folder: str, name: str, limit: int) -> bytes | None:
    """The contents of ``folder/name`` in the cache: data (never code) that this user's
    processes keep there, trusted under the rules above (checked folders and file, no link
    followed); None where it is missing, over ``limit`` bytes, or fails a check (one
    WARNING: then it is ignored, never read)."""
    try:
        at = _folder(folder, create=False)
        try:
            return _read_at(at, name, limit, cache_root() / folder / name)
        finally:
            os.close(at)
    except FileNotFoundError:
        return None
    except _Untrusted as exc:
        logger.warning("ignoring %s in the cache: %s %s", name, printable(str(exc.path)),
                       exc.why)
        return None


def update_data(folder: str, name: str, limit: int,
                edit: Callable[[bytes | None], bytes]) -> None:
    """Replace ``folder/name`` in the cache with ``edit(what it holds)`` (None: nothing,
    or nothing to trust), under the folder's lock so that processes editing it at once
    lose none of each other's edits; the new file is private and renamed over the old.
    Nothing, with one WARNING, where the cache folders fail a check. OSError propagates."""
    try:
        at = _folder(folder, create=True)
    except _Untrusted as exc:
        logger.warning("not writing %s to the cache: %s %s", name, printable(str(exc.path)),
                       exc.why)
        return
    try:
        with _locked(at):
            try:
                old = _read_at(at, name, limit, cache_root() / folder / name)
            except (FileNotFoundError, _Untrusted):
                old = None  # replaced, not read: the rename takes the name, not the file
            _put(at, name, edit(old))
    finally:
        os.close(at)


def _read_at(at: int, name: str, limit: int, path: Path) -> bytes | None:
    fd = _open(name, at, "regular file", path)
    try:
        with open(f"/proc/self/fd/{fd}", "rb") as file:
            data = file.read(limit + 1)
    finally:
        os.close(fd)
    return data if len(data) <= limit else None


def _folder(folder: str, *, create: bool) -> int:
    """An ``O_PATH`` descriptor on the checked ``folder`` of the checked cache root
    (both made where missing, if ``create``)."""
    root = cache_root()
    if create:
        _make_dirs(root)
    top = _open(root, None, "directory", root)
    try:
        if create:
            with contextlib.suppress(FileExistsError):
                os.mkdir(folder, 0o700, dir_fd=top)
        return _open(folder, top, "directory", root / folder)
    finally:
        os.close(top)


def _from_cache(folder: str, name: str, build: Callable[[Path], Path], what: str) -> Built:
    root = cache_root()
    at = _folder(folder, create=True)
    where = root / folder
    try:
        with _locked(at):
            fd = _verified(at, name, where, what)
            if fd is None:
                _install(at, name, _compiled(build))
                fd = _verified(at, name, where, what)
            if fd is None:
                raise OSError(f"{where / name} changed while it was written")
            return Built(fd, where / name)
    finally:
        os.close(at)


def _make_dirs(path: Path) -> None:
    """``path`` and the folders missing above it, each created 0700. mkdir never follows a
    link at the name it creates; what was there already is checked when it is opened."""
    missing = []
    while not os.path.lexists(path) and path != path.parent:
        missing.append(path)
        path = path.parent
    for folder in reversed(missing):
        with contextlib.suppress(FileExistsError):
            os.mkdir(folder, 0o700)


def _open(name: str | Path, at: int | None, kind: Kind, path: Path) -> int:
    """An ``O_PATH`` descriptor on ``name`` (relative to the folder ``at``), a link there
    not followed; _Untrusted unless it is a ``kind`` of ours alone."""
    fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=at)
    why = why_not_ours(os.fstat(fd), kind)
    if why is not None:
        os.close(fd)
        raise _Untrusted(path, why)
    return fd


@contextlib.contextmanager
def _locked(at: int) -> Iterator[None]:
    fd = os.open(".lock", os.O_RDONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                 dir_fd=at)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _verified(at: int, name: str, where: Path, what: str) -> int | None:
    """A descriptor on the object if it is as recorded when it was built; None if it or
    its digest is missing (never built; built by an older tensorx), or (with a WARNING)
    when the contents differ.

    Why a digest beside the object suffices: another user could swap both together only
    where the checks above fail, and then neither is read; where they pass, only this uid
    (or root, who can change our code anyway) could have written either. The digest
    catches what passes the checks yet is not what we built (a file of ours replaced or
    copied in from elsewhere, a torn write). Rebuilding to compare instead would cost a
    compile at every start, and compilers need not give the same bytes twice."""
    try:
        fd = _open(name, at, "regular file", where / name)
    except FileNotFoundError:
        return None
    try:
        recorded = _read(at, name + DIGEST, where / (name + DIGEST))
        if recorded is not None and recorded == _digest(fd):
            return fd
        if recorded is not None:
            logger.warning("%s in the build cache, %s, does not match the digest recorded "
                           "when it was built; rebuilding it", what, printable(str(where)))
    except BaseException:
        os.close(fd)
        raise
    os.close(fd)
    return None


def _read(at: int, name: str, path: Path) -> str | None:
    try:
        fd = _open(name, at, "regular file", path)
    except FileNotFoundError:
        return None
    try:
        with open(f"/proc/self/fd/{fd}", "rb") as file:
            return file.read(_MAX_DIGEST).decode("ascii", "replace").strip()
    finally:
        os.close(fd)


def _digest(fd: int) -> str:
    h = hashlib.sha256()
    with open(f"/proc/self/fd/{fd}", "rb") as file:
        for chunk in iter(lambda: file.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _compiled(build: Callable[[Path], Path]) -> bytes:
    tmp = tempfile.mkdtemp(prefix="tensorx-build-")  # 0700, a name nobody could guess
    try:
        return build(Path(tmp)).read_bytes()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _install(at: int, name: str, data: bytes) -> None:
    """``data`` as ``name`` and its digest beside it. The old digest goes first, so a
    crash between the two leaves an object with none (rebuilt quietly), not a mismatch."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(name + DIGEST, dir_fd=at)
    _put(at, name, data)
    _put(at, name + DIGEST, hashlib.sha256(data).hexdigest().encode() + b"\n")


def _put(at: int, name: str, data: bytes) -> None:
    """Write a new private file and rename it over ``name`` (a rename replaces a link,
    never follows it)."""
    tmp = f".{name}.{secrets.token_hex(4)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o600, dir_fd=at)
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(data)
        os.replace(tmp, name, src_dir_fd=at, dst_dir_fd=at)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=at)
        raise


def _private(build: Callable[[Path], Path]) -> Built:
    """Built in a fresh private folder, opened, and the folder removed (the open object
    stays loadable through its descriptor)."""
    tmp = Path(tempfile.mkdtemp(prefix="tensorx-build-"))
    try:
        out = build(tmp)
        try:
            fd = _open(out, None, "regular file", out)
        except _Untrusted as exc:  # the temporary folder's parent let someone swap it
            raise OSError(f"the private build {exc}") from None
        return Built(fd, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
