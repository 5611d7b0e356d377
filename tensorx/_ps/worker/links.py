"""The worker's links to its shards: one :class:`ShardLink` per shard (its endpoint and what
the shard told us), and the replies that come back.

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
from dataclasses import dataclass, field
from typing import Any

from tensorx._deadline import Deadline
from tensorx._ps.wire import protocol
from tensorx.endpoint import Endpoint
from tensorx.errors import (
    BrokenError,
    ClosedError,
    ProtocolError,
    TensorxError,
    TimeoutError,
    error_from_code,
)
from tensorx.memregion import RegionDescriptor
from tensorx.node import Node

__all__ = ["BYE_TIMEOUT", "ShardLink", "ShardLinks"]

logger = logging.getLogger("tensorx.worker")  # its lines read as the worker's

# A goodbye is best effort and nobody's budget (aclose() takes none): a shard that does not
# read must not hold the worker's exit up for longer than this.
BYE_TIMEOUT = 5.0


@dataclass(eq=False)
class ShardLink:
    """What a worker keeps of one shard: the endpoint it reaches it on and what the shard
    told it (its welcome, then its answers). Kept across reconnections: a new welcome
    replaces what the last one said."""

    address: str
    ep: Endpoint | None = None  # None while not connected
    version: int = 0  # of the parameters we last took from it
    optim: dict[str, Any] | None = None  # its optimizer, as its welcome said (None: not yet)
    hyper: list[dict[str, Any]] = field(default_factory=list)  # group values it last told us
    slot: RegionDescriptor | None = None  # where our gradient goes
    header: bytes = b""  # where our sparse headers go (b"": no dynamic path)
    parts: list[tuple[int, int]] = field(default_factory=list)  # its pipelined parts
    note: str | None = None  # why its sync barrier holds us (latest)

    def welcomed(self, slot: RegionDescriptor, header: bytes, parts: list[tuple[int, int]],
                 optim: dict[str, Any], hyper: list[dict[str, Any]]) -> None:
        self.slot, self.header, self.parts = slot, header, parts
        self.optim, self.hyper = optim, hyper


class ShardLinks:
    """The links of worker ``rank`` to the shards at ``addresses``, in shard order
    (:attr:`shards`; their endpoints set by the worker to those :meth:`connect_all` gave
    it), and the replies read from them."""

    def __init__(self, node: Node, rank: int, addresses: list[str]) -> None:
        self._node = node
        self._rank = rank
        self.shards = [ShardLink(address) for address in addresses]

    @property
    def eps(self) -> list[Endpoint]:
        """Our endpoint to each shard, in shard order: all of them, or none."""
        return [link.ep for link in self.shards if link.ep is not None]

    def use(self, eps: list[Endpoint]) -> None:
        """Reach the shards over ``eps`` (one per shard, in shard order) from now on."""
        for link, ep in zip(self.shards, eps, strict=True):
            link.ep = ep

    # -- connections ----------------------------------------------------------------------
    async def connect_all(self, addresses: list[str], timeout: float | None) -> list[Endpoint]:
        """One endpoint per shard, at ``addresses`` (the worker's, which its user may set
        until it starts), or none: a partial set is closed before raising."""
        if len(addresses) != len(self.shards):
            self.shards = [ShardLink(address) for address in addresses]
        for link, address in zip(self.shards, addresses, strict=True):
            link.address = address
        got = await asyncio.gather(*(self._connect(link.address, timeout)
                                     for link in self.shards), return_exceptions=True)
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
        for link in self.shards:
            link.ep = None

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
                self.shards[shard].note = None
                return msg
            if msg["t"] == "error":
                raise error_from_code(msg["code"], msg["msg"], f"ps shard {shard}: ")
            raise ProtocolError(f"shard {shard} sent {msg['t']!r} while we waited for {kind!r}")

    async def _next(self, shard: int, kind: str, timeout: float | None,
                    deadline: Deadline) -> dict[str, Any]:
        try:
            payload = await self.eps[shard].messages.get(deadline.left())
        except TimeoutError:
            note = self.shards[shard].note
            raise TimeoutError(f"ps shard {shard} ({self.shards[shard].address}) sent no {kind!r} "
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
        link = self.shards[shard]
        if link.note != why:
            logger.info("worker rank %d: ps shard %d holds our step: %r", self._rank, shard,
                        why)
        link.note = why

    # -- naming ---------------------------------------------------------------------------
    def _lost(self, shard: int, detail: str = "") -> BrokenError:
        return BrokenError(f"lost the connection to ps shard {shard} "
                           f"({self.shards[shard].address}){': ' if detail else ''}{detail}")

    @contextlib.contextmanager
    def naming(self, shard: int) -> Iterator[None]:
        """A broken endpoint's error says which shard (and where) it was."""
        try:
            yield
        except BrokenError as exc:
            if str(exc).startswith("lost the connection to ps shard"):
                raise
            raise self._lost(shard, str(exc)) from exc
