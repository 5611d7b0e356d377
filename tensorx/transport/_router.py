"""An endpoint's lanes seen as one: each op goes to the fastest lane that carries it.

``auto.py`` opens the lanes (fastest first: same-host lanes, then the lane between hosts,
then the TCP lane, which carries every op); this lane routes among them. A batch whose ops
go to several lanes is issued on each at once and completes when all have; a flush flushes
every lane, so a notification still never overtakes the data of earlier writes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Sequence
from typing import Any

from tensorx._deadline import Deadline
from tensorx.transport.base import DataLane, Op

__all__ = ["Router"]


class Router(DataLane):
    """``lanes``: fastest first, the last carries every op. ``network``: the one of them
    between hosts whose ``info`` heads ``ep.info`` (the same-host lanes add their keys)."""

    def __init__(self, lanes: Sequence[DataLane], network: DataLane) -> None:
        self.lanes = list(lanes)
        self._choosers = self.lanes[:-1]  # the last carries every op: never asked
        self.network = network
        self.name = network.name
        self.rdma = network.rdma
        self.bypasses_owner = any(lane.bypasses_owner for lane in self.lanes)

    @property
    def info(self) -> dict[str, Any]:
        """The network lane's info, with the keys of the same-host lanes in front of it
        (the fastest wins); ``"lanes"`` names every lane that carries data, fastest first:
        the TCP lane behind UCX only where it carries GPU memory UCX cannot (UCX's ``gpu``
        says so)."""
        network = self.network.info
        info = dict(network)
        ahead = self.lanes[:self.lanes.index(self.network)]
        for lane in reversed(ahead):
            info.update(lane.info)
        names = [name for lane in ahead for name in lane.info.get("lanes", [])]
        names += network.get("lanes", [])
        if self.lanes[-1] is not self.network and "gpu" in network:
            names += self.lanes[-1].info.get("lanes", [])
        info["lanes"] = names
        return info

    def _lane(self, op: Op) -> DataLane:
        for lane in self._choosers:
            if lane.carries(op):
                return lane
        return self.lanes[-1]

    def _split(self, ops: Sequence[Op]) -> dict[DataLane, list[Op]]:
        by_lane: dict[DataLane, list[Op]] = {}
        for op in ops:
            by_lane.setdefault(self._lane(op), []).append(op)
        return by_lane

    # write and read hand over the chosen lane's coroutine itself: no frame of their own on
    # the small-op path (an 8-byte same-host write takes a few microseconds in all)
    def write(self, op: Op, *, timeout: float | None) -> Coroutine[Any, Any, None]:
        for lane in self._choosers:  # (_lane, inlined)
            if lane.carries(op):
                return lane.write(op, timeout=timeout)
        return self.lanes[-1].write(op, timeout=timeout)

    def read(self, op: Op, *, timeout: float | None) -> Coroutine[Any, Any, None]:
        for lane in self._choosers:
            if lane.carries(op):
                return lane.read(op, timeout=timeout)
        return self.lanes[-1].read(op, timeout=timeout)

    async def write_many(self, ops: Sequence[Op], *, timeout: float | None) -> None:
        by_lane = self._split(ops)
        if len(by_lane) == 1:
            lane, mine = next(iter(by_lane.items()))
            await lane.write_many(mine, timeout=timeout)
            return
        await asyncio.gather(*(lane.write_many(mine, timeout=timeout)
                               for lane, mine in by_lane.items()))

    async def write_notify(self, ops: Sequence[Op], payload: bytes, *,
                           timeout: float | None) -> bool:
        by_lane = self._split(ops)
        if len(by_lane) != 1:
            return False  # the endpoint writes, flushes every lane and notifies
        lane, mine = next(iter(by_lane.items()))
        deadline = Deadline(timeout)
        await self._flush_others(lane, deadline)
        return await lane.write_notify(mine, payload, timeout=deadline.left())

    async def write_then_notify(self, ops: Sequence[Op], payload: bytes, *,
                                timeout: float | None) -> bool:
        by_lane = self._split(ops)  # (once: write_notify then write_many would split twice)
        if len(by_lane) != 1:
            await asyncio.gather(*(lane.write_many(mine, timeout=timeout)
                                   for lane, mine in by_lane.items()))
            return False
        lane, mine = next(iter(by_lane.items()))
        deadline = Deadline(timeout)
        await self._flush_others(lane, deadline)
        return await lane.write_then_notify(mine, payload, timeout=deadline.left())

    async def _flush_others(self, lane: DataLane, deadline: Deadline) -> None:
        """Earlier ops still in flight on the lanes other than ``lane`` land first: a
        notification ``lane`` carries with its data must not overtake them."""
        for other in self.lanes:
            if other is not lane:
                await other.flush(timeout=deadline.left())

    async def flush(self, *, timeout: float | None) -> None:
        for lane in self.lanes:
            await lane.flush(timeout=timeout)

    async def aclose(self) -> None:
        try:
            await asyncio.gather(*(lane.aclose() for lane in self.lanes))
        finally:
            self.abort()

    def abort(self) -> None:
        for lane in self.lanes:
            lane.abort()

    def peer_gone(self, why: str) -> None:
        for lane in self.lanes:
            lane.peer_gone(why)
