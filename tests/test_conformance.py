"""Transport conformance: real owner process, real sockets, every available backend."""

from __future__ import annotations

import asyncio
import contextlib

import numpy as np
import pytest

import tensorx as tx
from tensorx.testing import OwnerProcess, check_timed_out_reads, digest, pattern

from .conftest import lanes, node_transport

pytestmark = pytest.mark.parametrize("transport", lanes())


@contextlib.asynccontextmanager
async def session(transport: str, token: str | None = None):
    mode = node_transport(transport)
    async with OwnerProcess(mode, token=token) as owner, \
            tx.Node(listen=None, transport=mode, token=token) as node:
        ep = await node.connect(owner.address)
        if transport == "cma":
            assert ep.info["host"].startswith("cma"), ep.info["host"]
        else:
            assert ep.info["transport"] == transport
            assert not ep.info["host"].startswith("cma")
        yield owner, node, ep


@pytest.mark.parametrize("nbytes", [0, 1, 4096, 16 << 20, 256 << 20])
async def test_write_then_read_roundtrip(transport: str, nbytes: int) -> None:
    async with session(transport) as (owner, _, ep):
        desc = await owner.export(nbytes, seed=1)
        data = pattern(nbytes, seed=2)
        await ep.write(tx.MemoryRegion.register(data), desc)
        assert await owner.call("digest", desc.region_id) == digest(data)
        back = np.zeros(nbytes, np.uint8)
        await ep.read(tx.MemoryRegion.register(back), desc)
        assert np.array_equal(back, data)
        assert await owner.call("guards_intact")


async def test_partial_ranges_land_at_offsets(transport: str) -> None:
    async with session(transport) as (owner, _, ep):
        desc = await owner.export(1000, seed=3)
        src = np.arange(100, dtype=np.uint8)
        await ep.write(tx.MemoryRegion.register(src), desc, offset=10, remote_offset=500,
                       nbytes=50)
        out = np.zeros(1000, np.uint8)
        await ep.read(tx.MemoryRegion.register(out), desc)
        expected = pattern(1000, 3)
        expected[500:550] = src[10:60]
        assert np.array_equal(out, expected)


async def test_hundred_concurrent_ops(transport: str) -> None:
    async with session(transport) as (owner, _, ep):
        n, chunk = 100, 64 * 1024
        desc = await owner.export(n * chunk)
        src = pattern(n * chunk, seed=4)
        region = tx.MemoryRegion.register(src)
        await asyncio.gather(*(ep.write(region, desc, i * chunk, i * chunk, chunk)
                               for i in range(n)))
        out = np.zeros_like(src)
        dst = tx.MemoryRegion.register(out)
        await asyncio.gather(*(ep.read(dst, desc, i * chunk, i * chunk, chunk) for i in range(n)))
        assert np.array_equal(out, src)


async def test_write_many_is_one_completion(transport: str) -> None:
    async with session(transport) as (owner, _, ep):
        descs = [await owner.export(4096, seed=s) for s in range(3)]
        src = pattern(3 * 4096, seed=9)
        region = tx.MemoryRegion.register(src)
        await ep.write_many([(region, d, i * 4096, 0, 4096) for i, d in enumerate(descs)])
        for i, d in enumerate(descs):
            assert await owner.call("digest", d.region_id) == digest(src[i * 4096:(i + 1) * 4096])


async def test_notification_never_precedes_its_data(transport: str) -> None:
    async with session(transport) as (owner, node, ep):
        nbytes = 256 * 1024
        desc = await owner.export(nbytes)
        for seed in range(40):
            data = pattern(nbytes, seed=100 + seed)
            region = tx.MemoryRegion.register(data)
            writes = [asyncio.ensure_future(ep.write(region, desc, i, i, 4096))
                      for i in range(0, nbytes, 4096)]
            await asyncio.sleep(0)  # the writes start (are issued); none has completed yet
            await ep.notify(f"check:{desc.region_id}:{100 + seed}".encode())
            await asyncio.gather(*writes)
            assert (await asyncio.wait_for(node.notifications.get(), 10))[1] == b"checked"
        notes = await owner.call("notes")
        assert len([n for n in notes if n.startswith(b"check:")]) == 40
        assert await owner.call("violations") == []


async def test_notification_never_precedes_large_writes(transport: str) -> None:
    """Large writes (several MiB each, in flight together), issued and not awaited, then a
    notification: checked by the last byte of each write, fast enough to catch one that
    has not landed yet."""
    async with session(transport) as (owner, node, ep):
        nbytes, piece = 64 << 20, 8 << 20
        desc = await owner.export(nbytes)
        for value in range(1, 7):
            region = tx.MemoryRegion.register(np.full(nbytes, value, np.uint8))
            writes = [asyncio.ensure_future(ep.write(region, desc, i, i, piece))
                      for i in range(0, nbytes, piece)]
            await asyncio.sleep(0)
            await ep.notify(f"fill:{desc.region_id}:{value}:{piece}".encode())
            await asyncio.gather(*writes)
            assert (await asyncio.wait_for(node.notifications.get(), 10))[1] == b"checked"
        assert await owner.call("violations") == []


async def test_write_with_notify_delivers_after_the_data(transport: str) -> None:
    """``write(..., notify=)`` (write with immediate data): the notification arrives once
    the data is there, for one write and for write_many."""
    async with session(transport) as (owner, node, ep):
        nbytes, piece = 64 << 20, 8 << 20
        desc = await owner.export(nbytes)
        for value in (1, 2, 3):
            region = tx.MemoryRegion.register(np.full(nbytes, value, np.uint8))
            payload = f"fill:{desc.region_id}:{value}:{piece}".encode()
            if value == 2:
                await ep.write_many([(region, desc, i, i, piece)
                                     for i in range(0, nbytes, piece)], notify=payload)
            else:
                await ep.write(region, desc, notify=payload)
            assert (await asyncio.wait_for(node.notifications.get(), 10))[1] == b"checked"
        assert await owner.call("violations") == []
        assert ep.info["stats"]["notify"]["ops"] == 3


async def test_write_with_notify_is_silent_when_the_owner_refuses(transport: str) -> None:
    """A write the owner refuses (a forged right, in the first of two ops) raises, and its
    notification is never delivered; the endpoint keeps working."""
    import dataclasses

    async with session(transport) as (owner, _, ep):
        readonly = await owner.export(4096, access="r", seed=31)
        ok = await owner.export(4096, seed=32)
        forged = dataclasses.replace(readonly, access="rw")
        src = tx.MemoryRegion.register(pattern(4096, seed=33))
        with pytest.raises(tx.RegionError):
            await ep.write_many([(src, forged), (src, ok)], notify=b"must not arrive")
        await ep.write(src, ok, notify=b"arrives")
        for _ in range(100):
            notes = await owner.call("notes")
            if b"arrives" in notes:
                break
            await asyncio.sleep(0.05)
        assert b"arrives" in notes and b"must not arrive" not in notes
        assert await owner.call("digest", readonly.region_id) == digest(pattern(4096, 31))


async def test_notifications_flow_both_ways(transport: str) -> None:
    async with session(transport) as (owner, _, ep):
        await ep.notify(b"hello")
        for _ in range(100):  # delivery is asynchronous: poll, with a deadline
            if b"hello" in await owner.call("notes"):
                break
            await asyncio.sleep(0.05)
        assert b"hello" in await owner.call("notes")
        with pytest.raises(tx.UsageError):
            await ep.notify("not bytes")  # type: ignore[arg-type]


async def test_cancelled_write_leaves_endpoint_usable(transport: str) -> None:
    async with session(transport) as (owner, _, ep):
        desc = await owner.export(64 << 20)
        big = tx.MemoryRegion.register(pattern(64 << 20, seed=5))
        task = asyncio.ensure_future(ep.write(big, desc))
        await asyncio.sleep(0.005)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        small = pattern(4096, seed=6)
        await ep.write(tx.MemoryRegion.register(small), desc, nbytes=4096)
        out = np.zeros(4096, np.uint8)
        await ep.read(tx.MemoryRegion.register(out), desc, nbytes=4096)
        assert np.array_equal(out, small)


async def test_peer_killed_mid_transfer_raises_broken(transport: str) -> None:
    async with session(transport) as (owner, node, ep):
        desc = await owner.export(64 << 20)
        big = tx.MemoryRegion.register(np.zeros(64 << 20, np.uint8))

        async def hammer() -> None:
            while True:
                await ep.read(big, desc, timeout=20)

        task = asyncio.ensure_future(hammer())
        await asyncio.sleep(0.3)
        owner.kill()
        with pytest.raises(tx.BrokenError):
            await asyncio.wait_for(task, 25)
        with pytest.raises(tx.BrokenError):
            await ep.write(big, desc, nbytes=8)
        gone = await asyncio.wait_for(node.disconnected.get(), 5)
        assert gone is ep


async def test_timeout_is_a_tensorx_and_builtin_timeout(transport: str) -> None:
    async with session(transport) as (owner, _, ep):
        desc = await owner.export(256 << 20)
        big = tx.MemoryRegion.register(np.zeros(256 << 20, np.uint8))
        with pytest.raises(tx.TimeoutError) as info:
            await ep.read(big, desc, timeout=0.0001)
        assert isinstance(info.value, TimeoutError)


async def test_write_many_defaults_fill_the_rest(transport: str) -> None:
    async with session(transport) as (owner, _, ep):
        desc = await owner.export(64, seed=11)
        src = pattern(64, seed=12)
        region = tx.MemoryRegion.register(src)
        await ep.write_many([(region, desc, 32)])  # offset 32, remote 0, nbytes: the rest
        expected = pattern(64, 11)
        expected[:32] = src[32:]
        assert await owner.call("digest", desc.region_id) == digest(expected)
        with pytest.raises(tx.UsageError):
            await ep.write_many([(region,)])


async def test_region_closed_by_its_owner_is_refused_and_untouched(transport: str) -> None:
    async with session(transport) as (owner, _, ep):
        desc = await owner.export(4096, seed=21)
        src = tx.MemoryRegion.register(pattern(4096, seed=22))
        await ep.write(src, desc, nbytes=8)  # used (and, on UCX, validated) while open
        await owner.call("close_region", desc.region_id)
        await asyncio.sleep(0.2)  # the owner's revocation travels to us
        with pytest.raises(tx.RegionError, match="closed"):
            await ep.write(src, desc)
        with pytest.raises(tx.RegionError, match="closed"):
            await ep.read(src, desc)
        expected = pattern(4096, 21)
        expected[:8] = pattern(4096, 22)[:8]
        assert await owner.call("backing_digest", desc.region_id) == digest(expected)


async def test_connections_leak_no_fds(transport: str) -> None:
    """Connect, move bytes, close, five times: the owner ends with the fds it had after the
    first round (what a transport sets up once is not a leak; a UCX endpoint the owner kept
    after its peer left used to keep a socket on both sides)."""
    async with OwnerProcess(node_transport(transport)) as owner, \
            tx.Node(listen=None, transport=node_transport(transport)) as node:
        desc = await owner.export(4096)
        buf = tx.MemoryRegion.register(np.zeros(4096, np.uint8))

        async def one_round() -> dict[str, int]:
            ep = await node.connect(owner.address)
            await ep.read(buf, desc)
            await ep.aclose()
            for _ in range(50):
                found: dict[str, int] = await owner.resources()
                if found["endpoints"] == 0:
                    return found
                await asyncio.sleep(0.1)
            raise AssertionError("the owner kept an endpoint of a closed connection")

        first = await one_round()
        for _ in range(5):
            last = await one_round()
        for _ in range(50):  # UCX closes an endpoint's socket a moment later, in progress,
            # and a connection's cancelled tasks finish on the loop's next turn
            if last["fds"] <= first["fds"] and last["tasks"] <= first["tasks"]:
                break
            await asyncio.sleep(0.1)
            last = await owner.resources()
        assert last["fds"] <= first["fds"], f"owner fds {first['fds']} -> {last['fds']}"
        assert last["tasks"] <= first["tasks"]


async def test_timed_out_read_never_writes_the_buffer_again(
        transport: str) -> None:
    """#16 item 2: once ``read`` raised, the late reply never lands in the caller's memory,
    and the endpoint stays usable (the rest of the reply is drained, not a dead reader)."""
    async with session(transport) as (owner, _, ep):
        desc = await owner.export(64 << 20, seed=31)
        small = await owner.export(4096, seed=32)
        assert await check_timed_out_reads(ep, desc, small, small_seed=32)


async def test_read_cancelled_mid_transfer_never_writes_the_buffer_again(
        transport: str) -> None:
    """#16 item 2, deterministic: cancel the read as soon as its first bytes have landed."""
    async with session(transport) as (owner, _, ep):
        desc = await owner.export(64 << 20, seed=33)
        small = await owner.export(4096, seed=34)
        out = np.zeros(64 << 20, np.uint8)
        task = asyncio.ensure_future(ep.read(tx.MemoryRegion.register(out), desc, timeout=30))
        for _ in range(1_000_000):  # poll the buffer itself: no event says "bytes landed"
            if out[:4096].any() or task.done():
                break
            await asyncio.sleep(0)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        before = out.copy()
        check = np.zeros(4096, np.uint8)
        await ep.read(tx.MemoryRegion.register(check), small, timeout=30)
        assert np.array_equal(check, pattern(4096, 34))
        await asyncio.sleep(0.2)
        assert np.array_equal(out, before), "a cancelled read wrote the buffer later"
