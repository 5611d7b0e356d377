"""GPU ops on a UCX lane whose UCX (or the peer's) cannot move GPU memory go to TCP staging.

The routing alone, with recording lanes: no GPU is needed to check which lane gets which op
(the staging itself is tested in tests/test_staging.py and, on a GPU, test_gpu_tcp.py)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

import tensorx as tx
from tensorx.transport.base import DataLane, Op
from tensorx.transport.gpu_route import GpuViaTcp, needs_route


class FakeCuda:
    __cuda_array_interface__ = {"shape": (64,), "typestr": "|u1", "data": (0xDEAD000, False),
                                "version": 3, "strides": None}


class Recording(DataLane):
    def __init__(self, name: str) -> None:
        self.name = name
        self.ops: list[tuple[str, int]] = []

    @property
    def info(self) -> dict[str, Any]:
        return {"transport": self.name, "lanes": [self.name], "why": "test", "gpu": "staged"}

    async def write(self, op: Op, *, timeout: float | None) -> None:
        self.ops.append(("w", op.nbytes))

    async def read(self, op: Op, *, timeout: float | None) -> None:
        self.ops.append(("r", op.nbytes))

    async def write_many(self, ops: Sequence[Op], *, timeout: float | None) -> None:
        self.ops.extend(("w", op.nbytes) for op in ops)

    async def flush(self, *, timeout: float | None) -> None:
        self.ops.append(("flush", 0))

    async def aclose(self) -> None:
        pass

    def abort(self) -> None:
        pass


def desc(device: str, keys: dict[str, Any]) -> tx.RegionDescriptor:
    return tx.RegionDescriptor("peer", 1, 2, 64, device, "rw", keys)


HOST = tx.MemoryRegion.register(np.zeros(64, np.uint8))
GPU = tx.MemoryRegion.register(FakeCuda())


def op(local: tx.MemoryRegion, remote: tx.RegionDescriptor, n: int) -> Op:
    return Op(local, remote, 0, 0, n)


def test_which_ops_leave_ucx() -> None:
    gpu_desc_ucx, gpu_desc_bare = desc("cuda", {"ucx": {}}), desc("cuda", {})
    host_desc = desc("cpu", {"ucx": {}})
    assert not needs_route(op(HOST, host_desc, 1), ucx_gpu=False)
    assert needs_route(op(GPU, host_desc, 1), ucx_gpu=False)
    assert not needs_route(op(GPU, host_desc, 1), ucx_gpu=True)
    assert needs_route(op(HOST, gpu_desc_ucx, 1), ucx_gpu=False)
    assert not needs_route(op(HOST, gpu_desc_ucx, 1), ucx_gpu=True)
    assert needs_route(op(GPU, gpu_desc_bare, 1), ucx_gpu=True)  # the peer's UCX cannot


async def test_mixed_batches_split_and_the_endpoint_notifies_after_both() -> None:
    ucx, tcp = Recording("ucx"), Recording("tcp")
    lane = GpuViaTcp(ucx, tcp, ucx_gpu=False)
    ops = [op(HOST, desc("cpu", {"ucx": {}}), 1), op(GPU, desc("cpu", {"ucx": {}}), 2)]
    assert not await lane.write_notify(ops, b"x", timeout=None)  # nothing done: endpoint's job
    assert ucx.ops == tcp.ops == []
    await lane.write_many(ops, timeout=None)
    assert ucx.ops == [("w", 1)] and tcp.ops == [("w", 2)]
    await lane.read(op(GPU, desc("cpu", {}), 3), timeout=None)
    assert tcp.ops[-1] == ("r", 3)
    await lane.flush(timeout=None)
    assert ucx.ops[-1] == tcp.ops[-1] == ("flush", 0)
    assert lane.name == "ucx" and "UCX here has no CUDA transport" in lane.info["gpu"]
