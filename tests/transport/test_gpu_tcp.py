"""GPU memory over the TCP lane (staged through pinned host buffers): every direction, odd
offsets, multi-chunk sizes, checked byte for byte by the owner; and the stream-order
guarantees (a write carries what a kernel queued just before it wrote; read data is there
for the next kernel on any stream). Needs a CUDA device; skipped elsewhere."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest

import tensorx as tx
from tensorx.testing import pattern
from tensorx.transport._staging import CHUNK, POOL

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

BIG = 64 << 20
# (local offset, remote offset, nbytes): odd places, one byte to many chunks
RANGES = [(1, 7, 1), (13, CHUNK - 1, CHUNK + 1), (4097, 3, 5 * CHUNK + 12345),
          (3, 5, BIG - 4099)]
DIRECTIONS = [("cuda", "cuda"), ("cuda", "cpu"), ("cpu", "cuda")]  # (ours, the owner's)


@contextlib.asynccontextmanager
async def pair() -> AsyncIterator[tuple[tx.Node, tx.Endpoint]]:
    """An owner node and a client node (its endpoint to the owner), both forced to TCP and
    without the CUDA IPC lane (which would carry GPU<->GPU ops between them itself)."""
    async with tx.Node(transport="tcp", cuda_ipc=False) as owner, \
            tx.Node(listen=None, transport="tcp", cuda_ipc=False) as client:
        ep = await client.connect(owner.address)
        assert ep.info["transport"] == "tcp"
        assert ep.info["gpu"].startswith("staged via pinned host"), ep.info
        yield owner, ep


def tensor(data: np.ndarray, device: str) -> Any:
    t = torch.from_numpy(data.copy())
    return t.to(device) if device == "cuda" else t


def host(t: Any) -> np.ndarray:
    """The owner's check: its memory, copied out after the device is idle."""
    torch.cuda.synchronize()
    return np.asarray(t.cpu().numpy())


@pytest.mark.parametrize(("ours", "theirs"), DIRECTIONS)
async def test_writes_land_byte_for_byte(ours: str, theirs: str) -> None:
    async with pair() as (owner, ep):
        remote = tensor(pattern(BIG, 1), theirs)
        desc = owner.export(tx.MemoryRegion.register(remote))
        assert desc.device == ("cuda" if theirs == "cuda" else "cpu")
        expected = pattern(BIG, 1)
        for i, (off, roff, n) in enumerate(RANGES):
            src_host = pattern(BIG, 10 + i)
            src = tx.MemoryRegion.register(tensor(src_host, ours))
            await ep.write(src, desc, off, roff, n)
            expected[roff:roff + n] = src_host[off:off + n]
            assert np.array_equal(host(remote), expected), (off, roff, n)


@pytest.mark.parametrize(("ours", "theirs"), DIRECTIONS)
async def test_reads_land_byte_for_byte(ours: str, theirs: str) -> None:
    async with pair() as (owner, ep):
        remote_host = pattern(BIG, 2)
        desc = owner.export(tx.MemoryRegion.register(tensor(remote_host, theirs)), "r")
        for i, (off, roff, n) in enumerate(RANGES):
            expected = pattern(BIG, 20 + i)
            out = tensor(expected, ours)
            await ep.read(tx.MemoryRegion.register(out), desc, off, roff, n)
            expected[off:off + n] = remote_host[roff:roff + n]
            assert np.array_equal(host(out), expected), (off, roff, n)


async def test_write_carries_what_a_slow_kernel_just_wrote() -> None:
    """No synchronize between the kernel and the write: the write still sends its result."""
    async with pair() as (owner, ep):
        remote = torch.zeros(BIG, dtype=torch.uint8, device="cuda")
        desc = owner.export(tx.MemoryRegion.register(remote))
        buf = torch.zeros(BIG, dtype=torch.uint8, device="cuda")
        region = tx.MemoryRegion.register(buf)
        for value in (7, 9):
            torch.cuda._sleep(int(5e8))  # a slow kernel on the current stream ...
            buf.fill_(value)  # ... then the one that writes the source
            await ep.write(region, desc)
            assert bool((host(remote) == value).all())


async def test_read_data_is_there_for_the_next_kernel_on_any_stream() -> None:
    async with pair() as (owner, ep):
        remote_host = pattern(BIG, 3)
        desc = owner.export(tx.MemoryRegion.register(tensor(remote_host, "cuda")))
        want = int(remote_host.astype(np.int64).sum())
        out = torch.zeros(BIG, dtype=torch.uint8, device="cuda")
        region = tx.MemoryRegion.register(out)
        await ep.read(region, desc)
        assert int(out.sum(dtype=torch.int64)) == want  # the current stream, no synchronize
        out.zero_()
        torch.cuda.synchronize()
        await ep.read(region, desc)
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            total = out.sum(dtype=torch.int64)
        side.synchronize()
        assert int(total) == want


async def test_notification_after_a_gpu_write_finds_the_data() -> None:
    """The owner reads its GPU region when the notification arrives, on its own stream."""
    async with pair() as (owner, ep):
        remote = torch.zeros(BIG, dtype=torch.uint8, device="cuda")
        desc = owner.export(tx.MemoryRegion.register(remote))
        for value in (1, 2, 3):
            src = tx.MemoryRegion.register(torch.full((BIG,), value, dtype=torch.uint8,
                                                      device="cuda"))
            if value == 2:
                await ep.write(src, desc)
                await ep.notify(b"now")
            else:
                await ep.write(src, desc, notify=b"now")
            _, payload = await asyncio.wait_for(owner.notifications.get(), 30)
            assert payload == b"now"
            assert int(remote.min()) == value == int(remote.max())


async def test_concurrent_gpu_ops_with_a_bounded_pool() -> None:
    async with pair() as (owner, ep):
        n, piece = 24, CHUNK + 4099
        remote = torch.zeros(2 * n * piece, dtype=torch.uint8, device="cuda")
        desc = owner.export(tx.MemoryRegion.register(remote))
        src_host = pattern(n * piece, 4)
        src = tx.MemoryRegion.register(tensor(src_host, "cuda"))
        await asyncio.gather(*(ep.write(src, desc, i * piece, i * piece, piece)
                               for i in range(n)))
        out = torch.zeros(n * piece, dtype=torch.uint8, device="cuda")
        dst = tx.MemoryRegion.register(out)
        await asyncio.gather(*(ep.read(dst, desc, i * piece, i * piece, piece)
                               for i in range(n)))
        assert np.array_equal(host(remote)[:n * piece], src_host)
        assert np.array_equal(host(out), src_host)
        conns = [ep._channel, *(e._channel for e in owner.endpoints)]
        assert all(max(c.staging_buffers) <= POOL for c in conns)
