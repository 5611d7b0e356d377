"""#16 item 2 on the UCX lane itself, in both error-handling modes: once a read raised
(timed out or cancelled), its gets never write the caller's memory again, and the lane is
either usable (a new endpoint where the old one was force-closed) or broken, never a zombie.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal

import numpy as np
import pytest

pytest.importorskip("ucxx")

from tensorx.errors import BrokenError, TimeoutError
from tensorx.memregion import MemoryRegion
from tensorx.transport.base import Op
from tensorx.transport.ucx import UcxFactory, UcxLane
from tests.support.ucx_owner import MiB, Owner, digest, owner_process

pytestmark = [pytest.mark.ucx, pytest.mark.parametrize("error_handling", [True, False])]

BIG = 64 * MiB
TAIL = (np.arange(BIG, BIG + 4096, dtype=np.uint64) * 2654435761 + 3).astype(np.uint8)


async def _usable_or_broken(lane: UcxLane, peer: Owner) -> str:
    """Read the owner's last 4 KiB: ``usable`` (right bytes) or ``broken`` (BrokenError at
    once, every time); anything else (a timeout: a zombie) fails."""
    small = MemoryRegion.allocate(4096)
    try:
        await lane.read(Op(small, peer.desc, 0, BIG, 4096), timeout=30)
    except BrokenError:
        with pytest.raises(BrokenError):
            await lane.read(Op(small, peer.desc, 0, BIG, 4096), timeout=30)
        return "broken"
    assert bytes(small.buffer()) == TAIL.tobytes()
    return "usable"


async def _untouched_later(lane: UcxLane, peer: Owner, out: np.ndarray,
                           before: np.ndarray | None = None) -> None:
    """``out`` as the raise left it (``before``) stays so: checked after another read over
    the lane and a pause far longer than the rest of a 64 MiB reply takes to arrive."""
    before = out.copy() if before is None else before
    assert await _usable_or_broken(lane, peer) == "usable"
    await asyncio.sleep(0.5)  # the window a late write would land in: no event marks one
    assert np.array_equal(out, before), "a get that raised wrote the buffer later"


def _waiting_factory(error_handling: bool) -> UcxFactory:
    """No inline progress: a read waits for the driver thread, so a short timeout or a
    cancel can land while UCX owns its gets (on cma a read progressed inline is done before
    the call returns, and nothing is left to stop)."""
    return UcxFactory(error_handling=error_handling, inline_progress=0)


async def test_timed_out_get_never_writes_the_buffer_again(error_handling: bool) -> None:
    factory = _waiting_factory(error_handling)
    try:
        with owner_process(error_handling=error_handling) as peer:
            lane = await factory.connect(peer.info, peer="peer", timeout=10)
            timed_out = 0
            for timeout in (0.0005, 0.005):
                out = np.zeros(BIG, np.uint8)
                try:
                    await lane.read(Op(MemoryRegion.register(out), peer.desc, 0, 0, BIG),
                                    timeout=timeout)
                except TimeoutError:
                    timed_out += 1
                    await _untouched_later(lane, peer, out)
            assert timed_out
            await lane.aclose()
    finally:
        await factory.aclose()


async def test_cancelled_get_never_writes_the_buffer_again(error_handling: bool) -> None:
    factory = _waiting_factory(error_handling)
    try:
        with owner_process(error_handling=error_handling) as peer:
            lane = await factory.connect(peer.info, peer="peer", timeout=10)
            for delay in (0, 0.005):
                out = np.zeros(BIG, np.uint8)
                task = asyncio.ensure_future(
                    lane.read(Op(MemoryRegion.register(out), peer.desc, 0, 0, BIG), timeout=30))
                await asyncio.sleep(delay)  # where the cancel lands: at once, or mid-transfer
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                await _untouched_later(lane, peer, out)
            await lane.aclose()
    finally:
        await factory.aclose()


async def test_other_reads_in_flight_survive_the_reset(error_handling: bool) -> None:
    """A read that times out must not fail the others in flight on the lane: where its
    endpoint is force-closed under them, they are issued again on the new one."""
    factory = UcxFactory(error_handling=error_handling)
    try:
        with owner_process(error_handling=error_handling) as peer:
            lane = await factory.connect(peer.info, peer="peer", timeout=10)
            half = BIG // 2
            slow = MemoryRegion.allocate(BIG)
            others = [MemoryRegion.allocate(half) for _ in range(3)]
            reads = [asyncio.ensure_future(lane.read(Op(r, peer.desc, 0, half, half),
                                                     timeout=60)) for r in others]
            with contextlib.suppress(TimeoutError):
                await lane.read(Op(slow, peer.desc, 0, 0, BIG), timeout=0.0005)
            await asyncio.gather(*reads)
            want = peer.ask("digest", half, half)
            assert all(digest(r.buffer()) == want for r in others)
            assert await _usable_or_broken(lane, peer) == "usable"
            await lane.aclose()
    finally:
        await factory.aclose()


async def test_get_whose_owner_stalls_mid_transfer_never_lands_late(
        error_handling: bool) -> None:
    """The owner stops (SIGSTOP) once the first bytes landed, the read times out, then the
    owner resumes and serves the rest of the reply: none of it reaches the buffer."""
    if not error_handling:
        pytest.skip("over shared memory a stopped owner does not stall a get (cma copies)")
    factory = UcxFactory(error_handling=error_handling)
    try:
        with owner_process(error_handling=error_handling) as peer:
            lane = await factory.connect(peer.info, peer="peer", timeout=10)
            out = np.zeros(BIG, np.uint8)
            task = asyncio.ensure_future(
                lane.read(Op(MemoryRegion.register(out), peer.desc, 0, 0, BIG), timeout=1.0))
            for _ in range(1_000_000):  # no event says "bytes landed": poll the buffer
                if out[:4096].any() or task.done():
                    break
                await asyncio.sleep(0)
            os.kill(peer.pid, signal.SIGSTOP)
            try:
                with pytest.raises(TimeoutError):
                    await task
                before = out.copy()
            finally:
                os.kill(peer.pid, signal.SIGCONT)
            await _untouched_later(lane, peer, out, before)
            await lane.aclose()
    finally:
        await factory.aclose()
