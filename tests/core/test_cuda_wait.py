"""``tensorx._cuda.wait``: how a transfer waits for the kernels that produce its bytes.

The waiting logic runs here on stand-in events (``query()``/``synchronize()``, the part of
``torch.cuda.Event`` it uses); the real events are exercised by the ``gpu`` tests.
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from tensorx import _cuda
from tensorx.testing import wait_until


class Event:
    """Complete after ``polls`` queries, or once synchronized (in any thread)."""

    def __init__(self, polls: int | None) -> None:
        self.polls = polls
        self.queried = 0
        self.synchronized: list[str] = []
        self.done = threading.Event()

    def query(self) -> bool:
        self.queried += 1
        if self.polls is not None and self.queried > self.polls:
            self.done.set()
        return self.done.is_set()

    def synchronize(self) -> None:
        self.synchronized.append(threading.current_thread().name)
        self.done.wait(0.05)  # a kernel that finishes meanwhile
        self.done.set()


async def test_complete_events_cost_one_query_each() -> None:
    events = [Event(0), Event(0)]
    await _cuda.wait(events)
    assert [e.queried for e in events] == [1, 1]
    assert not any(e.synchronized for e in events)


async def test_an_event_completing_soon_is_polled_while_the_loop_runs() -> None:
    ticks = 0

    async def other_work() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)  # one loop turn: other work interleaved with the polls

    other = asyncio.ensure_future(other_work())
    event = Event(3)
    await _cuda.wait([event])
    other.cancel()
    assert event.done.is_set() and not event.synchronized
    assert ticks >= 1  # the loop went on between polls


async def test_an_event_still_running_is_waited_for_in_a_thread(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Not with sleeps between polls: the loop's selector sleeps 1 ms at least, far longer
    than the copy. (Before: an event that completes only when synchronized was never seen
    complete; here ``wait_for`` is the hang detector.)"""
    monkeypatch.setattr(_cuda, "SPIN_S", 1e-4)
    event = Event(None)
    await asyncio.wait_for(_cuda.wait([event]), 30)
    assert len(event.synchronized) == 1
    assert event.synchronized[0] != threading.current_thread().name


async def test_a_cancelled_wait_waits_for_the_events_before_it_raises(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_cuda, "SPIN_S", 10.0)  # stay in the polling phase
    event = Event(None)
    task = asyncio.ensure_future(_cuda.wait([event]))
    await wait_until(lambda: event.queried, what="the wait polling the event")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert event.done.is_set()  # synchronized before the cancellation went through
    assert event.synchronized == [threading.current_thread().name]
