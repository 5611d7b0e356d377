"""The worker's side of same-host mapping: bind the model straight into a shard's memory.

In sync mode a shard on this host may offer (in its welcome) the descriptors of its
parameter arena and of this worker's gradient slot, both in shared memory, which the
worker maps with :meth:`tensorx.Node.attach`. :class:`SharedArenas` maps them and
rebinds the model as views into them, without copying: the parameters are the shard's, and
autograd writes gradients into the slot the shard reads. Pushes then write nothing and the
shard writes nothing back. Anything that stands in the way leaves that shard on the copy
path, with one log line saying why.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from tensorx._analyzer.binding import ARENAS, Binding
from tensorx._ps.wire import protocol
from tensorx._shm import SHM_DIR, host_id
from tensorx.errors import ProtocolError, TensorxError
from tensorx.memregion import MemoryRegion, RegionDescriptor

if TYPE_CHECKING:
    from tensorx._analyzer.plan import TransferPlan
    from tensorx.node import Node

__all__ = ["SharedArenas", "plan_obstacle"]

logger = logging.getLogger(__name__)

NOT_OFFERED = ("the server did not offer it (its mode is not sync, it runs with "
               "share_memory=False, or its arenas are not in shared memory)")


def plan_obstacle(plan: TransferPlan, device: str) -> str:
    """Why this plan on this device cannot be mapped at all; "" when it can."""
    if device != "cpu":
        return f"the model is on {device} (only host memory is mapped)"
    buffers = [e.name for e in plan.entries if e.role != "param"]
    if buffers:
        return (f"the plan carries buffers ({buffers[0]}, ...) that every worker's forward "
                "pass would update in the one shared arena")
    for name, chunks in plan.tensors().items():
        if len({c.shard for c in chunks}) > 1:
            return f"{name} is split across shards"
    if not host_id():
        return f"{SHM_DIR} is not usable here"
    return ""


class SharedArenas:
    """Which shards' arenas the model is bound to, and the swaps between them and copies."""

    def __init__(self, plan: TransferPlan, rank: int, enabled: bool, device: str) -> None:
        self.plan = plan
        self.rank = rank
        self.obstacle = "share_memory=False" if not enabled else plan_obstacle(plan, device)
        self.mapped = [False] * plan.num_shards
        self._attached: dict[int, tuple[MemoryRegion, MemoryRegion]] = {}
        self._warned = False  # about an edit in place

    @property
    def wanted(self) -> bool:
        """Ask the shards for mapping (hello ``share``)?"""
        return not self.obstacle

    def map(self, binding: Binding, welcomes: list[dict[str, Any]], node: Node) -> Binding:
        """Map what the welcomes offer (with ``node.attach``); return the binding the model
        now has."""
        assert not self._attached, "unmap before mapping again"
        if self.obstacle:
            logger.info("worker rank %d: arenas not mapped, copying: %s", self.rank,
                        self.obstacle)
            return binding
        for shard, welcome in enumerate(welcomes):
            try:
                self._attached[shard] = self._attach(shard, welcome, node)
            except (TensorxError, _NotMapped) as exc:
                logger.info("worker rank %d: shard %d's arenas not mapped, copying: %s",
                            self.rank, shard, exc)
                continue
            logger.info("worker rank %d mapped shard %d's arenas (same host, zero-copy)",
                        self.rank, shard)
        if not self._attached:
            return binding
        regions = _arenas(binding)
        replaced = [regions[(s, a)] for s in self._attached for a in ARENAS]
        for s, pair in self._attached.items():
            regions.update(zip([(s, a) for a in ARENAS], pair, strict=True))
            self.mapped[s] = True
        new = _rebind(binding, regions, init="arena")
        for region in replaced:
            region.close()
        return new

    def unmap(self, binding: Binding) -> Binding:
        """Rebind mapped shards to private memory (a copy of the values); return the binding."""
        if not self._attached:
            return binding
        regions = _arenas(binding)
        for s in self._attached:
            for a in ARENAS:
                regions[(s, a)] = MemoryRegion.allocate(self.plan.arena_bytes(s))
        new = _rebind(binding, regions, init="tensor")
        for pair in self._attached.values():
            for region in pair:
                region.close()
        self._attached.clear()
        self.mapped = [False] * self.plan.num_shards
        return new

    def _attach(self, shard: int, welcome: dict[str, Any], node: Node
                ) -> tuple[MemoryRegion, MemoryRegion]:
        try:
            offer = protocol.share_offer(welcome)
            if offer is None:
                raise _NotMapped(NOT_OFFERED)
            params, slot = (RegionDescriptor.from_bytes(offer[k]) for k in ("params", "slot"))
        except ProtocolError as exc:
            raise _NotMapped(str(exc)) from exc
        nbytes = self.plan.arena_bytes(shard)
        for desc in (params, slot):
            if desc.nbytes != nbytes:
                raise _NotMapped(f"the server offers {desc.nbytes} B, the plan needs "
                                 f"{nbytes} B")
        # the parameters copy-on-write: an edit of the model in place stays ours (refresh)
        mapped = node.attach(params, private=True)
        try:
            return mapped, node.attach(slot)
        except BaseException:
            mapped.close()
            raise

    def refresh(self, shard: int) -> None:
        """Before reading a pull from a mapped shard: drop what this process wrote into the
        parameters in place (copy-on-write pages), so the model holds the shard's update,
        exactly as a copied pull would overwrite such an edit. The shard and the other
        workers never saw it."""
        if shard not in self._attached:
            return  # nothing of the shard's is mapped here (a claim the shard will refuse)
        edited = self._attached[shard][0].drop_own_writes()  # -1: unknown, all dropped
        if edited > 0 and not self._warned:
            self._warned = True
            logger.warning("worker rank %d: the model's parameters were edited in place "
                           "(%s of shard %d's arena); the edit is dropped at this pull, as "
                           "on the copy path, and never reached the server", self.rank,
                           f"{edited} page(s)", shard)


class _NotMapped(Exception):
    """A reason not to map that is no error (the server did not offer, another host)."""


def _arenas(binding: Binding) -> dict[tuple[int, str], MemoryRegion]:
    return {k: r for k, r in binding.regions.items() if k[1] in ARENAS}


def _rebind(binding: Binding, regions: dict[tuple[int, str], MemoryRegion],
            init: str) -> Binding:
    binding.unbind(close_regions=False)
    return Binding(binding.plan, binding.model, regions=regions,
                   densify_sparse=binding.densify_sparse, init=init)
