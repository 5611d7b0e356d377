"""The peer's exports as one endpoint knows them: which descriptors the owner confirmed
(on the connection in use), which exports it revoked (for the endpoint's life: an export
made since has a cookie of its own), and the acknowledgements of revocations a lane that
bypasses the owner needs. Used by ``tensorx.endpoint`` only."""

from __future__ import annotations

import asyncio
import logging
from typing import Protocol

from tensorx._opcheck import foreign, get_again, named
from tensorx.errors import RegionError, TensorxError
from tensorx.memregion import RegionDescriptor
from tensorx.transport.base import DataLane
from tensorx.transport.control import ControlChannel

__all__ = ["NodeSide", "PeerExports"]

logger = logging.getLogger("tensorx.endpoint")


class NodeSide(Protocol):
    """What :class:`PeerExports` asks of the node (its ``EndpointEvents``)."""

    @property
    def timeout(self) -> float | None: ...  # the node's default
    def former_peers(self, address: str) -> list[str]: ...  # reached there before


class PeerExports:
    """The exports of the peer at ``address`` as our endpoint there knows them; ``node``:
    the node's side. :meth:`use` gives it each connection's parts, before anything else."""

    peer: str  # the peer node's id, on the connection in use
    _lane: DataLane
    _channel: ControlChannel
    _bypassed: bool

    def __init__(self, address: str, node: NodeSide) -> None:
        self._address = address
        self._node = node
        # Exports the owner revoked, as (region id, cookie): an export of the region made
        # since has a cookie of its own and is usable.
        self._revoked: set[tuple[int, int]] = set()
        self._acks: set[asyncio.Task[None]] = set()
        # descriptors the owner confirmed on this connection: (region id, cookie) ->
        # (nbytes, access)
        self._validated: dict[tuple[int, int], tuple[int, str]] = {}

    def use(self, peer: str, lane: DataLane, channel: ControlChannel, bypassed: bool) -> None:
        """A connection (the first, or one made again) to node ``peer``: what the owner
        confirmed on the one before no longer counts. ``bypassed``: either side's lane may
        reach the other's memory without its code."""
        self.peer, self._lane, self._channel, self._bypassed = peer, lane, channel, bypassed
        self._validated = {}

    def limits_now(self, desc: RegionDescriptor) -> tuple[int, str] | None:
        """Size and rights of the remote region if known without asking: from the
        descriptor for lanes that do not bypass the owner (it re-checks every TCP op),
        else from the owner's earlier answer."""
        if desc.owner != self.peer:
            raise RegionError(foreign(desc, self.peer, self._address,
                                      self._node.former_peers(self._address)))
        self._check_not_revoked(desc)
        if not self._lane.bypasses_owner:  # the owner checks every op itself
            return desc.nbytes, desc.access
        return self._validated.get((desc.region_id, desc.cookie))

    async def limits(self, desc: RegionDescriptor, timeout: float | None) -> tuple[int, str]:
        """:meth:`limits_now`, asking the owner (once) where needed, within the op's
        budget."""
        known = self.limits_now(desc)
        if known is not None:
            return known
        key = (desc.region_id, desc.cookie)
        if key not in self._validated:
            n, access = await self._channel.requests.validate(*key, timeout)
            self._check_not_revoked(desc)  # revoked while we asked
            if n != desc.nbytes or not set(desc.access) <= set(access):
                raise RegionError(f"the descriptor of region {named(desc)} claims {desc.nbytes} B "
                                  f"'{desc.access}', but its owner exported {n} B '{access}' "
                                  "(altered or forged): " + get_again(desc))
            self._validated[key] = (n, desc.access)
        return self._validated[key]

    def _check_not_revoked(self, desc: RegionDescriptor) -> None:
        if (desc.region_id, desc.cookie) in self._revoked:
            raise RegionError(f"region {named(desc)} was closed or unexported by its owner, "
                              "or exported again under a new descriptor: "
                              + get_again(desc))

    # -- revocations -----------------------------------------------------------------------
    def revoke(self, region_id: int, cookie: int) -> None:
        """The owner closed or unexported an export of a region: refuse its descriptor
        from now on. Over a lane that bypasses the owner, the owner keeps the memory until
        we acknowledge, which we do once every op issued before (on any region) has
        completed."""
        self._revoked.add((region_id, cookie))
        self._validated.pop((region_id, cookie), None)
        if self._bypassed:
            task = asyncio.get_running_loop().create_task(self._ack_revoke(region_id, cookie))
            self._acks.add(task)
            task.add_done_callback(self._acks.discard)

    async def _ack_revoke(self, region_id: int, cookie: int) -> None:
        try:
            await self._lane.flush(timeout=self._node.timeout)
        except TensorxError as exc:  # a broken or closed lane has nothing in flight either
            logger.debug("flush before acknowledging a revocation: %s", exc)
        if not self._channel.broken:
            self._channel.revoke_ack(region_id, cookie)

    def cancel_acks(self) -> None:
        """The endpoint closes: acknowledgements not sent yet are not sent."""
        for task in list(self._acks):
            task.cancel()
