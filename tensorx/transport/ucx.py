"""UCX data lanes: true one-sided put/get with ``ucp_put_nbx``/``ucp_get_nbx``.

ucxx provides the UCP context, the worker and its progress thread; the RMA calls, the
endpoints and the rkeys go through our cffi binding (:mod:`tensorx.transport._ucp`) on
ucxx's own handles. No code of the owner runs for a read or write: only UCX's progress.

Error handling is a real trade-off on a single host (see the class docstring of
:class:`UcxFactory`): with ``error_handling=True`` (the default) endpoints use UCX's peer
failure mode, which confines them to tcp lanes but turns a dead peer into ``BrokenError``;
with ``error_handling=False`` endpoints get shared-memory lanes (cma, posix) and run several
times faster, but a peer that dies *during* a transfer aborts this process inside libucp (a
peer that exited between calls is caught by a pidfd watch and gives ``BrokenError``).

Completion: each call issues its ops and a flush against one ``tx_wait_t`` (issuing returns
at once; UCX moves the data while the worker progresses). A small call progresses the worker
inline a few dozen times (most finish there, in microseconds); then it wakes ucxx's progress
thread and awaits an eventfd that the C completion callback writes. Large calls leave all
progress to that thread. The event loop never spins.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections.abc import Mapping, Sequence
from typing import Any

from tensorx.errors import (
    BrokenError,
    ClosedError,
    RegionError,
    TimeoutError,
    TransportUnavailableError,
    UsageError,
)
from tensorx.memregion import MemoryRegion, RegionDescriptor
from tensorx.transport import _ucp
from tensorx.transport.base import DataLane, LaneFactory, Op

__all__ = ["UcxFactory", "UcxLane"]

logger = logging.getLogger("tensorx.transport.ucx")

DEFAULT_CHUNK = 256 << 20
DEFAULT_SPIN_US = 50.0
CONNECT_TIMEOUT = 10.0
CLOSE_TIMEOUT = 2.0
# Settings applied when this process initialises ucxx (never at import time).
DEFAULT_OPTIONS: Mapping[str, str] = {
    "RNDV_SCHEME": "put_zcopy",  # tag transfers: the sender pushes; get is emulated on tcp
    # RMA over tcp is emulated with active messages cut into segments: 8K (UCX's default)
    # costs ucx_perftest itself about half of its put/get bandwidth on loopback.
    "TCP_TX_SEG_SIZE": "256K",
    "TCP_RX_SEG_SIZE": "1M",
    # cma copies in pieces of this size, one per worker progress call (UCX default: 512K).
    "CMA_SEG_SIZE": "4M",
    "WARN_UNUSED_ENV_VARS": "n",
}
_ORPHANS: list[Any] = []  # waits still owned by UCX after a timeout or cancellation


class UcxFactory(LaneFactory):
    """Registers memory with UCP and opens :class:`UcxLane` s to peers.

    Parameters:
        error_handling: use UCX peer-failure handling on every endpoint (both peers must
            agree, see :meth:`local_info`). ``None`` reads ``$TENSORX_UCX_ERROR_HANDLING``
            (``0`` or ``1``, default ``1``). ``True`` (the default, safe): a dead peer gives
            ``BrokenError``; on one host UCX then only offers tcp lanes. ``False`` (fast):
            same-host peers get cma/posix lanes, but a peer dying mid-transfer aborts this
            process from inside libucp (one that exited between calls is a ``BrokenError``).
            On RDMA NICs both go together.
        tls: ``UCX_TLS`` for this process's UCX context, e.g. ``"tcp"`` or ``"posix,cma"``
            (``None``: UCX's choice, or the environment's ``UCX_TLS``).
        options: extra UCX settings (names without ``UCX_``); override the defaults.
        chunk_bytes: transfers are issued to UCP in pieces of at most this size.
        inline_bytes: calls moving fewer bytes progress the worker inline a little before
            sleeping (microsecond latency); larger ones leave all progress to ucxx's thread,
            since two threads progressing one worker contend for its lock and halve the
            speed of a shared-memory copy.
        inline_progress: worker progress passes made inline for small calls.
        progress_spin_us: progress the worker with tensorx's driver thread, which keeps
            polling this many microseconds after the last sign of work before it sleeps
            (a bulk transfer over tcp, e.g. a peer's get served by this process, produces
            work every few microseconds); ``None`` keeps ucxx's progress thread, which
            sleeps as soon as the worker is idle. ``$TENSORX_UCX_SPIN_US`` overrides.

    UCX settings only take effect if this is the first user of ucxx in the process (ucxx
    has one context per process); otherwise the running context is used and a differing
    ``tls`` is logged as a warning.
    """

    name = "ucx"

    def __init__(self, *, error_handling: bool | None = None, tls: str | None = None,
                 options: Mapping[str, str] | None = None, chunk_bytes: int = DEFAULT_CHUNK,
                 inline_bytes: int = 256 << 10, inline_progress: int = 64,
                 progress_spin_us: float | None = DEFAULT_SPIN_US) -> None:
        if chunk_bytes <= 0 or inline_progress < 0 or inline_bytes < 0:
            raise UsageError("chunk_bytes must be > 0; inline_bytes, inline_progress >= 0")
        if error_handling is None:
            error_handling = os.environ.get("TENSORX_UCX_ERROR_HANDLING", "1") != "0"
        self.error_handling = bool(error_handling)
        self.chunk_bytes = int(chunk_bytes)
        self.inline_bytes = int(inline_bytes)
        self.inline_progress = int(inline_progress)
        self._ucp = _ucp.load()
        self._ffi, self._lib = self._ucp.ffi, self._ucp.lib
        self._ctx = _ucp.ucxx_context(DEFAULT_OPTIONS, tls, options)
        self.context_handle = int(self._ctx.context.handle)
        self.worker_handle = int(self._ctx.worker.handle)
        self._address = bytes(self._ctx.worker_address.tobytes())
        spin = os.environ.get("TENSORX_UCX_SPIN_US")
        if spin is not None:
            progress_spin_us = None if spin.lower() in ("", "none", "off") else float(spin)
        if progress_spin_us and len(os.sched_getaffinity(0)) < 2:
            progress_spin_us = 0.0  # one core: polling only delays the threads that share it
        self.driver = progress_spin_us is not None and _ucp.acquire_driver(
            self._ucp, self._ctx, int(progress_spin_us * 1000))
        self._efd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._waits: dict[int, tuple[Any, asyncio.Future[None]]] = {}
        self._regs: dict[int, _Registration] = {}
        self._lanes: set[UcxLane] = set()
        self._peer_states: list[Any] = []  # every lane's error-callback state
        # ops that timed out or were cancelled while UCX still owns them: the memory they
        # address stays pinned (mapped and registered) until UCX completes them
        self._held: list[tuple[Any, list[MemoryRegion]]] = []
        self._unmap_later: set[int] = set()
        self._closed = False

    # -- LaneFactory -----------------------------------------------------------------
    def register(self, region: MemoryRegion) -> dict[str, Any]:
        reg = self._registration(region)
        return {"addr": region.address, "rkey": reg.rkey}

    def local_info(self) -> dict[str, Any]:
        return {"worker_address": self._address, "error_handling": self.error_handling,
                "host": socket.gethostname(), "pid": os.getpid(),
                "ucx": self._ucp.version()}

    async def open_lane(self, peer_info: dict[str, Any], *, peer: str,
                        timeout: float | None) -> UcxLane:
        self._check_open()
        address = peer_info.get("worker_address")
        if not isinstance(address, bytes) or not address:
            raise TransportUnavailableError(f"{peer} sent no UCX worker address")
        if peer_info.get("error_handling") != self.error_handling:
            raise TransportUnavailableError(
                f"UCX error handling differs ({peer}: {peer_info.get('error_handling')}, "
                f"here: {self.error_handling}); UCX needs both sides to agree")
        self._attach_loop()
        lane = UcxLane(self, address, peer, peer_info)
        budget = CONNECT_TIMEOUT if timeout is None else min(timeout, CONNECT_TIMEOUT)
        try:
            await lane._connect(budget)
        except BaseException:
            lane.abort()
            raise
        self._lanes.add(lane)
        logger.debug("ucx lane to %s: %s %s", peer, lane.roles, lane.why)
        return lane

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            for lane in list(self._lanes):
                await lane.aclose()
        finally:
            for region_id in list(self._regs):
                self._unregister(region_id)
            self._detach_loop()
            self._retire_efd()
            if self.driver:
                self.driver = False
                _ucp.release_driver(self._ucp, self._ctx)

    def _retire_efd(self) -> None:
        # Callbacks UCX may still run must not write into a recycled descriptor number.
        for w in [*_ORPHANS, *(w for w, _ in self._waits.values()), *self._peer_states]:
            if w.efd == self._efd:
                w.efd = -1
        self._waits.clear()
        os.close(self._efd)

    # -- registrations ---------------------------------------------------------------
    def _registration(self, region: MemoryRegion) -> _Registration:
        self._check_open()
        reg = self._regs.get(region.region_id)
        if reg is None:
            reg = self._map(region)
            self._regs[region.region_id] = reg
            region.add_close_callback(self._on_region_closed)
        return reg

    def _on_region_closed(self, region: MemoryRegion) -> None:
        """Deregister now, or once the last op still using the memory has completed."""
        if region.pinned:
            self._unmap_later.add(region.region_id)
        else:
            self._unregister(region.region_id)

    def _map(self, region: MemoryRegion) -> _Registration:
        if region.nbytes == 0:
            return _Registration(0, b"")
        memh = self._ffi.new("uintptr_t *")
        st = self._lib.tx_mem_map(self.context_handle, region.address, region.nbytes,
                                  int(region.is_cuda), memh)
        if st != _ucp.UCS_OK:
            raise RegionError(f"ucp_mem_map of {region!r} failed: {self._ucp.status_string(st)}")
        buf, size = self._ffi.new("void **"), self._ffi.new("size_t *")
        st = self._lib.tx_rkey_pack(self.context_handle, memh[0], buf, size)
        if st != _ucp.UCS_OK:
            self._lib.tx_mem_unmap(self.context_handle, memh[0])
            raise RegionError(f"ucp_rkey_pack failed: {self._ucp.status_string(st)}")
        rkey = bytes(self._ffi.buffer(buf[0], size[0]))
        self._lib.tx_rkey_buffer_release(buf[0])
        return _Registration(int(memh[0]), rkey)

    def _unregister(self, region_id: int) -> None:
        reg = self._regs.pop(region_id, None)
        if reg is not None and reg.memh:
            st = self._lib.tx_mem_unmap(self.context_handle, reg.memh)
            if st != _ucp.UCS_OK:
                logger.warning("ucp_mem_unmap failed: %s", self._ucp.status_string(st))

    def _local_memh(self, region: MemoryRegion) -> int:
        try:
            return self._registration(region).memh
        except RegionError:  # e.g. read-only memory some transport cannot map: no memh
            return 0

    # -- completion ------------------------------------------------------------------
    def _attach_loop(self) -> None:
        loop = asyncio.get_running_loop()
        if self._loop is loop:
            return
        if self._loop is not None and not self._loop.is_closed():
            raise UsageError("a UcxFactory serves one event loop")
        self._loop = loop
        loop.add_reader(self._efd, self._on_event)

    def _detach_loop(self) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._efd)
        self._loop = None

    def _on_event(self) -> None:
        try:
            os.eventfd_read(self._efd)
        except BlockingIOError:
            pass
        for key, (w, fut) in list(self._waits.items()):
            if w.pending == 0:
                del self._waits[key]
                if not fut.done():
                    fut.set_result(None)
        for lane in list(self._lanes):
            lane._check_peer()
        if self._held:
            self._reap()
        if _ORPHANS:  # completed orphans: UCX holds no reference to them any more
            _ORPHANS[:] = [w for w in _ORPHANS if w.pending]

    def _hold_until_done(self, w: Any, regions: list[MemoryRegion]) -> None:
        """``w``'s ops address ``regions`` (pinned): unpin them when UCX completes ``w``."""
        if w.pending == 0:
            self._unpin(regions)
        else:
            self._held.append((w, regions))

    def _reap(self) -> None:
        done = [(w, regions) for w, regions in self._held if w.pending == 0]
        self._held = [(w, regions) for w, regions in self._held if w.pending != 0]
        for _, regions in done:
            self._unpin(regions)

    def _unpin(self, regions: list[MemoryRegion]) -> None:
        for region in regions:
            region._unpin()
            if not region.pinned and region.region_id in self._unmap_later:
                self._unmap_later.discard(region.region_id)
                self._unregister(region.region_id)

    def _new_wait(self) -> Any:
        w = self._ffi.new("tx_wait_t *")
        self._lib.tx_wait_init(w, self._efd)
        return w

    async def _complete(self, w: Any, timeout: float | None, *, inline: bool = True,
                        lane: UcxLane | None = None) -> None:
        """Release the issuer's guard on ``w`` and wait until every op on it finished."""
        if self._lib.tx_wait_release(w):
            return
        if inline and self.inline_progress:
            self._lib.tx_progress(self.worker_handle, self.inline_progress, w)
            if w.pending == 0:
                return
        assert self._loop is not None
        fut: asyncio.Future[None] = self._loop.create_future()
        key = id(w)
        self._waits[key] = (w, fut)
        self._lib.tx_signal(self.worker_handle)  # the progress thread may sleep in epoll_wait
        if w.pending == 0:  # completed before the future was visible
            self._waits.pop(key, None)
            return
        try:
            await self._sleep_until(fut, w, timeout, lane)
        finally:
            if self._waits.pop(key, None) is not None and w.pending:
                _ORPHANS.append(w)

    async def _sleep_until(self, fut: asyncio.Future[None], w: Any,
                           timeout: float | None, lane: UcxLane | None) -> None:
        """Await ``fut``; every so often wake ucxx's progress thread again, as a safety net
        (shared-memory lanes have no event fd to wake it with)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        poll = 0.001
        while True:
            left = _remaining(deadline)
            await asyncio.wait([fut], timeout=poll if left is None else min(poll, left))
            if fut.done() or w.pending == 0:
                return
            if lane is not None:
                lane._check_usable()  # e.g. the peer process exited meanwhile
            if left is not None and left <= poll:
                raise TimeoutError(f"UCX operation did not complete within {timeout} s")
            self._lib.tx_signal(self.worker_handle)
            poll = min(poll * 2, 0.05)

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("the UCX transport is closed")


class _Registration:
    __slots__ = ("memh", "rkey")

    def __init__(self, memh: int, rkey: bytes) -> None:
        self.memh = memh
        self.rkey = rkey


class UcxLane(DataLane):
    """One UCP endpoint to one peer's worker, with its unpacked rkeys."""

    name = "ucx"

    def __init__(self, factory: UcxFactory, address: bytes, peer: str,
                 peer_info: Mapping[str, Any]) -> None:
        self._f = factory
        self._lib = factory._lib
        self.peer = peer
        self._address = factory._ffi.from_buffer(address)  # UCP reads it in ucp_ep_create
        self._peer_state = factory._ffi.new("tx_peer_t *")
        factory._peer_states.append(self._peer_state)
        self._peer_state.efd = factory._efd
        self._ep = 0
        self._rkeys: dict[tuple[str, int, int], int] = {}
        self._closed = False
        self._gone = False  # closed because the connection to the peer ended
        self._broken: str | None = None
        self.lanes: list[str] = []
        self._peer_info = dict(peer_info)
        self._pidfd = -1
        self.roles: dict[str, list[str]] = {}
        self.why = ""
        self.stats = {"ops": 0, "bytes": 0}

    @property
    def info(self) -> dict[str, Any]:
        return {"transport": "ucx", "lanes": list(self.lanes), "why": self.why,
                "roles": {k: list(v) for k, v in self.roles.items()},
                "error_handling": self._f.error_handling}

    async def _connect(self, timeout: float) -> None:
        ep = self._f._ffi.new("uintptr_t *")
        st = self._lib.tx_ep_create(self._f.worker_handle, self._address,
                                    int(self._f.error_handling), self._peer_state, ep)
        if st != _ucp.UCS_OK:
            raise TransportUnavailableError(
                f"ucp_ep_create to {self.peer} failed: {self._f._ucp.status_string(st)}")
        self._ep = int(ep[0])
        try:
            await self.flush(timeout=timeout)  # completes wireup, or fails
        except (BrokenError, TimeoutError) as exc:
            raise TransportUnavailableError(f"UCX cannot reach {self.peer}: {exc}") from exc
        self.lanes = self._query_lanes()
        self.roles = _ucp.lane_roles(self.describe())
        self.why = _why(self.lanes, self._f.error_handling)
        if not self._f.error_handling:
            self._watch_peer_process()

    def _watch_peer_process(self) -> None:
        """Without UCX error handling, a dead peer aborts us inside libucp on the next op:
        watch a same-host peer's pid (pidfd) and refuse ops once it has exited. This cannot
        save an op already in flight when the peer dies."""
        pid, host = self._peer_info.get("pid"), self._peer_info.get("host")
        same_host = host == socket.gethostname() and any(
            lane.split("/")[0] in ("cma", "posix", "sysv", "knem", "xpmem") for lane in self.lanes)
        if not (same_host and isinstance(pid, int) and hasattr(os, "pidfd_open")):
            return
        try:
            self._pidfd = os.pidfd_open(pid)
        except OSError as exc:
            raise TransportUnavailableError(f"peer process {pid} is gone: {exc}") from exc
        assert self._f._loop is not None
        self._f._loop.add_reader(self._pidfd, self._peer_exited)

    def _peer_exited(self) -> None:
        if self._broken is None:
            self._broken = "the peer process exited"
            logger.warning("ucx lane to %s broke: %s", self.peer, self._broken)
        self._unwatch_peer_process()

    def _unwatch_peer_process(self) -> None:
        if self._pidfd >= 0:
            if self._f._loop is not None and not self._f._loop.is_closed():
                self._f._loop.remove_reader(self._pidfd)
            os.close(self._pidfd)
            self._pidfd = -1

    def _query_lanes(self) -> list[str]:
        out = self._f._ffi.new("char[]", 1024)
        if self._lib.tx_ep_transports(self._ep, out, 1024) != _ucp.UCS_OK:
            return []
        text = self._f._ffi.string(out).decode()
        return sorted({t for t in text.split(",") if t})

    def describe(self) -> str:
        """UCP's own description of the endpoint (``ucp_ep_print_info``)."""
        if not self._ep:
            return ""
        raw = self._lib.tx_ep_info(self._ep)
        if raw == self._f._ffi.NULL:
            return ""
        try:
            return str(self._f._ffi.string(raw).decode(errors="replace"))
        finally:
            self._lib.tx_free(raw)

    # -- DataLane ----------------------------------------------------------------------
    async def write(self, op: Op, *, timeout: float | None) -> None:
        await self._run([op], put=True, timeout=timeout)

    async def read(self, op: Op, *, timeout: float | None) -> None:
        await self._run([op], put=False, timeout=timeout)

    async def write_many(self, ops: Sequence[Op], *, timeout: float | None) -> None:
        await self._run(list(ops), put=True, timeout=timeout)

    async def flush(self, *, timeout: float | None) -> None:
        self._check_usable()
        w = self._f._new_wait()
        st = self._lib.tx_flush(self._ep, w)
        await self._finish(w, st, timeout)

    async def aclose(self) -> None:
        if self._closed:
            return
        if self._ep and self._broken is None:
            try:
                await self.flush(timeout=CLOSE_TIMEOUT)
            except Exception as exc:  # an unresponsive peer: close without waiting
                logger.debug("flush before closing the lane to %s: %s", self.peer, exc)
                self._broken = str(exc)
        if self._broken is not None:
            self.abort()
            return
        self._mark_closed()
        closing = self._teardown(self._f.error_handling)
        if closing is not None:
            try:
                await self._f._complete(closing, CLOSE_TIMEOUT)
            except TimeoutError:
                logger.warning("closing the UCX endpoint to %s timed out", self.peer)

    def peer_gone(self, why: str) -> None:
        if not self._closed:
            self._gone = True
            self._broken = self._broken or why
        self.abort()

    def abort(self) -> None:
        if self._closed:
            return
        self._mark_closed()
        _forget(self._lib, self._teardown(self._f.error_handling))

    # -- internals -----------------------------------------------------------------------
    async def _run(self, ops: list[Op], *, put: bool, timeout: float | None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        self._check_usable()
        plan = [self._plan(op) for op in ops if op.nbytes]
        regions = [op.local for op in ops if op.nbytes]
        w = self._f._new_wait()
        for region in regions:
            region._pin()  # closed meanwhile, its memory stays until UCX is done with it
        try:
            try:
                st = self._issue_all(plan, put, w)  # returns at once: UCX copies in progress
            except BaseException:
                _forget(self._lib, w)
                raise
            small = sum(p[1] for p in plan) < self._f.inline_bytes
            await self._finish(w, st, _remaining(deadline), inline=small)
        finally:
            self._f._hold_until_done(w, regions)
        self.stats["ops"] += len(ops)
        self.stats["bytes"] += sum(op.nbytes for op in ops)

    def _plan(self, op: Op) -> tuple[int, int, int, int, int]:
        """(local address, nbytes, remote address, rkey, local memh), checked."""
        _check_op(op)
        rkey = self._rkey(op.remote)  # validates the descriptor's UCX keys
        raddr = int(op.remote.keys["ucx"]["addr"]) + op.remote_offset
        return (op.local.address + op.local_offset, op.nbytes, raddr, rkey,
                self._f._local_memh(op.local))

    def _issue_all(self, plan: list[tuple[int, int, int, int, int]], put: bool, w: Any) -> int:
        """Issue every piece and a flush on ``w`` (guard still held); first error status."""
        issue = self._lib.tx_put if put else self._lib.tx_get
        chunk, ep = self._f.chunk_bytes, self._ep
        for laddr, nbytes, raddr, rkey, memh in plan:
            for done in range(0, nbytes, chunk):
                st = issue(ep, laddr + done, min(chunk, nbytes - done), raddr + done, rkey,
                           memh, w)
                if st < 0:
                    return int(st)
        return int(self._lib.tx_flush(ep, w))

    async def _finish(self, w: Any, st: int, timeout: float | None, *,
                      inline: bool = True) -> None:
        try:
            await self._f._complete(w, timeout, inline=inline, lane=self)
        except TimeoutError:
            self._check_usable()
            raise
        status = int(w.status) or (st if st < 0 else 0)
        if status:
            raise self._error(status)

    def _rkey(self, desc: RegionDescriptor) -> int:
        key = (desc.owner, desc.region_id, desc.cookie)
        rkey = self._rkeys.get(key)
        if rkey is None:
            keys = desc.keys.get("ucx")
            if not isinstance(keys, Mapping) or not isinstance(keys.get("rkey"), bytes) \
                    or not isinstance(keys.get("addr"), int) or not keys["rkey"]:
                raise RegionError(f"region {desc.region_id:#x} was not exported over UCX")
            out = self._f._ffi.new("uintptr_t *")
            st = self._lib.tx_rkey_unpack(self._ep, keys["rkey"], out)
            if st != _ucp.UCS_OK:
                raise RegionError(f"cannot unpack the rkey of region {desc.region_id:#x}: "
                                  f"{self._f._ucp.status_string(st)}")
            rkey = self._rkeys[key] = int(out[0])
        return rkey

    def _release_rkeys(self) -> None:
        for rkey in self._rkeys.values():
            self._lib.tx_rkey_destroy(rkey)
        self._rkeys.clear()

    def _mark_closed(self) -> None:
        self._closed = True
        self._f._lanes.discard(self)

    def _teardown(self, force: bool) -> Any:
        """Destroy the rkeys and start closing the endpoint; the close's wait (guard held)."""
        self._unwatch_peer_process()
        self._release_rkeys()
        ep, self._ep = self._ep, 0
        if not ep:
            return None
        w = self._f._new_wait()
        st = self._lib.tx_ep_close(ep, int(force), w)
        if st < 0 and st != _ucp.UCS_ERR_CANCELED:
            logger.debug("ucp_ep_close_nbx to %s: %s", self.peer, self._f._ucp.status_string(st))
        return w

    def _check_peer(self) -> None:
        if self._broken is None and self._peer_state.failed:
            status = int(self._peer_state.status)
            self._broken = self._f._ucp.status_string(status)
            logger.warning("ucx lane to %s broke: %s", self.peer, self._broken)

    def _check_usable(self) -> None:
        if self._closed and not self._gone:
            raise ClosedError(f"the UCX lane to {self.peer} is closed")
        self._check_peer()
        if self._broken is not None:
            raise BrokenError(f"the UCX lane to {self.peer} is broken: {self._broken}")

    def _error(self, status: int) -> Exception:
        self._check_peer()
        if self._gone:
            return BrokenError(f"the UCX lane to {self.peer} broke: {self._broken}")
        if self._closed:
            return ClosedError(f"the UCX lane to {self.peer} was closed")
        text = self._f._ucp.status_string(status)
        if self._broken is None:
            self._broken = text
        return BrokenError(f"UCX operation to {self.peer} failed: {text}")


def _check_op(op: Op) -> None:
    if op.nbytes < 0 or op.local_offset < 0 or op.remote_offset < 0 \
            or op.local_offset + op.nbytes > op.local.nbytes:
        raise UsageError(f"local range [{op.local_offset}, +{op.nbytes}) outside {op.local!r}")
    if op.remote_offset + op.nbytes > op.remote.nbytes:
        raise RegionError(f"remote range [{op.remote_offset}, +{op.nbytes}) outside region "
                          f"{op.remote.region_id:#x} of {op.remote.nbytes} B")
    if op.local.closed:
        raise ClosedError(f"memory region {op.local.region_id:#x} is closed")


def _forget(lib: Any, w: Any) -> None:
    """Drop the issuer's guard on ``w``; keep it alive while UCX may still complete it."""
    if w is not None and lib.tx_wait_release(w) == 0:
        _ORPHANS.append(w)


def _remaining(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


def _why(lanes: list[str], error_handling: bool) -> str:
    fast = any(lane.split("/")[0] in ("cma", "posix", "sysv", "knem", "xpmem", "rc_mlx5",
                                      "rc_verbs", "dc_mlx5", "ud_mlx5", "cuda_ipc")
               for lane in lanes)
    if error_handling:
        return ("UCX peer-failure handling on (safe default): a dead peer is a BrokenError; "
                + ("" if fast else "on one host that leaves only tcp lanes"))
    return ("UCX error handling off (fast lanes"
            + (")" if fast else ", but none found)") + ": a peer dying mid-transfer aborts "
            "this process")
