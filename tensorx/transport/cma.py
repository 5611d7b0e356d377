"""The same-host lane for host memory: cross-memory attach (CMA).

Two tensorx processes on one host move a write or read of host memory with one copy, by the
kernel, straight between the two address spaces: ``process_vm_writev`` / ``process_vm_readv``
on the owner's registered memory. The owner's code never runs for an op (one-sided), so the
lane has ``bypasses_owner``: the endpoint validates every descriptor with the owner first, and
the owner keeps a closed region's memory until we acknowledge its revocation.

Addresses come from the owner only, never from the descriptor: on first use of a
(region, cookie) the lane asks the owner over the control channel (a VALIDATE request that
also asks for the address), and caches the answer.

The endpoint's other lanes (TCP or UCX) keep everything else: GPU memory, zero-byte ops,
notifications. It is chosen when both peers offer it (a node offers it only to a peer whose
end of the connection the kernel shows to be a socket of this user on this host), the
kernel says that the pid the peer offers holds the peer's end of the connection
(:meth:`Link.held_by`), and a ``process_vm_readv`` of the peer's probe buffer returns the
token it advertised: that proves we may read its memory (yama ``ptrace_scope``,
containers). The token is bound to the connection (a hash of both handshake nonces and the
peer's node id), so no other process holds it.

Whom the lane trusts: the kernel, never the peer's word. Its node id, pid, host and probe
address are claims it can copy from us (we tell them to it), so none of them alone may aim
our copies: a peer that said our own node id and offered our own pid and probe would have
made us open the lane to ourselves (our writes to it going into our own heap at addresses
it chose), and a relay between two nodes of this host could have handed each one's claims
to the other. The handshake refuses a peer that says our id; the kernel's answer refuses
the rest: our own process holds the peer's end only when the peer is a node of this same
process, and a relay's process holds it where a relay is. The owner gives a region's
address only to a peer it placed so (:meth:`CmaFactory.tells_addresses`).

Trust model: ``process_vm_*`` needs the same permission as ``ptrace`` (same uid, and yama
allowing it). A peer that has it could already attach a debugger to us; the lane adds no
access that the kernel did not grant. The lane never calls ``prctl(PR_SET_PTRACER)``: where
permission is missing it is not used and the endpoint says why (a WARNING when the peer is on
this host and offered it).

Peer death is seen by the control channel: ops then fail with ``BrokenError`` before any
syscall (a reused pid is never written). Enabled under ``transport="auto"`` only; switch it
off with ``Node(same_host=False)`` or ``TENSORX_SAME_HOST=0``.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ctypes
import errno
import hashlib
import logging
import os
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from typing import Any

from tensorx._deadline import Deadline, wait_for
from tensorx._exports import check_bounds
from tensorx._loud import fallback
from tensorx._shm import host_id
from tensorx._text import printable
from tensorx.errors import (
    BrokenError,
    ClosedError,
    RegionError,
    TimeoutError,
    TransportUnavailableError,
    UsageError,
)
from tensorx.transport.base import HOST, Capabilities, DataLane, LaneFactory, Link, Op
from tensorx.transport.control import ControlChannel

__all__ = ["KEY", "CmaFactory", "CmaLane", "Probe", "check", "enabled", "make_pool", "offered",
           "token"]

logger = logging.getLogger(__name__)

KEY = "cma"
# Ops larger than this run in the pool, not on the event loop. A trip through the pool
# (submit, a thread's wake-up, the GIL and the loop's wake-up back) costs 50 us on an idle
# host and 0.3-0.6 ms on a busy one, twice a PS round, while a 4 MiB copy takes ~0.7 ms: at
# 256 KiB, a 2 MB round over this lane lost to TCP (benchmarks/ps_round.py, many-small:
# 4.7 vs 4.4 ms; 3.4 ms with the copies on the loop). Up to this, the loop pauses instead.
POOL_ABOVE = 4 << 20
PIECE = 8 << 20  # bytes per syscall: a cancelled or closed op stops at the next piece
MAX_IOV = 1024  # UIO_MAXIOV
MAX_CACHED = 4096  # owner-given addresses kept per lane
# probes kept readable after their connection ended: a peer that connected and closed at
# once may still be checking ours (it read freed memory: a WARNING, no lane)
RETIRED = 64
HOW = ("cma (process_vm_writev/readv: one copy, same host; peer death seen by the control "
       "channel)")

Segment = tuple[int, int, int]  # (local address, remote address, nbytes)


def enabled(setting: bool | None, transport: str) -> bool:
    """``Node(same_host=...)``: None means on under ``transport="auto"`` unless
    ``TENSORX_SAME_HOST=0``; an explicit transport keeps meaning exactly that lane."""
    if setting is None:
        off = os.environ.get("TENSORX_SAME_HOST", "1").strip().lower() in (
            "0", "no", "off", "false")
        return transport == "auto" and not off
    if setting and transport != "auto":
        raise UsageError(f"same_host=True needs transport='auto' (transport={transport!r} "
                         "means exactly that lane)")
    return setting


def make_pool() -> Executor:
    """The small pool large copies run in (the syscalls release the GIL)."""
    return ThreadPoolExecutor(max_workers=2, thread_name_prefix="tx-cma")


# -- the syscalls ---------------------------------------------------------------------------
class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


_calls: dict[bool, Any] = {}


def _syscall(to_remote: bool) -> Any:
    """``process_vm_writev`` (to_remote) or ``process_vm_readv``, bound once."""
    if not _calls:
        libc = ctypes.CDLL(None, use_errno=True)
        for write, name in ((True, "process_vm_writev"), (False, "process_vm_readv")):
            fn = getattr(libc, name)
            fn.argtypes = [ctypes.c_int, ctypes.POINTER(_Iovec), ctypes.c_ulong,
                           ctypes.POINTER(_Iovec), ctypes.c_ulong, ctypes.c_ulong]
            fn.restype = ctypes.c_ssize_t
            _calls[write] = fn
    return _calls[to_remote]


def copy(pid: int, segments: Sequence[Segment], to_remote: bool,
         stop: Callable[[], BaseException | None]) -> None:
    """Move every segment (loops on partial counts), at most :data:`PIECE` bytes and
    :data:`MAX_IOV` segments per syscall; ``stop()`` is asked before each one and what it
    returns is raised. Errors leave as ``tensorx.errors``."""
    fn = _syscall(to_remote)
    if len(segments) == 1 and segments[0][2] <= PIECE:  # the usual small op: no arrays
        _one(fn, pid, segments[0], stop)
        return
    i, skip = 0, 0  # the segment to continue, and how much of it is done
    while i < len(segments):
        halt = stop()
        if halt is not None:
            raise halt
        local, remote, count = _batch(segments, i, skip)
        done = fn(pid, local, count, remote, count, 0)
        if done <= 0:
            raise _error(ctypes.get_errno() if done < 0 else errno.EFAULT, segments[i], skip)
        while done:
            n = segments[i][2]
            take = min(n - skip, done)
            skip, done = skip + take, done - take
            if skip == n:
                i, skip = i + 1, 0


def _one(fn: Any, pid: int, segment: Segment, stop: Callable[[], BaseException | None]
         ) -> None:
    la, ra, n = segment
    skip = 0
    while skip < n:
        halt = stop()
        if halt is not None:
            raise halt
        done = fn(pid, _Iovec(la + skip, n - skip), 1, _Iovec(ra + skip, n - skip), 1, 0)
        if done <= 0:
            raise _error(ctypes.get_errno() if done < 0 else errno.EFAULT, segment, skip)
        skip += done


def _batch(segments: Sequence[Segment], i: int, skip: int) -> tuple[Any, Any, int]:
    """The iovecs of the next syscall, from segment ``i`` (``skip`` bytes into it)."""
    size = min(MAX_IOV, len(segments) - i)
    local, remote = (_Iovec * size)(), (_Iovec * size)()
    k = total = 0
    while i < len(segments) and k < size and total < PIECE:
        la, ra, n = segments[i]
        take = min(n - skip, PIECE - total)
        local[k].base, local[k].len = la + skip, take
        remote[k].base, remote[k].len = ra + skip, take
        k, total = k + 1, total + take
        i, skip = i + 1, 0
    return local, remote, k


def _error(code: int, segment: Segment, skip: int) -> BrokenError:
    start = segment[1] + skip
    where = f"remote [{start:#x}, {segment[1] + segment[2]:#x})"
    if code in (errno.ESRCH, errno.EPERM):
        exc = BrokenError(f"cma: the peer process is gone ({os.strerror(code)})")
        exc.__cause__ = OSError(code, os.strerror(code))
        return exc
    if code == errno.EFAULT:  # the owner holds revoked memory until we acknowledged
        return BrokenError(f"cma: {where} is not mapped in the peer (a bug or a dying peer)")
    exc = BrokenError(f"cma: copy of {where} failed: {os.strerror(code)}")
    exc.__cause__ = OSError(code, os.strerror(code))
    return exc


# -- choosing the lane ----------------------------------------------------------------------
def token(binding: bytes, node_id: str) -> bytes:
    """The probe token of node ``node_id`` on the connection with ``binding`` (both
    handshake nonces): 16 bytes no process could hold before this handshake."""
    return hashlib.sha256(b"tensorx-cma\0" + binding + node_id.encode()).digest()[:16]


class Probe:
    """Our token for one connection at a known address: a peer that reads it back
    through ``process_vm_readv`` has proved it may use this lane to us."""

    def __init__(self, binding: bytes, node_id: str) -> None:
        self.token = token(binding, node_id)
        self._buf = ctypes.create_string_buffer(self.token, 16)

    def caps(self) -> dict[str, Any]:
        return {"host": host_id(), "pid": os.getpid(), "probe": ctypes.addressof(self._buf),
                "token": self.token}


def offered(ours: bool, theirs: Any) -> bool:
    """Both peers offer the lane and share a host: each may bypass the other (so each
    holds closed regions for the other until it acknowledges)."""
    host = host_id()
    return ours and isinstance(theirs, dict) and bool(host) and theirs.get("host") == host


def check(ours: bool, theirs: Any, expected: bytes, held_by: Callable[[int], str]
          ) -> tuple[int | None, str, bool]:
    """(the peer's pid, "", False) when we may use the lane to it: ``held_by(pid)`` (the
    kernel, see :meth:`Link.held_by`) places the peer in the process it offers, and its
    probe there holds ``expected`` (see :func:`token`); else (None, why, loud): loud when
    the peer says it is on this host and offered it (permission is missing, or the peer is
    not the process it says)."""
    if not ours:
        return None, "off (same_host disabled here)", False
    if not isinstance(theirs, dict):
        return None, "none (the peer does not offer cma)", False
    if not offered(ours, theirs):
        return None, "none (the peer is on another host)", False
    pid, probe, token = theirs.get("pid"), theirs.get("probe"), theirs.get("token")
    if not (isinstance(pid, int) and isinstance(probe, int) and isinstance(token, bytes)
            and len(token) == 16 and 0 < pid < 2**31 and 0 < probe < 2**64):
        return None, "none (the peer's cma offer is malformed)", True
    held = held_by(pid)
    if held:  # never read, let alone write, a process the kernel does not place it in
        return None, f"none (the peer says it is process {pid}, the kernel says: {held})", True
    got = ctypes.create_string_buffer(16)
    try:
        copy(pid, [(ctypes.addressof(got), probe, 16)], False, lambda: None)
    except BrokenError as exc:
        if isinstance(exc.__cause__, OSError) and exc.__cause__.errno == errno.ESRCH:
            return None, "none (the peer's process has exited)", False
        return None, (f"none (process_vm_readv of the peer's memory failed: {exc}; "
                      "yama ptrace_scope, another user or a container?)"), True
    if got.raw != expected or token != expected:
        return None, "none (the peer's probe did not read back its token: another pid " \
                     "namespace?)", True
    return pid, "", False


# -- the factory and the lane ---------------------------------------------------------------
class CmaFactory(LaneFactory):
    """Offers a probe per connection and opens :class:`CmaLane` s to peers that pass
    :func:`check`. ``enabled``: see :func:`enabled`; a disabled factory offers nothing
    and says so in ``ep.info["host"]``."""

    name = KEY
    caps = Capabilities(memory=frozenset({HOST}), one_sided=True, peer_death=True,
                        same_host=True, rank=30)
    note = "host"

    def __init__(self, node_id: str, enabled: bool) -> None:
        self._node_id = node_id
        self._enabled = enabled
        self._probes: dict[bytes, Probe] = {}  # per connection, while it lives
        self._retired: collections.deque[Probe] = collections.deque(maxlen=RETIRED)
        self._pool: Executor | None = None

    def offer(self, binding: bytes) -> Any:
        if not self._enabled:
            return None
        probe = self._probes[binding] = Probe(binding, self._node_id)
        return probe.caps()

    def forget(self, binding: bytes) -> None:
        probe = self._probes.pop(binding, None)
        if probe is not None:
            self._retired.append(probe)  # see RETIRED

    def reaches(self, offer: Any) -> bool:
        return offered(self._enabled, offer)

    def tells_addresses(self, link: Link) -> bool:
        """Only to a peer that offered the lane from the process that the kernel says
        holds its end of the connection (see the module's docstring)."""
        theirs = link.offer(KEY)
        if not (offered(self._enabled, theirs) and isinstance(theirs, dict)):
            return False
        pid = theirs.get("pid")
        return isinstance(pid, int) and 0 < pid < 2**31 and not link.held_by(pid)

    async def open_lane(self, link: Link, *, timeout: float | None) -> CmaLane:
        """The lane, or TransportUnavailableError saying why not (logged as a WARNING
        where it should have worked: the peer is on this host and offered it)."""
        pid, why, loud = check(self._enabled, link.offer(KEY), token(link.binding, link.peer),
                               link.held_by)
        if pid is None:
            if loud:
                fallback(logger, "cma", "endpoint to %s: no same-host lane (CMA), host memory "
                         "goes over the lane between hosts: %s. CMA needs the permission "
                         "ptrace has (same user; yama ptrace_scope <= 1; containers may "
                         "forbid it); same_host=False (TENSORX_SAME_HOST=0) turns it off "
                         "without this warning", link.peer, printable(why))
            raise TransportUnavailableError(why)
        if self._pool is None:
            self._pool = make_pool()
        return CmaLane(link.channel, pid, self._pool)

    async def aclose(self) -> None:
        self.abort()  # the node closed every endpoint first: each waited for its copies

    def abort(self) -> None:
        if self._pool is not None:  # its threads finish the piece they copy, then end
            self._pool.shutdown(wait=False)


class CmaLane(DataLane):
    """Host-memory ops to a same-host peer by ``process_vm_writev/readv``; the endpoint
    sends every other op to its other lanes."""

    name = KEY
    bypasses_owner = True

    def __init__(self, channel: ControlChannel, pid: int, pool: Executor) -> None:
        self._requests = channel.requests
        self._pid = pid
        self._pool = pool
        self._addrs: dict[tuple[int, int], asyncio.Future[int | None]] = {}
        self._known: dict[tuple[int, int], int] = {}  # the answers, for the fast path
        self._inflight: set[asyncio.Future[None]] = set()
        self._halt: BaseException | None = None  # set once closed or the peer is gone
        self.ops = 0  # ops this lane carried itself (instrumentation, tests)

    @property
    def info(self) -> dict[str, Any]:
        return {"host": HOW, "lanes": [KEY]}

    def carries(self, op: Op) -> bool:
        return op.nbytes > 0 and not op.local.is_cuda and op.remote.device != "cuda"

    async def _address(self, op: Op, timeout: float | None) -> int:
        """The owner's address of ``op.remote``."""
        key = (op.remote.region_id, op.remote.cookie)
        fut = self._addrs.get(key)
        if fut is not None and fut.done() and not fut.cancelled() and fut.exception() is None:
            addr = fut.result()  # the usual case: no event-loop hop
        else:
            addr = await self._ask_once(key, op.remote.nbytes, fut, timeout)
        if addr is None:  # GPU memory under a descriptor that says host, or an owner
            raise RegionError(  # that does not place us on its host (see tells_addresses)
                f"the owner of region {key[0]:#x} gives no address for it (GPU memory "
                "under a host descriptor, or the owner does not see this process as its "
                "peer)")
        return addr

    async def _ask_once(self, key: tuple[int, int], nbytes: int,
                        fut: asyncio.Future[int | None] | None,
                        timeout: float | None) -> int | None:
        """Ask the owner for the address (one request for every op that waits on it)."""
        if fut is None:
            if len(self._addrs) >= MAX_CACHED:
                self._addrs = {k: f for k, f in self._addrs.items() if not f.done()}
            fut = self._addrs[key] = asyncio.ensure_future(self._ask(key, nbytes))
            fut.add_done_callback(_retrieve)
        try:
            return await wait_for(asyncio.shield(fut), timeout)
        except asyncio.TimeoutError:
            raise TimeoutError(f"cma: the owner's address of region {key[0]:#x} did not "
                               f"come within {timeout} s") from None
        except BaseException:
            if fut.done() and (fut.cancelled() or fut.exception() is not None):
                self._addrs.pop(key, None)  # ask again next time
            raise

    async def _ask(self, key: tuple[int, int], nbytes: int) -> int | None:
        n, _, addr = await self._requests.address(*key, None)
        if n != nbytes:
            raise RegionError(f"the descriptor of region {key[0]:#x} claims {nbytes} B, but "
                              f"its owner exported {n} B (altered or forged): get it from "
                              "its owner again")
        if addr is not None:
            if len(self._known) >= MAX_CACHED:
                self._known.clear()
            self._known[key] = addr
        return addr

    def _at_once(self, ops: Sequence[Op], to_remote: bool) -> bool:
        """Do small ops whose addresses we know right here (nothing to wait for, so
        nothing in flight for :meth:`flush` to track); False, nothing done, where they are
        not that. Each op's range is checked before any byte moves."""
        if self._halt is not None:
            return False
        segments: list[Segment] = []
        total = 0
        for op in ops:
            addr = self._known.get((op.remote.region_id, op.remote.cookie))
            if addr is None:
                return False
            check_bounds(op.remote.nbytes, op.remote_offset, op.nbytes)
            segments.append((op.local.address + op.local_offset, addr + op.remote_offset,
                             op.nbytes))
            total += op.nbytes
        if total > POOL_ABOVE:
            return False
        copy(self._pid, segments, to_remote, self._stopped)
        self.ops += len(segments)
        return True

    async def _segments(self, ops: Sequence[Op], deadline: Deadline) -> list[Segment]:
        segments: list[Segment] = []
        for op in ops:
            addr = await self._address(op, deadline.left())
            # the endpoint checked the range against the owner's size; defence:
            check_bounds(op.remote.nbytes, op.remote_offset, op.nbytes)
            segments.append((op.local.address + op.local_offset, addr + op.remote_offset,
                             op.nbytes))
        return segments

    # -- the contract ---------------------------------------------------------------------
    async def write(self, op: Op, *, timeout: float | None) -> None:
        if not self._at_once((op,), True):
            await self._run([op], True, timeout)

    async def read(self, op: Op, *, timeout: float | None) -> None:
        if not self._at_once((op,), False):
            await self._run([op], False, timeout)

    async def write_many(self, ops: Sequence[Op], *, timeout: float | None) -> None:
        if not self._at_once(ops, True):
            await self._run(ops, True, timeout)

    async def _run(self, ops: Sequence[Op], to_remote: bool, timeout: float | None) -> None:
        deadline = Deadline(timeout)  # asking owners for addresses, then copying
        async with self._tracked():
            segments = await self._segments(ops, deadline)
            await self._copy(segments, list(ops), to_remote, deadline.left())

    async def flush(self, *, timeout: float | None) -> None:
        """Every op started before (reads too: a revocation is acknowledged after this)
        has finished."""
        pending = list(self._inflight)
        if pending:
            try:
                await wait_for(asyncio.gather(*pending), timeout)
            except asyncio.TimeoutError:
                raise TimeoutError(f"cma: ops did not finish within {timeout} s") from None

    async def aclose(self) -> None:
        self.abort()

    def abort(self) -> None:
        if self._halt is None:
            self._halt = ClosedError("lane closed")

    def peer_gone(self, why: str) -> None:
        if self._halt is None or isinstance(self._halt, ClosedError):
            self._halt = BrokenError(f"peer gone: {why}")

    # -- copies ---------------------------------------------------------------------------
    def _stopped(self) -> BaseException | None:
        halt = self._halt
        return None if halt is None else type(halt)(str(halt))

    @contextlib.asynccontextmanager
    async def _tracked(self) -> AsyncIterator[None]:
        """Count the op in flight (for :meth:`flush`) from its start, address wait included."""
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._inflight.add(done)
        try:
            yield
        finally:
            self._inflight.discard(done)
            done.set_result(None)

    async def _copy(self, segments: list[Segment], ops: list[Op], to_remote: bool,
                    timeout: float | None) -> None:
        halt = self._stopped()
        if halt is not None:
            raise halt
        if sum(s[2] for s in segments) <= POOL_ABOVE:
            copy(self._pid, segments, to_remote, self._stopped)
        else:
            await self._in_pool(segments, ops, to_remote, timeout)
        self.ops += len(segments)

    async def _in_pool(self, segments: list[Segment], ops: list[Op], to_remote: bool,
                       timeout: float | None) -> None:
        """Copy in the pool; on a timeout or cancellation stop at the next piece and wait
        for the syscall in flight, so the caller's memory is never touched after we raise."""
        cancelled: list[BaseException] = []

        def stop() -> BaseException | None:
            return cancelled[0] if cancelled else self._stopped()

        for op in ops:
            op.local.backing.pin()  # a local region closed meanwhile stays mapped until we are done
        loop = asyncio.get_running_loop()
        try:
            fut = loop.run_in_executor(self._pool, copy, self._pid, segments, to_remote, stop)
        except RuntimeError as exc:  # the node closed its pool (an endpoint that came late)
            for op in ops:
                op.local.backing.unpin()
            raise ClosedError("cma: the node is closed") from exc
        try:
            await wait_for(asyncio.shield(fut), timeout)
        except asyncio.TimeoutError:
            cancelled.append(TimeoutError(f"cma: copy did not finish within {timeout} s"))
            await _settle(fut)
            raise TimeoutError(f"cma: copy did not finish within {timeout} s") from None
        except asyncio.CancelledError:
            cancelled.append(ClosedError("cma: copy cancelled"))
            await _settle(fut)
            raise
        finally:
            for op in ops:
                op.local.backing.unpin()


def _retrieve(fut: asyncio.Future[Any]) -> None:
    """Mark a shared future's error as seen (its waiters may all have timed out)."""
    if not fut.cancelled():
        fut.exception()


async def _settle(fut: asyncio.Future[None]) -> None:
    """Wait until ``fut`` (a copy in the pool) has finished, whatever else is cancelled."""
    while not fut.done():
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait((fut,))  # never raises fut's error
    if not fut.cancelled():
        fut.exception()  # retrieved: the caller raises its own error
