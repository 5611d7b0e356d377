"""A shard's answer to its workers: the new parameters, and the notification with them.

A worker that copies gets the parameter arena written into its own (one-sided); one that
mapped the shard's arena (same host) only gets the notification. With a flat shard in
several parts (:mod:`tensorx._ps.parts`) the update is applied part by part, in a thread
(torch releases the GIL), and each finished part is already on its way while the next is
computed; the notification travels with the last part, so a worker never sees it before
every part has landed.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from tensorx.endpoint import Endpoint
from tensorx.memregion import MemoryRegion, RegionDescriptor

__all__ = ["Peer", "apply_in_parts", "last_part", "send_params"]


@dataclass
class Peer:
    """A worker as one shard sees it."""

    rank: int
    ep: Endpoint
    params: RegionDescriptor
    step: int = 0
    offered: bool = False  # we offered it our arenas in /dev/shm
    mapped: bool = False   # it said it mapped them: its arena is ours, nothing to write


async def apply_in_parts(state: Any, ranks: list[int], copies: list[Peer],
                         timeout: float | None) -> dict[int, list[asyncio.Future[None]]]:
    """Apply ``state``'s update part by part and start writing each finished part to
    ``copies``; all but the last part, which :func:`send_params` sends with the
    notification. Returns the writes in flight, by rank."""
    sending: dict[int, list[asyncio.Future[None]]] = {p.rank: [] for p in copies}
    last = state.num_parts - 1
    for k in range(last + 1):
        try:
            await asyncio.to_thread(state.apply_part, ranks, k)
        except BaseException:  # the parts on their way are waited for, their errors dropped
            await asyncio.gather(*(f for fs in sending.values() for f in fs),
                                 return_exceptions=True)
            raise
        if k == last:
            break
        off, nbytes = state.part_bytes(k)
        for peer in copies:
            sending[peer.rank].append(asyncio.ensure_future(peer.ep.write(
                state.params_region, peer.params, off, off, nbytes, timeout=timeout)))
    state.finish_update()
    return sending


def last_part(state: Any) -> tuple[int, int]:
    """(offset, nbytes) of the part :func:`send_params` sends after :func:`apply_in_parts`."""
    return state.part_bytes(state.num_parts - 1)  # type: ignore[no-any-return]


async def send_params(region: MemoryRegion, peer: Peer, msg: bytes,
                      sent: list[asyncio.Future[None]] | None, last: tuple[int, int],
                      timeout: float | None) -> None:
    """The new parameters in ``region`` (or, after :func:`apply_in_parts`, their ``last``
    part; nothing for a mapped worker) with ``msg`` as the notification, ordered after every
    part sent before. Raises the first error of any of the writes."""
    ops: list[tuple[Any, ...]] = []
    if sent is not None:
        off, nbytes = last
        ops = [(region, peer.params, off, off, nbytes)]
    elif not peer.mapped:
        ops = [(region, peer.params)]
    results = await asyncio.gather(peer.ep.write_many(ops, notify=msg, timeout=timeout),
                                   *(sent or []), return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result
