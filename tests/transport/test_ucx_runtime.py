"""The UCX runtime's completion: a wait ends when its ops complete, when its timer runs out
or as soon as its lane's peer is seen to fail; nothing in between polls. Waits here are
real ``tx_wait_t`` of a real runtime, with an op in flight stood in by one more count."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import AsyncIterator

import pytest

pytest.importorskip("ucxx")

from tensorx.errors import BrokenError, TimeoutError
from tensorx.transport._ucx_progress import ProgressDriver
from tensorx.transport._ucx_runtime import UcxRuntime
from tensorx.transport.ucx import UcxFactory

pytestmark = pytest.mark.ucx


@pytest.fixture
async def runtime() -> AsyncIterator[UcxRuntime]:
    factory = UcxFactory(error_handling=True)
    factory.runtime.attach_loop()
    yield factory.runtime
    await factory.aclose()


def in_flight(runtime: UcxRuntime) -> object:
    """A wait with one op UCX has not completed (and never will, by itself)."""
    w = runtime.new_wait()
    w.pending += 1
    return w


def done(runtime: UcxRuntime, w: object) -> None:
    """The op in flight completes, as UCX's callback would have it, and its eventfd's
    callback runs (the process's count of waits in flight goes back down too)."""
    runtime.lib.tx_wait_release(w)
    runtime._on_event()


async def test_a_peer_seen_to_fail_ends_its_waits_at_once(runtime: UcxRuntime) -> None:
    told: list[str] = []
    watch = runtime.watch_peer("peer", told.append)
    w = in_flight(runtime)
    waiting = asyncio.ensure_future(runtime.complete(w, None, inline=False, watch=watch))
    await asyncio.sleep(0)
    assert not waiting.done()
    runtime.peer_failed(watch, "the peer process exited")
    with pytest.raises(BrokenError, match="peer process exited"):
        await asyncio.wait_for(waiting, 5)  # no timeout of its own: only the failure ends it
    assert told == ["the peer process exited"]
    assert w in runtime._orphans  # UCX still owns it: kept alive until it completes
    done(runtime, w)


async def test_a_wait_ends_on_its_timer_and_on_its_completion(runtime: UcxRuntime) -> None:
    w = in_flight(runtime)
    with pytest.raises(TimeoutError):
        await runtime.complete(w, 0.05, inline=False)
    done(runtime, w)
    other = in_flight(runtime)
    waiting = asyncio.ensure_future(runtime.complete(other, None, inline=False))
    await asyncio.sleep(0)
    done(runtime, other)
    await asyncio.wait_for(waiting, 5)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="one core: the driver never polls")
async def test_an_op_that_completes_without_waking_the_driver_is_not_slept_through(
        runtime: UcxRuntime) -> None:
    """A completion that writes no fd the driver sleeps on (a CUDA copy ending on the
    device, a shared-memory transfer, a worker fd that stays quiet after arming): the
    driver keeps polling while the op is in flight, so no epoll timeout (1 ms) lies
    between the completion and the wait's end. Before, it slept after 50 us of quiet and
    each such op cost one timed-out sleep."""
    driver = ProgressDriver._running
    assert runtime.driver and driver is not None
    loop = asyncio.get_running_loop()
    before = driver.timeouts
    for _ in range(20):
        w = in_flight(runtime)

        def finish(w: object = w) -> None:  # the op ends 0.3 ms later, waking nobody
            time.sleep(0.0003)
            runtime.lib.tx_wait_release(w)
            loop.call_soon_threadsafe(runtime._on_event)

        thread = threading.Thread(target=finish)
        thread.start()
        await runtime.complete(w, 5, inline=False)
        thread.join()
        await asyncio.sleep(0.003)  # no next op to wake a sleeping driver early
    # (before: 20 of 20; one or two allowed for a loaded machine descheduling the driver)
    assert driver.timeouts - before <= 2
