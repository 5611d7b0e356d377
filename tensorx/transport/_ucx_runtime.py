"""The UCX runtime of one factory: what its lanes share, handed to each at construction.

It owns the handles of the process's UCP context and worker (ucxx's, see ``_ucp.py``),
the memory registrations, its share of the worker's progress (``_ucx_progress.py``), an
eventfd the event loop watches, the waits of ops in flight, the memory they pin, the
orphans UCX still owns, and the watches on peers.

Completion is event-driven. Every op is issued against a ``tx_wait_t`` (``_ucp_build.py``)
whose last completion, from whichever thread progresses the worker, writes the eventfd.
:meth:`UcxRuntime.complete` progresses the worker inline a few dozen times for a small op
(most finish there, in microseconds), then wakes the progress thread (``ucp_worker_signal``:
it may sleep in epoll) and awaits a future that the eventfd's callback completes. A timer
enforces the timeout, and a peer seen to fail (UCX's error callback, which also writes the
eventfd, or the pidfd of a same-host peer) fails the waits of its lane at once: the event
loop never polls.

A wait whose caller gave up (timeout, cancellation, a broken peer) while UCX still owns its
ops becomes an orphan: kept alive (UCX's callback writes into it) until it completes, with
the memory its ops address pinned (mapped and registered) until then.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from typing import Any

from tensorx import _cuda
from tensorx.errors import BrokenError, ClosedError, RegionError, TimeoutError, UsageError
from tensorx.memregion import MemoryRegion
from tensorx.transport import _ucp
from tensorx.transport._futures import set_once
from tensorx.transport._ucx_progress import ProgressDriver

__all__ = ["PeerWatch", "Registration", "UcxRuntime"]

logger = logging.getLogger("tensorx.transport.ucx")


class Registration:
    __slots__ = ("memh", "rkey")

    def __init__(self, memh: int, rkey: bytes) -> None:
        self.memh = memh
        self.rkey = rkey


class PeerWatch:
    """One lane's peer, as UCX's error callback reports it: ``state`` goes to every
    endpoint the lane creates; ``on_fail(why)`` is called once when it fails."""

    def __init__(self, state: Any, peer: str, on_fail: Callable[[str], None]) -> None:
        self.state = state
        self.peer = peer
        self.on_fail = on_fail
        self.failed: str | None = None

    def clear(self) -> None:
        """A failure of the endpoint the lane just force-closed itself is no news."""
        self.state.failed = 0
        self.state.status = 0


class UcxRuntime:
    """See the module docstring. ``spin_ns``: progress with tensorx's driver thread (None:
    ucxx's); ``inline_progress``: worker progress passes a small op makes inline."""

    def __init__(self, ucp: _ucp.UcpLib, ctx: Any, *, spin_ns: int | None,
                 inline_progress: int) -> None:
        self.ucp = ucp
        self.ffi, self.lib = ucp.ffi, ucp.lib
        self.context = int(ctx.context.handle)
        self.worker = int(ctx.worker.handle)
        self.address = bytes(ctx.worker_address.tobytes())
        self.inline_progress = inline_progress
        self._driver = None if spin_ns is None else ProgressDriver.acquire(ucp, ctx, spin_ns)
        self._efd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._waits: dict[int, tuple[Any, asyncio.Future[None], PeerWatch | None]] = {}
        self._watches: list[PeerWatch] = []  # of open lanes
        self._states: list[Any] = []  # every peer state made: UCX may call back late
        self._held: list[tuple[Any, list[MemoryRegion]]] = []  # waits pinning memory
        self._orphans: list[Any] = []
        self._regs: dict[int, Registration] = {}
        self._unmap_later: set[int] = set()
        self._closed = False

    @property
    def driver(self) -> bool:
        """Whether tensorx's driver thread progresses the worker for this runtime."""
        return self._driver is not None

    def status_string(self, status: int) -> str:
        return self.ucp.status_string(status)

    def check_open(self) -> None:
        if self._closed:
            raise ClosedError("the UCX transport is closed")

    def close(self) -> None:
        """Deregister everything, stop watching, give up the driver. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for region_id in list(self._regs):
            self._unregister(region_id)
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._efd)
        self._loop = None
        # Callbacks UCX may still run must not write into a recycled descriptor number.
        waits = [w for w, _, _ in self._waits.values()]
        for w in [*self._orphans, *waits, *self._states]:
            if w.efd == self._efd:
                w.efd = -1
        self._waits.clear()
        os.close(self._efd)
        if self._driver is not None:
            driver, self._driver = self._driver, None
            driver.release()

    # -- registrations ---------------------------------------------------------------
    def register(self, region: MemoryRegion) -> Registration:
        """``region``'s UCP registration, made on first use; deregistered when it closes
        (or once the last op still using its memory has completed)."""
        self.check_open()
        reg = self._regs.get(region.region_id)
        if reg is None:
            reg = self._map(region)
            self._regs[region.region_id] = reg
            region.add_close_callback(self._on_region_closed)
        return reg

    def memh(self, region: MemoryRegion) -> int:
        """The memory handle of a local region (0: none, UCX registers on the fly)."""
        try:
            return self.register(region).memh
        except RegionError:  # e.g. read-only memory some transport cannot map: no memh
            return 0

    def _on_region_closed(self, region: MemoryRegion) -> None:
        if region.backing.pinned:
            self._unmap_later.add(region.region_id)
        else:
            self._unregister(region.region_id)

    def _map(self, region: MemoryRegion) -> Registration:
        if region.nbytes == 0:
            return Registration(0, b"")
        if region.is_cuda and self._driver is not None:  # UCX's CUDA transports progress
            self._driver.set_cuda(_cuda.device_index(region.device))  # in this context
        memh = self.ffi.new("uintptr_t *")
        st = self.lib.tx_mem_map(self.context, region.address, region.nbytes,
                                 int(region.is_cuda), memh)
        if st != _ucp.UCS_OK:
            raise RegionError(f"ucp_mem_map of {region!r} failed: {self.status_string(st)}")
        buf, size = self.ffi.new("void **"), self.ffi.new("size_t *")
        st = self.lib.tx_rkey_pack(self.context, memh[0], buf, size)
        if st != _ucp.UCS_OK:
            self.lib.tx_mem_unmap(self.context, memh[0])
            raise RegionError(f"ucp_rkey_pack failed: {self.status_string(st)}")
        rkey = bytes(self.ffi.buffer(buf[0], size[0]))
        self.lib.tx_rkey_buffer_release(buf[0])
        return Registration(int(memh[0]), rkey)

    def _unregister(self, region_id: int) -> None:
        reg = self._regs.pop(region_id, None)
        if reg is not None and reg.memh:
            st = self.lib.tx_mem_unmap(self.context, reg.memh)
            if st != _ucp.UCS_OK:
                logger.warning("ucp_mem_unmap failed: %s", self.status_string(st))

    def unpin(self, regions: list[MemoryRegion]) -> None:
        """Undo one pin of each region; deregister one closed meanwhile once unpinned."""
        for region in regions:
            region.backing.unpin()
            if not region.backing.pinned and region.region_id in self._unmap_later:
                self._unmap_later.discard(region.region_id)
                self._unregister(region.region_id)

    # -- peers -------------------------------------------------------------------------
    def watch_peer(self, peer: str, on_fail: Callable[[str], None]) -> PeerWatch:
        """A watch whose ``state`` a lane gives every endpoint it creates to ``peer``."""
        state = self.ffi.new("tx_peer_t *")
        state.efd = self._efd
        self._states.append(state)  # kept: an endpoint closing may still call back into it
        watch = PeerWatch(state, peer, on_fail)
        self._watches.append(watch)
        return watch

    def unwatch_peer(self, watch: PeerWatch) -> None:
        """The lane is closed: no more news of its peer."""
        if watch in self._watches:
            self._watches.remove(watch)

    def check_peer(self, watch: PeerWatch) -> str | None:
        """Why ``watch``'s peer failed, seeing UCX's report right now if there is one."""
        if watch.failed is None and watch.state.failed:
            self.peer_failed(watch, self.status_string(int(watch.state.status)))
        return watch.failed

    def peer_failed(self, watch: PeerWatch, why: str) -> None:
        """``watch``'s peer is gone: tell its lane, fail the waits of its ops at once."""
        if watch.failed is not None:
            return
        watch.failed = why
        watch.on_fail(why)
        for _, fut, owner in self._waits.values():
            if owner is watch:
                set_once(fut, BrokenError(f"the UCX lane to {watch.peer} is broken: {why}"))

    def watch_fd(self, fd: int, callback: Callable[[], None]) -> None:
        assert self._loop is not None
        self._loop.add_reader(fd, callback)

    def unwatch_fd(self, fd: int) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(fd)

    # -- completion ------------------------------------------------------------------
    def attach_loop(self) -> None:
        loop = asyncio.get_running_loop()
        if self._loop is loop:
            return
        if self._loop is not None and not self._loop.is_closed():
            raise UsageError("a UcxFactory serves one event loop")
        self._loop = loop
        loop.add_reader(self._efd, self._on_event)

    def _on_event(self) -> None:
        try:
            os.eventfd_read(self._efd)
        except BlockingIOError:
            pass
        for key, (w, fut, _) in list(self._waits.items()):
            if w.pending == 0:
                del self._waits[key]
                set_once(fut)
        for watch in list(self._watches):
            self.check_peer(watch)
        if self._held:
            done = [regions for w, regions in self._held if w.pending == 0]
            self._held = [(w, regions) for w, regions in self._held if w.pending != 0]
            for regions in done:
                self.unpin(regions)
        if self._orphans:  # completed: UCX holds no reference to them any more
            self._orphans = [w for w in self._orphans if w.pending]

    def new_wait(self) -> Any:
        """A wait to issue ops against; the issuer holds its guard until :meth:`complete`
        or :meth:`forget`."""
        w = self.ffi.new("tx_wait_t *")
        self.lib.tx_wait_init(w, self._efd)
        return w

    def forget(self, w: Any) -> None:
        """Drop the issuer's guard on ``w`` without waiting; UCX may still complete it."""
        if w is not None and self.lib.tx_wait_release(w) == 0:
            self._orphans.append(w)

    def hold_until_done(self, w: Any, regions: list[MemoryRegion]) -> None:
        """``w``'s ops address ``regions`` (pinned): unpin them when UCX completes ``w``."""
        if w.pending == 0:
            self.unpin(regions)
        else:
            self._held.append((w, regions))

    async def complete(self, w: Any, timeout: float | None, *, inline: bool = True,
                       watch: PeerWatch | None = None) -> None:
        """Release the issuer's guard on ``w`` and wait until every op on it finished.
        TimeoutError after ``timeout``; BrokenError as soon as ``watch``'s peer fails."""
        if not self.done_inline(w, inline):
            await self.wait(w, timeout, watch=watch)

    def done_inline(self, w: Any, inline: bool) -> bool:
        """Release the issuer's guard on ``w``; whether every op on it has finished, after
        a few progress passes made here when ``inline`` (a small op: no wait then)."""
        if self.lib.tx_wait_release(w):
            return True
        if inline and self.inline_progress:
            self.lib.tx_progress(self.worker, self.inline_progress, w)
            return w.pending == 0  # type: ignore[no-any-return]
        return False

    async def wait(self, w: Any, timeout: float | None, *,
                   watch: PeerWatch | None = None) -> None:
        """Wait until every op on ``w`` (its guard released) finished; the second half of
        :meth:`complete`."""
        assert self._loop is not None
        fut: asyncio.Future[None] = self._loop.create_future()
        key = id(w)
        self._waits[key] = (w, fut, watch)
        self.lib.tx_signal(self.worker)  # the progress thread may sleep in epoll_wait
        if w.pending == 0:  # completed before the future was visible
            self._waits.pop(key, None)
            return
        if watch is not None and watch.failed is not None:
            set_once(fut, BrokenError(f"the UCX lane to {watch.peer} is broken: "
                                      f"{watch.failed}"))
        timer = None if timeout is None else self._loop.call_later(
            timeout, set_once, fut,
            TimeoutError(f"UCX operation did not complete within {timeout} s"))
        try:
            await fut
        finally:
            if timer is not None:
                timer.cancel()
            if self._waits.pop(key, None) is not None and w.pending:
                self._orphans.append(w)

    def settle(self, w: Any, bound: float) -> bool:
        """Progress (or let the driver progress) until ``w`` is done, blocking for at most
        ``bound`` seconds: the clean-up of a read that raised, which must be over before
        its error reaches the caller. Whether ``w`` is done."""
        end = time.monotonic() + bound
        while w.pending and time.monotonic() < end:
            if self._driver is not None:  # it copies; progressing here too contends
                self.lib.tx_signal(self.worker)
                time.sleep(0.0002)
            else:
                self.lib.tx_progress(self.worker, 16, w)
        return not w.pending
