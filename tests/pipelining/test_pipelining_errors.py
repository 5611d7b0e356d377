"""A pipeline stage against peers that are missing, mismatched or hostile: every wait is
bounded and says whom it waits for, a forged mark is a ProtocolError that touches nothing
outside its slot, two stages built with different schedules refuse to start."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Callable
from typing import Any

import msgpack
import pytest
import torch
from torch import nn

from tensorx import MemoryRegion, Node, RegionDescriptor
from tensorx import pipelining as pp
from tensorx.errors import (
    BrokenError,
    ClosedError,
    ProtocolError,
    RegionError,
    TimeoutError,
    UsageError,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def in_thread(fn: Callable[[], Any]) -> tuple[threading.Thread, dict[str, Any]]:
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["result"] = fn()
        except BaseException as exc:  # the test asserts on it
            box["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, box


def test_a_stage_alone_times_out_naming_the_stage_it_waits_for() -> None:
    peers = {0: f"tcp://127.0.0.1:{free_port()}", 1: f"tcp://127.0.0.1:{free_port()}"}
    with pp.PipelineStage(nn.Linear(4, 2), 1, 2, "cpu", peers=peers, timeout=1.0) as stage:
        sched = pp.ScheduleGPipe(stage, 2, loss_fn=nn.MSELoss())
        with pytest.raises(TimeoutError, match=r"stage 0") as info:
            sched.step(target=torch.zeros(4, 2))
        assert "stage 1 waited 1 s" in str(info.value)
        # and it stays failed: the pipeline is broken, not half-way through a step
        with pytest.raises(TimeoutError):
            sched.step(target=torch.zeros(4, 2))


def test_stages_built_with_different_schedules_refuse_to_start() -> None:
    peers = {0: f"tcp://127.0.0.1:{free_port()}", 1: f"tcp://127.0.0.1:{free_port()}"}
    first = pp.PipelineStage(nn.Linear(4, 4), 0, 2, "cpu", peers=peers, timeout=10.0)
    last = pp.PipelineStage(nn.Linear(4, 2), 1, 2, "cpu", peers=peers, timeout=10.0)
    with first, last:
        a = pp.ScheduleGPipe(first, 2)
        b = pp.ScheduleGPipe(last, 4, loss_fn=nn.MSELoss())
        ta, ra = in_thread(lambda: a.step(torch.randn(8, 4)))
        tb, rb = in_thread(lambda: b.step(target=torch.zeros(8, 2)))
        ta.join(20)
        tb.join(20)
    assert isinstance(rb.get("error"), UsageError), rb
    assert "every stage must build the same schedule" in str(rb["error"])
    assert isinstance(ra.get("error"), BrokenError), ra
    assert "stage 1 failed" in str(ra["error"]), ra


def test_step_arguments_are_checked_where_they_are_given() -> None:
    peers = {0: f"tcp://127.0.0.1:{free_port()}", 1: f"tcp://127.0.0.1:{free_port()}"}
    with pp.PipelineStage(nn.Linear(4, 4), 0, 2, "cpu", peers=peers) as first:
        sched = pp.Schedule1F1B(first, 4)
        with pytest.raises(UsageError, match="cannot be split into 4 micro-batches"):
            sched.step(torch.randn(3, 4))
        with pytest.raises(UsageError, match="needs the batch"):
            sched.step()
        with pytest.raises(UsageError, match="one schedule per stage"):
            pp.ScheduleGPipe(first, 2)
    with pytest.raises(UsageError, match="loss_fn"):
        with pp.PipelineStage(nn.Linear(4, 4), 1, 2, "cpu", peers=peers) as last:
            pp.ScheduleGPipe(last, 2)
    with pytest.raises(UsageError, match="stage_index"):
        pp.PipelineStage(nn.Linear(4, 4), 2, 2, "cpu", peers=peers)
    with pytest.raises(UsageError, match="max_shapes"):
        pp.PipelineStage(nn.Linear(4, 4), 1, 2, "cpu", peers=peers, dynamic=(1,))


class FakeFirstStage:
    """Stage 0 of 2 played by hand over a raw node: it plans the boundary honestly, then
    sends what the test says."""

    def __init__(self, address: str) -> None:
        self.address = address

    async def open(self, node: Node) -> tuple[Any, RegionDescriptor, MemoryRegion]:
        ep = await node.connect(self.address)
        messages = ep.messages
        await ep.notify(msgpack.packb({"t": "hello", "stage": 0, "stages": 2}))
        await ep.notify(msgpack.packb({"t": "meta", "tensors": [["float32", [4, 16], True]],
                                       "schedule": "ScheduleGPipe", "microbatches": 2}))
        accept = msgpack.unpackb(await messages.get(10.0))
        assert accept["t"] == "accept" and accept["slots"] == 2, accept
        ring = RegionDescriptor.from_bytes(accept["ring"])
        grads = MemoryRegion.allocate(4 * 16 * 4 * 2)
        await ep.notify(msgpack.packb({"t": "grads",
                                       "ring": node.export(grads).to_bytes()}))
        return ep, ring, grads


@pytest.mark.parametrize("forged", ["shape beyond the slot", "transfer not in flight",
                                    "not a message"])
async def test_a_forged_mark_is_a_protocol_error_and_touches_nothing_outside_its_slot(
        forged: str) -> None:
    peers = {0: f"tcp://127.0.0.1:{free_port()}", 1: f"tcp://127.0.0.1:{free_port()}"}
    stage = pp.PipelineStage(nn.Linear(16, 2), 1, 2, "cpu", peers=peers, timeout=10.0)
    sched = pp.ScheduleGPipe(stage, 2, loss_fn=nn.MSELoss())
    thread, box = in_thread(lambda: sched.step(target=torch.zeros(8, 2)))
    try:
        async with Node(transport="tcp") as node:
            ep, ring, _grads = await FakeFirstStage(peers[1]).open(node)
            data = MemoryRegion.allocate(ring.nbytes + 64)
            # the owner checks every op against the ring: nothing lands past its end
            with pytest.raises(RegionError):
                await ep.write(data, ring, 0, 0, ring.nbytes + 64)
            if forged == "shape beyond the slot":
                mark = {"t": "F", "n": 0, "shapes": [[5, 16]], "mb": 0, "train": True}
            elif forged == "transfer not in flight":
                mark = {"t": "F", "n": 1 << 40, "shapes": [[4, 16]], "mb": 0, "train": True}
            else:
                mark = {"t": "\x1b[31mexec", "n": 0}
            await ep.write(data, ring, 0, 0, 256, notify=msgpack.packb(mark))
            await asyncio.to_thread(thread.join, 20)
    finally:
        stage.close()
    assert isinstance(box.get("error"), ProtocolError), box
    assert "\x1b" not in str(box["error"])  # a peer's string comes back escaped


async def test_asyncio_callers_step_with_astep_and_close_with_async_with() -> None:
    peers = {0: f"tcp://127.0.0.1:{free_port()}", 1: f"tcp://127.0.0.1:{free_port()}"}
    torch.manual_seed(0)
    first, last = nn.Linear(4, 4), nn.Linear(4, 2)
    x, y = torch.randn(6, 4), torch.randn(6, 2)
    want = [nn.MSELoss()(last(first(xb)), yb).item()
            for xb, yb in zip(torch.tensor_split(x, 3), torch.tensor_split(y, 3), strict=True)]
    async with pp.PipelineStage(first, 0, 2, "cpu", peers=peers) as a, \
            pp.PipelineStage(last, 1, 2, "cpu", peers=peers) as b:
        sa, sb = pp.Schedule1F1B(a, 3), pp.Schedule1F1B(b, 3, loss_fn=nn.MSELoss())
        losses: list[torch.Tensor] = []
        ticks = 0

        async def tick() -> None:  # the caller's loop keeps running while the stages step
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.001)

        ticker = asyncio.create_task(tick())
        _, out = await asyncio.gather(sa.astep(x), sb.astep(target=y, losses=losses))
        ticker.cancel()
        assert out.shape == (6, 2)
        assert [round(v.item(), 5) for v in losses] == [round(v, 5) for v in want]
        assert first.weight.grad is not None and last.weight.grad is not None
        assert a.stats()["transfers_sent"] == 3 and b.stats()["transfers_received"] == 3
        assert a.info["peers"][1]["transport"] in ("tcp", "ucx")  # one process: no CMA
        assert ticks > 0
    a.close()  # idempotent
    with pytest.raises(ClosedError, match="closed"):
        await sa.astep(x)
