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
from collections.abc import AsyncIterator, Awaitable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from tensorx import _cuda, _rows
from tensorx._counters import OpStats
from tensorx._deadline import Deadline, wait_for
from tensorx._exports import check_bounds
from tensorx._opcheck import check_local, check_payload, descriptor, is_cuda, spec
from tensorx._peerexports import PeerExports
from tensorx._queues import MessageStream
from tensorx._redial import redial
from tensorx._text import printable
from tensorx.errors import (
    BrokenError,
    ClosedError,
    ProtocolError,
    RegionError,
    TimeoutError,
)
from tensorx.memregion import MemoryRegion, RegionDescriptor, check_name
from tensorx.transport.base import DataLane, Op
from tensorx.transport.control import ChannelEvents, ControlChannel
from tensorx.transport.owner import OwnerService

__all__ = ["DEFAULT", "Connection", "Endpoint", "EndpointEvents"]

logger = logging.getLogger(__name__)

ROW_READS_IN_FLIGHT = 256  # read_rows: reads of runs of rows issued at once


class _Default:
    def __repr__(self) -> str:
        return "DEFAULT"


DEFAULT: Any = _Default()
"""Timeout sentinel: use the node's ``timeout``. ``None`` means wait forever."""


@dataclass(eq=False)
class Connection:
    """One authenticated connection's parts, made by the node once the handshake is done
    and the lanes are open: what an endpoint uses (and replaces when it reconnects)."""

    channel: ControlChannel
    owner: OwnerService  # serves the peer's requests on the channel
    lane: DataLane  # the lane the node chose (see ``transport/auto.py``)
    peer: str  # the peer node's id
    notes: dict[str, Any]  # e.g. why there is no same-host lane
    bypassed: bool  # the peer's lane may reach our memory without us
    binding: bytes  # the handshake's, under which the factories keep what they offered


class EndpointEvents(Protocol):
    """What an endpoint reports to the node that made it, and asks of it: the node's side
    of its endpoints (``tensorx._peers.Peers``). On the event loop; only ``dial`` waits."""

    @property
    def timeout(self) -> float | None: ...  # the node's: what DEFAULT means
    @property
    def notifications(self) -> asyncio.Queue[tuple[Endpoint, bytes]]: ...  # not claimed
    async def dial(self, address: str, timeout: float | None) -> Connection: ...  # again
    def former_peers(self, address: str) -> list[str]: ...  # reached there before
    def revoke_acked(self, ep: Endpoint, region_id: int, cookie: int) -> None: ...
    def lost(self, ep: Endpoint, exc: BaseException | None) -> None: ...  # reconnecting
    def relinked(self, ep: Endpoint, binding: bytes) -> None: ...  # under this handshake
    def ended(self, ep: Endpoint, exc: BaseException | None) -> None: ...  # for good
    def closed(self, ep: Endpoint) -> None: ...  # aclose() or abort()


class Endpoint:
    """A connection to one peer; both sides of a connection get one and can use it fully.

    An endpoint made by ``Node.connect(address, reconnect=seconds)`` outlives its
    connection: when the connection ends (the peer node closed, died or restarted, or the
    link broke), ops in flight fail with :class:`~tensorx.errors.BrokenError` and it
    connects again in the background, with the backoff of ``Worker(reconnect=)``; ops
    issued meanwhile wait for it (within their timeout). A peer that restarted is a new
    node (:attr:`peer` changes) whose exports are new: look them up again
    (:meth:`lookup`). Once ``reconnect`` seconds pass without a connection, the endpoint
    is broken for good (every op raises BrokenError saying why, ``messages`` ends, the node
    puts it on ``node.disconnected``)."""

    def __init__(self, events: EndpointEvents, conn: Connection, *, address: str,
                 claimed: bool = False, reconnect: float | None = None) -> None:
        """Made by the node once the handshake is done and the lanes are open; starts
        serving the peer (``claimed``: its notifications go to :attr:`messages` from the
        first one). ``events``: the node's side, told what happens to it."""
        self._events = events
        self.address = address
        self._reconnect = reconnect
        self._rejoin: asyncio.Task[None] | None = None  # reconnecting now
        self._gone: BrokenError | None = None  # could not reconnect: why
        self._exports = PeerExports(address, events)  # what we know of the peer's exports
        self._issuing: set[asyncio.Future[None]] = set()
        self._closed = False
        self.stats = OpStats()
        self._stream = MessageStream(f"endpoint to {conn.peer}")
        self._claimed = claimed  # our notifications go to _stream, not node.notifications
        self._use(conn)

    def _use(self, conn: Connection) -> None:
        """Serve the peer on ``conn`` and send our ops over it from now on."""
        self._conn = conn
        self._channel, self._lane, self._peer = conn.channel, conn.lane, conn.peer
        self._notes = dict(conn.notes)
        # Whether either side's lane may reach the other's memory without its code (UCX,
        # CMA). Symmetric by construction: each owner then holds closed regions until the
        # peer acknowledges, and each peer acknowledges (after its ops on them finished).
        self.bypassed = conn.lane.bypasses_owner or conn.bypassed
        self._exports.use(conn.peer, conn.lane, conn.channel, self.bypassed)
        conn.channel.start(conn.owner, ChannelEvents(
            deliver=self._deliver, revoked=self._exports.revoke,
            ended=lambda exc: self._ended(conn, exc),
            revoke_acked=lambda rid, cookie: self._events.revoke_acked(self, rid, cookie),
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
        return self._events.notifications.put((self, payload))

    def _deliver_now(self, payload: bytes) -> bool:
        """:meth:`_deliver` where it would not wait; False (nothing done) where it would."""
        if self._claimed:
            return self._stream.put_nowait(payload)
        queue = self._events.notifications
        if queue.full():
            return False
        queue.put_nowait((self, payload))
        return True

    def _ended(self, conn: Connection, exc: BaseException | None) -> None:
        """``conn``'s control channel ended (the peer left or broke it, or we closed it):
        release the lanes too (a UCX endpoint would otherwise keep its socket and state
        forever); then reconnect, or end the message stream and tell the node."""
        if conn is not self._conn:
            return
        self._lane.peer_gone(str(exc or "the peer closed the endpoint"))
        if self._reconnect is not None and not self._closed:
            self._events.lost(self, exc)
            self._rejoin = asyncio.get_running_loop().create_task(
                self._redial(exc), name=f"tx-reconnect {self.address}")
            return
        self._stream.end(exc)
        self._events.ended(self, exc)

    async def _redial(self, why: BaseException | None) -> None:
        """Connect to :attr:`address` again (see :func:`tensorx._redial.redial`); then
        serve the new connection, or end as broken for good."""
        assert self._reconnect is not None
        try:
            conn = await redial(self.address, self._reconnect, self._events.dial)
        except BrokenError as exc:
            self._rejoin = None
            self._gone = BrokenError(f"endpoint to {self.address}: the connection ended "
                                     f"({printable(str(why or 'the peer closed it'))}) and "
                                     f"{exc}")
            self._stream.end(self._gone)
            self._events.ended(self, self._gone)
            return
        self._rejoin = None
        former = self._peer
        self._use(conn)
        self._events.relinked(self, conn.binding)
        logger.warning("endpoint to %s reconnected%s", self.address,
                       "" if conn.peer == former else f"; node {former} there restarted as "
                       f"node {conn.peer}: its exports have new descriptors")

    async def _rejoined(self, timeout: float | None) -> float | None:
        """Wait (within ``timeout``) for the reconnection in progress; the time left."""
        task = self._rejoin
        if task is None:
            return timeout
        deadline = Deadline(timeout)
        try:
            await wait_for(asyncio.shield(task), timeout)
        except asyncio.TimeoutError:
            raise TimeoutError(f"endpoint to {self.address} is still reconnecting after "
                               f"{timeout} s") from None
        return deadline.left()

    @property
    def reconnecting(self) -> bool:
        """Whether the connection ended and the endpoint is connecting again now."""
        return self._rejoin is not None

    def tell_unexported(self, desc: RegionDescriptor) -> None:
        """Tell the peer that this node stopped serving the export ``desc`` (best effort,
        no wait): the node's side of revocation (``Node.unexport``, a closed region), called
        by its peer table for every endpoint; not for users."""
        self._channel.revoke(desc.region_id, desc.cookie)

    def cut_off(self, why: str) -> None:
        """End the connection as one the peer broke (``why``: the rule it broke): its lanes
        close, ops in flight fail with BrokenError, and it reconnects where it was made to
        (else it ends, and the node puts it on ``node.disconnected``). The node's side of a
        peer that does not acknowledge a revocation; not for users."""
        self._channel.cut_off(why)

    def __repr__(self) -> str:
        return f"<Endpoint to {self.peer} at {self.address} over {self._lane.name}>"

    # -- state --------------------------------------------------------------------------
    @property
    def peer(self) -> str:
        """The peer node's id (``Node.id`` on the other side; a new one once the endpoint
        reconnected to a node that restarted)."""
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

    @property
    def closed(self) -> bool:
        """Whether it has no connection: closed, broken, or (see :attr:`reconnecting`)
        connecting again."""
        return self._closed or self._channel.broken is not None

    def _check_usable(self) -> None:
        if self._closed:
            raise ClosedError(f"endpoint to {self.peer} at {self.address} is closed (aclose() "
                              "or abort() was called on it): connect again to go on")
        if self._gone is not None:
            raise BrokenError(str(self._gone))
        if self._channel.broken is not None:
            raise type(self._channel.broken)(str(self._channel.broken))

    def _timeout(self, timeout: Any) -> float | None:
        return self._events.timeout if timeout is DEFAULT else timeout  # type: ignore[no-any-return]

    # -- data ---------------------------------------------------------------------------
    async def write(self, region: MemoryRegion, remote: RegionDescriptor | bytes,
                    offset: int = 0, remote_offset: int = 0, nbytes: int | None = None, *,
                    notify: bytes | None = None, timeout: float | None = DEFAULT) -> None:
        """Write ``nbytes`` bytes (default: the rest of ``region`` from ``offset``) into the
        peer's region at ``remote_offset``. Returns when the data is in the peer's memory.
        Offsets and sizes are in bytes, whatever the regions hold (for rows of a tensor,
        see :meth:`write_rows`); the owner checks them against its export.

        ``notify``: also deliver these bytes to the peer's ``node.notifications`` once the
        data has landed (a write with immediate data): never before the data, and not at all
        if the write fails. Over TCP the notification travels with the data (no round trip
        between them, unlike ``write`` then ``notify``)."""
        if notify is not None:
            await self.write_many([(region, remote, offset, remote_offset, nbytes)],
                                  notify=notify, timeout=timeout)
            return
        produced = _cuda.ready((region,)) if is_cuda(region) else []  # recorded at the call
        t = self._timeout(timeout)
        if self._rejoin is not None:
            t = await self._rejoined(t)
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
        """Read ``nbytes`` bytes (default: the rest of ``region`` from ``offset``) from the
        peer's region at ``remote_offset`` into ``region``. Returns when the data is local.
        Offsets and sizes are in bytes (for rows of a tensor, see :meth:`read_rows`)."""
        # kernels enqueued before the call that still use the destination finish first
        used = _cuda.ready((region,)) if is_cuda(region) else []
        t = self._timeout(timeout)
        if self._rejoin is not None:
            t = await self._rejoined(t)
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
        """Issue several writes ``(region, desc, offset, remote_offset, nbytes)`` (bytes, as
        :meth:`write`); one completion covers them all. Raises the first error. ``notify``: as for
        :meth:`write`, delivered once all of them have landed."""
        if notify is not None:
            check_payload(notify)
        specs = [spec(op) for op in ops]
        produced = _cuda.ready(s[0] for s in specs if is_cuda(s[0]))  # recorded at the call
        # waiting for a reconnection, checks, writes and notify: one budget
        deadline = Deadline(self._timeout(timeout))
        if self._rejoin is not None:
            await self._rejoined(deadline.left())
        known = [] if produced else [self._op_now(*one, "w") for one in specs]
        checked: list[Op] = [op for op in known if op is not None]
        if len(checked) < len(specs):  # it may wait before the lane has it: notify waits too
            async with self._issuing_write():
                checked = [await self._op(*one, "w", deadline.left()) for one in specs]
                if produced:
                    await _cuda.wait(produced)
        t = deadline.left()
        carried = False
        if checked:
            started, failed = time.perf_counter(), True
            try:
                if notify is None:
                    await self._lane.write_many(checked, timeout=t)
                else:  # written, and notified too where the lane carries it with the data
                    carried = await self._lane.write_then_notify(checked, bytes(notify),
                                                                 timeout=t)
                failed = False
            finally:
                self.stats.record("write", sum(op.nbytes for op in checked), started, failed)
            if carried:
                assert notify is not None
                self.stats.record("notify", len(notify), started, False)
        if notify is not None and not carried:  # the lane could not carry it: flush, notify
            await self._notify(bytes(notify), deadline)

    async def _notify(self, payload: bytes, deadline: Deadline) -> None:
        """:meth:`notify` once its checks are done (the payload's, the reconnection)."""
        self._check_usable()
        if self._issuing:  # writes started earlier but still being checked
            await asyncio.gather(*self._issuing)
        started, failed = time.perf_counter(), True
        try:
            await self._lane.flush(timeout=deadline.left())
            await self._channel.notify(payload, deadline.left())
            failed = False
        finally:
            self.stats.record("notify", len(payload), started, failed)

    async def read_rows(self, out: Any, remote: RegionDescriptor | bytes, rows: Any, *,
                        timeout: float | None = DEFAULT) -> None:
        """Read rows ``rows`` of the peer's tensor into ``out``: ``out[i]`` becomes the
        tensor's row ``rows[i]`` (its index along dim 0).

        ``remote``: the descriptor of a tensor or array the peer registered whole (it
        carries its dtype and shape). ``rows``: 1-D ints (list, numpy array, torch tensor),
        any order, repeats allowed. ``out``: a tensor or array (or its MemoryRegion) of
        that dtype and of shape ``(len(rows), *row_shape)``. Rows that follow each other
        travel as one read. UsageError for a row out of range or a dtype or shape that
        differs (nothing moves then); a failed read raises once none is in flight."""
        desc = descriptor(remote)
        planned = _rows.plan(out, desc, rows, "r")
        if len(planned.ranges) == 1:  # one run of rows (one row, say): no task per read
            off, roff, n = planned.ranges[0]
            await self.read(planned.region, desc, off, roff, n, timeout=timeout)
            return
        deadline = Deadline(self._timeout(timeout))
        for first in range(0, len(planned.ranges), ROW_READS_IN_FLIGHT):
            batch = planned.ranges[first:first + ROW_READS_IN_FLIGHT]
            done = await asyncio.gather(*(
                self.read(planned.region, desc, off, roff, n, timeout=deadline.left())
                for off, roff, n in batch), return_exceptions=True)
            failed = [r for r in done if isinstance(r, BaseException)]
            if failed:
                raise failed[0]

    async def write_rows(self, src: Any, remote: RegionDescriptor | bytes, rows: Any, *,
                         notify: bytes | None = None, timeout: float | None = DEFAULT) -> None:
        """Write ``src[i]`` into row ``rows[i]`` of the peer's tensor, for every ``i``, as
        one :meth:`write_many` (rows that follow each other as one range; ``notify`` as
        there). The checks are :meth:`read_rows`' (``src`` in place of ``out``), and a row
        may appear only once."""
        desc = descriptor(remote)
        planned = _rows.plan(src, desc, rows, "w")
        await self.write_many([(planned.region, desc, *r) for r in planned.ranges],
                              notify=notify, timeout=timeout)

    async def notify(self, payload: bytes = b"", *, timeout: float | None = DEFAULT) -> None:
        """Send ``payload`` to the peer's ``node.notifications``. The peer never sees it
        before the data of any write issued earlier on this endpoint."""
        check_payload(payload)
        deadline = Deadline(self._timeout(timeout))
        if self._rejoin is not None:
            await self._rejoined(deadline.left())
        await self._notify(bytes(payload), deadline)

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
        desc = descriptor(remote)
        check_local(region, offset, nbytes, need)
        limits = self._exports.limits_now(desc)
        if limits is None:
            return None
        return self._checked(region, desc, offset, remote_offset, nbytes, need, *limits)

    async def _op(self, region: MemoryRegion, remote: RegionDescriptor | bytes, offset: int,
                  remote_offset: int, nbytes: int | None, need: str,
                  timeout: float | None) -> Op:
        self._check_usable()
        desc = descriptor(remote)
        check_local(region, offset, nbytes, need)
        size, access = await self._exports.limits(desc, timeout)
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

    async def query(self, what: str, *, timeout: float | None = DEFAULT) -> dict[str, Any]:
        """Ask the peer node about itself: ``"exports"`` (regions, sizes, rights - never
        their cookies) or ``"endpoints"`` (peers, transports, counters)."""
        deadline = Deadline(self._timeout(timeout))
        if self._rejoin is not None:
            await self._rejoined(deadline.left())
        self._check_usable()
        return await self._channel.requests.query(what, deadline.left())

    async def lookup(self, name: str, *, timeout: float | None = DEFAULT) -> RegionDescriptor:
        """The descriptor of the region the peer exported under ``name``
        (``node.export(region, name=name)``): one round trip. The owner checks every op
        on it as on any descriptor. RegionError when the peer exports nothing under that
        name (its message lists the names it does export).

        After the peer restarted (see ``Node.connect(reconnect=)``), look its regions up
        again: their descriptors are new, and the old ones are refused saying so."""
        check_name(name)
        deadline = Deadline(self._timeout(timeout))
        if self._rejoin is not None:
            await self._rejoined(deadline.left())
        self._check_usable()
        answer = await self._channel.requests.query("lookup", deadline.left(), name=name)
        raw = answer.get("desc")
        if not isinstance(raw, bytes):
            raise ProtocolError(f"the lookup of '{printable(name)}' was answered without a "
                                "descriptor")
        desc = RegionDescriptor.from_bytes(raw)
        if desc.owner != self.peer or desc.name != name:
            raise ProtocolError(f"the lookup of '{printable(name)}' was answered with the "
                                f"descriptor of '{printable(desc.name)}' of node "
                                f"{printable(desc.owner)}")
        return desc

    # -- closing ------------------------------------------------------------------------
    async def aclose(self) -> None:
        """Close the lane and the connection. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stop_rejoining()
        try:
            await self._lane.aclose()
        finally:
            self._exports.cancel_acks()
            await self._channel.aclose()
            self._events.closed(self)

    def abort(self) -> None:
        """Close at once; ops in flight fail with ClosedError. Idempotent."""
        self._closed = True
        self._stop_rejoining()
        self._exports.cancel_acks()
        self._lane.abort()
        self._channel.abort()
        self._events.closed(self)

    def _stop_rejoining(self) -> None:
        """We close it: no more reconnecting (the old connection has ended already, so
        nothing else ends the message stream)."""
        if self._rejoin is not None:
            self._rejoin.cancel()
            self._rejoin = None
            self._stream.end(None)

    async def __aenter__(self) -> Endpoint:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
