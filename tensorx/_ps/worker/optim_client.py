"""A worker's side of the optimizer state of :class:`tensorx.RemoteOptimizer`: every shard's
state fetched (``state_dict``), or loaded into every shard or none (``load_state_dict``).

The tensors never ride on the control channel (see :mod:`tensorx._ps.wire.optim_state`): a
fetch reads the region the shard lends (``state_get``, ``state``, the read, ``state_done``)
after checking its size and manifest against the shard's parameters; a load lends each
shard its packed part, read-only, in two phases (see :mod:`tensorx._ps.service.optim_load`): every
shard reads and checks its part (``state_put``, ``state_checked``), then all of them load
it, or, when one refused, all of them drop it (``state_commit``, ``state_loaded``).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from tensorx._ps.update.optim import plan_params
from tensorx._ps.wire import optim_state, protocol
from tensorx._ps.wire.hyper import heard
from tensorx._ps.worker.links import ShardLinks
from tensorx.errors import ProtocolError, TensorxError
from tensorx.memregion import MemoryRegion, RegionDescriptor
from tensorx.node import Node

if TYPE_CHECKING:
    from tensorx._analyzer.plan import TransferPlan

__all__ = ["OptimStates"]

Fetched = tuple[dict[str, Any], optim_state.State]  # (manifest, state by entry label)


class OptimStates:
    """The optimizer-state exchange of one worker with its shards, over its ``links``;
    ``node`` exports what a load lends."""

    def __init__(self, links: ShardLinks, node: Node) -> None:
        self._links = links
        self._node = node

    async def fetch(self, num_shards: int, plan: TransferPlan, timeout: float | None
                    ) -> list[Fetched]:
        """Every shard's optimizer state: (manifest, state by entry label) per shard."""
        return list(await asyncio.gather(*(self._fetch(s, plan, timeout)
                                           for s in range(num_shards))))

    async def _fetch(self, shard: int, plan: TransferPlan, timeout: float | None) -> Fetched:
        ep = self._links.eps[shard]
        with self._links.naming(shard):
            await ep.notify(protocol.encode("state_get"), timeout=timeout)
            msg = await self._links.expect(shard, "state", timeout)
            desc = RegionDescriptor.from_bytes(msg["region"])
            numels = {e.label: e.numel for e in plan_params(plan) if e.shard == shard}
            if desc.nbytes > optim_state.bound(numels) + optim_state.ALIGN:
                raise ProtocolError(f"shard {shard} lends {desc.nbytes} B of optimizer state, "
                                    "more than its parameters can have")
            optim_state.check_manifest(msg["manifest"], numels, desc.nbytes)
            region = MemoryRegion.allocate(desc.nbytes)
            try:
                await ep.read(region, desc, timeout=timeout)
                state = optim_state.unpack(msg["manifest"], region)
            finally:
                region.close()
            await ep.notify(protocol.encode("state_done"), timeout=timeout)
        return msg["manifest"], state

    async def load(self, num_shards: int, hps: list[dict[str, Any]],
                   states: list[optim_state.State], timeout: float | None) -> None:
        """Load ``states[s]`` into shard ``s``'s optimizer with the groups' ``hps``: into
        every shard, or (the first shard's error) into none. The group values last heard
        from each shard that answered the commit (its link's ``hyper``; ``[]``: its
        optimizer has no groups) become what it reports, even when another shard's error
        is raised."""
        packed = [optim_state.pack(state) for state in states]
        regions = [p.region() for p in packed]
        try:
            checked = await asyncio.gather(*(self._put(s, hps, packed[s], regions[s], timeout)
                                             for s in range(num_shards)),
                                           return_exceptions=True)
            refused = [r for r in checked if isinstance(r, BaseException)]
            done = await asyncio.gather(*(self._commit(s, not refused, timeout)
                                          for s, r in enumerate(checked)
                                          if not isinstance(r, BaseException)),
                                        return_exceptions=True)
        finally:
            for region in regions:
                region.close()
        for result in (*refused, *done):
            if isinstance(result, BaseException):
                raise result

    async def _put(self, shard: int, hps: list[dict[str, Any]], packed: optim_state.Packed,
                   region: MemoryRegion, timeout: float | None) -> None:
        """Phase one: ``shard`` has read and checked its part (see _ps.service.optim_load)."""
        groups = [{"hp": hp, "params": []} for hp in hps] if self._links.shards[shard].hyper else []
        desc = self._node.export(region, access="r")
        with self._links.naming(shard):
            await self._links.eps[shard].notify(protocol.encode(
                "state_put", manifest=packed.manifest(groups), region=desc.to_bytes(),
                digest=optim_state.digest(region)), timeout=timeout)
            await self._links.expect(shard, "state_checked", timeout)

    async def _commit(self, shard: int, load: bool, timeout: float | None) -> None:
        """Phase two: load it (every shard checked its part) or drop it."""
        with self._links.naming(shard):
            await self._links.eps[shard].notify(protocol.encode("state_commit", load=load),
                                                timeout=timeout)
            try:
                msg = await self._links.expect(shard, "state_loaded", timeout)
            except TensorxError:
                if load:
                    raise
                return  # dropped, as asked: the refusal that made us ask is raised instead
        link = self._links.shards[shard]
        if link.hyper:
            link.hyper = heard(shard, link.hyper, msg["hyper"])
