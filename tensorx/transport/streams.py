"""Extra TCP streams of one connection: large transfers cut in stripes, moved in parallel.

One TCP stream is copied by one core at a time on each side, so a single stream leaves the
other cores idle (on this project's 2-core loopback and veth measurements a 100 MB write
took about 1.7x longer on one stream than on two; NCCL's socket transport and ``iperf -P``
use several streams for the same reason). A TCP connection may therefore carry ``n``
extra streams, and writes and reads of at least ``stripe_min`` bytes travel on them, cut
into one stripe per stream; smaller ops keep the control socket and its latency.

Each stream is a blocking socket served by two threads on each side: a *receiver* that
parses frames (as owner it receives WRITE payloads straight into region memory and answers
READs straight out of it, after the same export checks as the control channel) and never
blocks on sending, and a *sender* that drains a queue. Answers are queued, so no thread
ever waits on a peer thread that waits on it. Completions reach the event loop through
``call_soon_threadsafe``. Socket calls release the GIL: the kernel's copies run in parallel.

Attaching (after the control handshake, TCP lanes only): the client opens ``n`` sockets to
the server's listener and sends STREAM{conn, i, proof} on each, where proof is
HMAC(session key, conn | i) and the session key is derived from the token and both
handshake nonces (it never travels); the server answers STREAMS{n: 1} on the stream. Then
the client tells the server on the control channel how many streams it attached
(STREAMS{n}): both sides use all of them, or none.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import os
import queue
import secrets
import socket
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tensorx import _auth, _wire
from tensorx._wire import Kind
from tensorx.errors import (
    AuthError,
    BrokenError,
    ClosedError,
    ProtocolError,
    TensorxError,
    TimeoutError,
    UsageError,
)
from tensorx.memregion import ExportTable

if TYPE_CHECKING:
    from tensorx.transport.tcp import Connection

__all__ = ["MAX_STREAMS", "Piece", "StreamRegistry", "StreamSet", "default_streams",
           "join_client", "join_server", "open_streams", "stripe"]

logger = logging.getLogger("tensorx.transport.tcp")

Piece = tuple[memoryview, int, int, int]  # (local bytes, region id, cookie, remote offset)
ALIGN = 4096
MAX_STREAMS = 16
_DISCARD = 1 << 20


def stripe(pieces: Sequence[Piece], n: int) -> list[list[Piece]]:
    """Cut ``pieces`` into ``n`` runs of about equal bytes (page-aligned cuts), in order."""
    total = sum(len(p[0]) for p in pieces)
    share = -(-total // n) if n else total
    share = -(-share // ALIGN) * ALIGN
    runs: list[list[Piece]] = [[] for _ in range(max(n, 1))]
    run, room = 0, share
    for mv, rid, ck, off in pieces:
        pos = 0
        while pos < len(mv):
            take = min(len(mv) - pos, room)
            runs[run].append((mv[pos:pos + take], rid, ck, off + pos))
            pos, room = pos + take, room - take
            if room == 0 and run < len(runs) - 1:
                run, room = run + 1, share
    return [r for r in runs if r]


class _PeerClosedStream(BrokenError):
    """A clean end of a data stream: the connection itself reports whether the peer left
    (BYE, or end of the control socket); a reset or a bad frame breaks it at once."""


@dataclass
class _Pending:
    future: asyncio.Future[None]
    dest: memoryview | None = None


class StreamSet:
    """The extra streams of one connection (both sides have one, and both may initiate)."""

    def __init__(self, socks: Sequence[socket.socket], exports: ExportTable, label: str,
                 on_broken: Callable[[TensorxError], None]) -> None:
        self.label = label
        self._loop = asyncio.get_running_loop()
        self._exports = exports
        self._on_broken = on_broken
        self._pending: dict[int, _Pending] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._next = 0
        self._error: TensorxError | None = None
        self.stats = {"bytes_out": 0, "bytes_in": 0, "stripes": 0}
        self._streams = [_Stream(self, sock, i) for i, sock in enumerate(socks)]
        for s in self._streams:
            s.start()

    @property
    def n(self) -> int:
        return len(self._streams)

    @property
    def broken(self) -> TensorxError | None:
        return self._error

    # -- initiator side (event loop thread) -----------------------------------------------
    def write(self, pieces: Sequence[Piece]) -> list[asyncio.Future[None]]:
        """Queue WRITE frames for ``pieces`` (striped over the streams); one future each
        stripe, done when the owner has the data in memory."""
        return [self._submit(i, [(Kind.WRITE, p) for p in run], None)
                for i, run in enumerate(stripe(pieces, self.n))]

    def read(self, pieces: Sequence[Piece]) -> list[asyncio.Future[None]]:
        """Queue READ frames: each piece's bytes land in its memoryview."""
        futures = []
        for i, run in enumerate(stripe(pieces, self.n)):
            futures += [self._submit(i, [(Kind.READ, p)], p[0]) for p in run]
        return futures

    def _submit(self, run: int, frames: list[tuple[Kind, Piece]],
                dest: memoryview | None) -> asyncio.Future[None]:
        """One request for ``frames`` on stream ``run`` (a write run is acked once, after
        its last frame: the owner lands a stream's frames in order)."""
        if self._error is not None:
            raise _copy(self._error)
        fut: asyncio.Future[None] = self._loop.create_future()
        req = next(self._ids)
        with self._lock:
            self._pending[req] = _Pending(fut, dest)
        fut.add_done_callback(functools.partial(self._forget, req))
        parts: list[Any] = []
        for j, (kind, (mv, rid, ck, off)) in enumerate(frames):
            header = {"req": req, "rid": rid, "ck": ck, "off": off, "n": len(mv)}
            if kind is Kind.WRITE:
                header["last"] = j == len(frames) - 1
                parts += [_wire.encode(kind, header, len(mv)), mv]
            else:
                parts.append(_wire.encode(kind, header))
        self.stats["stripes"] += 1
        self._streams[(self._next + run) % self.n].send(parts)
        if run == 0:
            self._next = (self._next + 1) % self.n
        return fut

    def _forget(self, req: int, _: object = None) -> None:
        with self._lock:
            self._pending.pop(req, None)

    # -- completion (receiver threads) ---------------------------------------------------------
    def _take(self, req: int) -> _Pending | None:
        with self._lock:
            return self._pending.get(req)

    def _resolve(self, pending: _Pending | None, exc: BaseException | None = None) -> None:
        if pending is not None:
            self._call(_set_once, pending.future, exc)

    def _call(self, fn: Callable[..., None], *args: Any) -> None:
        """Run ``fn`` on the event loop (from any thread); nothing to do once it closed."""
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(fn, *args)

    def fail(self, exc: TensorxError) -> None:
        """Break every stream (thread-safe, idempotent): pending ops fail with ``exc``."""
        with self._lock:
            if self._error is not None:
                return
            self._error = exc
            pending, self._pending = list(self._pending.values()), {}
        for p in pending:
            self._resolve(p, _copy(exc))
        for s in self._streams:
            s.stop()
        if not isinstance(exc, ClosedError | _PeerClosedStream):
            self._call(self._on_broken, exc)

    async def aclose(self) -> None:
        """Close every stream and wait (briefly) for its threads. Idempotent."""
        self.fail(ClosedError(f"{self.label}: streams closed"))
        await asyncio.to_thread(self.join, 5.0)

    def join(self, timeout: float) -> None:
        for s in self._streams:
            s.join(timeout)


class _Stream:
    """One socket with its receiver and sender threads."""

    def __init__(self, owner: StreamSet, sock: socket.socket, index: int) -> None:
        self._set = owner
        self._sock = sock
        sock.setblocking(True)
        self._queue: queue.SimpleQueue[list[Any] | None] = queue.SimpleQueue()
        name = f"tensorx-stream{index} {owner.label}"
        self._threads = [threading.Thread(target=self._rx_main, name=name + " rx", daemon=True),
                         threading.Thread(target=self._tx_main, name=name + " tx", daemon=True)]

    def start(self) -> None:
        for t in reversed(self._threads):  # the sender first: the receiver joins it on exit
            t.start()

    def send(self, parts: list[Any]) -> None:
        self._queue.put(parts)

    def stop(self) -> None:
        self._queue.put(None)
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def join(self, timeout: float) -> None:
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(timeout)

    # -- sender ---------------------------------------------------------------------------------
    def _tx_main(self) -> None:
        try:
            while (parts := self._queue.get()) is not None:
                for part in parts:
                    self._sock.sendall(part)
                    self._set.stats["bytes_out"] += len(part)
        except OSError as exc:
            self._set.fail(BrokenError(f"{self._set.label}: data stream lost: {exc}"))

    # -- receiver ---------------------------------------------------------------------------------
    def _rx_main(self) -> None:
        try:
            self._serve()
        finally:  # every way out breaks the set (stopping the senders), then frees the socket
            self._set.fail(ClosedError(f"{self._set.label}: streams closed"))
            self._threads[1].join()
            self._sock.close()

    def _serve(self) -> None:
        try:
            while True:
                self._frame()
        except TensorxError as exc:
            if isinstance(exc, ProtocolError):
                logger.warning("%s: closing data streams after protocol error: %s",
                               self._set.label, exc)
            self._set.fail(exc if isinstance(exc, BrokenError | ClosedError)
                           else BrokenError(f"{self._set.label}: {exc}"))
        except OSError as exc:
            self._set.fail(BrokenError(f"{self._set.label}: data stream lost: {exc}"))

    def _frame(self) -> None:
        kind, hlen, plen = _wire.decode_prefix(self._exact(_wire.PREFIX.size))
        header = _wire.decode_header(kind, self._exact(hlen), plen)
        handler = _HANDLERS.get(kind)
        if handler is None:
            raise ProtocolError(f"unexpected {kind.name} frame on a data stream")
        handler(self, header, plen)

    def _exact(self, n: int) -> bytes:
        buf = bytearray(n)
        self._into(memoryview(buf))
        return bytes(buf)

    def _into(self, dest: memoryview) -> None:
        pos = 0
        while pos < len(dest):
            got = self._sock.recv_into(dest[pos:], len(dest) - pos, socket.MSG_WAITALL)
            if got == 0:
                if self._set.broken is not None:
                    raise ClosedError(f"{self._set.label}: streams closed")
                raise _PeerClosedStream(f"{self._set.label}: peer closed a data stream")
            pos += got
        self._set.stats["bytes_in"] += len(dest)

    def _discard(self, n: int) -> None:
        scratch = memoryview(bytearray(min(n, _DISCARD)))
        while n:
            step = min(n, len(scratch))
            self._into(scratch[:step])
            n -= step

    def _refuse(self, req: int, exc: TensorxError) -> None:
        logger.info("%s: refused streamed request %d: %s", self._set.label, req, exc)
        self.send([_wire.encode(Kind.ERROR, {"req": req, "code": _wire.error_code(exc),
                                              "msg": str(exc)})])

    # owner role: the peer writes into or reads from our exported memory
    def _on_write(self, h: dict[str, Any], plen: int) -> None:
        try:
            region = self._set._exports.resolve(h["rid"], h["ck"], h["off"], h["n"], "w")
            dest = region.buffer()[h["off"]:h["off"] + h["n"]]
        except TensorxError as exc:
            self._discard(plen)
            self._refuse(h["req"], exc)
            return
        self._into(dest)
        if h["last"]:
            self.send([_wire.encode(Kind.WRITE_ACK, {"req": h["req"]})])

    def _on_read(self, h: dict[str, Any], plen: int) -> None:
        try:
            region = self._set._exports.resolve(h["rid"], h["ck"], h["off"], h["n"], "r")
            src = region.buffer()[h["off"]:h["off"] + h["n"]]
        except TensorxError as exc:
            self._refuse(h["req"], exc)
            return
        self.send([_wire.encode(Kind.READ_DATA, {"req": h["req"]}, len(src)), src])

    # initiator role: answers to our requests
    def _on_read_data(self, h: dict[str, Any], plen: int) -> None:
        pending = self._set._take(h["req"])
        if pending is None or pending.dest is None:
            self._discard(plen)  # timed out or cancelled meanwhile
            return
        if len(pending.dest) != plen:
            self._discard(plen)
            self._set._resolve(pending, ProtocolError(
                f"{self._set.label}: read of {len(pending.dest)} B answered with {plen} B"))
            return
        self._into(pending.dest)
        self._set._resolve(pending)

    def _on_ack(self, h: dict[str, Any], plen: int) -> None:
        self._set._resolve(self._set._take(h["req"]))

    def _on_error(self, h: dict[str, Any], plen: int) -> None:
        cls = _wire.ERROR_CODES.get(h["code"], BrokenError)
        exc = cls(f"{self._set.label}: peer says: {h['msg']}")
        self._set._resolve(self._set._take(h["req"]), exc)


_HANDLERS: dict[Kind, Callable[[_Stream, dict[str, Any], int], None]] = {
    Kind.WRITE: _Stream._on_write, Kind.READ: _Stream._on_read,
    Kind.READ_DATA: _Stream._on_read_data, Kind.WRITE_ACK: _Stream._on_ack,
    Kind.ERROR: _Stream._on_error,
}


# -- attaching ------------------------------------------------------------------------------
def default_streams(requested: int | None) -> int:
    """Extra streams per TCP connection: ``requested``, else ``$TENSORX_TCP_STREAMS``, else
    one per core up to 4 (none on a single core, where they cannot run in parallel)."""
    if requested is None:
        env = os.environ.get("TENSORX_TCP_STREAMS")
        if env is not None:
            try:
                requested = int(env)
            except ValueError:
                raise UsageError(f"TENSORX_TCP_STREAMS must be an int, got {env!r}") from None
        else:
            cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") \
                else os.cpu_count() or 1
            requested = min(4, cores) if cores >= 2 else 0
    if isinstance(requested, bool) or not isinstance(requested, int) \
            or not 0 <= requested <= MAX_STREAMS:
        raise UsageError(f"tcp_streams must be an int in 0..{MAX_STREAMS}, got {requested!r}")
    return requested


def offer(registry: StreamRegistry, conn: Connection, ours: int,
          caps: dict[str, Any]) -> bytes | None:
    """Server, before WELCOME: offer the client ``min(ours, theirs)`` streams in ``caps``."""
    theirs = conn.peer_caps.get("tcp_streams")
    if not isinstance(theirs, int) or isinstance(theirs, bool):
        return None
    n = max(0, min(ours, theirs, MAX_STREAMS))
    if not n:
        return None
    conn_id = registry.expect(conn.session_key, n)
    caps["streams"] = {"id": conn_id, "n": n}
    return conn_id


async def join_client(conn: Connection, dial: tuple[str, int], use: bool,
                      timeout: float | None) -> None:
    """Client, after choosing the lane: attach the offered streams (``use``: a TCP lane)
    and tell the server how many; a failure to attach only costs the speed-up (logged)."""
    got = conn.peer_caps.get("streams")
    if not isinstance(got, dict):
        return
    conn_id, n = got.get("id"), got.get("n")
    if not isinstance(conn_id, bytes) or not isinstance(n, int) or not 0 <= n <= MAX_STREAMS:
        raise ProtocolError(f"{conn.label}: malformed stream offer {got!r}")
    socks: list[socket.socket] = []
    if use and n:
        try:
            socks = await open_streams(*dial, conn_id, conn.session_key, n, timeout)
        except (BrokenError, TimeoutError, AuthError, ProtocolError) as exc:
            logger.warning("%s: no extra data streams (%s); large ops share the control "
                           "socket", conn.label, exc)
    await conn.send_now(Kind.STREAMS, {"n": len(socks)})
    conn.attach_streams(socks)


async def join_server(conn: Connection, registry: StreamRegistry, conn_id: bytes | None,
                      timeout: float | None) -> None:
    """Server: learn how many streams the client attached; keep them all, or none."""
    if conn_id is None:
        return
    try:
        header = await asyncio.wait_for(conn.recv_frame(Kind.STREAMS), timeout)
        conn.attach_streams(registry.claim(conn_id, header["n"]))
    except asyncio.TimeoutError:
        raise TimeoutError(f"{conn.label}: the client did not report its data streams") \
            from None
    finally:
        registry.claim(conn_id, 0)  # no-op once claimed: drops a slot left behind


async def serve_attach(conn: Connection, registry: StreamRegistry,
                       header: dict[str, Any]) -> None:
    """Server, an accepted socket whose first frame was STREAM: keep it for its connection
    (answer STREAMS{n: 1}) or refuse it (AuthError, after telling the peer)."""
    try:
        registry.attach(header, conn.sock)
    except AuthError as exc:
        await conn.send_now(Kind.ERROR, {"req": 0, "code": "auth", "msg": str(exc)})
        raise
    await conn.send_now(Kind.STREAMS, {"n": 1})
@dataclass
class _Slot:
    key: bytes
    n: int
    socks: dict[int, socket.socket] = field(default_factory=dict)


class StreamRegistry:
    """Server side: connections waiting for their streams, by connection id."""

    def __init__(self) -> None:
        self._slots: dict[bytes, _Slot] = {}

    def expect(self, key: bytes, n: int) -> bytes:
        """Register a connection that may attach ``n`` streams; returns its public id."""
        conn_id = secrets.token_bytes(16)
        self._slots[conn_id] = _Slot(key, n)
        return conn_id

    def attach(self, header: dict[str, Any], sock: socket.socket) -> None:
        """Check a STREAM frame and keep its socket; AuthError if it proves nothing."""
        slot = self._slots.get(header["conn"])
        i = header["i"]
        if slot is None or not 0 <= i < slot.n or i in slot.socks:
            raise AuthError("data stream for an unknown connection (or attached twice)")
        if not _auth.verify_proof(_auth.stream_proof(slot.key, header["conn"], i),
                                  header["proof"]):
            raise AuthError("data stream failed to prove the connection's session key")
        slot.socks[i] = sock

    def claim(self, conn_id: bytes, n: int) -> list[socket.socket]:
        """Remove the slot; its sockets in order if all ``n`` attached, else close them."""
        slot = self._slots.pop(conn_id, None)
        socks = [] if slot is None else [slot.socks[i] for i in sorted(slot.socks)]
        if n and slot is not None and len(socks) == n == slot.n:
            return socks
        for s in socks:
            s.close()
        return []

    def __len__(self) -> int:
        return len(self._slots)


async def open_streams(host: str, port: int, conn_id: bytes, key: bytes, n: int,
                       timeout: float | None) -> list[socket.socket]:
    """Client side: connect and attach ``n`` streams (all or none; BrokenError/TimeoutError)."""
    from tensorx.transport._sock import open_socket

    async def one(i: int) -> socket.socket:
        sock = await open_socket(host, port)
        try:
            loop = asyncio.get_running_loop()
            frame = _wire.encode(Kind.STREAM, {"conn": conn_id, "i": i,
                                               "proof": _auth.stream_proof(key, conn_id, i)})
            await loop.sock_sendall(sock, frame)
            reply = await _recv_exact_async(sock, _wire.PREFIX.size)
            kind, hlen, plen = _wire.decode_prefix(reply)
            header = _wire.decode_header(kind, await _recv_exact_async(sock, hlen), plen)
            if kind is Kind.ERROR:
                raise AuthError(f"server refused data stream {i}: {header['msg']}")
            if kind is not Kind.STREAMS or header["n"] != 1:
                raise ProtocolError(f"data stream {i}: unexpected {kind.name} while attaching")
            return sock
        except BaseException:
            sock.close()
            raise

    tasks = [asyncio.ensure_future(one(i)) for i in range(n)]
    try:
        done = await asyncio.wait_for(asyncio.gather(*tasks), timeout)
    except asyncio.TimeoutError:
        raise TimeoutError(f"attaching {n} data streams timed out") from None
    except BaseException:
        for t in tasks:
            if t.done() and not t.cancelled() and t.exception() is None:
                t.result().close()
            t.cancel()
        raise
    return list(done)


async def _recv_exact_async(sock: socket.socket, n: int) -> bytes:
    loop = asyncio.get_running_loop()
    buf = bytearray()
    while len(buf) < n:
        try:
            chunk = await loop.sock_recv(sock, n - len(buf))
        except OSError as exc:
            raise BrokenError(f"data stream lost while attaching: {exc}") from exc
        if not chunk:
            raise BrokenError("server closed a data stream while attaching")
        buf += chunk
    return bytes(buf)


def _set_once(fut: asyncio.Future[None], exc: BaseException | None = None) -> None:
    if fut.done():
        return
    if exc is None:
        fut.set_result(None)
    else:
        fut.set_exception(exc)


def _copy(exc: TensorxError) -> TensorxError:
    new = type(exc)(str(exc))
    new.__cause__ = exc.__cause__
    return new
