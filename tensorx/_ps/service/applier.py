"""The shard's apply thread: where an update is stepped part by part while the loop sends.

torch releases the GIL in its kernels, so a part stepped in a thread overlaps the writes of
the parts before it (:func:`tensorx._ps.service.answer.apply_in_parts`) and the landing of the parts
after it (:mod:`tensorx._ps.service.pipelined`). Both go through one :class:`Applier` per server:
one thread, made on first use, so the parts are stepped one at a time, in the order asked,
always by the same thread (a GPU part's kernels are queued on that thread's current stream,
which :func:`tensorx._ps.common.device.fence` waits on), and a call whose caller was cancelled (the
server closes mid-update) can be waited for (:meth:`Applier.settle`) before a checkpoint
reads the arena. A hop to a thread of its own also measured a little cheaper than
``asyncio.to_thread`` here (2-core VM, an empty call: ~59 vs ~70 us).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["Applier"]

T = TypeVar("T")


class Applier:
    """Runs an update's steps in the shard's apply thread, one call at a time."""

    def __init__(self) -> None:
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._running: concurrent.futures.Future[Any] | None = None

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` in the apply thread: its result, or its exception. Cancelled, the
        call still runs to its end in the thread (see :meth:`settle`)."""
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(1, "tensorx-ps-apply")
        running: concurrent.futures.Future[T] = self._pool.submit(fn, *args)
        self._running = running
        return await asyncio.wrap_future(running)

    async def settle(self) -> None:
        """Return once nothing runs in the apply thread (a call whose caller was cancelled
        may still be stepping the arena)."""
        if self._running is not None and not self._running.done():
            await asyncio.to_thread(concurrent.futures.wait, [self._running])

    def close(self) -> None:
        """Let the thread end (after :meth:`settle`); a later :meth:`run` raises
        RuntimeError."""
        if self._pool is not None:
            self._pool.shutdown(wait=False)
