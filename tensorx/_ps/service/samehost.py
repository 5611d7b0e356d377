"""A shard's offers to workers on its host to map its arenas (sync mode).

A worker on the shard's host may map its gradient slot (autograd writes straight into it:
a push copies nothing) and the parameter arena (the shard's update is there for it to read:
a pull copies nothing). The worker maps the parameter arena copy-on-write
(:mod:`tensorx._ps.worker.samehost`), so an edit it makes in place never reaches the shard or any
other worker, and is dropped at its next pull, as on the copy path.

The offer is no PS-private mechanism: it is the two regions' descriptors, which carry their
/dev/shm names because the arenas were allocated in shared memory, and the worker maps them
with :meth:`tensorx.Node.attach`, as any two nodes on one host can.

Only host memory is mapped: a shard whose arenas are on a GPU (``device="cuda:N"``) offers
nothing, says so once, and its workers copy (straight to and from its GPU memory).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from tensorx._ps.service.answer import Peer
from tensorx.errors import ProtocolError
from tensorx.memregion import RegionDescriptor

if TYPE_CHECKING:
    from tensorx._ps.state.shard import ShardState
    from tensorx.node import Node

__all__ = ["Sharing"]

logger = logging.getLogger(__name__)


class Sharing:
    """One shard's offers to map its arenas (same host, sync mode)."""

    def __init__(self, shard: int, mode: str, enabled: bool, device: str = "cpu") -> None:
        self.shard = shard
        self.mode = mode
        self.enabled = enabled
        self.device = device
        self._params: tuple[Any, RegionDescriptor] | None = None  # arena, its export
        if enabled and mode == "sync" and device != "cpu":
            logger.info("ps shard %d: same-host mapping (share_memory) is not offered: the "
                        "arenas are on %s and only host memory can be mapped; workers "
                        "copy to and from the GPU", shard, device)

    @property
    def wanted(self) -> bool:
        """Put the arenas in /dev/shm, for workers to map?"""
        return self.enabled and self.mode == "sync" and self.device == "cpu"

    def offer(self, state: ShardState, rank: int, asked: bool) -> bool:
        """Offer ``rank`` our arenas to map? Loud about why not when it asked (the GPU
        reason was said once, at construction)."""
        if asked and self.enabled and self.device != "cpu":
            return False
        why = ("the worker did not ask" if not asked
               else "share_memory=False" if not self.enabled
               else f"mode={self.mode} updates the arena while workers compute"
               if self.mode != "sync"
               else "the arenas are not in shared memory"
               if not state.shared or state.slot_region(rank).shared_name is None
               else "")
        if why and asked:
            logger.info("ps shard %d: not offering rank %d to map the arenas: %s",
                        self.shard, rank, why)
        return not why

    def offer_message(self, state: ShardState, peer: Peer, node: Node,
                      slot: RegionDescriptor) -> dict[str, Any]:
        """The welcome's ``share`` field: {} or the descriptors to attach (``node.attach``):
        the parameter arena, exported read-only (once per arena), and the peer's ``slot``."""
        if not peer.offered:
            return {}
        region = state.params_region
        if self._params is None or self._params[0] is not region or region.closed:
            self._params = (region, node.export(region, access="r"))
        return {"params": self._params[1].to_bytes(), "slot": slot.to_bytes()}

    def check_mapped(self, peer: Peer, mapped: bool) -> None:
        """A push says whether its sender mapped our arenas: believe it only if offered."""
        if mapped and not peer.offered:
            raise ProtocolError(f"rank {peer.rank} says it mapped this shard's arenas, "
                                "which were not offered to it")
        if mapped and not peer.mapped:
            logger.info("ps shard %d: rank %d mapped shard %d's arenas (same host, zero-copy)",
                        self.shard, peer.rank, self.shard)
        peer.mapped = mapped
