"""Pure-asyncio TCP: the control channel of every connection, and the fallback data lane.

Payloads never pass through an intermediate bytes object: the owner receives a WRITE
straight into the region (``sock_recv_into`` on a slice of it) and sends READ data straight
out of it (``sock_sendall`` on a memoryview); the requester does the same on its side.
GPU memory, which a socket cannot address, is staged through pinned host buffers on each
side that holds it (``_staging.py``); the bytes on the wire are the same.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import socket
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from tensorx import _wire
from tensorx._ratelog import RefusalLog
from tensorx._text import printable
from tensorx._wire import Kind
from tensorx.errors import (
    AuthError,
    BrokenError,
    ClosedError,
    ProtocolError,
    RegionError,
    TensorxError,
    TimeoutError,
    UsageError,
)
from tensorx.memregion import ExportTable
from tensorx.transport import _staging
from tensorx.transport._sock import (
    BUFFER_BYTES,
    IOV_MAX,
    FrameReader,
    TcpListener,
    advance,
    open_socket,
)
from tensorx.transport._staging import RecvStager, SendStager, StagedRange, staged_range

__all__ = ["Connection", "TcpListener", "open_socket"]

logger = logging.getLogger(__name__)

MAX_IMM = _wire.MAX_HEADER // 2  # a notification small enough to ride in a WRITE header
MAX_QUEUED_FRAMES = 4096  # answers queued for a peer before we stop reading its requests
REQUESTS = frozenset({Kind.WRITE, Kind.READ, Kind.VALIDATE, Kind.QUERY})
ERROR_CODES: dict[str, type[TensorxError]] = {
    "region": RegionError, "protocol": ProtocolError, "auth": AuthError, "usage": UsageError,
}


def error_code(exc: BaseException) -> str:
    for code, cls in ERROR_CODES.items():
        if isinstance(exc, cls):
            return code
    return "broken"


@dataclass
class _Pending:
    future: asyncio.Future[Any]
    dest: memoryview | StagedRange | None = None


NotifyHandler = Callable[["Connection", bytes], Awaitable[None]]
QueryHandler = Callable[[str], dict[str, Any]]
ClosedHandler = Callable[["Connection", BaseException | None], None]


class Connection:
    """One TCP connection to a peer: frames in, frames out, requests in flight.

    Before :meth:`start`, the handshake uses :meth:`send_now` and :meth:`recv_frame`.
    After it, a reader task serves the peer's requests against ``exports`` and completes
    ours, and a writer task sends queued frames in the order they were queued.
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
        self._pending: dict[int, _Pending] = {}
        self._refused: set[int] = set()  # peer's write requests with a refused frame
        self._req_ids = itertools.count(1)
        self._tasks: list[asyncio.Task[None]] = []
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

    # -- handshake phase ----------------------------------------------------------------
    async def send_now(self, kind: Kind, header: dict[str, Any]) -> None:
        try:
            await self._loop.sock_sendall(self.sock, _wire.encode(kind, header))
        except OSError as exc:
            raise BrokenError(f"{self.label}: connection lost: {exc}") from exc

    async def recv_frame(self, expect: Kind) -> dict[str, Any]:
        kind, header, payload_len = await self._reader.frame()
        if kind is Kind.ERROR:
            raise ERROR_CODES.get(header["code"], BrokenError)(printable(header["msg"]))
        if kind is not expect or payload_len:
            raise ProtocolError(f"expected {expect.name} during handshake, got {kind.name}")
        return header

    def start(self) -> None:
        """The peer has authenticated: serve it (and only now give it a full-size buffer)."""
        self._reader.resize(BUFFER_BYTES)
        self._tasks = [self._loop.create_task(self._read_loop(), name=f"tx-read {self.label}"),
                       self._loop.create_task(self._write_loop(), name=f"tx-write {self.label}")]

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
            _set_once(pending.future, _copy(exc))
        self._pending.clear()
        for _, fut in self._sendq:
            if fut is not None:
                _set_once(fut, _copy(exc))
        self._sendq.clear()
        self._wakeup.set()
        self._sent.set()
        current = asyncio.current_task()
        for task in self._tasks:  # a task waiting on the socket would wait forever
            if task is not current:
                task.cancel()
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
            with _suppress():
                await asyncio.wait_for(self._send_frame(Kind.BYE, {}), 1.0)
        self._fail(ClosedError(f"{self.label}: endpoint closed"))
        await self._join_tasks()

    def abort(self) -> None:
        self._fail(ClosedError(f"{self.label}: endpoint aborted"))
        for task in self._tasks:
            task.cancel()

    async def _join_tasks(self) -> None:
        current = asyncio.current_task()
        for task in self._tasks:
            if task is not current:
                task.cancel()
        await asyncio.gather(*(t for t in self._tasks if t is not current),
                             return_exceptions=True)
        if current not in self._tasks:  # a cancelled task's traceback keeps its frames
            self._tasks = []

    # -- sending ------------------------------------------------------------------------
    def _enqueue(self, parts: list[Any], done: asyncio.Future[None] | None = None) -> None:
        """Send ``parts`` after everything queued before them.

        When nothing is queued, try to send right here (one ``sendmsg``, header and payload
        gathered without a copy); whatever the kernel does not take goes to the writer task.
        """
        self._check()
        if not self._sendq and not self._busy and not _staging.has_staged(parts):
            try:
                parts = self._send_some(parts)
            except OSError as exc:
                self._fail(BrokenError(f"{self.label}: connection lost: {exc}"))
                raise BrokenError(f"{self.label}: connection lost: {exc}") from exc
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
            while self._error is None:
                await self._wakeup.wait()
                self._wakeup.clear()
                while self._sendq:
                    await self._send_batch()
        except OSError as exc:
            self._fail(BrokenError(f"{self.label}: connection lost: {exc}"))
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
        self._loop.add_writer(fd, _set_once, fut)
        try:
            await fut
        finally:
            self._loop.remove_writer(fd)

    # -- requests -----------------------------------------------------------------------
    def _new_request(self, dest: memoryview | StagedRange | None = None
                     ) -> tuple[int, _Pending]:
        req = next(self._req_ids)
        pending = _Pending(self._loop.create_future(), dest)
        self._pending[req] = pending
        return req, pending

    async def _await(self, req: int, pending: _Pending, timeout: float | None, what: str) -> Any:
        """Wait for the reply; a timer (not wait_for's extra task hop) enforces the timeout."""
        fut = pending.future
        timer = None
        if timeout is not None:
            exc = TimeoutError(f"{self.label}: {what} timed out after {timeout} s")
            timer = self._loop.call_later(timeout, _set_once, fut, exc)
        try:
            return await fut
        finally:
            if timer is not None:
                timer.cancel()
            self._pending.pop(req, None)

    async def request_write(self, ops: Sequence[tuple[memoryview | StagedRange, int, int, int]],
                            timeout: float | None, imm: bytes | None = None) -> None:
        """Send WRITE frames for (src, region_id, cookie, offset); one ACK covers them all.
        ``imm``: a notification carried by the last frame, which the owner delivers once
        every frame of the write has landed (and not at all if one was refused)."""
        req, pending = self._new_request()
        try:
            for i, (src, rid, ck, off) in enumerate(ops):
                header: dict[str, Any] = {"req": req, "rid": rid, "ck": ck, "off": off,
                                          "n": len(src), "last": i == len(ops) - 1}
                if imm is not None and header["last"]:
                    header["imm"] = imm
                self._enqueue([_wire.encode(Kind.WRITE, header, len(src)), src])
        except BaseException:
            self._pending.pop(req, None)
            raise
        await self._await(req, pending, timeout, "write")

    async def request_read(self, dest: memoryview | StagedRange, rid: int, ck: int, off: int,
                           timeout: float | None) -> None:
        req, pending = self._new_request(dest)
        try:
            header = {"req": req, "rid": rid, "ck": ck, "off": off, "n": len(dest)}
            self._enqueue([_wire.encode(Kind.READ, header)])
        except BaseException:
            self._pending.pop(req, None)
            raise
        await self._await(req, pending, timeout, "read")

    async def request_validate(self, rid: int, ck: int, timeout: float | None) -> tuple[int, str]:
        n, access, _ = await self._validate({"rid": rid, "ck": ck}, timeout)
        return n, access

    async def request_address(self, rid: int, ck: int, timeout: float | None
                              ) -> tuple[int, str, int | None]:
        """(nbytes, access, address) of the owner's region: the address of host memory
        (None for GPU memory), for a same-host lane. Only a peer that offered such a lane
        is asked (an older owner would not answer with one)."""
        return await self._validate({"rid": rid, "ck": ck, "addr": True}, timeout)

    async def _validate(self, fields: dict[str, Any], timeout: float | None
                        ) -> tuple[int, str, int | None]:
        req, pending = self._new_request()
        try:
            self._enqueue([_wire.encode(Kind.VALIDATE, {"req": req, **fields})])
        except BaseException:
            self._pending.pop(req, None)
            raise
        result: tuple[int, str, int | None] = await self._await(req, pending, timeout,
                                                                "descriptor check")
        return result

    async def request_query(self, what: str, timeout: float | None) -> dict[str, Any]:
        req, pending = self._new_request()
        self._enqueue([_wire.encode(Kind.QUERY, {"req": req, "what": what})])
        answer: dict[str, Any] = await self._await(req, pending, timeout, "query")
        return answer

    def revoke(self, region_id: int) -> None:
        """Tell the peer (best effort, without waiting) that a region of ours is gone."""
        if self._error is None:
            self._send_frame(Kind.REVOKE, {"rid": region_id})

    def revoke_ack(self, region_id: int) -> None:
        """Tell the owner that none of our ops on its region is in flight any more."""
        if self._error is None:
            self._send_frame(Kind.REVOKE_ACK, {"rid": region_id})

    async def notify(self, payload: bytes, timeout: float | None) -> None:
        if len(payload) > _wire.MAX_NOTIFY:
            raise UsageError(f"notification of {len(payload)} B exceeds {_wire.MAX_NOTIFY} B")
        done = self._send_frame(Kind.NOTIFY, {}, bytes(payload) if payload else None)
        try:
            await asyncio.wait_for(asyncio.shield(done), timeout)
        except asyncio.TimeoutError:
            raise TimeoutError(f"{self.label}: notify timed out after {timeout} s") from None

    # -- receiving ----------------------------------------------------------------------
    async def _read_loop(self) -> None:
        try:
            while True:
                kind, header, payload_len = await self._reader.frame()
                self.stats["frames_in"] += 1
                self.stats["bytes_in"] += payload_len
                if kind is Kind.BYE:
                    self._fail(BrokenError(f"{self.label}: peer closed the endpoint"), True)
                    return
                await self._dispatch(kind, header, payload_len)
        except ProtocolError as exc:
            logger.warning("%s: closing connection after protocol error: %s", self.label, exc)
            with _suppress():
                await asyncio.wait_for(
                    self._loop.sock_sendall(self.sock, _wire.encode(
                        Kind.ERROR, {"req": 0, "code": "protocol", "msg": str(exc)})), 1.0)
            self._fail(BrokenError(f"{self.label}: protocol error: {exc}"))
        except TensorxError as exc:
            self._fail(exc if isinstance(exc, BrokenError | ClosedError)
                       else BrokenError(f"{self.label}: {exc}"))
        except Exception as exc:  # a bug: close as broken rather than leave a dead reader
            logger.exception("%s: reader failed", self.label)
            self._fail(BrokenError(f"{self.label}: internal error: {exc!r}"))

    async def _dispatch(self, kind: Kind, header: dict[str, Any], payload_len: int) -> None:
        handler = self._HANDLERS.get(kind)
        if handler is None:
            raise ProtocolError(f"unexpected {kind.name} frame after the handshake")
        if kind in REQUESTS and len(self._sendq) >= MAX_QUEUED_FRAMES:
            # A peer that asks without reading our answers: stop reading its requests
            # until the answers drain (TCP then holds it back), instead of queueing more.
            self._sent.clear()
            await self._sent.wait()
        await handler(self, header, payload_len)

    async def _on_write(self, h: dict[str, Any], payload_len: int) -> None:
        imm = h.get("imm")
        if imm is not None and (not isinstance(imm, bytes) or not h["last"]):
            raise ProtocolError("WRITE carries a malformed notification")
        try:
            region = self._exports.resolve(h["rid"], h["ck"], h["off"], h["n"], "w")
            dest = staged_range(region, h["off"], h["n"])
        except TensorxError as exc:
            await self._reader.discard(payload_len)
            self._reply_error(h["req"], exc)
            self._note_refused(h["req"], h["last"])
            return
        await self._land(dest)  # into GPU memory: every copy has completed
        if h["last"]:
            if h["req"] in self._refused:  # an earlier frame of this write was refused
                self._refused.discard(h["req"])
                return
            self._send_frame(Kind.WRITE_ACK, {"req": h["req"]})
            if imm is not None:
                await self.on_notify(self, imm)

    def _note_refused(self, req: int, last: bool) -> None:
        """Remember a write with a refused frame until its last frame (so that a
        notification it carries is dropped)."""
        if last:
            self._refused.discard(req)
            return
        if len(self._refused) > 4096:  # a peer that never finishes its writes
            raise ProtocolError("too many unfinished refused writes")
        self._refused.add(req)

    async def _on_read(self, h: dict[str, Any], payload_len: int) -> None:
        try:
            region = self._exports.resolve(h["rid"], h["ck"], h["off"], h["n"], "r")
            src = staged_range(region, h["off"], h["n"])
        except TensorxError as exc:
            self._reply_error(h["req"], exc)
            return
        self._send_frame(Kind.READ_DATA, {"req": h["req"]}, src if len(src) else None)

    async def _on_read_data(self, h: dict[str, Any], payload_len: int) -> None:
        pending = self._pending.get(h["req"])
        if pending is None or pending.dest is None or pending.future.done():
            await self._reader.discard(payload_len)  # timed out or cancelled meanwhile
            return
        if len(pending.dest) != payload_len:
            await self._reader.discard(payload_len)
            _set_once(pending.future, ProtocolError(
                f"{self.label}: read of {len(pending.dest)} B answered with {payload_len} B"))
            return
        # The read may time out or be cancelled while its reply streams in: from then on
        # the rest is dropped, never written to the caller's memory.
        if await self._land(pending.dest, live=lambda: not pending.future.done()):
            _set_once(pending.future)

    async def _land(self, dest: memoryview | StagedRange,
                    live: Callable[[], bool] = lambda: True) -> bool:
        if isinstance(dest, StagedRange):
            return await self._stage_in.receive(self._reader, dest, live)
        return await self._reader.read_into(dest, live)

    async def _on_ack(self, h: dict[str, Any], payload_len: int) -> None:
        self._resolve(h["req"], None)

    async def _on_valid(self, h: dict[str, Any], payload_len: int) -> None:
        addr = h.get("addr")
        if addr is not None and (not isinstance(addr, int) or isinstance(addr, bool)
                                 or not 0 <= addr < 2**64):
            raise ProtocolError("VALID carries a malformed address")
        self._resolve(h["req"], (h["n"], h["access"], addr))

    async def _on_error(self, h: dict[str, Any], payload_len: int) -> None:
        exc = ERROR_CODES.get(h["code"], BrokenError)(
            f"{self.label}: peer says: {printable(h['msg'])}")
        if h["req"] == 0:
            raise BrokenError(str(exc)) from exc
        pending = self._pending.get(h["req"])
        if pending is not None and not pending.future.done():
            pending.future.set_exception(exc)

    async def _on_notify(self, h: dict[str, Any], payload_len: int) -> None:
        payload = bytearray(payload_len)
        await self._reader.read_into(memoryview(payload))
        await self.on_notify(self, bytes(payload))  # waits (we stop reading) while full

    async def _on_validate(self, h: dict[str, Any], payload_len: int) -> None:
        try:
            export = self._exports.lookup(h["rid"], h["ck"])
        except TensorxError as exc:
            self._reply_error(h["req"], exc)
            return
        desc = export.descriptor
        reply = {"req": h["req"], "n": desc.nbytes, "access": desc.access}
        if h.get("addr") is True and not export.region.is_cuda:  # for a same-host lane
            reply["addr"] = export.region.address
        self._send_frame(Kind.VALID, reply)

    async def _on_query(self, h: dict[str, Any], payload_len: int) -> None:
        try:
            data = self.on_query(h["what"])
        except TensorxError as exc:
            self._reply_error(h["req"], exc)
            return
        self._send_frame(Kind.ANSWER, {"req": h["req"], "data": data})

    async def _on_revoke(self, h: dict[str, Any], payload_len: int) -> None:
        self.on_revoke(h["rid"])

    async def _on_revoke_ack(self, h: dict[str, Any], payload_len: int) -> None:
        self.on_revoke_ack(h["rid"])

    async def _on_answer(self, h: dict[str, Any], payload_len: int) -> None:
        self._resolve(h["req"], h["data"])

    _HANDLERS: dict[Kind, Callable[[Connection, dict[str, Any], int], Any]] = {
        Kind.WRITE: _on_write, Kind.READ: _on_read, Kind.READ_DATA: _on_read_data,
        Kind.WRITE_ACK: _on_ack, Kind.VALID: _on_valid, Kind.ERROR: _on_error,
        Kind.NOTIFY: _on_notify, Kind.VALIDATE: _on_validate, Kind.QUERY: _on_query,
        Kind.ANSWER: _on_answer, Kind.REVOKE: _on_revoke, Kind.REVOKE_ACK: _on_revoke_ack,
    }

    def _resolve(self, req: int, value: Any) -> None:
        pending = self._pending.get(req)
        if pending is not None and not pending.future.done():
            pending.future.set_result(value)

    def _reply_error(self, req: int, exc: TensorxError) -> None:
        self._refusals.refused(req, exc)  # the first, then a summary at most once a minute
        self._send_frame(Kind.ERROR, {"req": req, "code": error_code(exc), "msg": str(exc)})


async def _ignore_notification(conn: Connection, payload: bytes) -> None:
    return None


def _set_once(fut: asyncio.Future[Any], exc: BaseException | None = None) -> None:
    if fut.done():
        return
    if exc is None:
        fut.set_result(None)
    else:
        fut.set_exception(exc)


def _copy(exc: TensorxError) -> TensorxError:
    """A fresh exception per waiter, so tracebacks do not pile up on one shared object."""
    new = type(exc)(str(exc))
    new.__cause__ = exc.__cause__
    return new


class _suppress:
    """Swallow failures of best-effort steps during shutdown (and only there)."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, typ: type[BaseException] | None, exc: BaseException | None,
                 tb: object) -> bool:
        return typ is not None and issubclass(typ, Exception | asyncio.TimeoutError)
