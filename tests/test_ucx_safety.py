"""UCX under attack by a peer that passed the handshake (issue #16): the owner runs in a
child process, so a crash shows up as a dead child instead of taking the test down; every
test then checks that the owner is alive and still serves an honest peer, byte for byte."""

from __future__ import annotations

import asyncio
import contextlib

import numpy as np
import pytest

import tensorx as tx
from tensorx.testing import OwnerProcess, digest, pattern

pytest.importorskip("ucxx")

pytestmark = pytest.mark.ucx


async def _serves_an_honest_peer(owner: OwnerProcess, desc: tx.RegionDescriptor) -> None:
    assert owner.alive, "the owner process died"
    async with tx.Node(listen=None, transport="ucx") as node:
        ep = await node.connect(owner.address, timeout=20)
        data = pattern(desc.nbytes, seed=7)
        await ep.write(tx.MemoryRegion.register(data), desc)
        back = np.zeros_like(data)
        await ep.read(tx.MemoryRegion.register(back), desc)
        assert np.array_equal(back, data)
        assert await owner.call("digest", desc.region_id) == digest(data)
        assert await owner.call("guards_intact")
        assert await owner.call("endpoints") == 1  # this one: every attacker was refused


@pytest.mark.parametrize("garbage", ["ff", "truncated", "empty"])
async def test_a_garbage_worker_address_is_refused_and_the_owner_keeps_serving(
        garbage: str) -> None:
    """Item 1: b'\\xff' * 64 made libucp abort the owner (SIGABRT, an assertion on the
    address version); an empty address was taken as 'no UCX' and the peer served."""
    async with OwnerProcess("ucx") as owner:
        desc = await owner.export(4096, seed=1)
        async with tx.Node(listen=None, transport="ucx") as liar:
            real = liar._factory.local_info()  # type: ignore[union-attr]
            address = real["worker_address"]
            bad = {"ff": b"\xff" * 64, "truncated": address[:len(address) // 2],
                   "empty": b""}[garbage]
            liar._factory.local_info = lambda: {**real, "worker_address": bad}  # type: ignore
            with contextlib.suppress(tx.TensorxError):
                await liar.connect(owner.address, timeout=20)
                # the owner refuses once it has looked at the address: the link closes
                await asyncio.wait_for(liar.disconnected.get(), 20)
        await _serves_an_honest_peer(owner, desc)
