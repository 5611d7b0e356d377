"""The bounded queues a node hands to its user: every queue a peer can fill has a limit."""

from __future__ import annotations

import asyncio
import collections
import logging
from typing import Any, Generic, TypeVar

from tensorx._deadline import Deadline, wait_for
from tensorx.errors import BrokenError, ClosedError
from tensorx.errors import TimeoutError as TxTimeoutError

__all__ = ["LatestQueue", "MessageStream", "NotificationQueue"]

logger = logging.getLogger("tensorx.node")

T = TypeVar("T")


class NotificationQueue(asyncio.Queue[tuple[Any, bytes]]):
    """``(endpoint, payload)`` items, bounded by count *and* by payload bytes.

    ``put`` waits while either bound is reached (the bytes held stay under ``max_bytes`` plus
    one notification): the connection delivering it stops reading its socket meanwhile, so
    a peer flooding notifications nobody reads is held back by TCP instead of growing this
    process."""

    def __init__(self, maxsize: int, max_bytes: int) -> None:
        super().__init__(maxsize)
        self.max_bytes = max_bytes
        self.nbytes = 0

    def full(self) -> bool:
        return super().full() or (self.nbytes >= self.max_bytes and not self.empty())

    def _put(self, item: tuple[Any, bytes]) -> None:
        self.nbytes += len(item[1])
        super()._put(item)  # type: ignore[misc]

    def _get(self) -> tuple[Any, bytes]:
        item: tuple[Any, bytes] = super()._get()  # type: ignore[misc]
        self.nbytes -= len(item[1])
        return item


class LatestQueue(asyncio.Queue[T], Generic[T]):
    """Keeps the latest ``maxsize`` items: putting into a full queue drops the oldest (with
    one log line per ``maxsize`` drops), so events nobody reads cost a bounded amount."""

    def __init__(self, maxsize: int, what: str) -> None:
        super().__init__(maxsize)
        self._what = what
        self.dropped = 0

    def put_nowait(self, item: T) -> None:
        if self.full():
            self.get_nowait()
            if self.dropped % self.maxsize == 0:
                logger.info("%s: nobody reads them; keeping the latest %d", self._what,
                            self.maxsize)
            self.dropped += 1
        super().put_nowait(item)



class MessageStream:
    """One endpoint's notifications, in the order they arrived, ending after the last one.

    Bounded by count *and* bytes (``max_bytes`` plus one message): a :meth:`put` that does
    not fit waits, and the connection delivering it stops reading meanwhile, so a peer
    whose messages nobody takes is held back by TCP. The end always gets in: after the
    messages already here, :meth:`get` raises why the stream ended
    (:class:`~tensorx.errors.ClosedError` for a clean close by either side,
    :class:`~tensorx.errors.BrokenError` otherwise); ``async for`` simply stops, and
    :attr:`ended_by` then tells which (``None``: clean)."""

    def __init__(self, what: str, max_count: int = 256, max_bytes: int = 16 << 20) -> None:
        self.what = what
        self.max_count = max_count
        self.max_bytes = max_bytes
        self._items: collections.deque[bytes] = collections.deque()
        self._nbytes = 0
        self._end: BaseException | None = None  # why it ended, once it has
        self.ended = False
        self.ended_by: BaseException | None = None  # None: a clean close
        self._arrived = asyncio.Event()
        self._room = asyncio.Event()

    def __len__(self) -> int:
        return len(self._items)

    def full(self) -> bool:
        return bool(self._items) and (len(self._items) >= self.max_count
                                      or self._nbytes >= self.max_bytes)

    async def put(self, payload: bytes) -> None:
        """Append ``payload``; waits while the stream is full. Dropped once it has ended."""
        while not self.put_nowait(payload):
            self._room.clear()
            await self._room.wait()

    def put_nowait(self, payload: bytes) -> bool:
        """:meth:`put` where it would not wait; False (nothing done) while the stream is full."""
        if self.ended:
            return True
        if self.full():
            return False
        self._items.append(payload)
        self._nbytes += len(payload)
        self._arrived.set()
        return True

    def end(self, exc: BaseException | None) -> None:
        """No more messages: ``exc`` is why (``None``: a clean close). Idempotent."""
        if self.ended:
            return
        self.ended, self.ended_by = True, exc
        self._end = exc if exc is not None else ClosedError(f"{self.what}: closed")
        self._arrived.set()
        self._room.set()

    def get_nowait(self) -> bytes | None:
        """The next message, or None when none is here yet; raises once ended and empty."""
        if self._items:
            payload = self._items.popleft()
            self._nbytes -= len(payload)
            self._room.set()
            return payload
        if self._end is not None:
            raise type(self._end)(str(self._end))
        return None

    async def get(self, timeout: float | None = None) -> bytes:
        """The next message; :class:`~tensorx.errors.TimeoutError` after ``timeout``
        seconds (``None``: no limit)."""
        deadline = Deadline(timeout)
        while True:
            payload = self.get_nowait()
            if payload is not None:
                return payload
            self._arrived.clear()
            try:
                await wait_for(self._arrived.wait(), deadline.left())
            except TimeoutError:
                raise TxTimeoutError(f"{self.what}: no message within {timeout} s") from None

    def __aiter__(self) -> MessageStream:
        return self

    async def __anext__(self) -> bytes:
        try:
            return await self.get()
        except (ClosedError, BrokenError):
            raise StopAsyncIteration from None
