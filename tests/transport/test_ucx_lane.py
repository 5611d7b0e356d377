"""The UCX lane between two real processes: one-sided put/get, failures, reconnects.

The owner (``tests/support/ucx_owner.py``) runs in a spawned process whose main thread sits
in its event loop waiting for test commands on a pipe; only UCX's progress thread serves the
reads and writes.
"""

from __future__ import annotations

import asyncio
import contextlib
import glob
import multiprocessing as mp
import os
import signal
from collections.abc import AsyncIterator, Iterator
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import pytest

pytest.importorskip("ucxx")

from tensorx._deadline import Deadline
from tensorx.errors import (
    BrokenError,
    ClosedError,
    ProtocolError,
    RegionError,
    TimeoutError,
    TransportUnavailableError,
)
from tensorx.memregion import MemoryRegion, RegionDescriptor
from tensorx.testing import wait_until
from tensorx.transport.base import Op
from tensorx.transport.ucx import UcxFactory, UcxLane
from tests.support.ucx_owner import OWNER_BYTES, MiB, Owner, digest, owner_process, pattern

pytestmark = pytest.mark.ucx


@pytest.fixture(scope="module")
def owner() -> Iterator[Owner]:
    with owner_process() as o:
        yield o


@pytest.fixture
async def factory() -> AsyncIterator[UcxFactory]:
    f = UcxFactory(error_handling=True)
    yield f
    await f.aclose()


@pytest.fixture
async def lane(factory: UcxFactory, owner: Owner) -> AsyncIterator[UcxLane]:
    lane = await factory.connect(owner.info, peer="owner", timeout=10)
    yield lane
    await lane.aclose()


# -- data movement ------------------------------------------------------------------------
@pytest.mark.parametrize("nbytes", [0, 1, 4096, 16 * MiB, 64 * MiB])
async def test_put_then_get_roundtrip(lane: UcxLane, owner: Owner, nbytes: int) -> None:
    local = MemoryRegion.allocate(nbytes + 8)
    local.view(np.uint8)[:] = pattern(nbytes + 8, nbytes)
    roff = 4096 if nbytes < 64 * MiB else 1
    await lane.write(Op(local, owner.desc, 8, roff, nbytes), timeout=20)
    # complete means in the owner's memory, seen there without a flush
    assert owner.ask("digest", roff, nbytes) == digest(local.buffer()[8:8 + nbytes])
    back = MemoryRegion.allocate(nbytes)
    await lane.read(Op(back, owner.desc, 0, roff, nbytes), timeout=20)
    assert digest(back.buffer()) == digest(local.buffer()[8:8 + nbytes])


async def test_lane_info_names_real_lanes(lane: UcxLane) -> None:
    info = lane.info
    assert info["transport"] == "ucx"
    assert info["error_handling"] is True
    assert any(name.startswith("tcp/") for name in info["lanes"])
    assert any("am" in roles for roles in info["roles"].values())
    assert "BrokenError" in info["why"]
    assert "lane[" in lane.describe()


async def test_concurrent_writes_and_write_many(lane: UcxLane, owner: Owner) -> None:
    n, k = 256 * 1024, 16
    local = MemoryRegion.allocate(n * k)
    local.view(np.uint8)[:] = pattern(n * k, 11)
    await asyncio.gather(*(lane.write(Op(local, owner.desc, i * n, i * n, n), timeout=20)
                           for i in range(k)))
    assert owner.ask("digest", 0, n * k) == digest(local.buffer())
    local.view(np.uint8)[:] = pattern(n * k, 12)
    await lane.write_many([Op(local, owner.desc, i * n, i * n, n) for i in range(k)],
                          timeout=20)
    assert owner.ask("digest", 0, n * k) == digest(local.buffer())
    reads = [MemoryRegion.allocate(n) for _ in range(k)]
    await asyncio.gather(*(lane.read(Op(r, owner.desc, 0, i * n, n), timeout=20)
                           for i, r in enumerate(reads)))
    assert b"".join(bytes(r.buffer()) for r in reads) == bytes(local.buffer())


async def test_small_puts_complete_one_after_another(lane: UcxLane, owner: Owner) -> None:
    """200 small puts in a row, each awaited: each completes (with its flush) and the last
    one's bytes are the owner's. (Their latency is measured by benchmarks/transfer.py.)"""
    local = MemoryRegion.allocate(8)
    op = Op(local, owner.desc, 0, 0, 8)
    for value in range(200):
        local.view(np.uint8)[:] = value
        await lane.write(op, timeout=5)
    assert owner.ask("digest", 0, 8) == digest(bytes([199] * 8))


async def test_symmetric_lane_owner_writes_back(factory: UcxFactory, lane: UcxLane,
                                                owner: Owner) -> None:
    mine = MemoryRegion.allocate(4096)
    desc = RegionDescriptor("client", mine.region_id, 1, mine.nbytes, "cpu", "rw",
                            {"ucx": factory.register(mine)})
    info = owner.ask("lane", factory.local_info())
    assert info["transport"] == "ucx"
    assert owner.ask("write_back", 4096, desc.to_bytes()) == "ok"
    assert digest(mine.buffer()) == owner.ask("digest", 0, 4096)
    assert any(mine.buffer())


async def test_cancelled_write_leaves_lane_usable(lane: UcxLane, owner: Owner) -> None:
    local = MemoryRegion.allocate(64 * MiB)
    task = asyncio.ensure_future(lane.write(Op(local, owner.desc, 0, 0, 64 * MiB), timeout=20))
    await asyncio.sleep(0)  # one loop turn: the write is issued
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    small = MemoryRegion.allocate(16)
    small.view(np.uint8)[:] = 9
    await lane.write(Op(small, owner.desc, 0, 0, 16), timeout=20)
    assert owner.ask("digest", 0, 16) == digest(bytes([9] * 16))


# -- errors -------------------------------------------------------------------------------
async def test_bad_descriptors_and_ranges(lane: UcxLane, owner: Owner) -> None:
    local = MemoryRegion.allocate(64)
    no_key = RegionDescriptor("owner", 5, 1, 64, "cpu", "rw", {})
    with pytest.raises(RegionError, match="not exported over UCX"):
        await lane.write(Op(local, no_key, 0, 0, 8), timeout=5)
    with pytest.raises(RegionError, match="outside"):
        await lane.write(Op(local, owner.desc, 0, OWNER_BYTES - 4, 8), timeout=5)


async def test_closed_lane_raises_closed(factory: UcxFactory, owner: Owner) -> None:
    lane = await factory.connect(owner.info, peer="owner", timeout=10)
    await lane.aclose()
    await lane.aclose()
    lane.abort()
    with pytest.raises(ClosedError):
        await lane.write(Op(MemoryRegion.allocate(8), owner.desc, 0, 0, 8), timeout=5)


async def test_error_handling_default_comes_from_environment(
        monkeypatch: pytest.MonkeyPatch) -> None:
    for value, expected in (("0", False), ("1", True), (None, True)):
        if value is None:
            monkeypatch.delenv("TENSORX_UCX_ERROR_HANDLING")
        else:
            monkeypatch.setenv("TENSORX_UCX_ERROR_HANDLING", value)
        f = UcxFactory()
        assert f.error_handling is expected
        await f.aclose()


async def test_mismatched_error_handling_is_unavailable(owner: Owner) -> None:
    fast = UcxFactory(error_handling=False)
    try:
        with pytest.raises(TransportUnavailableError, match="error handling"):
            await fast.connect(owner.info, peer="owner", timeout=5)
        with pytest.raises(ProtocolError, match="worker address"):
            await fast.connect({}, peer="nobody", timeout=5)
    finally:
        await fast.aclose()


async def test_register_is_cached_and_released_on_close(factory: UcxFactory) -> None:
    region = MemoryRegion.allocate(4096)
    keys = factory.register(region)
    assert factory.register(region) == keys
    assert keys["addr"] == region.address
    assert keys["rkey"]
    region.close()
    assert region.region_id not in factory.runtime._regs
    assert factory.register(MemoryRegion.allocate(0))["rkey"] == b""


async def _write_forever(lane: UcxLane, op: Op) -> None:
    while True:
        await lane.write(op, timeout=10)


async def test_peer_killed_mid_transfer_then_reconnect(factory: UcxFactory) -> None:
    local = MemoryRegion.allocate(64 * MiB)
    with owner_process() as victim:
        lane = await factory.connect(victim.info, peer="victim", timeout=10)
        op = Op(local, victim.desc, 0, 0, 64 * MiB)
        await lane.write(op, timeout=10)
        asyncio.get_running_loop().call_later(0.02, victim.kill)
        with pytest.raises(BrokenError):  # not a TimeoutError: the death was noticed
            await _write_forever(lane, op)
        with pytest.raises(BrokenError):
            await lane.read(op, timeout=10)
        await asyncio.wait_for(lane.aclose(), 5)
    with owner_process() as reborn:  # a restarted peer is reachable from the same factory
        lane = await factory.connect(reborn.info, peer="reborn", timeout=10)
        local.view(np.uint8)[:4096] = 5
        await lane.write(Op(local, reborn.desc, 0, 0, 4096), timeout=10)
        assert reborn.ask("digest", 0, 4096) == digest(bytes([5] * 4096))
        await lane.aclose()


async def test_stopped_peer_times_out(factory: UcxFactory) -> None:
    local = MemoryRegion.allocate(64 * MiB)
    with owner_process() as sleeper:
        lane = await factory.connect(sleeper.info, peer="sleeper", timeout=10)
        os.kill(sleeper.pid, signal.SIGSTOP)
        try:
            with pytest.raises(TimeoutError):
                await lane.write(Op(local, sleeper.desc, 0, 0, 64 * MiB), timeout=0.5)
            await asyncio.wait_for(lane.aclose(), 10)  # shutdown never hangs
        finally:
            os.kill(sleeper.pid, signal.SIGCONT)


# -- the fast mode ---------------------------------------------------------------------
async def test_without_error_handling_uses_shared_memory_lanes() -> None:
    fast = UcxFactory(error_handling=False)
    try:
        with owner_process(error_handling=False) as peer:
            lane = await fast.connect(peer.info, peer="peer", timeout=10)
            assert {"cma/memory", "posix/memory"} & set(lane.info["lanes"])
            assert "rma_bw" in lane.info["roles"].get("cma/memory", [])
            local = MemoryRegion.allocate(16 * MiB)
            local.view(np.uint8)[:] = pattern(16 * MiB, 21)
            await lane.write(Op(local, peer.desc, 0, 0, 16 * MiB), timeout=10)
            assert peer.ask("digest", 0, 16 * MiB) == digest(local.buffer())
            back = MemoryRegion.allocate(16 * MiB)
            await lane.read(Op(back, peer.desc, 0, 0, 16 * MiB), timeout=10)
            assert bytes(back.buffer()) == bytes(local.buffer())
            await lane.aclose()
    finally:
        await fast.aclose()


def _in_child(target: Any, timeout: float = 90.0) -> Any:
    """Run ``target(conn)`` in a spawned child (UCX configuration, or a crash, stays
    there) and return what it sends; the child must exit cleanly."""
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=target, args=(child,))
    proc.start()
    try:
        deadline = Deadline(timeout)
        while not conn.poll(0.1):
            assert proc.is_alive(), f"child died (exit code {proc.exitcode})"
            if deadline.expired:
                raise TimeoutError(f"child did not answer in {timeout} s")
        result = conn.recv()
    finally:
        proc.join(20)
        if proc.is_alive():
            proc.kill()
    assert proc.exitcode == 0
    return result


def _fast_lane_after_peer_death(conn: Connection) -> None:
    async def main() -> str:
        fast = UcxFactory(error_handling=False)
        try:
            with owner_process(error_handling=False) as peer:
                lane = await fast.connect(peer.info, peer="peer", timeout=10)
                op = Op(MemoryRegion.allocate(4096), peer.desc, 0, 0, 4096)
                await lane.write(op, timeout=10)
                peer.kill()
                await wait_until(lambda: lane._broken is not None,
                                 what="the pidfd watch noticing the death")
                try:
                    await lane.write(op, timeout=10)
                except BrokenError:
                    lane.abort()
                    return "broken"
                return "written"
        finally:
            await fast.aclose()

    conn.send(asyncio.run(main()))


def test_without_error_handling_a_dead_peer_is_broken_not_an_abort() -> None:
    # In a child: without UCX error handling, libucp aborts the process that touches a
    # dead peer; the lane must refuse the op first.
    assert _in_child(_fast_lane_after_peer_death) == "broken"


def _close_memory_of_a_timed_out_write(conn: Connection) -> None:
    import gc

    import tensorx as tx
    from tensorx.testing import OwnerProcess

    async def main() -> str:
        async with OwnerProcess("ucx") as owner, tx.Node(listen=None, transport="ucx") as node:
            desc = await owner.export(256 * MiB)
            ep = await node.connect(owner.address)
            data = np.ones(256 * MiB, np.uint8)
            region = tx.MemoryRegion.register(data)
            outcome = "completed"
            try:
                await ep.write(region, desc, timeout=0.002)
            except tx.TimeoutError:
                outcome = "timed out"
            region.close()  # UCX may still be reading it: its memory must stay
            del data, region
            gc.collect()
            small = tx.MemoryRegion.register(np.zeros(16, np.uint8))
            await ep.write(small, desc, nbytes=16, timeout=30)
            await ep.notify(b"", timeout=30)  # flushes: the timed-out write has finished
            return outcome

    conn.send(asyncio.run(main()))


def test_closing_memory_under_a_timed_out_write_is_safe() -> None:
    """A UCX op that timed out still reads its memory; closing and freeing the region must
    not pull the memory from under it (this used to crash the process)."""
    assert _in_child(_close_memory_of_a_timed_out_write) in ("timed out", "completed")


# -- progress -------------------------------------------------------------------------------
async def _big_roundtrip(lane: UcxLane, owner: Owner, seed: int) -> None:
    local = MemoryRegion.allocate(16 * MiB)
    local.view(np.uint8)[:] = pattern(16 * MiB, seed)
    await lane.write(Op(local, owner.desc, 0, 0, 16 * MiB), timeout=20)
    back = MemoryRegion.allocate(16 * MiB)
    await lane.read(Op(back, owner.desc, 0, 0, 16 * MiB), timeout=20)
    assert digest(back.buffer()) == digest(local.buffer())


async def test_progress_driver_takes_over_and_hands_back(owner: Owner) -> None:
    """tensorx initialised ucxx here, so its progress driver replaces ucxx's thread while a
    factory wants it; afterwards ucxx's thread progresses again (large ops rely on it)."""
    first = UcxFactory(error_handling=True, progress_spin_us=20)
    try:
        assert first.driver
        lane = await first.connect(owner.info, peer="owner", timeout=10)
        await _big_roundtrip(lane, owner, 11)
        await lane.aclose()
    finally:
        await first.aclose()
    assert not first.driver
    plain = UcxFactory(error_handling=True, progress_spin_us=None)
    try:
        assert not plain.driver
        lane = await plain.connect(owner.info, peer="owner", timeout=10)
        await _big_roundtrip(lane, owner, 12)  # progressed by ucxx's thread again
        await lane.aclose()
    finally:
        await plain.aclose()


def _driver_under_foreign_ucxx(conn: Connection) -> None:
    import ucxx

    ucxx.init(progress_mode="thread")  # someone else's ucxx, first in this process

    async def main() -> bool:
        factory = UcxFactory(error_handling=True, progress_spin_us=50)
        try:
            return bool(factory.driver)
        finally:
            await factory.aclose()

    conn.send(asyncio.run(main()))


def test_a_process_whose_ucxx_someone_else_started_keeps_its_progress() -> None:
    assert _in_child(_driver_under_foreign_ucxx) is False


@pytest.mark.gpu
async def test_cuda_tensor_registers_as_cuda_memory(factory: UcxFactory) -> None:
    if not glob.glob("/dev/nvidia[0-9]*"):
        pytest.skip("no CUDA device")
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    region = MemoryRegion.register(torch.zeros(1024, device="cuda"))
    keys = factory.register(region)
    assert keys["rkey"]
    assert keys["addr"] == region.address
    region.close()


# -- progress --------------------------------------------------------------------------
def _driver_timeouts() -> int:
    from tensorx.transport._ucx_progress import ProgressDriver

    driver = ProgressDriver._running
    assert driver is not None, "tensorx's progress driver is not running"
    return driver.timeouts


@pytest.mark.parametrize("error_handling", [True, False], ids=["tcp", "shared-memory"])
async def test_the_progress_driver_does_not_sleep_through_completions(
        error_handling: bool) -> None:
    """While an op is in flight the driver polls (up to BUSY_SPIN_NS of quiet) instead of
    sleeping in epoll, whose 1 ms timeout, not the op, then set the op's time: small ops
    over tcp took about 3 ms where the worker's fd did not wake the sleeper, and a
    shared-memory or CUDA copy never wakes it. Counted here: the sleeps an op in flight
    ended by timing out, over 400 steady-state ops of 8 B and 64 KiB each way (before:
    about one per op; a few are allowed for a loaded CI machine descheduling the peer)."""
    factory = UcxFactory(error_handling=error_handling)
    try:
        with owner_process(error_handling=error_handling) as peer:
            lane = await factory.connect(peer.info, peer="peer", timeout=10)
            if not error_handling:
                assert {"cma/memory", "posix/memory"} & set(lane.info["lanes"])
            local = MemoryRegion.allocate(64 * 1024)
            ops = [Op(local, peer.desc, 0, 0, n) for n in (8, 64 * 1024)]

            async def run(rounds: int) -> None:
                for _ in range(rounds):
                    for op in ops:
                        await lane.write(op, timeout=10)
                        await lane.read(op, timeout=10)

            await run(10)
            before = _driver_timeouts()
            await run(100)
            timed_out = _driver_timeouts() - before
            assert timed_out <= 8, f"{timed_out} timed-out sleeps over 400 ops"
            await lane.aclose()
    finally:
        await factory.aclose()


@pytest.mark.parametrize("error_handling", [True, False], ids=["tcp", "shared-memory"])
async def test_calls_of_any_size_complete_inline_where_the_lanes_copy_in_the_call(
        error_handling: bool) -> None:
    """Over cma/posix a put or get copies inside the issuing call, so even a 16 MiB call or
    a window of 16 x 64 KiB is done after a few inline progress passes: it never waits for
    the driver thread (waking it cost about 150 us per call, and halved a window's speed).
    Over tcp a call of inline_bytes or more still leaves progress to the driver."""
    factory = UcxFactory(error_handling=error_handling)
    waits = 0
    wait = factory.runtime.wait

    async def counted(*args: Any, **kwargs: Any) -> None:
        nonlocal waits
        waits += 1
        await wait(*args, **kwargs)

    factory.runtime.wait = counted  # type: ignore[method-assign]
    try:
        with owner_process(error_handling=error_handling) as peer:
            lane = await factory.connect(peer.info, peer="peer", timeout=10)
            local = MemoryRegion.allocate(16 * MiB)
            local.view(np.uint8)[:] = pattern(16 * MiB, 23)
            waits = 0
            await lane.write_many([Op(local, peer.desc, i * 64 * 1024, i * 64 * 1024,
                                      64 * 1024) for i in range(16)], timeout=10)
            await lane.write(Op(local, peer.desc, 0, 0, 16 * MiB), timeout=10)
            back = MemoryRegion.allocate(16 * MiB)
            await lane.read(Op(back, peer.desc, 0, 0, 16 * MiB), timeout=10)
            assert bytes(back.buffer()) == bytes(local.buffer())
            if error_handling:
                assert waits >= 1, "large calls over tcp left no progress to the driver"
            else:
                assert {"cma/memory", "posix/memory"} & set(lane.info["lanes"])
                assert waits == 0, f"{waits} of 3 calls waited for the driver thread"
            await lane.aclose()
    finally:
        await factory.aclose()
