"""Endpoint: one authenticated connection to a peer node, with its data lanes.

It owns the connection's control channel (started here), the owner service that serves the
peer's requests on it, and the lane the node chose (see ``transport/auto.py``). It checks
every op against the local region and the remote descriptor before it reaches a lane,
sends data to the lane (TCP frames, UCX RMA, same-host copies) and notifications over the
control channel, flushing the lane first so a notification never overtakes its data.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from tensorx import _cuda
from tensorx._counters import OpStats
from tensorx._deadline import Deadline
from tensorx._exports import check_bounds
from tensorx._queues import MessageStream
from tensorx.errors import (
    ClosedError,
    RegionError,
    TensorxError,
    UsageError,
)
from tensorx.memregion import MemoryRegion, RegionDescriptor
from tensorx.transport.base import DataLane, Op
from tensorx.transport.control import ChannelEvents, ControlChannel
from tensorx.transport.owner import OwnerService

if TYPE_CHECKING:
    from tensorx.node import Node

__all__ = ["DEFAULT", "Endpoint"]

logger = logging.getLogger(__name__)


class _Default:
    def __repr__(self) -> str:
        return "DEFAULT"


DEFAULT: Any = _Default()
"""Timeout sentinel: use the node's ``timeout``. ``None`` means wait forever."""

OpSpec = tuple[MemoryRegion, "RegionDescriptor | bytes", int, int, "int | None"]


class Endpoint:
    """A connection to one peer; both sides of a connection get one and can use it fully."""

    def __init__(self, node: Node, channel: ControlChannel, owner: OwnerService,
                 lane: DataLane, *, peer: str, address: str, notes: dict[str, Any] | None = None,
                 bypassed: bool = False, claimed: bool = False) -> None:
        """Made by the node once the handshake is done and the lanes are open; starts
        serving the peer (``claimed``: its notifications go to :attr:`messages` from the
        first one)."""
        self._node = node
        self._channel = channel
        self._owner = owner
        self._lane = lane
        self._peer = peer
        self.address = address
        self._notes = dict(notes or {})  # e.g. why there is no same-host lane
        # Whether either side's lane may reach the other's memory without its code (UCX,
        # CMA). Symmetric by construction: each owner then holds closed regions until the
        # peer acknowledges, and each peer acknowledges (after its ops on them finished).
        self.bypassed = lane.bypasses_owner or bypassed
        self._validated: dict[tuple[int, int], tuple[int, str]] = {}
        # Exports the owner revoked, as (region id, cookie): an export of the region made
        # since has a cookie of its own and is usable.
        self._revoked: set[tuple[int, int]] = set()
        self._acks: set[asyncio.Task[None]] = set()
        self._issuing: set[asyncio.Future[None]] = set()
        self._closed = False
        self.stats = OpStats()
        self._stream = MessageStream(f"endpoint to {peer}")
        self._claimed = claimed  # our notifications go to _stream, not node.notifications
        channel.start(owner, ChannelEvents(
            deliver=self._deliver, revoked=self._revoke, ended=self._ended,
            revoke_acked=lambda rid, cookie: node._revoke_acked(self, rid, cookie),
            deliver_now=self._deliver_now))

    @property
    def messages(self) -> MessageStream:
        """This peer's notifications, in order, ending after its last one (see
        :class:`~tensorx.MessageStream`: ``await ep.messages.get(timeout)``, or
        ``async for payload in ep.messages``). Asking for it claims them: from then on
        they come here and no longer to ``node.notifications``. Ask right after
        :meth:`Node.connect` returns (before awaiting anything else); for the endpoints
        peers open, pass ``Node(handler=...)``, which claims them from the first one."""
        self._claimed = True
        return self._stream

    def _deliver(self, payload: bytes) -> Awaitable[None]:
        """Where a notification from the peer goes (an awaitable: waits while it is full)."""
        if self._claimed:
            return self._stream.put(payload)
        return self._node.notifications.put((self, payload))

    def _deliver_now(self, payload: bytes) -> bool:
        """:meth:`_deliver` where it would not wait; False (nothing done) where it would."""
        if self._claimed:
            return self._stream.put_nowait(payload)
        queue = self._node.notifications
        if queue.full():
            return False
        queue.put_nowait((self, payload))
        return True

    def _ended(self, exc: BaseException | None) -> None:
        """The control channel ended (the peer left or broke it, or we closed it): release
        the lanes too (a UCX endpoint would otherwise keep its socket and state forever),
        end the message stream, tell the node."""
        self._lane.peer_gone(str(exc or "the peer closed the endpoint"))
        self._stream.end(exc)
        self._node._endpoint_ended(self, exc)

    def _unexported(self, desc: RegionDescriptor) -> None:
        """The node stopped serving an export: tell the peer (best effort, no wait)."""
        self._channel.revoke(desc.region_id, desc.cookie)

    def __repr__(self) -> str:
        return f"<Endpoint to {self.peer} at {self.address} over {self._lane.name}>"

    # -- state --------------------------------------------------------------------------
    @property
    def peer(self) -> str:
        """The peer node's id (``Node.id`` on the other side)."""
        return self._peer

    @property
    def transport(self) -> str:
        return self._lane.name

    @property
    def info(self) -> dict[str, Any]:
        """``{"transport", "lanes", "why", "host", "skipped", "peer", "address", "stats",
        "socket"}`` (``"gpu"`` too where GPU memory has a path of its own): the lane
        between hosts, its lanes and why it is the one; how host memory moves between
        same-host peers or why not; why each lane factory left out was (by name)."""
        return {**self._lane.info, **self._notes, "peer": self.peer, "address": self.address,
                "stats": self.stats.snapshot(), "socket": dict(self._channel.stats)}

    @contextlib.contextmanager
    def _counted(self, op: str, nbytes: int) -> Iterator[None]:
        started, failed = time.perf_counter(), True
        try:
            yield
            failed = False
        finally:
            self.stats.record(op, nbytes, started, failed)

    @property
    def closed(self) -> bool:
        return self._closed or self._channel.broken is not None

    def _check_usable(self) -> None:
        if self._closed:
            raise ClosedError(f"endpoint to {self.peer} is closed")
        if self._channel.broken is not None:
            raise type(self._channel.broken)(str(self._channel.broken))

    def _timeout(self, timeout: Any) -> float | None:
        return self._node.timeout if timeout is DEFAULT else timeout  # type: ignore[no-any-return]

    # -- data ---------------------------------------------------------------------------
    async def write(self, region: MemoryRegion, remote: RegionDescriptor | bytes,
                    offset: int = 0, remote_offset: int = 0, nbytes: int | None = None, *,
                    notify: bytes | None = None, timeout: float | None = DEFAULT) -> None:
        """Write ``nbytes`` (default: the rest of ``region`` from ``offset``) into the peer's
        region at ``remote_offset``. Returns when the data is in the peer's memory.

        ``notify``: also deliver these bytes to the peer's ``node.notifications`` once the
        data has landed (a write with immediate data): never before the data, and not at all
        if the write fails. Over TCP the notification travels with the data (no round trip
        between them, unlike ``write`` then ``notify``)."""
        if notify is not None:
            await self.write_many([(region, remote, offset, remote_offset, nbytes)],
                                  notify=notify, timeout=timeout)
            return
        produced = _cuda.ready((region,)) if _is_cuda(region) else []  # recorded at the call
        t = self._timeout(timeout)
        op = self._op_now(region, remote, offset, remote_offset, nbytes, "w")
        if op is None or produced:  # it may wait before the lane has it: notify waits too
            deadline = Deadline(t)  # one budget for asking the owner and the write
            async with self._issuing_write():
                if op is None:
                    op = await self._op(region, remote, offset, remote_offset, nbytes, "w",
                                        deadline.left())
                if produced:
                    await _cuda.wait(produced)
            t = deadline.left()
        started, failed = time.perf_counter(), True
        try:
            await self._lane.write(op, timeout=t)
            failed = False
        finally:
            self.stats.record("write", op.nbytes, started, failed)

    async def read(self, region: MemoryRegion, remote: RegionDescriptor | bytes,
                   offset: int = 0, remote_offset: int = 0, nbytes: int | None = None, *,
                   timeout: float | None = DEFAULT) -> None:
        """Read ``nbytes`` (default: the rest of ``region`` from ``offset``) from the peer's
        region at ``remote_offset`` into ``region``. Returns when the data is local."""
        # kernels enqueued before the call that still use the destination finish first
        used = _cuda.ready((region,)) if _is_cuda(region) else []
        t = self._timeout(timeout)
        op = self._op_now(region, remote, offset, remote_offset, nbytes, "r")
        if op is None:
            deadline = Deadline(t)  # one budget for asking the owner and the read
            op = await self._op(region, remote, offset, remote_offset, nbytes, "r", t)
            t = deadline.left()
        if used:
            await _cuda.wait(used)
        started, failed = time.perf_counter(), True
        try:
            await self._lane.read(op, timeout=t)
            failed = False
        finally:
            self.stats.record("read", op.nbytes, started, failed)

    async def write_many(self, ops: Iterable[Sequence[Any]], *, notify: bytes | None = None,
                         timeout: float | None = DEFAULT) -> None:
        """Issue several writes ``(region, desc, offset, remote_offset, nbytes)``; one
        completion covers them all. Raises the first error. ``notify``: as for
        :meth:`write`, delivered once all of them have landed."""
        if notify is not None:
            _check_payload(notify)
        specs = [_spec(spec) for spec in ops]
        produced = _cuda.ready(s[0] for s in specs if _is_cuda(s[0]))  # recorded at the call
        deadline = Deadline(self._timeout(timeout))  # checks, writes and notify: one budget
        async with self._issuing_write():
            checked = [await self._op(*spec, "w", deadline.left()) for spec in specs]
            if produced:
                await _cuda.wait(produced)
        t = deadline.left()
        carried = False
        if checked:
            started = time.perf_counter()
            with self._counted("write", sum(op.nbytes for op in checked)):
                if notify is not None:
                    carried = await self._lane.write_notify(checked, bytes(notify), timeout=t)
                if not carried:
                    await self._lane.write_many(checked, timeout=t)
            if carried:
                assert notify is not None
                self.stats.record("notify", len(notify), started, False)
        if notify is not None and not carried:  # the lane could not carry it: flush, notify
            await self.notify(notify, timeout=deadline.left())

    async def notify(self, payload: bytes = b"", *, timeout: float | None = DEFAULT) -> None:
        """Send ``payload`` to the peer's ``node.notifications``. The peer never sees it
        before the data of any write issued earlier on this endpoint."""
        self._check_usable()
        _check_payload(payload)
        deadline = Deadline(self._timeout(timeout))
        if self._issuing:  # writes started earlier but still being checked
            await asyncio.gather(*self._issuing)
        with self._counted("notify", len(payload)):
            await self._lane.flush(timeout=deadline.left())
            await self._channel.notify(bytes(payload), deadline.left())

    @contextlib.asynccontextmanager
    async def _issuing_write(self) -> AsyncIterator[None]:
        """Mark a write as started until it is handed to the lane (which issues it without
        yielding), so a later notify waits for it to be issued first."""
        handed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._issuing.add(handed)
        try:
            yield
        finally:
            self._issuing.discard(handed)
            handed.set_result(None)

    def _op_now(self, region: MemoryRegion, remote: RegionDescriptor | bytes, offset: int,
                remote_offset: int, nbytes: int | None, need: str) -> Op | None:
        """:meth:`_op` without waiting, or None when the owner has to be asked first
        (a lane that bypasses it, a descriptor not checked yet)."""
        self._check_usable()
        desc = _descriptor(remote)
        _check_local(region, offset, nbytes, need)
        limits = self._remote_limits_now(desc)
        if limits is None:
            return None
        return self._checked(region, desc, offset, remote_offset, nbytes, need, *limits)

    async def _op(self, region: MemoryRegion, remote: RegionDescriptor | bytes, offset: int,
                  remote_offset: int, nbytes: int | None, need: str,
                  timeout: float | None) -> Op:
        self._check_usable()
        desc = _descriptor(remote)
        _check_local(region, offset, nbytes, need)
        size, access = await self._remote_limits(desc, timeout)
        return self._checked(region, desc, offset, remote_offset, nbytes, need, size, access)

    def _checked(self, region: MemoryRegion, desc: RegionDescriptor, offset: int,
                 remote_offset: int, nbytes: int | None, need: str, size: int,
                 access: str) -> Op:
        if nbytes is None:
            nbytes = region.nbytes - offset
        if need not in access:
            verb = "written" if need == "w" else "read"
            raise RegionError(f"remote region {desc.region_id:#x} is exported '{access}' "
                              f"and cannot be {verb}")
        check_bounds(size, remote_offset, nbytes)
        return Op(region, desc, offset, remote_offset, nbytes)

    def _revoke(self, region_id: int, cookie: int) -> None:
        """The owner closed or unexported an export of a region: refuse its descriptor
        from now on. Over a lane that bypasses the owner, the owner keeps the memory until
        we acknowledge, which we do once every op issued before (on any region) has
        completed."""
        self._revoked.add((region_id, cookie))
        self._validated.pop((region_id, cookie), None)
        if self.bypassed:
            task = asyncio.get_running_loop().create_task(self._ack_revoke(region_id, cookie))
            self._acks.add(task)
            task.add_done_callback(self._acks.discard)

    async def _ack_revoke(self, region_id: int, cookie: int) -> None:
        try:
            await self._lane.flush(timeout=self._node.timeout)
        except TensorxError as exc:  # a broken or closed lane has nothing in flight either
            logger.debug("flush before acknowledging a revocation: %s", exc)
        if not self._channel.broken:
            self._channel.revoke_ack(region_id, cookie)

    def _check_not_revoked(self, desc: RegionDescriptor) -> None:
        if (desc.region_id, desc.cookie) in self._revoked:
            raise RegionError(f"region {desc.region_id:#x} was closed by its owner (or "
                              "exported again, under a new descriptor)")

    def _remote_limits_now(self, desc: RegionDescriptor) -> tuple[int, str] | None:
        """Size and rights of the remote region if known without asking: from the
        descriptor for lanes that do not bypass the owner (it re-checks every TCP op),
        else from the owner's earlier answer."""
        if desc.owner != self.peer:
            raise RegionError(f"descriptor of region {desc.region_id:#x} belongs to node "
                              f"{desc.owner or '?'}, but this endpoint reaches {self.peer}")
        self._check_not_revoked(desc)
        if not self._lane.bypasses_owner:  # the owner checks every op itself
            return desc.nbytes, desc.access
        return self._validated.get((desc.region_id, desc.cookie))

    async def _remote_limits(self, desc: RegionDescriptor,
                             timeout: float | None) -> tuple[int, str]:
        """:meth:`_remote_limits_now`, asking the owner (once) where needed, within the
        op's budget."""
        known = self._remote_limits_now(desc)
        if known is not None:
            return known
        key = (desc.region_id, desc.cookie)
        if key not in self._validated:
            n, access = await self._channel.requests.validate(*key, timeout)
            self._check_not_revoked(desc)  # revoked while we asked
            if n != desc.nbytes or not set(desc.access) <= set(access):
                raise RegionError(f"descriptor of region {desc.region_id:#x} does not match "
                                  "what its owner exported")
            self._validated[key] = (n, desc.access)
        return self._validated[key]

    async def query(self, what: str, *, timeout: float | None = DEFAULT) -> dict[str, Any]:
        """Ask the peer node about itself: ``"exports"`` (regions, sizes, rights - never
        their cookies) or ``"endpoints"`` (peers, transports, counters)."""
        self._check_usable()
        return await self._channel.requests.query(what, self._timeout(timeout))

    # -- closing ------------------------------------------------------------------------
    async def aclose(self) -> None:
        """Close the lane and the connection. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            await self._lane.aclose()
        finally:
            for task in list(self._acks):
                task.cancel()
            await self._channel.aclose()
            self._node._forget(self)

    def abort(self) -> None:
        """Close at once; ops in flight fail with ClosedError. Idempotent."""
        self._closed = True
        for task in list(self._acks):
            task.cancel()
        self._lane.abort()
        self._channel.abort()
        self._node._forget(self)

    async def __aenter__(self) -> Endpoint:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


def _is_cuda(region: Any) -> bool:
    return isinstance(region, MemoryRegion) and region.is_cuda


def _check_payload(payload: Any) -> None:
    if not isinstance(payload, bytes | bytearray | memoryview):
        raise UsageError(f"notify payload must be bytes, not {type(payload).__name__}")


def _descriptor(remote: RegionDescriptor | bytes) -> RegionDescriptor:
    if isinstance(remote, RegionDescriptor):
        return remote
    if isinstance(remote, bytes | bytearray):
        return RegionDescriptor.from_bytes(bytes(remote))
    raise UsageError(f"expected a RegionDescriptor, got {type(remote).__name__}")


def _check_local(region: MemoryRegion, offset: int, nbytes: int | None, need: str) -> None:
    if not isinstance(region, MemoryRegion):
        raise UsageError(f"expected a MemoryRegion, got {type(region).__name__}; "
                         "wrap it with tx.MemoryRegion.register(obj)")
    if region.closed:
        raise ClosedError(f"local region {region.region_id:#x} is closed")
    if need == "r" and region.readonly:
        raise UsageError("cannot read into a read-only region")
    n = region.nbytes - offset if nbytes is None else nbytes
    # one cheap test on every op (a loop over the two took 0.9 us); the exact checks and
    # their messages only when it fails
    if type(offset) is not int or type(n) is not int or offset < 0 or n < 0:
        _check_count("offset", offset)
        _check_count("nbytes", n)
    if offset + n > region.nbytes:
        raise UsageError(f"local range [{offset}, {offset + n}) is outside the local region "
                         f"of {region.nbytes} B")


def _check_count(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise UsageError(f"{name} must be a non-negative int, got {value!r}")


def _spec(spec: Sequence[Any]) -> OpSpec:
    if not 2 <= len(spec) <= 5:
        raise UsageError("write_many takes (region, desc[, offset[, remote_offset[, nbytes]]])")
    full: list[Any] = [*spec, *[0, 0, None][len(spec) - 2:]]
    region, desc, offset, remote_offset, nbytes = full
    return region, desc, offset, remote_offset, nbytes

