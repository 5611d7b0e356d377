"""The raw-socket limit: blocking sockets, no framing beyond an 8-byte request, no asyncio.

A request is ``op(1 byte) | nbytes(8 bytes)``. ``w``: the payload follows and the server
answers one byte once it is in its buffer. ``r``: the server sends nbytes from its buffer.
"""

from __future__ import annotations

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


def serve(port_q: Any, max_bytes: int) -> None:
    buf = memoryview(np.zeros(max_bytes, np.uint8)).cast("B")
    lsock = socket.socket()
    _tune(lsock)  # before listen: accepted sockets inherit it, and the SYN advertises it
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(1)
    port_q.put(lsock.getsockname()[1])
    sock, _ = lsock.accept()
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


class RawClient:
    """Client side of the raw-socket baseline, with its server in a spawned process."""

    def __init__(self, max_bytes: int) -> None:
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        self.proc = ctx.Process(target=serve, args=(q, max_bytes), daemon=True)
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
