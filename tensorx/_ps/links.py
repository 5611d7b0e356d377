"""The worker's links to its shards: one endpoint per shard, and the replies that come back.

Connecting is all or nothing (a partial set is closed before the error is raised). A reply
is awaited by kind, on that shard's own message stream, in order: a ``waiting`` note from
a sync barrier that holds us is logged (once per reason) and waited past, the shard's
error is raised as its own type, and its end, a bad message or its silence past the
timeout as a :class:`~tensorx.errors.BrokenError` or :class:`~tensorx.errors.TimeoutError`
naming the shard and the address it was reached at.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator
from typing import Any

from tensorx._deadline import Deadline
from tensorx._ps import protocol
from tensorx.endpoint import Endpoint
from tensorx.errors import (
    BrokenError,
    ClosedError,
    ProtocolError,
    TensorxError,
    TimeoutError,
    error_from_code,
)
from tensorx.node import Node

__all__ = ["BYE_TIMEOUT", "ShardLinks"]

logger = logging.getLogger("tensorx.worker")  # its lines read as the worker's

# A goodbye is best effort and nobody's budget (aclose() takes none): a shard that does not
# read must not hold the worker's exit up for longer than this.
BYE_TIMEOUT = 5.0


class ShardLinks:
    """The endpoints of worker ``rank`` to its shards, in shard order (:attr:`eps`, set by
    the worker to those :meth:`connect_all` gave it), and the replies read from them."""

    def __init__(self, node: Node, rank: int) -> None:
        self._node = node
        self._rank = rank
        self.eps: list[Endpoint] = []
        self._addresses: list[str] = []  # where the shards were last connected to
        self._notes: dict[int, str] = {}  # shard -> why its sync barrier holds us (latest)

    # -- connections ----------------------------------------------------------------------
    async def connect_all(self, addresses: list[str], timeout: float | None) -> list[Endpoint]:
        """One endpoint per shard, or none: a partial set is closed before raising."""
        self._addresses = list(addresses)
        got = await asyncio.gather(*(self._connect(a, timeout) for a in addresses),
                                   return_exceptions=True)
        failed = [r for r in got if isinstance(r, BaseException)]
        if failed:
            for ep in got:
                if isinstance(ep, Endpoint):
                    with contextlib.suppress(TensorxError):
                        await ep.aclose()
            raise failed[0]
        return [ep for ep in got if isinstance(ep, Endpoint)]

    async def _connect(self, address: str, timeout: float | None) -> Endpoint:
        ep = await self._node.connect(address, timeout=timeout)
        ep.messages  # noqa: B018  # the shard's messages come to us, in order, with its end
        return ep

    async def drop(self) -> None:
        """Close every endpoint (errors ignored) and forget them."""
        for ep in self.eps:
            with contextlib.suppress(TensorxError):
                await ep.aclose()
        self.eps = []

    async def bye(self) -> None:
        """Say goodbye to every shard, best effort."""
        for ep in self.eps:
            with contextlib.suppress(TensorxError):
                await ep.notify(protocol.encode("bye"), timeout=BYE_TIMEOUT)

    # -- replies --------------------------------------------------------------------------
    async def expect(self, shard: int, kind: str, timeout: float | None) -> dict[str, Any]:
        """The shard's next message, which must be ``kind``: its error, its end (a
        BrokenError naming it) or silence past ``timeout`` raise instead."""
        deadline = Deadline(timeout)
        while True:
            msg = await self._next(shard, kind, timeout, deadline)
            if msg["t"] == "waiting":
                self._held(shard, msg["why"])
                continue
            if msg["t"] == kind:
                self._notes.pop(shard, None)
                return msg
            if msg["t"] == "error":
                raise error_from_code(msg["code"], msg["msg"], f"ps shard {shard}: ")
            raise ProtocolError(f"shard {shard} sent {msg['t']!r} while we waited for {kind!r}")

    async def _next(self, shard: int, kind: str, timeout: float | None,
                    deadline: Deadline) -> dict[str, Any]:
        try:
            payload = await self.eps[shard].messages.get(deadline.left())
        except TimeoutError:
            note = self._notes.get(shard)
            raise TimeoutError(f"ps shard {shard} ({self._addresses[shard]}) sent no {kind!r} "
                               f"within {timeout} s"
                               + (f": {note}" if note else "")) from None
        except (BrokenError, ClosedError) as exc:
            raise self._lost(shard, str(exc)) from None
        try:
            return protocol.decode(payload)
        except ProtocolError as exc:
            logger.warning("bad message from ps shard %d: %s", shard, exc)
            raise self._lost(shard, f"bad message: {exc}") from exc

    def _held(self, shard: int, why: str) -> None:
        if self._notes.get(shard) != why:
            logger.info("worker rank %d: ps shard %d holds our step: %r", self._rank, shard,
                        why)
        self._notes[shard] = why

    # -- naming ---------------------------------------------------------------------------
    def _lost(self, shard: int, detail: str = "") -> BrokenError:
        return BrokenError(f"lost the connection to ps shard {shard} "
                           f"({self._addresses[shard]}){': ' if detail else ''}{detail}")

    @contextlib.contextmanager
    def naming(self, shard: int) -> Iterator[None]:
        """A broken endpoint's error says which shard (and where) it was."""
        try:
            yield
        except BrokenError as exc:
            if str(exc).startswith("lost the connection to ps shard"):
                raise
            raise self._lost(shard, str(exc)) from exc
