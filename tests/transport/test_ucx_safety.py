"""UCX under attack by a peer that passed the handshake (issue #16): the owner runs in a
child process, so a crash shows up as a dead child instead of taking the test down; every
test then checks that the owner is alive and still serves an honest peer, byte for byte."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Awaitable, Callable

import numpy as np
import pytest

import tensorx as tx
from tensorx.testing import OwnerProcess, digest, pattern, wait_until

pytest.importorskip("ucxx")

pytestmark = pytest.mark.ucx


async def _serves_an_honest_peer(owner: OwnerProcess, desc: tx.RegionDescriptor,
                                 transport: str = "ucx", others: int = 0) -> None:
    assert owner.alive, "the owner process died"
    async with tx.Node(listen=None, transport=transport) as node:
        ep = await node.connect(owner.address, timeout=20)
        data = pattern(desc.nbytes, seed=7)
        await ep.write(tx.MemoryRegion.register(data), desc)
        back = np.zeros_like(data)
        await ep.read(tx.MemoryRegion.register(back), desc)
        assert np.array_equal(back, data)
        assert await owner.call("digest", desc.region_id) == digest(data)
        assert await owner.call("guards_intact")
        # this one and the honest ``others``: every attacker was refused
        assert await owner.call("endpoints") == 1 + others


@pytest.mark.parametrize("garbage", ["ff", "truncated", "empty"])
async def test_a_garbage_worker_address_is_refused_and_the_owner_keeps_serving(
        garbage: str) -> None:
    """Item 1: b'\\xff' * 64 made libucp abort the owner (SIGABRT, an assertion on the
    address version); an empty address was taken as 'no UCX' and the peer served."""
    async with OwnerProcess("ucx") as owner:
        desc = await owner.export(4096, seed=1)
        async with tx.Node(listen=None, transport="ucx") as liar:
            ucx = next(f for f in liar._factories if f.name == "ucx")
            real = ucx.offer(b"")
            address = real["worker_address"]
            bad = {"ff": b"\xff" * 64, "truncated": address[:len(address) // 2],
                   "empty": b""}[garbage]
            ucx.offer = lambda binding: {**real, "worker_address": bad}  # type: ignore
            with contextlib.suppress(tx.TensorxError):
                await liar.connect(owner.address, timeout=20)
                # the owner refuses once it has looked at the address: the link closes
                await asyncio.wait_for(liar.disconnected.get(), 20)
        await _serves_an_honest_peer(owner, desc)


DEFAULTS = {"TENSORX_UCX_TCP": "0"}  # what a user gets: the suite itself allows UCX tcp


@pytest.mark.parametrize("forged", ["next-to-the-export", "address-0x10"])
async def test_a_forged_ucx_address_never_reaches_memory_outside_the_export(
        forged: str) -> None:
    """Item 16: a token holder edits the UCX address in a descriptor it was given. With
    UCX's tcp lanes (yesterday's default here) the owner's UCX wrote wherever the request
    said: into the guard bytes after the export, or at 0x10, which killed the owner. By
    default the owner now runs no UCX tcp, so the peer's ops take tensorx's TCP lane,
    where the owner checks id, cookie, rights and bounds itself."""
    async with OwnerProcess("auto", env=DEFAULTS) as owner:
        desc = await owner.export(4096, seed=1)
        ucx = dict(desc.keys.get("ucx") or {"addr": 0, "rkey": b"\x00" * 8})
        ucx["addr"] = ucx["addr"] + 4096 if forged == "next-to-the-export" else 0x10
        forged_desc = dataclasses.replace(desc, keys={**desc.keys, "ucx": ucx})
        async with tx.Node(listen=None, transport="auto") as attacker:
            ep = await attacker.connect(owner.address, timeout=20)
            data = pattern(4096, seed=9)
            with contextlib.suppress(tx.TensorxError):
                await ep.write(tx.MemoryRegion.register(data), forged_desc, timeout=10)
            assert owner.alive, "a forged write killed the owner"
            assert await owner.call("guards_intact"), "a forged write landed outside the export"
            # the owner says which lane it gives this peer, and why
            seen = (await ep.query("endpoints"))["endpoints"]
            assert [e["transport"] for e in seen] == ["tcp"]
            assert "tcp" in seen[0]["why"] and "UCX" in seen[0]["why"]
        await _serves_an_honest_peer(owner, desc, transport="auto")


async def test_by_default_ucx_refuses_to_start_its_tcp_and_require_rdma_fails_loudly() -> None:
    """With the defaults, on a host without RDMA: no UCX tcp (not even when UCX_TLS asks
    for it), so ``transport="ucx"`` and ``require="rdma"`` fail with the reason; ``auto``
    uses tensorx's TCP."""
    async with OwnerProcess("auto", env=DEFAULTS) as owner:
        assert owner.address.startswith("tcp://")  # no UCX data transport offered
    for transport, options in (("ucx", {}), ("auto", {"require": "rdma"})):
        with pytest.raises(RuntimeError, match=r"TransportUnavailableError.*tcp"):
            async with OwnerProcess(transport, env=DEFAULTS, node_options=options):
                pass
    with pytest.raises(RuntimeError, match=r"TransportUnavailableError.*trusted network"):
        async with OwnerProcess("ucx", env={**DEFAULTS, "UCX_TLS": "tcp"}):
            pass


async def test_a_write_in_flight_never_lands_in_a_fresh_region() -> None:
    """Item 17: an honest peer's large UCX write is in flight when the owner closes the
    region and exports a fresh one of the same size. The owner used to free the memory at
    once: it died (SIGSEGV inside UCX) or the old write landed in the new region. Now the
    old memory stays until the peer acknowledged the revocation."""
    nbytes = 256 << 20
    async with OwnerProcess("ucx") as owner, tx.Node(listen=None, transport="ucx") as node:
        ep = await node.connect(owner.address, timeout=20)
        assert ep.info["transport"] == "ucx"
        old = tx.RegionDescriptor.from_bytes(await owner.call("export_allocated", nbytes, 1))
        data = tx.MemoryRegion.register(pattern(nbytes, seed=2))
        await ep.write(data, old, nbytes=8)  # the descriptor is validated: the next write
        writing = asyncio.create_task(ep.write(data, old, timeout=60))  # is issued at once
        await asyncio.sleep(0)  # one loop turn: issued; UCX moves it for about a second
        fresh = tx.RegionDescriptor.from_bytes(await owner.call("replace", old.region_id, 3))
        with contextlib.suppress(tx.TensorxError):
            await writing
        assert owner.alive, "the owner died under the late write"
        assert await owner.call("digest", fresh.region_id) == digest(pattern(nbytes, 3)), \
            "the old write landed in the fresh region"
        await wait_until(released(owner), what="the peer's acknowledgement releasing it")
        small = await owner.export(4096, seed=4)
        await _serves_an_honest_peer(owner, small, others=1)


def released(owner: OwnerProcess) -> Callable[[], Awaitable[bool]]:
    async def nothing_held() -> bool:
        return await owner.call("held") == 0

    return nothing_held


async def test_a_peer_that_never_acknowledges_keeps_the_memory_held_until_it_leaves() -> None:
    """Item 17, bounded: the owner never frees memory a connected UCX peer has not
    released; once that peer is gone (its UCX endpoint closed) the memory is let go. (One
    that stays connected is cut off after the owner's timeout: tests/node/test_node_revoke.py.)"""
    async with OwnerProcess("ucx") as owner:
        desc = tx.RegionDescriptor.from_bytes(await owner.call("export_allocated", 4096, 1))
        async with tx.Node(listen=None, transport="ucx") as node:
            ep = await node.connect(owner.address, timeout=20)
            ep._channel.revoke_ack = lambda *_: None  # type: ignore  # a peer that never acknowledges
            await ep.write(tx.MemoryRegion.register(pattern(4096, 2)), desc)
            await owner.call("replace", desc.region_id, 3)
            await ep.query("exports")  # the revocation is ahead of the answer: it reached us
            with pytest.raises(tx.RegionError, match="closed"):
                await ep.write(tx.MemoryRegion.register(pattern(4096, 2)), desc)
            assert await owner.call("held") == 1
        await wait_until(released(owner), what="the memory let go once the peer left")
        assert owner.alive
