"""Same-host shared memory: files in /dev/shm that one process creates and a peer maps.

A parameter-server shard allocates its parameter arena and each worker's gradient slot here
when it may offer them to workers on its own host (see :mod:`tensorx.ps`); a worker maps
them and binds its model as views into them, so a step moves no bytes at all.

The creator keeps a shared ``flock`` on its file for as long as the file is its own; a
file whose creator died (the lock is gone and the pid in its name is not alive) is stale,
and :func:`sweep` (run on every allocation) unlinks it. Errors leave as ``tensorx.errors``.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import mmap
import os
import re
import secrets
import stat
from dataclasses import dataclass
from typing import Any

import numpy as np

from tensorx.errors import RegionError, UsageError

__all__ = ["SHM_DIR", "ShmFile", "attach", "create", "host_id", "release", "sweep"]

SHM_DIR = "/dev/shm"
NAME = re.compile(r"tensorx-([0-9]{1,10})-([0-9a-f]{32})")
_BOOT_ID = "/proc/sys/kernel/random/boot_id"
_NETNS = "/proc/self/ns/net"


@dataclass
class ShmFile:
    """The creator's handle: the name peers attach by, the mapping, and the lock's fd."""

    name: str
    path: str
    fd: int
    mm: mmap.mmap


def host_id() -> str:
    """Who can share memory with whom: equal strings mean "same kernel, same /dev/shm, same
    network namespace"; "" where shared memory cannot be used at all.

    The network namespace is part of it on purpose: processes in different namespaces are
    treated as different hosts (that is how the benchmarks emulate two machines on one)."""
    try:
        with open(_BOOT_ID) as f:
            boot = f.read().strip()
        net = os.stat(_NETNS).st_ino
        shm = os.stat(SHM_DIR).st_dev
    except OSError:
        return ""
    return f"{boot}/net:{net}/shm:{shm}"


def create(nbytes: int) -> ShmFile:
    """A new zeroed file of ``nbytes`` (mode 0600), mapped; RegionError if /dev/shm cannot
    hold it. Its pages are reserved now, so a full /dev/shm fails here, not with SIGBUS."""
    sweep()
    size = max(nbytes, 1)
    name = f"tensorx-{os.getpid()}-{secrets.token_hex(16)}"
    path = os.path.join(SHM_DIR, name)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600)
    except OSError as exc:
        raise RegionError(f"cannot create shared memory in {SHM_DIR}: {exc}") from exc
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        os.posix_fallocate(fd, 0, size)
        mm = mmap.mmap(fd, size)
    except OSError as exc:
        _unlink(path)
        os.close(fd)
        raise RegionError(f"cannot allocate {nbytes} B of shared memory in {SHM_DIR}: "
                          f"{exc}") from exc
    return ShmFile(name, path, fd, mm)


def release(f: ShmFile) -> None:
    """Unlink the file and drop the lock; the mapping goes once no view uses it."""
    _unlink(f.path)
    with contextlib.suppress(OSError):
        os.close(f.fd)
    unmap(f.mm)


def unmap(mm: mmap.mmap) -> None:
    # Views (numpy, torch) still alive keep the mapping until they are collected.
    with contextlib.suppress(BufferError):
        mm.close()


def attach(name: str, nbytes: int, private: bool = False) -> mmap.mmap:
    """Map ``nbytes`` of the file a peer created as ``name``, after checking that it is one
    of ours: a tensorx name, a regular file, owned by this uid, private to it, big enough.
    ``private``: copy-on-write (``MAP_PRIVATE``): we see the file's pages as its owner
    writes them, but what we write stays ours (see :func:`drop_own_writes`)."""
    if not isinstance(name, str) or NAME.fullmatch(name) is None:
        raise UsageError(f"{name!r} is not a tensorx shared-memory name (tensorx-<pid>-<hex>)")
    if not isinstance(nbytes, int) or nbytes < 0:
        raise UsageError(f"nbytes must be a non-negative int, got {nbytes!r}")
    path = os.path.join(SHM_DIR, name)
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError as exc:
        raise RegionError(f"shared memory {path} does not exist (closed, or its owner "
                          "died)") from exc
    except OSError as exc:
        raise RegionError(f"cannot open shared memory {path}: {exc}") from exc
    try:
        _check(path, os.fstat(fd), nbytes)
        flags = mmap.MAP_PRIVATE if private else mmap.MAP_SHARED
        return mmap.mmap(fd, max(nbytes, 1), flags=flags)
    except OSError as exc:
        raise RegionError(f"cannot map shared memory {path}: {exc}") from exc
    finally:
        os.close(fd)


PAGEMAP_PRESENT = 1 << 63
PAGEMAP_SWAP = 1 << 62
PAGEMAP_FILE = 1 << 61  # a file (or shared) page: not one we copied on write

# PAGEMAP_SCAN (Linux >= 6.7): the kernel walks the range and hands back only the runs of
# pages that match, where reading /proc/self/pagemap copies out 8 bytes for every page and
# leaves the matching to us (132 MB mapped: 0.8 vs 1.1-1.5 ms per scan)
_PAGEMAP_SCAN = 0xC0606610  # _IOWR('f', 16, struct pm_scan_arg)
_IS_FILE, _IS_PRESENT, _IS_SWAPPED = 1 << 2, 1 << 3, 1 << 4


class _ScanArg(ctypes.Structure):  # struct pm_scan_arg (include/uapi/linux/fs.h)
    _fields_ = [(name, ctypes.c_uint64) for name in (
        "size", "flags", "start", "end", "walk_end", "vec", "vec_len", "max_pages",
        "category_inverted", "category_mask", "category_anyof_mask", "return_mask")]


class _PageRegion(ctypes.Structure):  # struct page_region
    _fields_ = [("start", ctypes.c_uint64), ("end", ctypes.c_uint64),
                ("categories", ctypes.c_uint64)]


_SCAN_VEC = 64
_scan_ok: bool | None = None  # None: not tried yet in this process


def drop_own_writes(mm: mmap.mmap, address: int, nbytes: int) -> int:
    """Of a ``private=True`` mapping at ``address``, forget the pages this process wrote
    (``MADV_DONTNEED``: the next access sees the file again). Returns how many there were,
    found without touching a page (PAGEMAP_SCAN where the kernel has it, else
    /proc/self/pagemap); -1 when neither can be read, and then every page is dropped."""
    if not nbytes:
        return 0
    page = mmap.PAGESIZE
    first, count = address // page, -(-(address % page + nbytes) // page)
    runs = _own_runs_scan(first * page, (first + count) * page)
    if runs is None:
        runs = _own_runs_pagemap(first, count)
    if runs is None:
        mm.madvise(mmap.MADV_DONTNEED)
        return -1
    base = first * page - address  # the mapping starts page-aligned: 0
    for start, stop in runs:
        mm.madvise(mmap.MADV_DONTNEED, base + start * page, (stop - start) * page)
    return sum(stop - start for start, stop in runs)


def _own_runs_scan(start: int, end: int) -> list[tuple[int, int]] | None:
    """Runs [start, stop) of pages (numbered from ``start``) that are ours: present or
    swapped out, and no page of the file. None where PAGEMAP_SCAN is not to be had."""
    global _scan_ok
    if _scan_ok is False:
        return None
    page = mmap.PAGESIZE
    vec = (_PageRegion * _SCAN_VEC)()
    arg = _ScanArg(size=ctypes.sizeof(_ScanArg), start=start, end=end,
                   vec=ctypes.addressof(vec), vec_len=_SCAN_VEC,
                   category_inverted=_IS_FILE, category_mask=_IS_FILE,
                   category_anyof_mask=_IS_PRESENT | _IS_SWAPPED, return_mask=_IS_FILE)
    runs: list[tuple[int, int]] = []
    try:
        fd = os.open("/proc/self/pagemap", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        while arg.start < end:
            try:
                found = fcntl.ioctl(fd, _PAGEMAP_SCAN, arg)
            except OSError:  # ENOTTY/EINVAL: an older kernel
                _scan_ok = False
                return None
            runs += [((r.start - start) // page, (r.end - start) // page)
                     for r in vec[:found]]
            if found < _SCAN_VEC or arg.walk_end <= arg.start:
                break
            arg.start = arg.walk_end  # the vector was full: go on where the walk stopped
    finally:
        os.close(fd)
    _scan_ok = True
    return runs


def _own_runs_pagemap(first: int, count: int) -> list[tuple[int, int]] | None:
    """The same runs from /proc/self/pagemap (one 8-byte entry per page); None where it
    cannot be read."""
    try:
        with open("/proc/self/pagemap", "rb", buffering=0) as f:
            f.seek(first * 8)
            raw = f.read(count * 8)
    except OSError:
        return None
    if len(raw) != count * 8:
        return None
    entries = np.frombuffer(raw, dtype=np.uint64)
    mapped = (entries & np.uint64(PAGEMAP_PRESENT | PAGEMAP_SWAP)) != 0
    own = mapped & ((entries & np.uint64(PAGEMAP_FILE)) == 0)
    return _runs(np.flatnonzero(own))


def _runs(pages: Any) -> list[tuple[int, int]]:
    """Consecutive runs [start, stop) in a sorted array of page numbers."""
    if not len(pages):
        return []
    cuts = np.flatnonzero(np.diff(pages) != 1) + 1
    return [(int(run[0]), int(run[-1]) + 1) for run in np.split(pages, cuts)]


def _check(path: str, st: os.stat_result, nbytes: int) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise RegionError(f"{path} is not a regular file; refusing to map it")
    if st.st_uid != _uid():
        raise RegionError(f"{path} is owned by uid {st.st_uid}, not by this process's uid "
                          f"{_uid()}; refusing to map it")
    if st.st_mode & 0o077:
        raise RegionError(f"{path} has mode {stat.S_IMODE(st.st_mode):o}: other users can "
                          "open it; refusing to map it")
    if st.st_size < nbytes:
        raise RegionError(f"{path} holds {st.st_size} B but {nbytes} B were asked for")


def _uid() -> int:
    return os.getuid()


def sweep() -> list[str]:
    """Unlink the files of creators that died; return their names."""
    try:
        entries = list(os.scandir(SHM_DIR))
    except OSError:
        return []
    removed = []
    for entry in entries:
        m = NAME.fullmatch(entry.name)
        if m is not None and not _alive(int(m[1])) and _unlocked(entry.path):
            _unlink(entry.path)
            removed.append(entry.name)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: alive, someone else's
        return True
    return True


def _unlocked(path: str) -> bool:
    """True when nobody holds the creator's lock (a creator in another pid namespace may
    look dead by pid and still hold it), and the file is ours to remove."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != _uid():
            return False
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
