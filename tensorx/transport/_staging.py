"""GPU memory over the TCP lane: device bytes staged through a few pinned host buffers.

A socket can only move host memory, so a CUDA range travels in chunks of :data:`CHUNK`
bytes through :data:`POOL` pinned buffers per connection and direction (allocated on first
use, released with the connection). The device copy of one chunk overlaps the socket
transfer of the previous one:

* sending (a write from a GPU region, or the owner serving a read of one): the
  device-to-host copy of chunk i+1 runs on a side stream while chunk i goes out;
* receiving (the owner landing a write in a GPU region, or a read into one): the socket
  fills chunk i+1 while the host-to-device copy of chunk i runs.

Copies wait on the device's current stream first, so a range is read after (and written
after) the kernels queued before the op. A receive returns only once its last copy's event
has completed: then any later kernel, on any stream, sees the data.

Waiting on a CUDA event from asyncio: :func:`wait_event` polls ``event.query()`` once a
loop turn for :data:`tensorx._cuda.SPIN_S` (the loop's selector never sleeps less than
1 ms, far longer than a chunk's copy), then with sleeps (50 us doubling to 1 ms), instead
of ``run_in_executor(synchronize)``. A 4 MiB copy takes about 100 us, about what a thread
hop costs; the default executor is
shared and bounded (a stuck copy would hold one of its threads), and polling never blocks
the event loop. A receive that fails (the op raised, the peer died) waits synchronously
for its few copies still in flight (:meth:`StagedRange.quiesce`, at most POOL chunk copies)
before the error reaches the caller, so no copy lands in the caller's memory afterwards.

``TENSORX_STAGE_HOST=1`` (tests only) sends host regions through this same path, with
host memory standing in for device memory and copies that complete late (on the second
poll), so the CPU-only suite exercises the staging and its ordering. It is read once per
connection (a spawned owner sets it after importing us, before its node starts).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from tensorx import _cuda
from tensorx.memregion import MemoryRegion
from tensorx.transport._exceptions import TORCH_ERRORS, map_exceptions
from tensorx.transport._sock import FrameReader

__all__ = ["CHUNK", "POOL", "Land", "RecvStager", "SendStager", "StagedRange", "describe",
           "has_staged", "split_staged", "stage_host", "staged_range"]

CHUNK = 4 << 20
POOL = 2


class Land(Protocol):
    """Receive the current frame's payload into ``dest`` (staged for GPU memory);
    ``live()`` is asked before every write into it. Returns whether ``dest`` was filled."""

    def __call__(self, dest: memoryview | StagedRange,
                 live: Callable[[], bool] = ...) -> Awaitable[bool]: ...


def describe() -> str:
    """What ``ep.info["gpu"]`` says about GPU memory over TCP."""
    return f"staged via pinned host, {CHUNK >> 20} MiB x {POOL}"


def stage_host() -> bool:
    """The test-only switch: whether host regions are staged too."""
    return os.environ.get("TENSORX_STAGE_HOST") == "1"


class Event(Protocol):
    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


async def wait_event(event: Event) -> None:
    """Wait for a copy without blocking the loop (see the module docstring)."""
    if await _cuda.spin(event):  # most copies end here
        return
    delay = 5e-5
    while not event.query():
        await asyncio.sleep(delay)
        delay = min(delay * 2, 1e-3)


class StagedRange:
    """A range of a region the socket cannot address: the device side of a staged op.

    Built when the op starts (a closed region fails there); holds the memory alive until
    dropped. ``len()`` is its size, so it stands where a payload memoryview would."""

    def __init__(self, region: MemoryRegion, offset: int, nbytes: int) -> None:
        self.nbytes = nbytes
        self.copier: _Copier = _CudaCopier(region) if region.is_cuda else _HostCopier()
        self.target = self.copier.target(region, offset, nbytes)
        self.inflight: list[Event] = []  # copies into the target not yet known complete

    def __len__(self) -> int:
        return self.nbytes

    def quiesce(self) -> None:
        """Block until every copy into the target has landed (a failing op's last step)."""
        for event in self.inflight:
            event.synchronize()
        self.inflight.clear()


def staged_range(region: MemoryRegion, offset: int, nbytes: int,
                 host: bool) -> memoryview | StagedRange:
    """The payload of an op on ``region``: its bytes, or a range to stage (GPU memory,
    and host memory too where ``host``, the connection's :func:`stage_host`)."""
    if host or region.is_cuda:
        return StagedRange(region, offset, nbytes)
    return region.buffer()[offset:offset + nbytes]


class _Stager:
    """One direction of one connection: its pool of staging buffers, made on first use."""

    def __init__(self) -> None:
        self._pools: dict[str, list[Any]] = {}

    def _pool(self, copier: _Copier) -> list[Any]:
        pool = self._pools.get(copier.kind)
        if pool is None:
            pool = self._pools[copier.kind] = [copier.buffer(CHUNK) for _ in range(POOL)]
        return pool

    @property
    def buffers(self) -> int:
        """Staging buffers held (at most POOL per kind of memory)."""
        return sum(len(pool) for pool in self._pools.values())

    def release(self) -> None:
        """The connection is over. A pinned buffer a copy still uses is kept by torch's
        host allocator until that copy's event has completed."""
        self._pools.clear()


class SendStager(_Stager):
    """Streams staged payloads onto the socket; only the connection's writer uses it."""

    async def stream(self, rng: StagedRange,
                     send: Callable[[list[Any]], Awaitable[None]]) -> None:
        """Copy ``rng`` out chunk by chunk and ``send`` each; the copy of the next chunk
        runs while the previous one is sent."""
        pool = self._pool(rng.copier)
        chunks = _chunks(rng.nbytes)
        events: list[Event] = []
        for i, (start, n) in enumerate(chunks[:POOL]):
            events.append(rng.copier.d2h(rng.target, start, n, pool[i]))
        for i, (_, n) in enumerate(chunks):
            slot = i % POOL
            await wait_event(events[i])
            await send([rng.copier.view(pool[slot], n)])  # the kernel has the bytes now
            if i + POOL < len(chunks):
                start, size = chunks[i + POOL]
                events.append(rng.copier.d2h(rng.target, start, size, pool[slot]))


class RecvStager(_Stager):
    """Lands staged payloads from the socket; only the connection's reader uses it."""

    async def receive(self, reader: FrameReader, rng: StagedRange,
                      live: Callable[[], bool] = lambda: True) -> bool:
        """Fill ``rng`` from the socket; returns once every copy has landed. ``live`` is
        asked right before each copy into the target: once False (the op has raised) the
        rest of the payload is read and dropped. Returns whether ``rng`` was filled."""
        try:
            return await self._receive(reader, rng, live)
        except BaseException:  # the peer died, or the reader stops: nothing lands later
            rng.quiesce()
            raise

    async def _receive(self, reader: FrameReader, rng: StagedRange,
                       live: Callable[[], bool]) -> bool:
        pool = self._pool(rng.copier)
        slots: list[Event | None] = [None] * POOL
        pos = 0
        for i, (start, n) in enumerate(_chunks(rng.nbytes)):
            slot = i % POOL
            previous = slots[slot]
            if previous is not None:  # its buffer is free once its copy is done
                await wait_event(previous)
                _forget(rng, previous)
            pos = start + n
            filled = await reader.read_into(rng.copier.view(pool[slot], n), live)
            if not filled or not live():
                await reader.discard(rng.nbytes - pos)
                return False
            event = rng.copier.h2d(pool[slot], n, rng.target, start)
            slots[slot] = event
            rng.inflight.append(event)
        for event in rng.inflight[:]:
            await wait_event(event)
            _forget(rng, event)
        return True


def _forget(rng: StagedRange, event: Event) -> None:
    if event in rng.inflight:
        rng.inflight.remove(event)


def _chunks(nbytes: int) -> list[tuple[int, int]]:
    return [(start, min(CHUNK, nbytes - start)) for start in range(0, nbytes, CHUNK)]


class _Copier(Protocol):
    kind: str

    def target(self, region: MemoryRegion, offset: int, nbytes: int) -> Any: ...

    def buffer(self, size: int) -> Any: ...

    def view(self, buf: Any, n: int) -> memoryview: ...

    def d2h(self, target: Any, start: int, n: int, buf: Any) -> Event: ...

    def h2d(self, buf: Any, n: int, target: Any, start: int) -> Event: ...


class _CudaCopier:
    """torch copies on a side stream per device, into and out of pinned buffers."""

    kind = "cuda"
    _streams: dict[str, Any] = {}  # one side stream per device, per process

    def __init__(self, region: MemoryRegion) -> None:
        with map_exceptions(f"GPU memory over TCP is staged with torch, which cannot reach "
                            f"{region.device} here", TORCH_ERRORS):
            import torch  # noqa: PLC0415 (optional dependency)

            self._device = torch.device(region.device)
            stream = self._streams.get(region.device)
            if stream is None:
                stream = torch.cuda.Stream(self._device)  # type: ignore[no-untyped-call]
                self._streams[region.device] = stream
        self._torch = torch
        self._stream = stream

    def target(self, region: MemoryRegion, offset: int, nbytes: int) -> Any:
        return region.view(self._torch.uint8, nbytes, offset)

    def buffer(self, size: int) -> Any:
        return self._torch.empty(size, dtype=self._torch.uint8, pin_memory=True)

    def view(self, buf: Any, n: int) -> memoryview:
        return memoryview(buf.numpy())[:n]

    def _copy(self, dst: Any, src: Any) -> Event:
        torch = self._torch
        # After what is queued on the device's current stream (the op's producer, or the
        # last reader of the memory we overwrite).
        self._stream.wait_stream(torch.cuda.current_stream(self._device))
        with torch.cuda.device(self._device), torch.cuda.stream(self._stream):
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._stream)
        return event  # type: ignore[no-any-return]

    def d2h(self, target: Any, start: int, n: int, buf: Any) -> Event:
        return self._copy(buf[:n], target[start:start + n])

    def h2d(self, buf: Any, n: int, target: Any, start: int) -> Event:
        return self._copy(target[start:start + n], buf[:n])


class _HostCopier:
    """Host memory standing in for a device (``TENSORX_STAGE_HOST=1``, tests only)."""

    kind = "host"

    def target(self, region: MemoryRegion, offset: int, nbytes: int) -> memoryview:
        return region.buffer()[offset:offset + nbytes]

    def buffer(self, size: int) -> bytearray:
        return bytearray(size)

    def view(self, buf: bytearray, n: int) -> memoryview:
        return memoryview(buf)[:n]

    def d2h(self, target: memoryview, start: int, n: int, buf: bytearray) -> Event:
        return _LateCopy(memoryview(buf)[:n], target[start:start + n])

    def h2d(self, buf: bytearray, n: int, target: memoryview, start: int) -> Event:
        return _LateCopy(target[start:start + n], memoryview(buf)[:n])


class _LateCopy:
    """A copy that, like a device copy, has not happened yet when it is issued: it runs on
    the second ``query()``, at ``synchronize()`` or by itself a moment later, so code that
    skips a wait reads stale bytes, and a copy left in flight lands after its op."""

    def __init__(self, dst: memoryview, src: memoryview) -> None:
        self._dst, self._src = dst, src
        self._polls = 0
        self._done = False
        asyncio.get_running_loop().call_later(0.002, self.synchronize)

    def query(self) -> bool:
        self._polls += 1
        if self._polls >= 2:
            self.synchronize()
        return self._done

    def synchronize(self) -> None:
        if not self._done:
            self._dst[:] = self._src
            self._done = True


def has_staged(parts: list[Any]) -> bool:
    for part in parts:  # not any(<genexpr>): this runs for every frame sent
        if isinstance(part, StagedRange):
            return True
    return False


def split_staged(parts: list[Any]) -> list[list[Any] | StagedRange]:
    """Cut a frame list at its staged payloads: runs of plain buffers (one gathered send
    each) and the staged ranges between them."""
    runs: list[list[Any] | StagedRange] = [[]]
    for part in parts:
        if isinstance(part, StagedRange):
            runs += [part, []]
        else:
            runs[-1].append(part)  # type: ignore[union-attr]
    return [run for run in runs if isinstance(run, StagedRange) or run]
