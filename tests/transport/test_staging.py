"""GPU staging over the TCP lane, run on CPU: ``TENSORX_STAGE_HOST=1`` sends host regions
through the very same staging path (pinned pool, chunked copies that complete late, events
waited on from asyncio), host memory standing in for device memory. Real sockets, real
processes; every transfer checked byte for byte."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator
from types import SimpleNamespace

import numpy as np
import pytest

import tensorx as tx
from tensorx import _cuda
from tensorx.testing import OwnerProcess, check_timed_out_reads, digest, pattern, wait_until
from tensorx.transport import _staging
from tensorx.transport._staging import CHUNK, POOL
from tensorx.transport.tcp import TcpLane

STAGE = "TENSORX_STAGE_HOST"

# (client stages, owner stages): both sides, and each side alone against a plain peer
SIDES = [pytest.param(True, True, id="both"), pytest.param(True, False, id="client"),
         pytest.param(False, True, id="owner")]

# (local offset, remote offset, nbytes): odd places, from one byte to many chunks
RANGES = [(1, 7, 1), (13, CHUNK - 1, CHUNK + 1), (4097, 3, 5 * CHUNK + 12345),
          (0, 0, 0), (CHUNK + 1, 2 * CHUNK + 3, 2 * CHUNK - 5)]
SIZE = 8 * CHUNK


@contextlib.asynccontextmanager
async def session(monkeypatch: pytest.MonkeyPatch, client: bool = True,
                  owner: bool = True) -> AsyncIterator[tuple[OwnerProcess, tx.Node, tx.Endpoint]]:
    monkeypatch.setenv(STAGE, "1" if client else "0")
    async with OwnerProcess("tcp", env={STAGE: "1" if owner else "0"}) as proc, \
            tx.Node(listen=None, transport="tcp") as node:
        ep = await node.connect(proc.address)
        yield proc, node, ep


def test_the_switch_stages_host_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    region = tx.MemoryRegion.register(bytearray(10))
    monkeypatch.delenv(STAGE, raising=False)
    assert not _staging.stage_host()
    assert isinstance(_staging.staged_range(region, 2, 3, _staging.stage_host()), memoryview)
    monkeypatch.setenv(STAGE, "1")
    assert _staging.stage_host()
    staged = _staging.staged_range(region, 2, 3, _staging.stage_host())
    assert isinstance(staged, _staging.StagedRange) and len(staged) == 3
    assert _staging.split_staged([b"h", staged, b"x", b"y"]) == [[b"h"], staged, [b"x", b"y"]]


@pytest.mark.usefixtures("fresh_fallbacks")
@pytest.mark.parametrize("cuda", [True, False], ids=["cuda", "cpu-only"])
async def test_info_and_log_line_say_gpu_memory_is_staged_where_there_is_a_gpu(
        cuda: bool, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Where torch has CUDA, ``ep.info["gpu"]`` and the INFO line say GPU memory is staged,
    and the first op on GPU memory is one WARNING per process; on a CPU-only torch there
    is no such path (as ``tensorx info`` says) and neither mentions one."""
    monkeypatch.setattr(_cuda, "available", lambda: cuda)
    caplog.set_level("INFO", logger="tensorx")
    async with tx.Node(transport="tcp", cuda_ipc=False) as a, \
            tx.Node(listen=None, transport="tcp", cuda_ipc=False) as b:
        ep = await b.connect(a.address)
        assert ep.info["lanes"] == ["tcp/socket"]
        lines = [r.getMessage() for r in caplog.records if "endpoint" in r.getMessage()]
        if not cuda:
            assert "gpu" not in ep.info and not any("gpu=" in line for line in lines)
            return
        assert ep.info["gpu"] == f"staged via pinned host, {CHUNK >> 20} MiB x {POOL}"
        assert lines and all("gpu=staged via pinned host" in line for line in lines)
    gpu = SimpleNamespace(local=SimpleNamespace(is_cuda=True),
                          remote=SimpleNamespace(device="cpu"))
    for lane in [TcpLane(SimpleNamespace(requests=None))] * 3 + [  # type: ignore[arg-type]
            TcpLane(SimpleNamespace(requests=None))]:  # type: ignore[arg-type]
        if not lane._said:  # as each op does
            lane._gpu_op(gpu)  # type: ignore[arg-type]
    said = [r for r in caplog.records if "GPU memory goes over TCP" in r.getMessage()]
    assert [r.levelname for r in said] == ["WARNING", "INFO"]  # per process, then per lane
    assert "tensorx info" in said[0].getMessage()


@pytest.mark.parametrize(("client", "owner"), SIDES)
async def test_writes_land_byte_for_byte_at_odd_ranges(
        monkeypatch: pytest.MonkeyPatch, client: bool, owner: bool) -> None:
    async with session(monkeypatch, client, owner) as (proc, _, ep):
        desc = await proc.export(SIZE, seed=1)
        expected = pattern(SIZE, 1)
        for i, (off, roff, n) in enumerate(RANGES):
            src = pattern(SIZE, seed=10 + i)
            await ep.write(tx.MemoryRegion.register(src), desc, off, roff, n)
            expected[roff:roff + n] = src[off:off + n]
            assert await proc.call("digest", desc.region_id) == digest(expected), (off, roff, n)
        assert await proc.call("guards_intact")


@pytest.mark.parametrize(("client", "owner"), SIDES)
async def test_reads_land_byte_for_byte_at_odd_ranges(
        monkeypatch: pytest.MonkeyPatch, client: bool, owner: bool) -> None:
    async with session(monkeypatch, client, owner) as (proc, _, ep):
        desc = await proc.export(SIZE, seed=2)
        remote = pattern(SIZE, 2)
        for i, (off, roff, n) in enumerate(RANGES):
            out = pattern(SIZE, seed=20 + i)
            expected = out.copy()
            expected[off:off + n] = remote[roff:roff + n]
            await ep.read(tx.MemoryRegion.register(out), desc, off, roff, n)
            assert np.array_equal(out, expected), (off, roff, n)


async def test_many_concurrent_ops_share_a_bounded_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    """Both sides in this process: 64 writes and reads at once, each spanning chunks, and
    each side's connection holds at most POOL staging buffers per direction."""
    monkeypatch.setenv(STAGE, "1")
    async with tx.Node(transport="tcp") as owner, tx.Node(listen=None, transport="tcp") as b:
        n, piece = 32, CHUNK + 4099
        remote = tx.MemoryRegion.allocate(2 * n * piece)
        desc = owner.export(remote)
        ep = await b.connect(owner.address)
        src = pattern(n * piece, seed=3)
        await asyncio.gather(*(ep.write(tx.MemoryRegion.register(src), desc, i * piece,
                                        i * piece, piece) for i in range(n)))
        remote.view(np.uint8)[n * piece:] = pattern(n * piece, seed=4)
        out = np.zeros(n * piece, np.uint8)
        dst = tx.MemoryRegion.register(out)
        await asyncio.gather(*(ep.read(dst, desc, i * piece, (n + i) * piece, piece)
                               for i in range(n)))
        assert np.array_equal(remote.view(np.uint8)[:n * piece], src)
        assert np.array_equal(out, pattern(n * piece, 4))
        conns = [ep._channel, *(e._channel for e in owner.endpoints)]
        assert all(max(c.staging_buffers) <= POOL for c in conns)
        assert ep._channel.staging_buffers == (POOL, POOL)


async def test_notification_never_precedes_staged_writes(monkeypatch: pytest.MonkeyPatch) -> None:
    async with session(monkeypatch) as (proc, node, ep):
        nbytes, piece = 6 * CHUNK, 3 * CHUNK
        desc = await proc.export(nbytes)
        for value in (1, 2, 3):
            region = tx.MemoryRegion.register(np.full(nbytes, value, np.uint8))
            payload = f"fill:{desc.region_id}:{value}:{piece}".encode()
            if value == 1:
                writes = [asyncio.ensure_future(ep.write(region, desc, i, i, piece))
                          for i in range(0, nbytes, piece)]
                await asyncio.sleep(0)  # one loop turn: the writes are issued, none complete
                await ep.notify(payload)
                await asyncio.gather(*writes)
            else:
                await ep.write(region, desc, notify=payload)
            assert (await asyncio.wait_for(node.notifications.get(), 10))[1] == b"checked"
        assert await proc.call("violations") == []


async def test_owner_refuses_a_bad_range_mid_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    """A forged size makes the second of three multi-chunk writes fall outside the region:
    the owner refuses it (RegionError), writes nothing outside, and keeps serving."""
    async with session(monkeypatch) as (proc, _, ep):
        desc = await proc.export(SIZE, seed=5)
        forged = dataclasses.replace(desc, nbytes=2 * SIZE)
        src = tx.MemoryRegion.register(pattern(SIZE, seed=6))
        with pytest.raises(tx.RegionError, match="outside"):
            await ep.write_many([(src, desc, 0, 0, 2 * CHUNK + 5),
                                 (src, forged, 0, SIZE - 10, CHUNK + 3),
                                 (src, desc, 0, 3 * CHUNK, CHUNK)], notify=b"must not arrive")
        out = pattern(SIZE, seed=7)
        before = out.copy()
        with pytest.raises(tx.RegionError, match="outside"):
            await ep.read(tx.MemoryRegion.register(out), forged, 0, SIZE - 1, 2 * CHUNK)
        assert np.array_equal(out, before)
        assert await proc.call("guards_intact")
        expected = pattern(SIZE, 5)  # the owner lands frames in order, skips the refused one
        expected[:2 * CHUNK + 5] = pattern(SIZE, 6)[:2 * CHUNK + 5]
        expected[3 * CHUNK:4 * CHUNK] = pattern(SIZE, 6)[:CHUNK]
        await ep.read(tx.MemoryRegion.register(out), desc, 1, 2, 4 * CHUNK + 1)
        assert np.array_equal(out[1:4 * CHUNK + 2], expected[2:4 * CHUNK + 3])
        assert b"must not arrive" not in await proc.call("notes")


async def test_peer_killed_mid_read_raises_broken_and_leaves_the_buffer(
        monkeypatch: pytest.MonkeyPatch) -> None:
    async with session(monkeypatch) as (proc, node, ep):
        desc = await proc.export(64 << 20, seed=8)
        out = np.zeros(64 << 20, np.uint8)
        region = tx.MemoryRegion.register(out)

        moving = asyncio.Event()

        async def hammer() -> None:
            while True:
                await ep.read(region, desc, timeout=20)
                moving.set()  # the next read is issued before this task yields again

        task = asyncio.ensure_future(hammer())
        await asyncio.wait_for(moving.wait(), 20)
        out[:] = 0  # from here, only a read after the raise could bring pattern bytes back
        proc.kill()
        with pytest.raises(tx.BrokenError):
            await asyncio.wait_for(task, 25)
        after = out.copy()
        # the endpoint is torn down (its lane closed): nothing of it can write any more
        assert await asyncio.wait_for(node.disconnected.get(), 5) is ep
        assert np.array_equal(out, after), "a read wrote the buffer after it raised"
        with pytest.raises(tx.BrokenError):
            await ep.write(region, desc, nbytes=8)


async def test_timed_out_staged_read_never_writes_the_buffer_again(
        monkeypatch: pytest.MonkeyPatch) -> None:
    async with session(monkeypatch) as (proc, _, ep):
        desc = await proc.export(64 << 20, seed=9)
        small = await proc.export(4096, seed=10)
        assert await check_timed_out_reads(ep, desc, small, small_seed=10)


async def test_owner_keeps_serving_when_a_writer_dies_mid_stream(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A staged owner in this process; a spawned client dies in the middle of a large
    staged write. The owner drops that connection and keeps serving another peer, with
    its pool still bounded."""
    monkeypatch.setenv(STAGE, "1")
    async with tx.Node(transport="tcp") as owner, tx.Node(listen=None, transport="tcp") as b, \
            OwnerProcess("tcp", env={STAGE: "1"}) as client:
        big = owner.export(tx.MemoryRegion.allocate(128 << 20))
        mine = tx.MemoryRegion.allocate(SIZE)
        desc = owner.export(mine)
        await client.connect(owner.address)
        transfer = asyncio.ensure_future(client.transfer(0, "write", big, seed=11))
        ep = await b.connect(owner.address)
        await wait_until(lambda: any(e._channel.stats["bytes_in"] > CHUNK
                                     for e in owner.endpoints), what="the dying write under way")
        client.kill()
        with contextlib.suppress(Exception):
            await transfer
        src = pattern(SIZE, seed=12)
        await ep.write(tx.MemoryRegion.register(src), desc, 3, 5, SIZE - 9)
        assert np.array_equal(mine.view(np.uint8)[5:SIZE - 4], src[3:SIZE - 6])
        await wait_until(lambda: len(owner.endpoints) == 1, what="the dead writer dropped")
        assert all(e._channel.staging_buffers[0] <= POOL for e in owner.endpoints)
