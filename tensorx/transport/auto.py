"""Choosing an endpoint's lanes by what both peers can do, never by name.

A node holds its lane factories fastest first (:attr:`Capabilities.rank`); the last one is
the TCP lane, which every pair of nodes can use and which carries every op. For each new
endpoint :func:`choose` opens

* the **lane between hosts**: the first factory that is not same-host-only and opens (UCX
  where both peers offer it, else TCP);
* every **same-host lane** both peers can use (CUDA IPC for GPU memory, CMA for host
  memory), in front of it;
* the TCP lane behind it, where it is not already the lane between hosts, for what no
  faster lane carries (GPU memory a UCX without CUDA cannot move);

and hands the endpoint one lane that sends each op to the fastest of them that carries it
(:class:`~tensorx.transport._router.Router`). Why a factory was not used is kept per factory
(``ep.info["skipped"]``), its gist in the endpoint's ``why`` (and ``host``).
``require`` makes a lane between hosts that does not meet it an error instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tensorx._deadline import Deadline
from tensorx._text import gist
from tensorx.errors import TransportUnavailableError
from tensorx.transport._router import Router
from tensorx.transport.base import DataLane, LaneFactory, Link

__all__ = ["REQUIREMENTS", "Choice", "choose", "meets"]

REQUIREMENTS = (None, "ucx", "rdma")


@dataclass
class Choice:
    """An endpoint's lanes: ``lane`` routes among them; ``notes`` go into ``ep.info``
    (why the lane between hosts is what it is, why there is no same-host lane);
    ``skipped``: factory name -> why its lane is not used."""

    lane: DataLane
    notes: dict[str, str]
    skipped: dict[str, str]


def meets(require: str | None, factory: LaneFactory, lane: DataLane) -> bool:
    """``require="ucx"``: a one-sided lane between hosts; ``"rdma"``: one on RDMA hardware."""
    if require is None:
        return True
    one_sided = factory.caps.one_sided and not factory.caps.same_host
    return one_sided and (require == "ucx" or lane.rdma)


async def choose(factories: Sequence[LaneFactory], link: Link, *, require: str | None,
                 strict: bool, skipped: dict[str, str], timeout: float | None) -> Choice:
    """Open the lanes of one endpoint (see the module docstring). ``factories``: fastest
    first, TCP last. ``strict``: a factory whose peer offered it and that fails to open is
    an error, not a reason to use the next one. ``skipped``: why factories the node could
    not start are absent."""
    return await _Chooser(link, skipped, timeout).choose(factories, require, strict)


class _Chooser:
    def __init__(self, link: Link, skipped: dict[str, str], timeout: float | None) -> None:
        self.link = link
        self.deadline = Deadline(timeout)
        self.notes: dict[str, str] = {}
        self.skipped = dict(skipped)

    async def choose(self, factories: Sequence[LaneFactory], require: str | None,
                     strict: bool) -> Choice:
        network = [f for f in factories if not f.caps.same_host]
        factory, lane = await self._between_hosts(network, strict)
        lanes = [lane]
        try:
            self._check(require, factory, lane)
            for other in factories:
                near = await self._try(other) if other.caps.same_host else None
                if near is not None:
                    lanes.insert(lanes.index(lane), near)
            if factory is not network[-1]:  # what no faster lane carries goes over TCP
                lanes.append(await network[-1].open_lane(self.link,
                                                         timeout=self.deadline.left()))
        except BaseException:
            for each in lanes:
                each.abort()
            raise
        return Choice(lane if len(lanes) == 1 else Router(lanes, lane), self.notes,
                      self.skipped)

    async def _between_hosts(self, network: Sequence[LaneFactory],
                             strict: bool) -> tuple[LaneFactory, DataLane]:
        """The first lane between hosts that opens; the last factory (TCP) always does."""
        for factory in network[:-1]:
            lane = await self._try(factory, strict)
            if lane is not None:
                return factory, lane
        last = network[-1]
        lane = await last.open_lane(self.link, timeout=self.deadline.left())
        if self.skipped:  # the gist: ``skipped`` has each reason whole
            reasons = "; ".join(f"{name}: {gist(why)}" for name, why in self.skipped.items())
            self.notes["why"] = f"{lane.name} ({reasons})"
        return last, lane

    async def _try(self, factory: LaneFactory, strict: bool = False) -> DataLane | None:
        """The factory's lane, or None having noted why not."""
        try:
            return await factory.open_lane(self.link, timeout=self.deadline.left())
        except TransportUnavailableError as exc:
            if strict and self.link.offer(factory.name) is not None:
                raise
            self.skipped[factory.name] = str(exc)
            if factory.note:
                self.notes[factory.note] = str(exc)
            return None

    def _check(self, require: str | None, factory: LaneFactory, lane: DataLane) -> None:
        if meets(require, factory, lane):
            return
        info = {**lane.info, **self.notes}
        reasons = "; ".join(f"{name}: {why}" for name, why in self.skipped.items())
        raise TransportUnavailableError(
            f"require={require!r} but this endpoint would use {lane.name} over "
            f"{', '.join(info['lanes']) or 'no lanes'} ({reasons or info['why']})")
