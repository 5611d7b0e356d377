"""The control channel: the one TCP connection between two nodes, under every data lane.

It carries the handshake's frames (before :meth:`ControlChannel.start`), then
notifications, our requests and their answers (:mod:`._requests`: the TCP lane's WRITE and
READ, descriptor checks, queries), revocations and the goodbye. The peer's requests are
served by the endpoint's :class:`~tensorx.transport.owner.OwnerService`, which the channel
hands them to. Frames leave through a :class:`~tensorx.transport._sendq.SendQueue`.

Payloads never pass through an intermediate bytes object: an owner receives a WRITE
straight into the region (``recv_into`` a slice of it; what came in with the frame's header
is copied from the read buffer) and sends READ data straight out of it (``sendmsg`` of a
memoryview, gathered with the header); the requester does the same on its side. GPU
memory, which a socket cannot address, is staged through pinned host buffers on each side
that holds it (``_staging.py``); the bytes on the wire are the same.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Awaitable, Callable
from typing import Any

from tensorx import _wire
from tensorx._deadline import wait_for
from tensorx._wire import Kind
from tensorx.errors import (
    MESSAGE_LIMIT,
    BrokenError,
    ClosedError,
    ProtocolError,
    TensorxError,
    TimeoutError,
    UsageError,
    error_code,
    error_from_code,
)
from tensorx.transport._exceptions import map_exceptions
from tensorx.transport._futures import best_effort
from tensorx.transport._peercred import OtherEnd
from tensorx.transport._requests import Requests
from tensorx.transport._sendq import SendQueue
from tensorx.transport._sock import BUFFER_BYTES, FrameReader
from tensorx.transport._staging import RecvStager, StagedRange
from tensorx.transport.owner import OwnerService

__all__ = ["MAX_IMM", "ChannelEvents", "ControlChannel"]

logger = logging.getLogger(__name__)

MAX_IMM = _wire.MAX_HEADER // 2  # a notification small enough to ride in a WRITE header
MAX_QUEUED_FRAMES = 4096  # answers queued for a peer before we stop reading its requests
REQUESTS = frozenset({Kind.WRITE, Kind.READ, Kind.VALIDATE, Kind.QUERY})
# A goodbye (BYE on aclose, the ERROR of a refusal) is best effort and nobody's budget:
# aclose() takes none, and a peer that does not read must not hold our close up.
GOODBYE_TIMEOUT = 1.0

# A frame's header: an op frame's row (a tuple), any other kind's map (tensorx._wire.decode).
Header = Any
Handler = Callable[[Header, int], None]


class ChannelEvents:
    """What a started channel tells its one owner (the endpoint), given to
    :meth:`ControlChannel.start` once: a notification to deliver (awaited: the channel
    stops reading while it waits; ``deliver_now``: the same where it would not wait, else
    False and nothing done), an export of the peer's revoked (region id and cookie), the
    peer's acknowledgement of a revocation of ours (the same), and the end of the channel
    (``None``: a clean close)."""

    __slots__ = ("deliver", "deliver_now", "ended", "revoke_acked", "revoked")

    def __init__(self, deliver: Callable[[bytes], Awaitable[None]],
                 revoked: Callable[[int, int], None],
                 revoke_acked: Callable[[int, int], None],
                 ended: Callable[[BaseException | None], None],
                 deliver_now: Callable[[bytes], bool] | None = None) -> None:
        self.deliver = deliver
        self.deliver_now = deliver_now or _never
        self.revoked = revoked
        self.revoke_acked = revoke_acked
        self.ended = ended


def _never(payload: bytes) -> bool:
    return False


class ControlChannel:
    """One TCP connection to a peer: frames in, frames out, requests in flight.

    Before :meth:`start`, the handshake uses :meth:`send_now` and :meth:`recv_frame`.
    After it, frames are served as they arrive, right in the socket's readiness callback
    (no task hop: a reply completes its request there); a frame that has to wait (a
    payload still on its way, GPU staging, a full queue) is served by a task, and the
    socket is not read meanwhile.
    """

    def __init__(self, sock: socket.socket, label: str) -> None:
        self.sock = sock
        self.label = label
        self.other_end = OtherEnd(sock)  # who holds the peer's end, as the kernel says
        self._loop = asyncio.get_running_loop()
        self.stats = {"frames_in": 0, "frames_out": 0, "bytes_in": 0, "bytes_out": 0}
        self.reader = FrameReader(sock)
        self.out = SendQueue(sock, label, self.stats, self._fail)
        self.requests = Requests(label, self.reader, self.out, self.land)
        self._stage_in = RecvStager()  # GPU payloads: the reader's staging buffers
        self._owner: OwnerService | None = None
        self._events: ChannelEvents | None = None
        self._now: dict[Kind, Callable[[Header, int], bool | None]] = {}
        self._plain: dict[Kind, Handler] = {}
        self._later: dict[Kind, Callable[[Header, int], Awaitable[None]]] = {}
        self._serving: asyncio.Task[None] | None = None  # a frame that had to wait
        self._refusing: asyncio.Task[None] | None = None
        self._reading = False  # the readiness callback is registered
        self._error: TensorxError | None = None
        self._closing = False  # we said BYE
        self._refused = False  # a refusal went one way or the other: none goes back
        self._lost = map_exceptions(f"{label}: connection lost")

    # -- handshake phase ----------------------------------------------------------------
    async def send_now(self, kind: Kind, header: dict[str, Any]) -> None:
        with self._lost:
            await self._loop.sock_sendall(self.sock, _wire.encode(kind, header))

    async def recv_frame(self, expect: Kind) -> dict[str, Any]:
        """The peer's next handshake frame, of kind ``expect``; its refusal (an ERROR
        frame) is raised as the error it names."""
        kind, header, payload_len = await self.reader.frame()
        if kind is Kind.ERROR:
            self._refused = True
            raise error_from_code(header["code"], header["msg"],
                                  f"{self.label}: the peer refused: ")
        if kind is not expect or payload_len:
            raise ProtocolError(f"expected {expect.name} during handshake, got {kind.name}")
        hello: dict[str, Any] = header  # a handshake kind's header is a map
        return hello

    async def refuse(self, exc: TensorxError) -> None:
        """Tell the peer why we end the connection: an ERROR frame, which it raises as the
        error ``exc`` is (its handshake's :meth:`recv_frame`), or with which its endpoint
        breaks once started. Once per connection, and not back to a peer that refused us;
        best effort and nobody's budget (see GOODBYE_TIMEOUT)."""
        if self._refused:
            return
        self._refused = True
        with best_effort():
            await wait_for(self._loop.sock_sendall(self.sock, _refusal(exc)), GOODBYE_TIMEOUT)

    def refuse_now(self, exc: TensorxError) -> None:
        """:meth:`refuse`, with what the socket takes at once (for a connection about to
        be shut down under a task that is reading it)."""
        if not self._refused:
            self._refused = True
            with contextlib.suppress(OSError):
                self.sock.send(_refusal(exc))

    def start(self, owner: OwnerService, events: ChannelEvents) -> None:
        """The peer has authenticated: serve it (and only now give it a full-size
        buffer). ``owner`` serves its requests; ``events`` is what we tell our owner."""
        self._owner, self._events = owner, events
        req = self.requests
        self._plain = {
            Kind.READ: owner.on_read, Kind.VALIDATE: owner.on_validate,
            Kind.QUERY: owner.on_query, Kind.WRITE_ACK: req.on_ack, Kind.VALID: req.on_valid,
            Kind.ERROR: req.on_error, Kind.ANSWER: req.on_answer,
            Kind.REVOKE: self._on_revoke, Kind.REVOKE_ACK: self._on_revoke_ack}
        # what the readiness callback serves: one lookup per frame (False: it has to wait)
        self._now = {**self._plain, Kind.BYE: self._on_bye, Kind.WRITE: self._write_now,
                     Kind.READ_DATA: req.read_data_now, Kind.NOTIFY: self._notify_now}
        self._later = {Kind.WRITE: self._on_write, Kind.READ_DATA: req.on_read_data,
                       Kind.NOTIFY: self._on_notify}
        self.reader.resize(BUFFER_BYTES)
        self.out.start()
        self._resume()
        self._loop.call_soon(self._pump)  # frames that came with the handshake's last one

    # -- state --------------------------------------------------------------------------
    @property
    def broken(self) -> TensorxError | None:
        return self._error

    def _fail(self, exc: TensorxError, graceful: bool = False) -> None:
        """Mark the channel dead, fail every request in flight, close the socket.

        ``graceful``: the peer said BYE. Once either side has said BYE, whatever ends the
        connection next (EOF, a reset) is part of a clean close, not a failure."""
        if self._error is not None:
            return
        self._error = exc
        self.requests.fail(exc)
        self.out.fail(exc)
        current = asyncio.current_task()
        for task in (self._serving, self._refusing):  # a task waiting on the socket
            if task is not None and task is not current:  # would wait forever
                task.cancel()
        self._reading = False
        if self.sock.fileno() >= 0:
            self._loop.remove_reader(self.sock.fileno())
            self._loop.remove_writer(self.sock.fileno())
        self.sock.close()
        self.reader.release()
        self._stage_in.release()
        if self._owner is not None:
            self._owner.close()
        if self._events is not None:
            clean = graceful or self._closing or isinstance(exc, ClosedError)
            self._events.ended(None if clean else exc)

    async def aclose(self) -> None:
        """Say BYE, stop the tasks and close the socket. Idempotent."""
        if self._error is None and self.out.task is not None and not self._closing:
            self._closing = True
            with best_effort():
                await wait_for(self.out.send(Kind.BYE, {}), GOODBYE_TIMEOUT)
        self._fail(ClosedError(f"{self.label}: endpoint closed"))
        await self._join_tasks()

    def abort(self) -> None:
        self._fail(ClosedError(f"{self.label}: endpoint aborted"))

    def cut_off(self, why: str) -> None:
        """End the connection as broken by the peer (``why``: how), without a goodbye."""
        self._fail(BrokenError(f"{self.label}: cut off: {why}"))

    async def _join_tasks(self) -> None:
        current = asyncio.current_task()
        tasks = [t for t in (self._serving, self._refusing) if t is not None and t is not current]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, self.out.join(), return_exceptions=True)
        if current not in (self._serving, self._refusing):  # a cancelled task's
            self._serving = self._refusing = None  # traceback keeps its frames

    # -- what we send -------------------------------------------------------------------
    def revoke(self, region_id: int, cookie: int) -> None:
        """Tell the peer (best effort, without waiting) that an export of ours is gone."""
        self._best_effort(Kind.REVOKE, {"rid": region_id, "ck": cookie})

    def revoke_ack(self, region_id: int, cookie: int) -> None:
        """Tell the owner that none of our ops on its export is in flight any more."""
        self._best_effort(Kind.REVOKE_ACK, {"rid": region_id, "ck": cookie})

    def _best_effort(self, kind: Kind, header: dict[str, Any]) -> None:
        """Send a frame nobody waits for, unless the channel failed. A send that finds the
        peer gone (EPIPE: it died and our loop has not read its end yet) fails the channel
        and is dropped: the peer needs telling no more, and the caller (a region's close,
        telling every peer in turn) goes on to the others."""
        if self._error is None:
            with contextlib.suppress(TensorxError):
                self.out.post(kind, header)

    async def notify(self, payload: bytes, timeout: float | None) -> None:
        if len(payload) > _wire.MAX_NOTIFY:
            raise UsageError(f"notification of {len(payload)} B exceeds {_wire.MAX_NOTIFY} B")
        done = self.out.send(Kind.NOTIFY, {}, payload or None)
        if done.done():  # handed to the kernel at once: nothing was queued before it
            done.result()
            return
        try:
            await wait_for(asyncio.shield(done), timeout)
        except asyncio.TimeoutError:
            raise TimeoutError(f"{self.label}: notify timed out after {timeout} s") from None

    # -- receiving ----------------------------------------------------------------------
    def _pause(self) -> None:
        if self._reading:
            self._reading = False
            self._loop.remove_reader(self.sock.fileno())

    def _resume(self) -> None:
        if not self._reading and self._error is None:
            self._reading = True
            self._loop.add_reader(self.sock.fileno(), self._on_readable)

    def _on_readable(self) -> None:
        try:
            self.reader.feed()
        except BlockingIOError:
            return
        except TensorxError as exc:
            self._read_failed(exc)
            return
        self._pump()

    def _pump(self) -> None:
        """Serve every buffered frame that can be served right here; hand the first one
        that has to wait to a task, and stop reading until that task is done."""
        try:
            while self._error is None and self._serving is None:
                frame = self.reader.next_frame()
                if frame is None:
                    return
                kind, header, payload_len = frame
                self.stats["frames_in"] += 1
                self.stats["bytes_in"] += payload_len
                if not self._serve_now(kind, header, payload_len):
                    self._hold(self._serve_waiting(kind, header, payload_len))
        except Exception as exc:
            self._read_failed(exc)

    def _hold(self, first: Awaitable[None]) -> None:
        """Stop reading; a task awaits ``first`` (what has to wait), then serves what came
        after it (:meth:`_serve_later`)."""
        self._pause()
        self._serving = self._loop.create_task(self._serve_later(first),
                                               name=f"tx-read {self.label}")

    def _serve_now(self, kind: Kind, header: Header, payload_len: int) -> bool:
        now = self._now.get(kind)
        if now is None or (kind in REQUESTS and self.out.backlog >= MAX_QUEUED_FRAMES):
            return False
        return now(header, payload_len) is not False

    def _on_bye(self, h: Header, payload_len: int) -> None:
        self._fail(BrokenError(f"{self.label}: peer closed the endpoint"), True)

    async def _serve_later(self, first: Awaitable[None]) -> None:
        """Serve what has to wait (``first``: a frame, or a notification for a full queue),
        then what is already here after it, as a reader task would (no loop turn between
        frames: a peer flooding notifications fills our queue at once and is held back by
        it); back to the callback once drained."""
        try:
            await first
            while (frame := self._next_waiting()) is not None:
                await self._serve_waiting(*frame)
        except Exception as exc:
            self._read_failed(exc)
            return
        self._serving = None
        self._resume()

    def _next_waiting(self) -> tuple[Kind, Header, int] | None:
        """Serve the frames already here that can be served at once; return the next one
        that has to wait, or None when nothing more has arrived."""
        while self._error is None:
            frame = self.reader.next_frame()
            if frame is None:
                try:
                    self.reader.feed()
                except BlockingIOError:
                    return None
                continue
            self.stats["frames_in"] += 1
            self.stats["bytes_in"] += frame[2]
            if not self._serve_now(*frame):
                return frame
        return None

    async def _serve_waiting(self, kind: Kind, header: Header, payload_len: int) -> None:
        if kind in REQUESTS and self.out.backlog >= MAX_QUEUED_FRAMES:
            # A peer that asks without reading our answers: stop reading its requests
            # until the answers drain (TCP then holds it back), instead of queueing more.
            await self.out.drained()
        plain = self._plain.get(kind)
        if plain is not None:
            plain(header, payload_len)
        elif kind in self._later:
            await self._later[kind](header, payload_len)
        else:
            raise ProtocolError(f"unexpected {kind.name} frame after the handshake")

    def _read_failed(self, exc: Exception) -> None:
        if isinstance(exc, ProtocolError):
            logger.warning("%s: closing connection after protocol error: %s", self.label, exc)
            self._pause()
            self._refusing = self._loop.create_task(self._refuse(exc))
        elif isinstance(exc, TensorxError):
            self._fail(exc if isinstance(exc, BrokenError | ClosedError)
                       else BrokenError(f"{self.label}: {exc}"))
        else:  # a bug: close as broken rather than leave a dead reader
            logger.error("%s: reader failed", self.label, exc_info=exc)
            self._fail(BrokenError(f"{self.label}: internal error: {exc!r}"))

    async def _refuse(self, exc: ProtocolError) -> None:
        """Tell the peer why (best effort), then close."""
        await self.refuse(exc)
        self._fail(BrokenError(f"{self.label}: protocol error: {exc}"))

    async def land(self, dest: memoryview | StagedRange,
                   live: Callable[[], bool] = lambda: True) -> bool:
        """Receive the current frame's payload into ``dest`` (see
        :meth:`FrameReader.read_into`), through staging buffers for GPU memory."""
        if isinstance(dest, StagedRange):
            return await self._stage_in.receive(self.reader, dest, live)
        return await self.reader.read_into(dest, live)

    @property
    def staging_buffers(self) -> tuple[int, int]:
        """(receiving, sending) pinned staging buffers held now (tests check the bound)."""
        return self._stage_in.buffers, self.out.staging_buffers

    # -- frames served here ---------------------------------------------------------------
    def _write_now(self, h: tuple[Any, ...], payload_len: int) -> bool:
        """A WRITE whose payload is all here lands right in the readiness callback, the
        notification it carries too (delivered after the data, as :meth:`_on_write` does;
        a full queue's wait is a task's, with the reader stopped till it is done)."""
        assert self._owner is not None
        assert self._events is not None
        imm = h[5]
        if payload_len > self.reader.buffered or (imm is not None and self._serving is not None):
            return False  # (in the serving task, :meth:`_on_write` delivers it in order)
        acked = self._owner.land_now(h, payload_len)
        if acked is None:  # it has to wait (GPU memory)
            return False
        if acked and imm is not None and not self._events.deliver_now(imm):
            self._hold(self._events.deliver(imm))
        return True

    async def _on_write(self, h: tuple[Any, ...], payload_len: int) -> None:
        assert self._owner is not None
        assert self._events is not None
        imm = await self._owner.on_write(h, payload_len)
        if imm is not None:  # the write has landed: now its notification
            await self._events.deliver(imm)

    def _notify_now(self, h: dict[str, Any], payload_len: int) -> bool:
        """A notification that is all here, to a queue with room: delivered right in the
        readiness callback (a task, a pause of the reader and an empty recv less, twice a
        PS round); else :meth:`_on_notify` in a task."""
        assert self._events is not None
        if payload_len > self.reader.buffered or \
                not self._events.deliver_now(self.reader.peek(payload_len)):
            return False
        self.reader.skip(payload_len)
        return True

    async def _on_notify(self, h: dict[str, Any], payload_len: int) -> None:
        assert self._events is not None
        payload = bytearray(payload_len)
        await self.reader.read_into(memoryview(payload))
        await self._events.deliver(bytes(payload))  # waits (we stop reading) while full

    def _on_revoke(self, h: dict[str, Any], payload_len: int) -> None:
        assert self._events is not None
        self._events.revoked(h["rid"], h["ck"])

    def _on_revoke_ack(self, h: dict[str, Any], payload_len: int) -> None:
        assert self._events is not None
        self._events.revoke_acked(h["rid"], h["ck"])


def _refusal(exc: TensorxError) -> bytes:
    """The ERROR frame that refuses a peer: the error's wire code and its text, cut to what
    the peer keeps of it."""
    return _wire.encode(Kind.ERROR, {"req": 0, "code": error_code(exc),
                                     "msg": str(exc)[:MESSAGE_LIMIT]})
