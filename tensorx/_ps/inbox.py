"""The service loop's inbox: what peers' notifications can make a shard hold is bounded.

The node's notification queue is bounded and holds back a peer nobody reads; the shard
takes notifications from it at once (a peer shard's gradient norm must get through while
the service loop waits for it), so its own queue is bounded per peer instead: an honest
worker has one or two messages waiting at most (it waits for its answer), and a peer with
more than ``max_count`` messages (or ``max_bytes``) not yet handled is refused: dropped,
with one WARNING line. One peer's flood can then neither grow the shard nor push the other
workers' steps behind a backlog of its messages."""

from __future__ import annotations

import asyncio
import logging
from typing import NamedTuple

from tensorx._text import printable
from tensorx.endpoint import Endpoint

__all__ = ["Event", "Inbox"]

logger = logging.getLogger("tensorx.ps")

MAX_COUNT = 64
MAX_BYTES = 64 << 20


class Event(NamedTuple):
    """What the service loop handles, one at a time."""

    kind: str                # "msg": a notification, "gone": an endpoint dropped, "lost": a
    ep: Endpoint | None      # departed rank's worker_loss_timeout ran out
    payload: bytes = b""
    rank: int = -1


class Inbox:
    """Events for the service loop, in arrival order. Control events ("gone", "lost": at
    most one per endpoint or rank) always get in; messages are counted per peer."""

    def __init__(self, what: str, max_count: int = MAX_COUNT,
                 max_bytes: int = MAX_BYTES) -> None:
        self._what = what
        self.max_count = max_count
        self.max_bytes = max_bytes
        self._queue: asyncio.Queue[Event] = asyncio.Queue()
        self._held: dict[Endpoint, list[int]] = {}  # peer -> [messages, bytes] queued
        self.refused = 0

    def post(self, event: Event) -> None:
        self._queue.put_nowait(event)

    def offer(self, ep: Endpoint, payload: bytes) -> bool:
        """Queue a peer's message; False (and the peer is refused) past its bound."""
        held = self._held.setdefault(ep, [0, 0])
        if held[0] >= self.max_count or held[1] + len(payload) > self.max_bytes:
            if held[0] == 0:
                del self._held[ep]
            self.refused += 1
            if ep.closed:  # refused already (or gone): the rest of its backlog goes quietly
                return False
            logger.warning("%s: peer %s sent more than %d messages (%d MiB) not yet handled; "
                           "closing its connection", self._what, printable(ep.peer),
                           self.max_count, self.max_bytes >> 20)
            ep.abort()
            return False
        held[0] += 1
        held[1] += len(payload)
        self._queue.put_nowait(Event("msg", ep, payload))
        return True

    async def get(self) -> Event:
        event = await self._queue.get()
        if event.kind == "msg" and event.ep is not None:
            held = self._held[event.ep]
            held[0] -= 1
            held[1] -= len(event.payload)
            if held[0] == 0:
                del self._held[event.ep]
        return event

    def qsize(self) -> int:
        return self._queue.qsize()
