"""Memory regions: zero-copy registration, views, descriptors, closing."""

from __future__ import annotations

import mmap
import os

import numpy as np
import pytest
import torch

import tensorx as tx


def test_register_numpy_is_zero_copy() -> None:
    arr = np.arange(10, dtype=np.float32)
    region = tx.MemoryRegion.register(arr)
    assert region.nbytes == 40 and region.device == "cpu"
    assert region.address == arr.ctypes.data
    view = region.view(np.float32)
    view[3] = 42.0
    assert arr[3] == 42.0


def test_register_torch_bytearray_memoryview_and_dlpack() -> None:
    t = torch.zeros(4, 4, dtype=torch.bfloat16)
    r = tx.MemoryRegion.register(t)
    assert (r.address, r.nbytes) == (t.data_ptr(), 32)
    r.view(torch.bfloat16, (4, 4))[1, 1] = 3.0
    assert t[1, 1].item() == 3.0
    ba = bytearray(b"abcd")
    tx.MemoryRegion.register(ba).buffer()[0] = ord("z")
    assert ba == bytearray(b"zbcd")
    mv = memoryview(bytearray(8))
    assert tx.MemoryRegion.register(mv).nbytes == 8

    class DL:
        def __init__(self, a: np.ndarray) -> None:
            self.a = a

        def __dlpack__(self, **kw: object) -> object:
            return self.a.__dlpack__(**kw)

        def __dlpack_device__(self) -> tuple[int, int]:
            return self.a.__dlpack_device__()

    base = np.zeros(6, np.int16)
    assert tx.MemoryRegion.register(DL(base)).address == base.ctypes.data


def test_non_contiguous_and_read_only_are_usage_errors() -> None:
    with pytest.raises(tx.UsageError, match="contiguous"):
        tx.MemoryRegion.register(np.zeros((4, 4))[:, 1])
    with pytest.raises(tx.UsageError, match="contiguous"):
        tx.MemoryRegion.register(torch.zeros(4, 4).t())
    with pytest.raises(tx.UsageError, match="read-only"):
        tx.MemoryRegion.register(b"immutable")
    assert tx.MemoryRegion.register(b"immutable", writable=False).readonly
    with pytest.raises(tx.UsageError, match="cannot register"):
        tx.MemoryRegion.register(object())


def test_same_memory_twice_returns_the_cached_region() -> None:
    arr = np.zeros(16, np.uint8)
    a = tx.MemoryRegion.register(arr)
    assert tx.MemoryRegion.register(arr) is a
    a.close()
    assert tx.MemoryRegion.register(arr) is not a


def test_allocate_is_page_aligned_zeroed_and_viewable() -> None:
    r = tx.MemoryRegion.allocate(10_000)
    assert r.address % mmap.PAGESIZE == 0 and r.nbytes == 10_000
    assert not np.frombuffer(r.buffer(), np.uint8).any()
    t = r.view(torch.float32, (10, 10), offset=64)
    t.fill_(1.0)
    assert r.view(np.float32, 100, offset=64).sum() == 100
    with pytest.raises(tx.UsageError, match="exceeds"):
        r.view(np.float64, 10_000)
    with pytest.raises(tx.UsageError, match="multiple"):
        r.view(np.float32, 1, offset=3)
    with pytest.raises(tx.UsageError):
        tx.MemoryRegion.allocate(-1)
    assert tx.MemoryRegion.allocate(0).nbytes == 0


def test_descriptor_roundtrip_and_validation() -> None:
    r = tx.MemoryRegion.allocate(100)
    d = r.descriptor()
    assert tx.RegionDescriptor.from_bytes(d.to_bytes()) == d
    assert (d.nbytes, d.device, d.access) == (100, "cpu", "rw")
    with pytest.raises(tx.ProtocolError):
        tx.RegionDescriptor.from_bytes(b"\x93\x01\x02\x03")
    with pytest.raises(tx.ProtocolError, match="version"):
        tx.RegionDescriptor.from_bytes(b"\x98\x07" + d.to_bytes()[2:])


def test_closed_region_fails_clearly_and_runs_callbacks() -> None:
    r = tx.MemoryRegion.allocate(64)
    seen = []
    r.add_close_callback(seen.append)
    r.close()
    r.close()
    assert seen == [r]
    for use in (r.buffer, r.descriptor, lambda: r.view(np.uint8)):
        with pytest.raises(tx.ClosedError):
            use()


def test_cuda_array_interface_is_recognised_as_gpu_memory() -> None:
    class FakeCuda:  # the interface only; no memory is touched
        __cuda_array_interface__ = {"shape": (4,), "typestr": "<f4", "data": (0xDEAD000, False),
                                    "version": 3, "strides": None}

    r = tx.MemoryRegion.register(FakeCuda())
    assert r.is_cuda and r.device == "cuda:0" and r.nbytes == 16
    with pytest.raises(tx.UsageError, match="GPU transport"):
        r.buffer()
    assert r.descriptor().device == "cuda"


def _have_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


@pytest.mark.skipif(_have_cuda(), reason="would copy from a made-up device pointer")
async def test_tcp_endpoint_that_cannot_stage_gpu_memory_says_why() -> None:
    """GPU memory over TCP is staged with torch (tests/transport/test_gpu_tcp.py); where torch has
    no CUDA, an op on a GPU region fails clearly and touches nothing."""
    class FakeCuda:
        __cuda_array_interface__ = {"shape": (4,), "typestr": "<f4", "data": (0xDEAD000, False),
                                    "version": 3, "strides": None}

    async with tx.Node(transport="tcp") as a, tx.Node(listen=None, transport="tcp") as b:
        desc = a.export(tx.MemoryRegion.allocate(16))
        ep = await b.connect(a.address)
        assert "gpu" not in ep.info  # no GPU path here (tensorx info says so too)
        for op in (ep.write, ep.read):
            with pytest.raises(tx.TransportUnavailableError, match="cuda:0"):
                await op(tx.MemoryRegion.register(FakeCuda()), desc)
        await ep.write(tx.MemoryRegion.register(np.ones(16, np.uint8)), desc)


def test_a_pinned_region_keeps_its_memory_until_unpinned() -> None:
    region = tx.MemoryRegion.allocate(4096, shared=True)
    name = region.shared_name
    assert name is not None
    assert region.backing.created_file == name
    region.backing.pin()
    region.close()  # closed for everyone, but a transport still addresses the memory
    assert region.closed and region.backing.pinned
    assert os.path.exists(f"/dev/shm/{name}")
    region.backing.unpin()
    assert not region.backing.pinned
    assert not os.path.exists(f"/dev/shm/{name}")


def test_only_the_creator_of_a_shared_file_may_offer_it() -> None:
    with tx.MemoryRegion.allocate(4096, shared=True) as mine:
        assert mine.shared_name is not None
        with tx.MemoryRegion.attach(mine.shared_name, 4096) as theirs:
            assert theirs.shared_name == mine.shared_name
            assert theirs.backing.created_file is None  # attached: not ours to offer
        assert os.path.exists(f"/dev/shm/{mine.shared_name}")  # closing it only unmapped
