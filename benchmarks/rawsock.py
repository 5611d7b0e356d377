"""The raw-socket limit: blocking sockets, no framing beyond an 8-byte request, no asyncio.

A request is ``op(1 byte) | nbytes(8 bytes)``. ``w``: the payload follows and the server
answers one byte once it is in its buffer. ``r``: the server sends nbytes from its buffer.

The same exchange between two asyncio event loops (:class:`AsyncioClient`, and a server
served from a readiness callback) is, for small ops, the floor of any asyncio transport:
what the loops' wake-ups and turns cost on top of the same system calls, with nothing else
in Python.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import socket
import struct
import time
from typing import Any

import numpy as np

REQ = struct.Struct("!cQ")
SOCK_BUF = 4 * 1024 * 1024


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        sock.setsockopt(socket.SOL_SOCKET, opt, SOCK_BUF)


def _recv_into(sock: socket.socket, view: memoryview) -> None:
    pos = 0
    while pos < len(view):  # MSG_WAITALL: one wake-up per transfer, the best sockets can do
        n = sock.recv_into(view[pos:], 0, socket.MSG_WAITALL)
        if not n:
            raise ConnectionError("peer closed")
        pos += n


def _accept(port_q: Any) -> socket.socket:
    lsock = socket.socket()
    _tune(lsock)  # before listen: accepted sockets inherit it, and the SYN advertises it
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(1)
    port_q.put(lsock.getsockname()[1])
    return lsock.accept()[0]


def serve(port_q: Any, max_bytes: int, use_asyncio: bool = False) -> None:
    buf = memoryview(np.zeros(max_bytes, np.uint8)).cast("B")
    sock = _accept(port_q)
    if use_asyncio:
        _AsyncioServer(sock, buf).run()
        return
    head = memoryview(bytearray(REQ.size))
    try:
        while True:
            _recv_into(sock, head)
            op, n = REQ.unpack(head)
            if op == b"w":
                _recv_into(sock, buf[:n])
                sock.sendall(b"k")
            else:
                sock.sendall(buf[:n])
    except ConnectionError:
        sock.close()


class _AsyncioServer:
    """The server's loop as an asyncio transport would run it: each readiness callback
    receives what is there into a read buffer and serves every request it completes."""

    def __init__(self, sock: socket.socket, buf: memoryview) -> None:
        self.sock, self.buf = sock, buf
        self.view = memoryview(bytearray(REQ.size + 256 * 1024))
        self.start = self.end = 0
        self.need = self.pos = 0  # a write's payload bytes still to come, where they go
        self.loop = asyncio.new_event_loop()

    def run(self) -> None:
        self.sock.setblocking(False)
        self.loop.add_reader(self.sock.fileno(), self.readable)
        self.loop.run_forever()
        self.sock.close()

    def readable(self) -> None:
        if self.start == self.end:
            self.start = self.end = 0
        try:
            n = self.sock.recv_into(self.view[self.end:])
        except BlockingIOError:
            return
        if not n:
            self.loop.stop()
            return
        self.end += n
        while self.serve():
            pass
        if self.end - self.start < REQ.size and self.end + REQ.size > len(self.view):
            rest = bytes(self.view[self.start:self.end])  # a request cut at the buffer's end
            self.view[:len(rest)] = rest
            self.start, self.end = 0, len(rest)

    def serve(self) -> bool:
        """Serve what is buffered; False once more has to come."""
        if self.need:
            take = min(self.need, self.end - self.start)
            self.buf[self.pos:self.pos + take] = self.view[self.start:self.start + take]
            self.start, self.pos, self.need = self.start + take, self.pos + take, self.need - take
            if self.need:
                return False
            self.reply(b"k")
            return True
        if self.end - self.start < REQ.size:
            return False
        op, n = REQ.unpack_from(self.view, self.start)
        self.start += REQ.size
        if op == b"w":
            self.need, self.pos = n, 0
            if not n:
                self.reply(b"k")
        else:
            self.reply(self.buf[:n])
        return True

    def reply(self, data: Any) -> None:
        sent = self.sock.send(data)
        if sent < len(data):  # larger than the socket buffer: finish it blocking
            self.sock.setblocking(True)
            self.sock.sendall(memoryview(data)[sent:])
            self.sock.setblocking(False)


class RawClient:
    """Client side of the raw-socket baseline, with its server in a spawned process."""

    def __init__(self, max_bytes: int, use_asyncio: bool = False) -> None:
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        self.proc = ctx.Process(target=serve, args=(q, max_bytes, use_asyncio), daemon=True)
        self.proc.start()
        self.sock = socket.socket()
        _tune(self.sock)
        self.sock.connect(("127.0.0.1", q.get(timeout=60)))
        self.buf = memoryview(np.ones(max_bytes, np.uint8)).cast("B")
        self.ack = memoryview(bytearray(1))

    def write(self, n: int) -> float:
        t = time.perf_counter()
        self.sock.sendall(REQ.pack(b"w", n))
        self.sock.sendall(self.buf[:n])
        _recv_into(self.sock, self.ack)
        return time.perf_counter() - t

    def read(self, n: int) -> float:
        t = time.perf_counter()
        self.sock.sendall(REQ.pack(b"r", n))
        _recv_into(self.sock, self.buf[:n])
        return time.perf_counter() - t

    def close(self) -> None:
        self.sock.close()
        self.proc.join(10)


class AsyncioClient(RawClient):
    """The same requests from an asyncio loop against an asyncio server: the reply is
    received in a readiness callback (straight into the destination) that completes the
    request's future."""

    def __init__(self, max_bytes: int) -> None:
        super().__init__(max_bytes, use_asyncio=True)
        self.sock.setblocking(False)
        self._into = self.ack
        self._got = 0
        self._done: asyncio.Future[None] | None = None

    def _readable(self) -> None:
        try:
            self._got += self.sock.recv_into(self._into[self._got:])
        except BlockingIOError:
            return
        if self._got == len(self._into) and self._done is not None:
            self._done.set_result(None)

    async def _exchange(self, parts: list[Any], into: memoryview) -> float:
        loop = asyncio.get_running_loop()
        t = time.perf_counter()
        self._into, self._got, self._done = into, 0, loop.create_future()
        try:
            sent = self.sock.sendmsg(parts)
        except BlockingIOError:
            sent = 0
        for part in map(memoryview, parts):  # what the kernel did not take at once
            if sent < len(part):
                await loop.sock_sendall(self.sock, part[sent:])
            sent = max(sent - len(part), 0)
        await self._done
        return time.perf_counter() - t

    async def awrite(self, n: int) -> float:
        return await self._exchange([REQ.pack(b"w", n), self.buf[:n]], self.ack)

    async def aread(self, n: int) -> float:
        return await self._exchange([REQ.pack(b"r", n)], self.buf[:n])

    def attach(self) -> None:
        asyncio.get_running_loop().add_reader(self.sock.fileno(), self._readable)

    def detach(self) -> None:
        asyncio.get_running_loop().remove_reader(self.sock.fileno())
