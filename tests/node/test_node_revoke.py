"""What a peer can make its owner hold by not acknowledging revocations is bounded: over a
lane that reaches the owner's memory without it (UCX, CMA), a peer that has not acknowledged
a revocation within the owner's timeout is cut off and the memory let go, while the owner's
other peers keep being served."""

from __future__ import annotations

import time

import pytest

import tensorx as tx
from tensorx.testing import OwnerProcess, digest, pattern, wait_until
from tests.support.lanes import assert_lane, lanes, node_transport

DEADLINE = 1.0  # the owner's timeout: how long a peer has to acknowledge a revocation


async def _held(owner: OwnerProcess) -> int:
    held: int = await owner.call("held")
    return held


async def _gone(owner: OwnerProcess) -> bool:
    return await _held(owner) == 0


@pytest.mark.parametrize("lane", [lane for lane in lanes() if lane != "tcp"])
async def test_a_peer_that_never_acknowledges_a_revocation_is_cut_off_and_the_memory_let_go(
        lane: str) -> None:
    async with OwnerProcess(node_transport(lane), node_options={"timeout": DEADLINE}) as owner, \
            tx.Node(listen=None, transport=node_transport(lane)) as silent_node, \
            tx.Node(listen=None, transport=node_transport(lane)) as honest_node:
        silent = await silent_node.connect(owner.address)
        honest = await honest_node.connect(owner.address)
        assert_lane(silent, lane)
        assert_lane(honest, lane)
        desc = tx.RegionDescriptor.from_bytes(await owner.call("export_allocated", 4096, 1))
        for ep in (silent, honest):  # both may reach the memory: both are asked to ack
            await ep.write(tx.MemoryRegion.register(pattern(4096, 2)), desc, nbytes=8)
        silent._channel.revoke_ack = lambda *_: None  # type: ignore[method-assign]  # never acks
        await owner.call("close_region", desc.region_id)
        await silent.query("exports")  # the revocation is ahead of the answer: it reached us
        started = time.monotonic()
        assert await _held(owner) == 1, "released before the silent peer acknowledged"

        await wait_until(lambda: _gone(owner), timeout=10 * DEADLINE, what="the memory let go")
        assert time.monotonic() - started >= DEADLINE / 2, "cut off before its deadline"
        await wait_until(lambda: silent.closed, what="the silent peer cut off")
        with pytest.raises(tx.BrokenError):
            await silent.query("exports")
        warnings = await owner.call("warnings")
        assert any("did not acknowledge" in w and silent_node.id in w for w in warnings), \
            warnings

        assert not honest.closed, "the honest peer was cut off too"
        fresh = await owner.export(4096, seed=4)
        await honest.write(tx.MemoryRegion.register(pattern(4096, 5)), fresh)
        assert await owner.call("digest", fresh.region_id) == digest(pattern(4096, 5))

