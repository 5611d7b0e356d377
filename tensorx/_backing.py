"""What keeps a region's memory mapped, and until when. Pure bookkeeping, no I/O but the
unmapping itself.

A :class:`Backing` owns a region's mapping state, apart from the region users hold: the
mapping to release (a /dev/shm file this process created, or another process's file it
attached), and the ops in flight that address the memory by raw pointer (a UCX put, a
cross-memory copy, a staged TCP send). Transports :meth:`~Backing.pin` around such an op;
the region :meth:`~Backing.release`\\ s it when closed; it is unmapped then, or when the last
pin goes, so that an op still running never touches memory that was given back.
"""

from __future__ import annotations

import logging
import mmap
import weakref
from typing import Any

from tensorx import _shm

__all__ = ["Backing"]

logger = logging.getLogger("tensorx.memregion")


class Backing:
    """The mapping of one region: who unmaps it, and which ops still hold it."""

    __slots__ = ("__weakref__", "_attached", "_file", "_finalizer", "_pins", "_released")

    def __init__(self, *, file: _shm.ShmFile | None = None,
                 attached: mmap.mmap | None = None) -> None:
        self._file = file  # the /dev/shm file this process created (unlinked at the end)
        self._attached = attached  # another process's file, mapped here
        self._pins = 0
        self._released = False
        # a safety net only: the owner of a created file is expected to close its region
        self._finalizer: weakref.finalize[Any, Any] | None = (
            weakref.finalize(self, _release_unclosed, file) if file is not None else None)

    @property
    def created_file(self) -> str | None:
        """The name of the /dev/shm file this process created for the region (what a
        same-host peer may attach), or None."""
        return self._file.name if self._file is not None else None

    def pin(self) -> None:
        """An op starts that addresses the memory by raw pointer: keep it mapped until
        :meth:`unpin`, even if the region is closed meanwhile."""
        self._pins += 1

    def unpin(self) -> None:
        self._pins -= 1
        if self._pins == 0 and self._released:
            self._unmap()

    @property
    def pinned(self) -> bool:
        """Whether an op still addresses the memory."""
        return self._pins > 0

    def release(self) -> None:
        """The region is closed: unmap now, or once the last pin is gone. Idempotent."""
        if self._released:
            return
        self._released = True
        if not self._pins:
            self._unmap()

    def _unmap(self) -> None:
        if self._finalizer is not None:
            self._finalizer.detach()
        if self._file is not None:
            _shm.release(self._file)
        elif self._attached is not None:
            _shm.unmap(self._attached)


def _release_unclosed(f: _shm.ShmFile) -> None:
    logger.warning("shared memory %s was never closed; unlinking it", f.name)
    _shm.release(f)
