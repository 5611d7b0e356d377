"""One UCX data lane: a UCP endpoint to one peer's worker, its rkeys, put/get/flush.

Opened by :class:`tensorx.transport.ucx.UcxFactory`, which hands it the factory's
:class:`~._ucx_runtime.UcxRuntime` (context, registrations, progress, completion) and its
settings; the lane holds nothing of the factory itself.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tensorx import _cuda
from tensorx._deadline import Deadline
from tensorx.errors import (
    BrokenError,
    ClosedError,
    RegionError,
    TimeoutError,
    TransportUnavailableError,
    UsageError,
)
from tensorx.memregion import RegionDescriptor
from tensorx.transport import _staging, _ucp
from tensorx.transport._exceptions import map_exceptions
from tensorx.transport._ucx_runtime import UcxRuntime
from tensorx.transport.base import DataLane, Op

__all__ = ["UcxLane", "UcxSettings"]

logger = logging.getLogger("tensorx.transport.ucx")

RDMA_LANES = ("rc", "dc", "ud", "ib", "roce", "mlx", "verbs", "efa")
# Lanes whose puts and gets copy inside the issuing call (cross-memory attach, shared
# memory): a flush after them completes in a few progress passes whatever the size, so the
# caller progresses inline instead of waking the driver thread (about 150 us per op here).
COPY_IN_CALL = ("cma", "posix", "sysv", "knem", "xpmem", "self")
# How long aclose() (which takes no timeout) waits for the peer to complete our ops and the
# endpoint to close before it forces the close: a bound on closing, not on a caller's op.
CLOSE_TIMEOUT = 2.0
# How long a read that raised may wait for UCX to give up its request (see _stop_late_reply):
# the caller's budget is already spent then; this bounds the clean-up before the error.
LATE_REPLY_BOUND = 2.0


@dataclass(frozen=True)
class UcxSettings:
    """The factory's settings a lane works by (see :class:`~.ucx.UcxFactory`)."""

    error_handling: bool
    chunk_bytes: int
    inline_bytes: int
    gpu_memory: bool  # this side's UCX moves GPU memory


class UcxLane(DataLane):
    """One UCP endpoint to one peer's worker, with its unpacked rkeys."""

    name = "ucx"
    bypasses_owner = True

    def __init__(self, runtime: UcxRuntime, settings: UcxSettings, address: bytes, peer: str,
                 peer_info: Mapping[str, Any], *, closed: Callable[[UcxLane], None]) -> None:
        """``closed(lane)`` is called once the lane is closed (its factory forgets it)."""
        self._rt = runtime
        self._s = settings
        self._gpu = settings.gpu_memory
        self._lib = runtime.lib
        self._on_closed = closed
        self.peer = peer
        self._address = runtime.ffi.from_buffer(address)  # UCP reads it in ucp_ep_create
        self._watch = runtime.watch_peer(peer, self._peer_failed)
        self._ep = 0
        self._reopen = False  # the endpoint was force-closed to stop a late reply: reconnect
        self._epoch = 0  # endpoints force-closed so far
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
        self._inline_any_size = False  # every lane copies in the call (see COPY_IN_CALL)

    @property
    def info(self) -> dict[str, Any]:
        info = {"transport": "ucx", "lanes": list(self.lanes), "why": self.why,
                "roles": {k: list(v) for k, v in self.roles.items()},
                "error_handling": self._s.error_handling}
        if _cuda.available() and (not self._gpu or self._peer_info.get("gpu") is False):
            why = ("UCX here has no CUDA transport" if not self._gpu else
                   "for GPU regions the peer's UCX cannot move")
            info["gpu"] = f"{_staging.describe()} ({why})"  # the TCP lane takes them
        return info

    def carries(self, op: Op) -> bool:
        """Not GPU memory this side's UCX cannot move, nor regions the peer exported
        without UCX keys (GPU memory its UCX cannot move, or exported before its UCX
        started): those go to the TCP lane."""
        if op.local.is_cuda and not self._gpu:
            return False
        return "ucx" in op.remote.keys and (self._gpu or op.remote.device != "cuda")

    @property
    def rdma(self) -> bool:  # type: ignore[override]
        return any(name.split("/")[0].startswith(RDMA_LANES) for name in self.lanes)

    async def _connect(self, timeout: float | None) -> None:
        ep = self._rt.ffi.new("uintptr_t *")
        st = self._lib.tx_ep_create(self._rt.worker, self._address,
                                    int(self._s.error_handling), self._watch.state, ep)
        if st != _ucp.UCS_OK:
            raise TransportUnavailableError(
                f"ucp_ep_create to {self.peer} failed: {self._rt.status_string(st)}")
        self._ep = int(ep[0])
        try:
            await self.flush(timeout=timeout)  # completes wireup, or fails
        except (BrokenError, TimeoutError) as exc:
            raise TransportUnavailableError(f"UCX cannot reach {self.peer}: {exc}") from exc
        self.lanes = self._query_lanes()
        self._inline_any_size = bool(self.lanes) and all(
            name.split("/")[0] in COPY_IN_CALL for name in self.lanes)
        self.roles = _ucp.lane_roles(self.describe())
        self.why = _why(self.lanes, self._s.error_handling)
        if not self._s.error_handling:
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
        with map_exceptions(f"peer process {pid} is gone", {OSError: TransportUnavailableError}):
            self._pidfd = os.pidfd_open(pid)
        self._rt.watch_fd(self._pidfd, self._peer_exited)

    def _peer_exited(self) -> None:
        self._rt.peer_failed(self._watch, "the peer process exited")  # fails its ops now
        self._unwatch_peer_process()

    def _peer_failed(self, why: str) -> None:
        """The runtime saw the peer fail (UCX's error callback, or the pidfd)."""
        if self._broken is None:
            self._broken = why
            logger.warning("ucx lane to %s broke: %s", self.peer, why)

    def _unwatch_peer_process(self) -> None:
        if self._pidfd >= 0:
            self._rt.unwatch_fd(self._pidfd)
            os.close(self._pidfd)
            self._pidfd = -1

    def _query_lanes(self) -> list[str]:
        out = self._rt.ffi.new("char[]", 1024)
        if self._lib.tx_ep_transports(self._ep, out, 1024) != _ucp.UCS_OK:
            return []
        text = self._rt.ffi.string(out).decode()
        return sorted({t for t in text.split(",") if t})

    def describe(self) -> str:
        """UCP's own description of the endpoint (``ucp_ep_print_info``)."""
        if not self._ep:
            return ""
        raw = self._lib.tx_ep_info(self._ep)
        if raw == self._rt.ffi.NULL:
            return ""
        try:
            return str(self._rt.ffi.string(raw).decode(errors="replace"))
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
        deadline = Deadline(timeout)
        for retry in (True, False):
            self._check_usable()
            await self._reconnect(deadline.left())
            w, epoch = self._rt.new_wait(), self._epoch
            st = self._lib.tx_flush(self._ep, w)
            try:
                await self._finish(w, st, deadline.left(), epoch=epoch, retry=retry)
                return
            except _Superseded:
                continue

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
        closing = self._teardown(self._s.error_handling)
        if closing is not None:
            try:
                await self._rt.complete(closing, CLOSE_TIMEOUT)
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
        self._rt.forget(self._teardown(self._s.error_handling))

    # -- internals -----------------------------------------------------------------------
    async def _run(self, ops: list[Op], *, put: bool, timeout: float | None) -> None:
        deadline = Deadline(timeout)
        for retry in (True, False):
            try:
                await self._run_once(ops, put, deadline, retry)
                break
            except _Superseded:  # the endpoint was force-closed under it: issue again
                continue
        stats = self.stats
        stats["ops"] += len(ops)
        stats["bytes"] += ops[0].nbytes if len(ops) == 1 else sum(op.nbytes for op in ops)

    async def _run_once(self, ops: list[Op], put: bool, deadline: Deadline,
                        retry: bool) -> None:
        self._check_usable()
        if self._reopen:
            await self._reconnect(deadline.left())
        plan, regions, total = [], [], 0
        for op in ops:
            if op.nbytes:
                plan.append(self._plan(op))
                regions.append(op.local)
                total += op.nbytes
        w, epoch = self._rt.new_wait(), self._epoch
        for region in regions:
            region.backing.pin()  # closed meanwhile, its memory stays until UCX is done with it
        try:
            try:
                st = self._issue_all(plan, put, w)  # returns at once: UCX copies in progress
            except BaseException:
                self._rt.forget(w)
                raise
            try:
                # a small op is most often done after a few progress passes: no wait then
                if not self._rt.done_inline(w, total < self._s.inline_bytes
                                            or self._inline_any_size):
                    await self._wait(w, deadline.left())
                self._check_status(w, st, epoch, retry)
            except _Superseded:
                raise
            except BaseException:  # timed out, cancelled, broken: UCX may still own the get
                if not put and w.pending:
                    self._stop_late_reply(w)
                raise
        finally:
            self._rt.hold_until_done(w, regions)

    def _stop_late_reply(self, w: Any) -> None:
        """A read raised while UCX still owns its gets: before the error reaches the
        caller, make sure they can never write the caller's memory again.

        With UCX error handling the endpoint is force-closed: UCX completes every
        outstanding request with ``UCS_ERR_CANCELED`` inside the call (under the worker
        lock, so no progress pass is mid-copy), and the next op opens a new endpoint to the
        same worker. Without it a force close is undefined behaviour, but shared-memory
        gets need nothing from the owner (cma copies even from a stopped process): progress
        until they are done, which takes the transfer's time at memory bandwidth. A request
        still pending after :data:`LATE_REPLY_BOUND` breaks the lane for good; its memory
        stays pinned until UCX lets go of it (the one exposure left, logged)."""
        if self._s.error_handling and self._ep:
            self._epoch += 1  # ops of other callers cancelled with it are issued again
            self._release_rkeys()  # rkeys belong to the endpoint
            ep, self._ep = self._ep, 0
            closing = self._rt.new_wait()
            st = self._lib.tx_ep_close(ep, 1, closing)
            self._watch.clear()
            if st < 0 and st != _ucp.UCS_ERR_CANCELED:
                logger.debug("force-closing the endpoint to %s: %s", self.peer,
                             self._rt.status_string(st))
            self._rt.forget(closing)
            self._reopen = True
        if not self._rt.settle(w, LATE_REPLY_BOUND):
            self._broken = self._broken or "a read that raised could not be stopped"
            logger.warning("ucx lane to %s: a read that raised is still owned by UCX after "
                           "%s s; the lane is closed and its memory stays pinned until UCX "
                           "completes it", self.peer, LATE_REPLY_BOUND)
            self._reopen = False
            self._gone = True  # later ops: BrokenError, not ClosedError
            self.abort()

    async def _reconnect(self, timeout: float | None) -> None:
        """Open a new endpoint where :meth:`_stop_late_reply` force-closed the old one,
        within what is left of the op's budget."""
        if not self._reopen:
            return
        self._reopen = False
        try:
            await self._connect(timeout)
        except BaseException as exc:
            self._broken = self._broken or f"cannot reconnect: {exc}"
            self._gone = True
            self.abort()
            if isinstance(exc, Exception):
                raise BrokenError(f"the UCX lane to {self.peer} is broken: {exc}") from exc
            raise

    def _plan(self, op: Op) -> tuple[int, int, int, int, int]:
        """(local address, nbytes, remote address, rkey, local memh), checked."""
        _check_op(op)
        rkey = self._rkey(op.remote)  # validates the descriptor's UCX keys
        raddr = int(op.remote.keys["ucx"]["addr"]) + op.remote_offset
        return (op.local.address + op.local_offset, op.nbytes, raddr, rkey,
                self._rt.memh(op.local))

    def _issue_all(self, plan: list[tuple[int, int, int, int, int]], put: bool, w: Any) -> int:
        """Issue every piece and a flush on ``w`` (guard still held); first error status."""
        issue = self._lib.tx_put if put else self._lib.tx_get
        chunk, ep = self._s.chunk_bytes, self._ep
        for laddr, nbytes, raddr, rkey, memh in plan:
            for done in range(0, nbytes, chunk):
                st = issue(ep, laddr + done, min(chunk, nbytes - done), raddr + done, rkey,
                           memh, w)
                if st < 0:
                    return int(st)
        return int(self._lib.tx_flush(ep, w))

    async def _finish(self, w: Any, st: int, timeout: float | None, *, epoch: int = -1,
                      retry: bool = False) -> None:
        """Wait for every op on ``w`` (issued with first status ``st``), then raise what
        went wrong with them."""
        if not self._rt.done_inline(w, True):
            await self._wait(w, timeout)
        self._check_status(w, st, epoch, retry)

    async def _wait(self, w: Any, timeout: float | None) -> None:
        try:
            await self._rt.wait(w, timeout, watch=self._watch)
        except TimeoutError:
            self._check_usable()
            raise

    def _check_status(self, w: Any, st: int, epoch: int, retry: bool) -> None:
        status = int(w.status) or (st if st < 0 else 0)
        if status == _ucp.UCS_ERR_CANCELED and epoch != self._epoch and not self._closed \
                and self._broken is None:
            # another op's read raised and force-closed the endpoint under this one
            if retry:
                raise _Superseded
            raise BrokenError(f"UCX operation to {self.peer} was cancelled twice by "
                              "endpoint resets (reads that timed out); the lane is usable")
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
            out = self._rt.ffi.new("uintptr_t *")
            st = self._lib.tx_rkey_unpack(self._ep, keys["rkey"], out)
            if st != _ucp.UCS_OK:
                raise RegionError(f"cannot unpack the rkey of region {desc.region_id:#x}: "
                                  f"{self._rt.status_string(st)}")
            rkey = self._rkeys[key] = int(out[0])
        return rkey

    def _release_rkeys(self) -> None:
        for rkey in self._rkeys.values():
            self._lib.tx_rkey_destroy(rkey)
        self._rkeys.clear()

    def _mark_closed(self) -> None:
        self._closed = True
        self._rt.unwatch_peer(self._watch)
        self._on_closed(self)

    def _teardown(self, force: bool) -> Any:
        """Destroy the rkeys and start closing the endpoint; the close's wait (guard held)."""
        self._unwatch_peer_process()
        self._release_rkeys()
        ep, self._ep = self._ep, 0
        if not ep:
            return None
        w = self._rt.new_wait()
        st = self._lib.tx_ep_close(ep, int(force), w)
        if st < 0 and st != _ucp.UCS_ERR_CANCELED:
            logger.debug("ucp_ep_close_nbx to %s: %s", self.peer, self._rt.status_string(st))
        return w

    def _check_peer(self) -> None:
        self._rt.check_peer(self._watch)  # (calls _peer_failed once the peer failed)

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
        text = self._rt.status_string(status)
        if self._broken is None:
            self._broken = text
        return BrokenError(f"UCX operation to {self.peer} failed: {text}")


class _Superseded(Exception):
    """An op's endpoint was force-closed under it (another read raised): issue it again."""


def _check_op(op: Op) -> None:
    if op.nbytes < 0 or op.local_offset < 0 or op.remote_offset < 0 \
            or op.local_offset + op.nbytes > op.local.nbytes:
        raise UsageError(f"local range [{op.local_offset}, +{op.nbytes}) outside {op.local!r}")
    if op.remote_offset + op.nbytes > op.remote.nbytes:
        raise RegionError(f"remote range [{op.remote_offset}, +{op.nbytes}) outside region "
                          f"{op.remote.region_id:#x} of {op.remote.nbytes} B")
    if op.local.closed:
        raise ClosedError(f"memory region {op.local.region_id:#x} is closed")


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
