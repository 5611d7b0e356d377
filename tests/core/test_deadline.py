"""Time budgets (tensorx._deadline) and what a lost cancellation must not do to a server."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import pytest

import tensorx as tx
from tensorx import _deadline
from tensorx.ps import ParameterServer


async def _cancel_as_it_completes(wait_for: Any) -> str:
    """Cancel a task in the very loop iteration where what it waits for completes; report
    whether the cancellation reached it ("cancelled") or was lost (the task runs on)."""
    fut = asyncio.get_running_loop().create_future()

    async def runner() -> None:
        await wait_for(fut, 10)
        await asyncio.sleep(3600)  # with the cancellation lost, it waits here forever

    task = asyncio.create_task(runner())
    for _ in range(3):  # loop turns: the runner is waiting on fut
        await asyncio.sleep(0)
    fut.set_result(None)
    task.cancel()
    try:
        await asyncio.wait_for(task, 2)
    except asyncio.CancelledError:
        return "cancelled"
    except TimeoutError:
        task.cancel()
        return "lost"
    return "finished"


async def test_wait_for_never_loses_an_outside_cancel() -> None:
    # asyncio.wait_for on Python 3.11 answers "lost" here: a server's aclose() hung on it
    assert await _cancel_as_it_completes(_deadline.wait_for) == "cancelled"


async def test_wait_for_times_out_and_cancels_what_it_waited_for() -> None:
    cancelled = asyncio.Event()

    async def slow() -> None:
        try:
            await asyncio.sleep(3600)  # what the timeout must cancel
        except asyncio.CancelledError:
            cancelled.set()
            raise

    with pytest.raises(TimeoutError):
        await _deadline.wait_for(slow(), 0.01)
    assert cancelled.is_set()
    assert await _deadline.wait_for(asyncio.sleep(0, "done"), None) == "done"


def test_a_deadline_is_shared_by_its_steps_and_never_raised() -> None:
    forever = _deadline.Deadline(None)
    assert forever.left() is None and not forever.expired and forever.least(5.0) == 5.0
    budget = _deadline.Deadline(0.2)
    first = budget.left()
    assert first is not None and 0 < first <= 0.2
    time.sleep(0.01)  # a step that takes time: the behaviour under test
    second = budget.left()
    assert second is not None and second < first  # one budget, spent across steps
    assert budget.least(60.0) == pytest.approx(budget.left(), abs=0.01)  # no cap raises it
    assert budget.least(0.001) == 0.001
    spent = _deadline.Deadline(0.0)
    assert spent.expired and spent.left() == 0.0


async def test_aclose_returns_though_a_handler_lost_its_cancellation() -> None:
    """A handler that swallows the cancellation aclose() sends (as asyncio.wait_for could)
    must not leave its session waiting for the peer's next message forever."""
    ps = ParameterServer(num_workers=1, transport="tcp", log_every=None)
    entered = asyncio.Event()

    async def swallowing_handle(ep: tx.Endpoint, payload: bytes) -> None:
        entered.set()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.sleep(3600)  # the handler that swallows aclose()'s cancellation

    ps.service._handle = swallowing_handle  # type: ignore[method-assign]
    async with tx.Node(listen=None, transport="tcp") as client:
        await ps.start()
        try:
            ep = await client.connect(ps.address)
            await ep.notify(b"anything")
            await asyncio.wait_for(entered.wait(), 10)
        finally:
            await asyncio.wait_for(ps.aclose(), 10)
