"""A UCX peer killed while our event loop has not noticed yet (SIGKILL; its end of the
control socket and UCX's error callback not read): what we do next, ops, closing the
regions it may hold, closing the node, raises tensorx errors, never hangs, frees what it
held and logs no ERROR (a peer dying is expected; it is a WARNING)."""

from __future__ import annotations

import asyncio
import gc
import logging

import numpy as np
import pytest

import tensorx as tx
from tensorx.testing import OwnerProcess, wait_until

pytest.importorskip("ucxx")

pytestmark = pytest.mark.ucx

EXPECTED = (tx.BrokenError, tx.ClosedError, tx.TimeoutError)
STEPS = ["ops", "close-regions", "close-node"]


async def _ops(ep: tx.Endpoint, mine: list[tx.MemoryRegion],
               descs: list[tx.RegionDescriptor], new: tx.RegionDescriptor) -> list[object]:
    """Every kind of op at once to the dead peer, each within its own timeout: on regions
    our lane reaches already, and on one it must ask the owner about first."""
    pairs = list(zip(mine, descs, strict=True))
    calls = [ep.write(mine[0], descs[0], timeout=10), ep.read(mine[1], descs[1], timeout=10),
             ep.write(mine[0], new, timeout=10), ep.read(mine[1], new, timeout=10),
             ep.write_many(pairs, timeout=10), ep.write_many(pairs, notify=b"x", timeout=10),
             ep.notify(b"y", timeout=10), ep.query("exports", timeout=10)]
    return await asyncio.gather(*calls, return_exceptions=True)


@pytest.mark.parametrize("first", STEPS)
async def test_a_ucx_peer_killed_unnoticed_leaves_errors_to_callers_and_none_logged(
        first: str, caplog: pytest.LogCaptureFixture) -> None:
    """The owner reaches our exports over UCX (so closing them waits for its revoke ack
    or its end) and we reach its over UCX; it is killed, then at once: every kind of op,
    our regions closed, the node closed, in each order. Each op raises BrokenError,
    ClosedError or TimeoutError; our closed regions are released; nothing is logged as an
    ERROR, also once collected (a failed future nobody retrieved is logged then)."""
    caplog.set_level(logging.WARNING)
    got: list[object] = []
    async with OwnerProcess("ucx") as owner, tx.Node(transport="ucx") as node:
        mine = [tx.MemoryRegion.register(np.zeros(4096, np.uint8)) for _ in range(2)]
        exported = [node.export(r) for r in mine]
        descs = [await owner.export(4096) for _ in range(3)]
        new = descs.pop()  # no op of ours has used it yet
        ep = await node.connect(owner.address, timeout=20)
        theirs = await owner.connect(node.address)
        await wait_until(lambda n=node: len(n.endpoints) == 2, what="both endpoints")
        assert ep.transport == "ucx" and all(e.bypassed for e in node.endpoints)
        for region, desc, ours in zip(mine, descs, exported, strict=True):
            await ep.write(region, desc, timeout=10)
            await ep.read(region, desc, timeout=10)
            assert (await owner.transfer(theirs, "write", ours))["ok"]
        owner.kill()  # blocking: the process is gone before this loop runs again
        for step in STEPS[STEPS.index(first):] + STEPS[:STEPS.index(first)]:
            if step == "ops":
                got = await _ops(ep, mine, descs, new)
            elif step == "close-regions":
                for region in mine:
                    region.close()
            else:
                await node.aclose()
        assert len(got) == 8 and [g for g in got if not isinstance(g, EXPECTED)] == [], got
        assert node._peers.held == {} and node.endpoints == []
    del ep, node, got
    gc.collect()  # a future nobody retrieved is logged as it is collected
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []
