"""Connecting again (``Node.connect(reconnect=)``), and remembering which node answered at
an address, so that a descriptor of a node that has since restarted is named as such."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

from tensorx._backoff import Backoff
from tensorx._deadline import Deadline
from tensorx.errors import BrokenError, ProtocolError, TensorxError, TimeoutError

__all__ = ["PeerHistory", "redial"]

logger = logging.getLogger("tensorx.endpoint")

T = TypeVar("T")
# What a later attempt may get past: nothing listens there yet, or the handshake broke or
# went unanswered (a node still starting). Anything else (refused credentials, this node
# closed) is final.
RETRY = (BrokenError, TimeoutError, ProtocolError)
MAX_ADDRESSES = 1024  # addresses whose nodes are remembered
MAX_PEERS_AT = 8  # nodes remembered per address


async def redial(address: str, budget: float,
                 dial: Callable[[str, float | None], Awaitable[T]]) -> T:
    """What ``dial(address, timeout)`` gives, trying again with backoff (as ``Worker(reconnect=)``)
    for up to ``budget`` seconds; BrokenError saying why once that is spent, or an attempt
    failed for good."""
    backoff = Backoff(Deadline(budget))
    while True:
        try:
            return await dial(address, backoff.deadline.left())
        except RETRY as exc:
            if not backoff.failed(exc):
                break
            pause = backoff.next_pause()
            logger.debug("reconnecting to %s: attempt %d failed (%s); next in %.2f s",
                         address, backoff.attempts, exc, pause)
            await asyncio.sleep(pause)
        except TensorxError as exc:
            backoff.failed(exc)
            break
    raise BrokenError(f"could not reconnect to {address} within {budget:g} s "
                      f"({backoff.attempts} attempt(s)); the last failed: {backoff.error}")


class PeerHistory:
    """Which nodes answered at each address, oldest first (the last is there now)."""

    def __init__(self) -> None:
        self._at: dict[str, list[str]] = {}

    def met(self, address: str, peer: str) -> None:
        ids = self._at.pop(address, [])
        if peer not in ids:
            ids = [*ids[-(MAX_PEERS_AT - 1):], peer]
        self._at[address] = ids
        while len(self._at) > MAX_ADDRESSES:  # the least recently met go first
            del self._at[next(iter(self._at))]

    def former(self, address: str) -> list[str]:
        """The nodes reached at ``address`` before the one there now."""
        return self._at.get(address, [])[:-1]
