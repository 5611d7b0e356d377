"""Time budgets: one :class:`Deadline` type for a wait that spans several steps, and one
:func:`wait_for` that bounds a single await. Pure asyncio, nothing else of tensorx.

Every wait in tensorx has a timeout (seconds, ``float | None``; ``None`` waits forever),
and a caller's budget is spent across the steps of a multi-step operation (connect, then
handshake, then probe) instead of each step getting a fresh one; nothing here caps a
caller's budget.

:func:`wait_for` rather than :func:`asyncio.wait_for`: on Python 3.11 the latter loses an
outside ``task.cancel()`` that arrives in the loop iteration where the awaited thing
completes (it returns the result and the task runs on, marked as cancelling, until its
next wait never ends: a server's ``aclose()`` hung on it). :func:`asyncio.timeout`, used
here where it exists, delivers the cancellation into the awaiting coroutine itself.
"""

from __future__ import annotations

import asyncio
import math
import sys
import time
from collections.abc import Awaitable
from typing import TypeVar, overload

__all__ = ["Deadline", "wait_for"]

T = TypeVar("T")

# The clock every Deadline reads: the monotonic one (a test may stand in a clock it moves
# itself, to show where a budget went without waiting for it).
_clock = time.monotonic


class Deadline:
    """A point in time on the monotonic clock (or none: ``Deadline(None)`` never expires)
    that several steps share: each asks :meth:`left` for what remains of the budget."""

    __slots__ = ("at", "timeout")

    def __init__(self, timeout: float | None) -> None:
        self.timeout = timeout
        self.at = math.inf if timeout is None else _clock() + timeout

    def left(self) -> float | None:
        """Seconds left (never below 0), or ``None`` for no limit."""
        if self.at == math.inf:
            return None
        return max(0.0, self.at - _clock())

    @property
    def expired(self) -> bool:
        return _clock() >= self.at

    @overload
    def least(self, cap: float) -> float: ...
    @overload
    def least(self, cap: None) -> float | None: ...

    def least(self, cap: float | None) -> float | None:
        """What is left, or ``cap`` if that is sooner (a step's own bound within the
        caller's budget; the budget itself is never raised)."""
        left = self.left()
        if cap is None:
            return left
        return cap if left is None else min(left, cap)


async def wait_for(aw: Awaitable[T], timeout: float | None) -> T:
    """``await aw``, raising :class:`TimeoutError` after ``timeout`` seconds (``None``: no
    limit; the awaited coroutine is cancelled then, as with :func:`asyncio.wait_for`). An
    outside cancellation is never lost, whatever ``aw`` does at that moment."""
    if timeout is None:
        return await aw
    if sys.version_info >= (3, 11):
        async with asyncio.timeout(timeout):
            return await aw
    return await asyncio.wait_for(aw, timeout)  # pragma: no cover (Python 3.10)
