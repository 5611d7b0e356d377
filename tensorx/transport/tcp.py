"""Pure-asyncio TCP: the control channel of every connection, and the fallback data lane.

Payloads never pass through an intermediate bytes object: the owner receives a WRITE
straight into the region (``recv_into`` a slice of it; what came in with the frame's header
is copied from the read buffer) and sends READ data straight out of it (``sendmsg`` of a
memoryview, gathered with the header); the requester does the same on its side.
GPU memory, which a socket cannot address, is staged through pinned host buffers on each
side that holds it (``_staging.py``); the bytes on the wire are the same.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import socket
from collections.abc import Awaitable, Callable
from typing import Any

from tensorx import _wire
from tensorx._deadline import wait_for
from tensorx._ratelog import RefusalLog
from tensorx._wire import Kind
from tensorx.errors import (
    BrokenError,
    ClosedError,
    ProtocolError,
    TensorxError,
    TimeoutError,
    UsageError,
    error_code,
    error_from_code,
)
from tensorx.memregion import ExportTable
from tensorx.transport import _staging
from tensorx.transport._exceptions import map_exceptions
from tensorx.transport._futures import best_effort, fresh_copy, set_once
from tensorx.transport._sock import (
    BUFFER_BYTES,
    IOV_MAX,
    FrameReader,
    TcpListener,
    advance,
    open_socket,
)
from tensorx.transport._staging import RecvStager, SendStager, StagedRange
from tensorx.transport._tcp_owner import OwnerService
from tensorx.transport._tcp_requests import Pending, Requester

__all__ = ["Connection", "TcpListener", "open_socket"]

logger = logging.getLogger(__name__)

MAX_IMM = _wire.MAX_HEADER // 2  # a notification small enough to ride in a WRITE header
MAX_QUEUED_FRAMES = 4096  # answers queued for a peer before we stop reading its requests
REQUESTS = frozenset({Kind.WRITE, Kind.READ, Kind.VALIDATE, Kind.QUERY})
# A goodbye (BYE on aclose, ERROR before closing on a bad frame) is best effort and nobody's
# budget: aclose() takes none, and a peer that does not read must not hold our close up.
GOODBYE_TIMEOUT = 1.0


NotifyHandler = Callable[["Connection", bytes], Awaitable[None]]
QueryHandler = Callable[[str], dict[str, Any]]
ClosedHandler = Callable[["Connection", BaseException | None], None]


class Connection(OwnerService, Requester):
    """One TCP connection to a peer: frames in, frames out, requests in flight.

    Before :meth:`start`, the handshake uses :meth:`send_now` and :meth:`recv_frame`.
    After it, frames are served as they arrive, right in the socket's readiness callback
    (no task hop: a reply completes its request there); a frame that has to wait (a
    payload still on its way, GPU staging, a full queue) is served by a task, and the
    socket is not read meanwhile. Frames go out with one gathered ``sendmsg`` right away
    when nothing is queued, else by a writer task in the order they were queued.
    """

    def __init__(self, sock: socket.socket, exports: ExportTable, label: str) -> None:
        self.sock = sock
        self.label = label
        self.peer = ""
        self.peer_caps: dict[str, Any] = {}
        self.binding = b""  # both handshake nonces: what is unique to this connection
        self._exports = exports
        self._loop = asyncio.get_running_loop()
        self._reader = FrameReader(sock)
        self._sendq: collections.deque[tuple[list[Any], asyncio.Future[None] | None]] = (
            collections.deque())
        self._wakeup = asyncio.Event()
        self._sent = asyncio.Event()  # set whenever the writer has taken the queue
        self._pending: dict[int, Pending] = {}
        self._refused: set[int] = set()  # peer's write requests with a refused frame
        self._req_ids = itertools.count(1)
        self._tasks: list[asyncio.Task[None]] = []
        self._later: asyncio.Task[None] | None = None  # serving a frame that had to wait
        self._reading = False  # the readiness callback is registered
        self._error: TensorxError | None = None
        self._busy = False
        self._closing = False  # we said BYE
        self._refusals = RefusalLog(logger, label)
        self._stage_out = SendStager()  # GPU payloads: the writer's staging buffers
        self._stage_in = RecvStager()  # and the reader's
        self.on_notify: NotifyHandler = _ignore_notification
        self.on_closed: ClosedHandler = lambda conn, exc: None
        self.on_query: QueryHandler = lambda what: {}
        self.on_revoke: Callable[[int], None] = lambda region_id: None
        self.on_revoke_ack: Callable[[int], None] = lambda region_id: None
        self.stats = {"frames_in": 0, "frames_out": 0, "bytes_in": 0, "bytes_out": 0}
        self._lost = map_exceptions(f"{label}: connection lost")

    # -- handshake phase ----------------------------------------------------------------
    async def send_now(self, kind: Kind, header: dict[str, Any]) -> None:
        with self._lost:
            await self._loop.sock_sendall(self.sock, _wire.encode(kind, header))

    async def recv_frame(self, expect: Kind) -> dict[str, Any]:
        kind, header, payload_len = await self._reader.frame()
        if kind is Kind.ERROR:
            raise error_from_code(header["code"], header["msg"])
        if kind is not expect or payload_len:
            raise ProtocolError(f"expected {expect.name} during handshake, got {kind.name}")
        return header

    def start(self) -> None:
        """The peer has authenticated: serve it (and only now give it a full-size buffer)."""
        self._reader.resize(BUFFER_BYTES)
        self._tasks = [self._loop.create_task(self._write_loop(), name=f"tx-write {self.label}")]
        self._resume()
        self._loop.call_soon(self._pump)  # frames that came with the handshake's last one

    # -- state --------------------------------------------------------------------------
    @property
    def broken(self) -> TensorxError | None:
        return self._error

    def _check(self) -> None:
        if self._error is not None:
            raise self._error

    def _fail(self, exc: TensorxError, graceful: bool = False) -> None:
        """Mark the connection dead, fail every request in flight, close the socket.

        ``graceful``: the peer said BYE. Once either side has said BYE, whatever ends the
        connection next (EOF, a reset) is part of a clean close, not a failure."""
        if self._error is not None:
            return
        self._error = exc
        for pending in self._pending.values():
            set_once(pending.future, fresh_copy(exc))
        self._pending.clear()
        for _, fut in self._sendq:
            if fut is not None:
                set_once(fut, fresh_copy(exc))
        self._sendq.clear()
        self._wakeup.set()
        self._sent.set()
        current = asyncio.current_task()
        for task in self._all_tasks():  # a task waiting on the socket would wait forever
            if task is not current:
                task.cancel()
        self._reading = False
        if self.sock.fileno() >= 0:
            self._loop.remove_reader(self.sock.fileno())
            self._loop.remove_writer(self.sock.fileno())
        self.sock.close()
        self._reader.release()
        self._stage_out.release()
        self._stage_in.release()
        self._refusals.flush()
        clean = graceful or self._closing or isinstance(exc, ClosedError)
        self.on_closed(self, None if clean else exc)

    async def aclose(self) -> None:
        """Say BYE, stop both tasks and close the socket. Idempotent."""
        if self._error is None and self._tasks and not self._closing:
            self._closing = True
            with best_effort():
                await wait_for(self._send_frame(Kind.BYE, {}), GOODBYE_TIMEOUT)
        self._fail(ClosedError(f"{self.label}: endpoint closed"))
        await self._join_tasks()

    def abort(self) -> None:
        self._fail(ClosedError(f"{self.label}: endpoint aborted"))
        for task in self._all_tasks():
            task.cancel()

    def _all_tasks(self) -> list[asyncio.Task[None]]:
        return [*self._tasks, self._later] if self._later is not None else self._tasks

    async def _join_tasks(self) -> None:
        current = asyncio.current_task()
        tasks = self._all_tasks()
        for task in tasks:
            if task is not current:
                task.cancel()
        await asyncio.gather(*(t for t in tasks if t is not current), return_exceptions=True)
        if current not in tasks:  # a cancelled task's traceback keeps its frames
            self._tasks, self._later = [], None

    # -- sending ------------------------------------------------------------------------
    def _enqueue(self, parts: list[Any], done: asyncio.Future[None] | None = None) -> None:
        """Send ``parts`` after everything queued before them.

        When nothing is queued, try to send right here (one ``sendmsg``, header and payload
        gathered without a copy); whatever the kernel does not take goes to the writer task.
        """
        self._check()
        if not self._sendq and not self._busy and not _staging.has_staged(parts):
            try:
                with self._lost:
                    parts = self._send_some(parts)
            except BrokenError as exc:
                self._fail(fresh_copy(exc))
                raise
            if not parts:
                if done is not None:
                    done.set_result(None)
                return
        self._sendq.append((parts, done))
        self._wakeup.set()

    def _send_frame(self, kind: Kind, header: dict[str, Any],
                    payload: Any = None) -> asyncio.Future[None]:
        """Queue one frame; the future completes once it has been handed to the kernel."""
        done: asyncio.Future[None] = self._loop.create_future()
        size = len(payload) if payload is not None else 0
        parts = [_wire.encode(kind, header, size)]
        if size:
            parts.append(payload)
        self._enqueue(parts, done)
        return done

    def _post(self, kind: Kind, header: dict[str, Any], payload: Any = None) -> None:
        """Queue one frame nobody waits for (a reply)."""
        size = len(payload) if payload is not None else 0
        self._enqueue([_wire.encode(kind, header, size), payload] if size
                      else [_wire.encode(kind, header)])

    def _send_some(self, parts: list[Any]) -> list[Any]:
        """One non-blocking gathered send; returns what is left (memoryview slices)."""
        try:
            sent = self.sock.sendmsg(parts[:IOV_MAX])
        except BlockingIOError:
            return parts
        self.stats["bytes_out"] += sent
        return advance(parts, sent)

    async def _write_loop(self) -> None:
        try:
            with self._lost:
                while self._error is None:
                    await self._wakeup.wait()
                    self._wakeup.clear()
                    while self._sendq:
                        await self._send_batch()
        except BrokenError as exc:
            self._fail(exc)
        except Exception as exc:  # a bug: close as broken rather than leave a dead writer
            logger.exception("%s: writer failed", self.label)
            self._fail(BrokenError(f"{self.label}: internal error: {exc!r}"))
        finally:
            self._busy = False

    async def _send_batch(self) -> None:
        """Send everything queued with gathered writes, then complete its futures."""
        self._busy = True
        parts: list[Any] = []
        done: list[asyncio.Future[None]] = []
        while self._sendq:
            frame, fut = self._sendq.popleft()
            parts.extend(frame)
            if fut is not None:
                done.append(fut)
        self._sent.set()
        for run in _staging.split_staged(parts):  # a GPU payload streams through staging
            if isinstance(run, StagedRange):
                await self._stage_out.stream(run, self._send_all)
            else:
                await self._send_all(run)
        self._busy = False
        self.stats["frames_out"] += len(done)
        for fut in done:
            if not fut.done():
                fut.set_result(None)

    async def _send_all(self, parts: list[Any]) -> None:
        while parts:
            parts = self._send_some(parts)
            if parts:
                await self._writable()

    async def _writable(self) -> None:
        fut: asyncio.Future[None] = self._loop.create_future()
        fd = self.sock.fileno()
        self._loop.add_writer(fd, set_once, fut)
        try:
            await fut
        finally:
            self._loop.remove_writer(fd)

    # -- requests -----------------------------------------------------------------------
    def revoke(self, region_id: int) -> None:
        """Tell the peer (best effort, without waiting) that a region of ours is gone."""
        if self._error is None:
            self._post(Kind.REVOKE, {"rid": region_id})

    def revoke_ack(self, region_id: int) -> None:
        """Tell the owner that none of our ops on its region is in flight any more."""
        if self._error is None:
            self._post(Kind.REVOKE_ACK, {"rid": region_id})

    async def notify(self, payload: bytes, timeout: float | None) -> None:
        if len(payload) > _wire.MAX_NOTIFY:
            raise UsageError(f"notification of {len(payload)} B exceeds {_wire.MAX_NOTIFY} B")
        done = self._send_frame(Kind.NOTIFY, {}, bytes(payload) if payload else None)
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
            self._reader.feed()
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
            while self._error is None and self._later is None:
                frame = self._reader.next_frame()
                if frame is None:
                    return
                kind, header, payload_len = frame
                self.stats["frames_in"] += 1
                self.stats["bytes_in"] += payload_len
                if not self._serve_now(kind, header, payload_len):
                    self._pause()
                    self._later = self._loop.create_task(
                        self._serve_later(kind, header, payload_len), name=f"tx-read {self.label}")
        except Exception as exc:
            self._read_failed(exc)

    def _serve_now(self, kind: Kind, header: dict[str, Any], payload_len: int) -> bool:
        if kind is Kind.BYE:
            self._fail(BrokenError(f"{self.label}: peer closed the endpoint"), True)
            return True
        if kind in REQUESTS and len(self._sendq) >= MAX_QUEUED_FRAMES:
            return False
        plain = self._PLAIN.get(kind)
        if plain is not None:
            plain(self, header, payload_len)
            return True
        now = self._NOW.get(kind)
        return now is not None and now(self, header, payload_len)

    async def _serve_later(self, kind: Kind, header: dict[str, Any], payload_len: int) -> None:
        """Serve a frame that has to wait, then what is already here after it, as a reader
        task would (no loop turn between frames: a peer flooding notifications fills our
        queue at once and is held back by it); back to the callback once drained."""
        try:
            frame: tuple[Kind, dict[str, Any], int] | None = (kind, header, payload_len)
            while frame is not None:
                await self._serve_waiting(*frame)
                frame = self._next_waiting()
        except Exception as exc:
            self._read_failed(exc)
            return
        self._later = None
        self._resume()

    def _next_waiting(self) -> tuple[Kind, dict[str, Any], int] | None:
        """Serve the frames already here that can be served at once; return the next one
        that has to wait, or None when nothing more has arrived."""
        while self._error is None:
            frame = self._reader.next_frame()
            if frame is None:
                try:
                    self._reader.feed()
                except BlockingIOError:
                    return None
                continue
            self.stats["frames_in"] += 1
            self.stats["bytes_in"] += frame[2]
            if not self._serve_now(*frame):
                return frame
        return None

    async def _serve_waiting(self, kind: Kind, header: dict[str, Any], payload_len: int) -> None:
        if kind in REQUESTS and len(self._sendq) >= MAX_QUEUED_FRAMES:
            # A peer that asks without reading our answers: stop reading its requests
            # until the answers drain (TCP then holds it back), instead of queueing more.
            self._sent.clear()
            await self._sent.wait()
        plain = self._PLAIN.get(kind)
        if plain is not None:
            plain(self, header, payload_len)
        elif kind in self._LATER:
            await self._LATER[kind](self, header, payload_len)
        else:
            raise ProtocolError(f"unexpected {kind.name} frame after the handshake")

    def _read_failed(self, exc: Exception) -> None:
        if isinstance(exc, ProtocolError):
            logger.warning("%s: closing connection after protocol error: %s", self.label, exc)
            self._pause()
            self._tasks.append(self._loop.create_task(self._refuse(exc)))
        elif isinstance(exc, TensorxError):
            self._fail(exc if isinstance(exc, BrokenError | ClosedError)
                       else BrokenError(f"{self.label}: {exc}"))
        else:  # a bug: close as broken rather than leave a dead reader
            logger.error("%s: reader failed", self.label, exc_info=exc)
            self._fail(BrokenError(f"{self.label}: internal error: {exc!r}"))

    async def _refuse(self, exc: ProtocolError) -> None:
        """Tell the peer why (best effort), then close."""
        with best_effort():
            frame = _wire.encode(Kind.ERROR, {"req": 0, "code": error_code(exc),
                                              "msg": str(exc)})
            await wait_for(self._loop.sock_sendall(self.sock, frame), GOODBYE_TIMEOUT)
        self._fail(BrokenError(f"{self.label}: protocol error: {exc}"))

    async def _land(self, dest: memoryview | StagedRange,
                    live: Callable[[], bool] = lambda: True) -> bool:
        if isinstance(dest, StagedRange):
            return await self._stage_in.receive(self._reader, dest, live)
        return await self._reader.read_into(dest, live)

    def _on_revoke(self, h: dict[str, Any], payload_len: int) -> None:
        self.on_revoke(h["rid"])

    def _on_revoke_ack(self, h: dict[str, Any], payload_len: int) -> None:
        self.on_revoke_ack(h["rid"])

    # Frames served by plain calls; frames served here when their payload is buffered
    # (else later); frames always served by a task.
    _PLAIN: dict[Kind, Callable[[Connection, dict[str, Any], int], None]] = {
        Kind.READ: OwnerService._on_read, Kind.WRITE_ACK: Requester._on_ack,
        Kind.VALID: Requester._on_valid,
        Kind.ERROR: Requester._on_error, Kind.VALIDATE: OwnerService._on_validate,
        Kind.QUERY: OwnerService._on_query,
        Kind.ANSWER: Requester._on_answer, Kind.REVOKE: _on_revoke,
        Kind.REVOKE_ACK: _on_revoke_ack,
    }
    _NOW: dict[Kind, Callable[[Connection, dict[str, Any], int], bool]] = {
        Kind.WRITE: OwnerService._write_now, Kind.READ_DATA: Requester._read_data_now,
    }
    _LATER: dict[Kind, Callable[[Connection, dict[str, Any], int], Awaitable[None]]] = {
        Kind.WRITE: OwnerService._on_write, Kind.READ_DATA: Requester._on_read_data,
        Kind.NOTIFY: OwnerService._on_notify,
    }

async def _ignore_notification(conn: Connection, payload: bytes) -> None:
    return None
