"""Socket-level pieces of the TCP transport: tuning, connecting, listening, framed reads.

Kept apart from ``tcp.py`` (the protocol) so each file has one job.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable
from typing import Any

from tensorx import _wire
from tensorx._wire import Kind
from tensorx.errors import BrokenError, UsageError
from tensorx.transport._exceptions import map_exceptions

__all__ = ["BUFFER_BYTES", "HANDSHAKE_BYTES", "IOV_MAX", "FrameReader", "TcpListener", "advance",
           "open_socket", "tune"]

logger = logging.getLogger("tensorx.transport.tcp")

BUFFER_BYTES = 256 * 1024
HANDSHAKE_BYTES = 4096  # what an unauthenticated peer gets (grows only for a larger frame)
IOV_MAX = 512
LOWAT_MIN = 256 * 1024
LOWAT_MAX = 1024 * 1024
SOCKET_BUFFER = 4 * 1024 * 1024

PREFIX_SIZE = _wire.PREFIX.size
KEEPALIVE = {"TCP_KEEPIDLE": 10, "TCP_KEEPINTVL": 5, "TCP_KEEPCNT": 3}


def tune(sock: socket.socket) -> None:
    """Non-blocking, no Nagle, large buffers, and keepalive so a vanished host is noticed
    (about 25 s) even on an idle connection."""
    sock.setblocking(False)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in KEEPALIVE.items():
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        sock.setsockopt(socket.SOL_SOCKET, opt, SOCKET_BUFFER)


async def open_socket(host: str, port: int) -> socket.socket:
    """A connected, tuned non-blocking socket; OSError becomes BrokenError."""
    loop = asyncio.get_running_loop()
    with map_exceptions(f"cannot resolve {host}:{port}"):
        infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        family, _, _, _, addr = infos[0]
        sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        with map_exceptions(f"cannot connect to {host}:{port}"):
            tune(sock)
            try:
                await loop.sock_connect(sock, addr)
            except ConnectionRefusedError as exc:
                raise BrokenError(f"connection refused: nothing listens at {host}:{port} "
                                  "(not started yet, stopped, or another port?)") from exc
    except BaseException:
        sock.close()
        raise
    return sock


class FrameReader:
    """Buffered small reads (prefix, header) and unbuffered large reads into caller memory."""

    def __init__(self, sock: socket.socket, size: int = HANDSHAKE_BYTES) -> None:
        self._sock = sock
        self._loop = asyncio.get_running_loop()
        self._buf = bytearray(size)
        self._view = memoryview(self._buf)
        self._start = 0
        self._end = 0
        self._lost = map_exceptions("connection lost")

    def resize(self, size: int) -> None:
        """Use a buffer of ``size`` bytes from now on (keeps what is buffered): large once
        the peer has authenticated, none once the connection is closed."""
        size = max(size, self._end - self._start)
        data = self._view[self._start:self._end]
        buf = bytearray(size)
        buf[:len(data)] = data
        self._buf, self._view = buf, memoryview(buf)
        self._start, self._end = 0, len(data)

    async def _recv(self, into: memoryview) -> int:
        with self._lost:
            n = await self._loop.sock_recv_into(self._sock, into)
        if n == 0:
            raise BrokenError("peer closed the connection")
        return n

    def _make_room(self, need: int) -> None:
        if len(self._buf) < need:  # a frame larger than the buffer (at most MAX_HEADER)
            self.resize(need)
        if len(self._buf) - self._start < need:
            size = self._end - self._start
            self._buf[:size] = self._buf[self._start:self._end]
            self._start, self._end = 0, size

    async def _fill(self, need: int) -> None:
        self._make_room(need)
        while self._end - self._start < need:
            self._end += await self._recv(self._view[self._end:])

    @property
    def buffered(self) -> int:
        return self._end - self._start

    def feed(self) -> None:
        """One non-blocking ``recv_into`` the buffer, for a reader driven by readiness
        callbacks. Raises BlockingIOError when nothing is there, BrokenError at the end."""
        if self._start == self._end:  # all consumed: read from the front, so that a frame
            self._start = self._end = 0  # as large as the buffer's free room is read whole
        elif self._end == len(self._buf):
            self._make_room(len(self._buf) - self._start + 1)
        with self._lost:
            try:
                n = self._sock.recv_into(self._view[self._end:])
            except InterruptedError:
                raise BlockingIOError from None
        if n == 0:
            raise BrokenError("peer closed the connection")
        self._end += n

    def next_frame(self) -> tuple[Kind, Any, int] | None:
        """The next frame's (kind, header, payload length) if its prefix and header are
        buffered, else None (and nothing consumed). Its payload is not consumed. The header
        is an op frame's row, any other kind's map (see :func:`tensorx._wire.decode`)."""
        start = self._start
        if self._end - start < PREFIX_SIZE:
            if self._end != start:  # (all consumed: the next feed reads from the front)
                self._make_room(PREFIX_SIZE)
            return None
        op = _wire.decode_op(self._buf, start, self._end - start)  # one unpack, most frames
        if op is not None:
            self._start = start + op[3]
            return op[0], op[1], op[2]
        kind, header_len, payload_len = _wire.decode_prefix(self._buf, start)
        end = start + PREFIX_SIZE + header_len
        if end > self._end:
            self._make_room(PREFIX_SIZE + header_len)
            return None
        header = _wire.decode(kind, self._view[start + PREFIX_SIZE:end])
        self._start = end
        return kind, header, payload_len

    def take_into(self, dest: memoryview) -> None:
        """Fill ``dest`` from the buffer, which holds at least ``len(dest)`` bytes."""
        n = len(dest)
        dest[:] = self._view[self._start:self._start + n]
        self._start += n

    def skip(self, n: int) -> None:
        """Drop ``n`` buffered bytes (at most :attr:`buffered`)."""
        self._start += n

    def peek(self, n: int) -> bytes:
        """A copy of the next ``n`` buffered bytes (at most :attr:`buffered`), left in."""
        return bytes(self._view[self._start:self._start + n])

    async def read_into(self, dest: memoryview,
                        live: Callable[[], bool] = lambda: True) -> bool:
        """Fill ``dest`` exactly: buffered bytes first, then straight from the socket.

        ``live`` is asked right before every write into ``dest``; once it says False (the
        op that owns ``dest`` has raised), the rest of the payload is read and dropped and
        ``dest`` is never touched again. Returns whether ``dest`` was filled."""
        pos = 0
        lowat = 1
        try:
            while pos < len(dest):
                if not live():
                    break
                have = min(len(dest) - pos, self._end - self._start)
                if have:
                    dest[pos:pos + have] = self._view[self._start:self._start + have]
                    self._start += have
                    pos += have
                    continue
                # Large payloads: wake only when a big piece is ready (fewer loop turns).
                want = min(len(dest) - pos, LOWAT_MAX) if len(dest) - pos >= LOWAT_MIN else 1
                if want != lowat:
                    self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, want)
                    lowat = want
                pos += await self._recv_now(dest[pos:])
        finally:
            if lowat != 1 and self._sock.fileno() >= 0:
                self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, 1)
        if pos < len(dest):  # abandoned (with the low-water mark back at 1 byte)
            await self.discard(len(dest) - pos)
            return False
        return True

    async def _recv_now(self, into: memoryview) -> int:
        """One ``recv_into`` done right here (never by a callback later: the caller has just
        checked that ``into`` may still be written); 0 after waiting for readability."""
        try:
            with self._lost:
                n = self._sock.recv_into(into)
        except (BlockingIOError, InterruptedError):
            await self._readable()
            return 0
        if n == 0:
            raise BrokenError("peer closed the connection")
        return n

    async def _readable(self) -> None:
        fut: asyncio.Future[None] = self._loop.create_future()
        fd = self._sock.fileno()
        self._loop.add_reader(fd, _done, fut)
        try:
            await fut
        finally:
            if self._sock.fileno() == fd:  # closed: the number may belong to another socket
                self._loop.remove_reader(fd)

    def release(self) -> None:
        """The connection is over: give the buffer back (reads after this fail)."""
        self._buf = bytearray()
        self._view = memoryview(self._buf)
        self._start = self._end = 0

    async def discard(self, n: int) -> None:
        while n:
            step = min(n, len(self._buf))
            await self._fill(min(step, len(self._buf)))
            taken = min(step, self._end - self._start)
            self._start += taken
            n -= taken

    async def frame(self) -> tuple[Kind, Any, int]:
        while (frame := self.next_frame()) is None:
            self._end += await self._recv(self._view[self._end:])
        return frame


def _done(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


def advance(parts: list[Any], sent: int) -> list[Any]:
    """Drop ``sent`` bytes from the front of a list of buffers (no payload copies)."""
    for i, part in enumerate(parts):
        size = len(part)
        if sent < size:
            rest = memoryview(part)[sent:] if sent else part
            return [rest, *parts[i + 1:]]
        sent -= size
    return []



class TcpListener:
    """Accepts TCP connections and hands each socket to ``on_accept`` in its own task."""

    def __init__(self, sock: socket.socket, on_accept: Callable[[socket.socket], Any]) -> None:
        self._sock = sock
        self._on_accept = on_accept
        self._task = asyncio.get_running_loop().create_task(self._accept_loop())
        self._children: set[asyncio.Task[None]] = set()

    @classmethod
    async def start(cls, host: str, port: int,
                    on_accept: Callable[[socket.socket], Any]) -> TcpListener:
        with map_exceptions(f"cannot listen on {host}:{port}", {OSError: UsageError}):
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            sock = socket.socket(family, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
            sock.listen(512)
            sock.setblocking(False)
        return cls(sock, on_accept)

    @property
    def host_port(self) -> tuple[str, int]:
        host, port = self._sock.getsockname()[:2]
        return host, port

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, _ = await loop.sock_accept(self._sock)
            except OSError as exc:  # EMFILE and friends: keep serving, slowly
                logger.warning("accept failed: %s", exc)
                await asyncio.sleep(0.1)
                continue
            tune(conn)
            task = loop.create_task(self._on_accept(conn))
            self._children.add(task)
            task.add_done_callback(self._children.discard)

    async def aclose(self) -> None:
        self._task.cancel()
        for task in list(self._children):
            task.cancel()
        await asyncio.gather(self._task, *self._children, return_exceptions=True)
        self._sock.close()
