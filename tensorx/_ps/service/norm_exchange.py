"""The shards' exchange of partial gradient norms, for ``clip_grad_norm=`` over all shards.

The norm that clips a sync update is the norm of the whole averaged gradient, and each shard
holds only its part of it. So before it steps, each shard sends every other shard the sum of
squares of its part (one small notification per peer shard, on an endpoint of its own),
waits for theirs, and clips with ``sqrt(sum)``. Every shard adds the same numbers in the same
(shard) order, so all of them clip by the same factor.

Shards learn each other's addresses from the workers' hello (a worker lists every shard,
in shard order) and connect on first use. A message is keyed by the version the update
makes, which advances in step on every shard in sync mode. Waits are bounded by the
server's ``timeout``: a shard that does not answer in time, or whose connection breaks, is
an error naming it (the shard then fails that update to its workers instead of applying a
wrongly clipped one).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from typing import TYPE_CHECKING, Any

from tensorx._deadline import Deadline, wait_for
from tensorx._ps.wire import protocol
from tensorx.endpoint import Endpoint
from tensorx.errors import BrokenError, ProtocolError, TensorxError
from tensorx.errors import TimeoutError as TxTimeoutError

if TYPE_CHECKING:
    from tensorx.node import Node

__all__ = ["NormExchange"]

logger = logging.getLogger(__name__)

AHEAD = 4  # versions a peer's message may be ahead of ours (it is at most one in sync mode)


class NormExchange:
    """One shard's side of the exchange: send our partial sum, gather the others'."""

    def __init__(self, node: Node, shard: int, num_shards: int, timeout: float | None) -> None:
        self.node = node
        self.shard = shard
        self.num_shards = num_shards
        self.timeout = timeout
        self.addresses: list[str] | None = None
        self._out: dict[int, Endpoint] = {}      # our endpoint to each other shard
        self._inbound: dict[Endpoint, int] = {}  # their endpoints to us, once they spoke
        self._gone: dict[int, str] = {}
        self._got: dict[int, dict[int, tuple[list[int], float]]] = {}  # version -> shard ->
        self._changed = asyncio.Event()
        self._floor = 0  # versions below this are done: late messages for them are dropped
        self._watching: set[asyncio.Task[None]] = set()

    # -- discovery and connections ---------------------------------------------------------
    def learn(self, shards: object) -> None:
        """Take the shard addresses a worker's hello lists (the first complete list wins)."""
        if self.addresses is not None or shards is None:
            return
        if not isinstance(shards, list) or len(shards) != self.num_shards or not all(
                isinstance(a, str) and 0 < len(a) < 512 for a in shards):
            raise ProtocolError(f"hello: 'shards' must list the {self.num_shards} shard "
                                "addresses")
        self.addresses = list(shards)

    def owns(self, ep: Endpoint) -> bool:
        return ep in self._inbound or ep in self._out.values()

    def lost(self, ep: Endpoint) -> None:
        """A connection to or from a peer shard dropped."""
        shard = self._inbound.pop(ep, None)
        for j, out in list(self._out.items()):
            if out is ep:
                del self._out[j]
                shard = j
        if shard is not None:
            self._gone[shard] = f"its connection to shard {self.shard} dropped"
            self._changed.set()

    async def _connect(self) -> None:
        if self.addresses is None:
            raise BrokenError(f"shard {self.shard} does not know the other shards' addresses "
                              "(no worker hello listed them)")
        for j, address in enumerate(self.addresses):
            if j != self.shard and j not in self._out:
                try:
                    ep = self._out[j] = await self.node.connect(address, timeout=self.timeout)
                except TensorxError as exc:
                    raise BrokenError(f"shard {self.shard} cannot reach shard {j} at "
                                      f"{address!r} to exchange gradient norms: {exc}") from exc
                self._gone.pop(j, None)
                self._watching.add(asyncio.create_task(self._watch(ep)))

    async def _watch(self, ep: Endpoint) -> None:
        """What comes back on a connection we opened (norms, if the peer sends them there),
        and its end."""
        async for payload in ep.messages:
            self.take(ep, payload)
        self.lost(ep)

    # -- messages --------------------------------------------------------------------------
    def take(self, ep: Endpoint, payload: bytes) -> bool:
        """Take ``payload`` if it is a gradient norm (a bad one is logged and dropped)."""
        if len(payload) > 4096:
            return False
        try:
            msg = protocol.decode(payload)
            if msg["t"] != "gnorm":
                return False
            self.receive(ep, msg)
        except ProtocolError as exc:
            logger.warning("ps shard %d: bad gradient norm from %s: %s", self.shard,
                           ep.peer, exc)
        return True

    def receive(self, ep: Endpoint, msg: dict[str, Any]) -> None:
        """A peer shard's partial sum (its types and ranges checked by
        ``protocol.SCHEMAS['gnorm']``)."""
        shard, version, sumsq = msg["shard"], msg["version"], msg["sumsq"]
        ranks = msg["ranks"]
        if not 0 <= shard < self.num_shards or shard == self.shard:
            raise ProtocolError(f"gnorm from shard {shard}: not a peer of shard {self.shard}")
        if sumsq < 0:  # inf and nan pass: a non-finite norm must reach every shard
            raise ProtocolError("gnorm: negative sum of squares")
        self._inbound[ep] = shard
        if version < self._floor:
            return
        if version > self._floor + AHEAD:
            raise ProtocolError(f"gnorm from shard {shard} for version {version}, "
                                f"far ahead of {self._floor}")
        self._got.setdefault(version, {})[shard] = (ranks, float(sumsq))
        self._changed.set()

    async def total(self, version: int, ranks: list[int], sumsq: float) -> float:
        """The sum of every shard's ``sumsq`` for the update that makes ``version``."""
        self._floor = version
        for old in [v for v in self._got if v < version]:
            del self._got[old]
        await self._connect()
        msg = protocol.encode("gnorm", shard=self.shard, version=version, ranks=ranks,
                              sumsq=sumsq)
        await asyncio.gather(*(self._send(j, ep, msg) for j, ep in self._out.items()))
        got = await self._wait(version)
        self._check_ranks(version, ranks, got)
        parts = {self.shard: sumsq, **{j: s for j, (_, s) in got.items()}}
        del self._got[version]
        self._floor = version + 1
        return math.fsum(parts[j] for j in range(self.num_shards))

    async def _send(self, j: int, ep: Endpoint, msg: bytes) -> None:
        try:
            await ep.notify(msg, timeout=self.timeout)
        except TensorxError as exc:
            self.lost(ep)
            raise BrokenError(f"shard {self.shard} lost shard {j} while sending its gradient "
                              f"norm: {exc}") from exc

    async def _wait(self, version: int) -> dict[int, tuple[list[int], float]]:
        deadline = Deadline(self.timeout)
        while True:
            got = self._got.setdefault(version, {})
            missing = [j for j in range(self.num_shards) if j != self.shard and j not in got]
            if not missing:
                return got
            gone = [j for j in missing if j in self._gone]
            if gone:
                raise BrokenError(f"shard {gone[0]} is gone ({self._gone[gone[0]]}): shard "
                                  f"{self.shard} cannot clip version {version} by the global "
                                  "gradient norm")
            self._changed.clear()
            if deadline.expired:
                raise TxTimeoutError(
                    f"shard {self.shard} heard no gradient norm for version {version} from "
                    f"shard(s) {missing} within {self.timeout:g} s (are they at another "
                    "version, or waiting for a worker?)")
            try:
                await wait_for(self._changed.wait(), deadline.left())
            except asyncio.TimeoutError:
                continue

    def _check_ranks(self, version: int, ranks: list[int],
                     got: dict[int, tuple[list[int], float]]) -> None:
        for j, (theirs, _) in got.items():
            if sorted(theirs) != sorted(ranks):
                logger.warning("ps shard %d: version %d averages ranks %s here and %s on "
                               "shard %d (a worker was lost): the clipping norm mixes them",
                               self.shard, version, sorted(ranks), sorted(theirs), j)

    async def aclose(self) -> None:
        for task in self._watching:
            task.cancel()
        await asyncio.gather(*self._watching, return_exceptions=True)
        out, self._out = list(self._out.values()), {}
        for ep in out:
            with contextlib.suppress(TensorxError):
                await ep.aclose()
