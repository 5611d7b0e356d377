"""An endpoint's lanes as one: each op goes to the fastest lane that carries it, e.g. GPU
ops on a UCX lane whose UCX (or the peer's) cannot move GPU memory go to the TCP lane's
staging.

The routing alone, with recording lanes: no GPU is needed to check which lane gets which op
(the staging itself is tested in tests/transport/test_staging.py and, on a GPU, test_gpu_tcp.py)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import Any

import numpy as np

import tensorx as tx
from tensorx.transport._router import Router
from tensorx.transport._ucx_lane import UcxLane
from tensorx.transport.base import DataLane, Op


class FakeCuda:
    __cuda_array_interface__ = {"shape": (64,), "typestr": "|u1", "data": (0xDEAD000, False),
                                "version": 3, "strides": None}


class Recording(DataLane):
    def __init__(self, name: str, carries: Callable[[Op], bool] = lambda op: True,
                 info: dict[str, Any] | None = None, notify: bool = False) -> None:
        self.name = name
        self._carries = carries
        self._info = info if info is not None else {"transport": name, "lanes": [name],
                                                    "why": "test"}
        self._notify = notify
        self.ops: list[tuple[str, int]] = []

    @property
    def info(self) -> dict[str, Any]:
        return self._info

    def carries(self, op: Op) -> bool:
        return self._carries(op)

    async def write(self, op: Op, *, timeout: float | None) -> None:
        self.ops.append(("w", op.nbytes))

    async def read(self, op: Op, *, timeout: float | None) -> None:
        self.ops.append(("r", op.nbytes))

    async def write_many(self, ops: Sequence[Op], *, timeout: float | None) -> None:
        self.ops.extend(("w", op.nbytes) for op in ops)

    async def write_notify(self, ops: Sequence[Op], payload: bytes, *,
                           timeout: float | None) -> bool:
        if self._notify:
            self.ops.extend(("wn", op.nbytes) for op in ops)
        return self._notify

    async def flush(self, *, timeout: float | None) -> None:
        self.ops.append(("flush", 0))

    async def aclose(self) -> None:
        self.ops.append(("close", 0))

    def abort(self) -> None:
        self.ops.append(("abort", 0))


def desc(device: str, keys: dict[str, Any]) -> tx.RegionDescriptor:
    return tx.RegionDescriptor("peer", 1, 2, 64, device, "rw", keys)


HOST = tx.MemoryRegion.register(np.zeros(64, np.uint8))
GPU = tx.MemoryRegion.register(FakeCuda())


def op(local: tx.MemoryRegion, remote: tx.RegionDescriptor, n: int) -> Op:
    return Op(local, remote, 0, 0, n)


def host_only(o: Op) -> bool:  # a UCX lane whose UCX has no CUDA transport
    return not o.local.is_cuda and o.remote.device != "cuda"


def test_which_ops_leave_ucx() -> None:
    def ucx_carries(o: Op, gpu: bool) -> bool:  # UcxLane.carries, without a UCX endpoint
        return UcxLane.carries(SimpleNamespace(_gpu=gpu), o)  # type: ignore[arg-type]

    gpu_desc_ucx, gpu_desc_bare = desc("cuda", {"ucx": {}}), desc("cuda", {})
    host_desc = desc("cpu", {"ucx": {}})
    assert ucx_carries(op(HOST, host_desc, 1), gpu=False)
    assert not ucx_carries(op(GPU, host_desc, 1), gpu=False)
    assert ucx_carries(op(GPU, host_desc, 1), gpu=True)
    assert not ucx_carries(op(HOST, gpu_desc_ucx, 1), gpu=False)
    assert ucx_carries(op(HOST, gpu_desc_ucx, 1), gpu=True)
    assert not ucx_carries(op(GPU, gpu_desc_bare, 1), gpu=True)  # the peer's UCX cannot


async def test_mixed_batches_split_and_the_endpoint_notifies_after_both() -> None:
    ucx, tcp = Recording("ucx", host_only, notify=True), Recording("tcp", notify=True)
    lane = Router([ucx, tcp], ucx)
    ops = [op(HOST, desc("cpu", {"ucx": {}}), 1), op(GPU, desc("cpu", {"ucx": {}}), 2)]
    assert not await lane.write_notify(ops, b"x", timeout=None)  # nothing done: endpoint's job
    assert ucx.ops == tcp.ops == []
    await lane.write_many(ops, timeout=None)
    assert ucx.ops == [("w", 1)] and tcp.ops == [("w", 2)]
    await lane.read(op(GPU, desc("cpu", {}), 3), timeout=None)
    assert tcp.ops[-1] == ("r", 3)
    await lane.flush(timeout=None)
    assert ucx.ops[-1] == tcp.ops[-1] == ("flush", 0)
    assert await lane.write_notify(ops[:1], b"x", timeout=None)  # one lane: it carries it
    assert ucx.ops[-1] == ("wn", 1)
    assert lane.name == "ucx" and lane.info["transport"] == "ucx"


async def test_the_fastest_lane_that_carries_an_op_gets_it_and_says_so() -> None:
    near = Recording("cma", lambda o: o.nbytes > 0 and host_only(o), info={"host": "cma"})
    ucx, tcp = Recording("ucx", host_only), Recording("tcp")
    lane = Router([near, ucx, tcp], ucx)
    await lane.write(op(HOST, desc("cpu", {}), 8), timeout=None)
    await lane.write(op(HOST, desc("cpu", {}), 0), timeout=None)  # not the same-host lane's
    await lane.write(op(GPU, desc("cuda", {}), 4), timeout=None)
    assert (near.ops, ucx.ops, tcp.ops) == ([("w", 8)], [("w", 0)], [("w", 4)])
    assert lane.info == {"transport": "ucx", "lanes": ["ucx"], "why": "test", "host": "cma"}
    await lane.aclose()
    assert all(x.ops[-2:] == [("close", 0), ("abort", 0)] for x in (near, ucx, tcp))
