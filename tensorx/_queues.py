"""The bounded queues a node hands to its user: every queue a peer can fill has a limit."""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Generic, TypeVar

__all__ = ["LatestQueue", "NotificationQueue"]

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

