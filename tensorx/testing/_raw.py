"""Peers that misbehave: the protocol by hand on a blocking socket, and a TCP proxy that
stalls or cuts a link on loopback."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

from tensorx import _auth, _wire
from tensorx.node import parse_address


def raw_socket(address: str, timeout: float = 5.0) -> socket.socket:
    """A plain blocking socket to a node, for tests that speak (or abuse) the protocol."""
    _, host, port = parse_address(address)
    return socket.create_connection((host, port), timeout=timeout)


def recv_frame(sock: socket.socket) -> tuple[_wire.Kind, dict[str, Any]]:
    """Read one whole frame from a blocking socket; its payload is read and dropped."""
    kind, hlen, plen = _wire.decode_prefix(_recv_exact(sock, _wire.PREFIX.size))
    header = _wire.decode_header(kind, _recv_exact(sock, hlen), plen)
    _recv_exact(sock, plen)
    return kind, header


def recv_refusal(sock: socket.socket) -> dict[str, Any]:
    """The ERROR frame a node sends on a connection it refuses (the header: ``code``,
    ``msg``), checked to be followed by the end of the connection."""
    kind, header = recv_frame(sock)
    assert kind is _wire.Kind.ERROR, (kind, header)
    assert sock.recv(1) == b"", "the connection goes on after its refusal"
    return header


def authenticate(sock: socket.socket, token: bytes, node_id: str = "raw-client",
                 caps: dict[str, Any] | None = None, then: bytes = b"") -> dict[str, Any]:
    """The client side of the handshake by hand on a blocking socket (for tests that then
    misbehave), up to the server's READY; returns the server's WELCOME header. Raises
    AssertionError if refused. ``then``: frames sent in the same ``sendall`` as the last
    handshake frame."""
    nonce = _auth.new_nonce()
    sock.sendall(_wire.encode(_wire.Kind.HELLO, {"id": node_id, "nonce": nonce}))
    kind, ch = recv_frame(sock)
    assert kind is _wire.Kind.CHALLENGE, (kind, ch)
    proof = _auth.make_proof(token, b"client", nonce, ch["nonce"], node_id, ch["id"])
    sock.sendall(_wire.encode(_wire.Kind.AUTH, {"proof": proof}))
    kind, welcome = recv_frame(sock)
    assert kind is _wire.Kind.WELCOME, (kind, welcome)
    sock.sendall(_wire.encode(_wire.Kind.CAPS, {"caps": caps or {}})
                 + _wire.encode(_wire.Kind.READY, {}) + then)
    kind, ready = recv_frame(sock)
    assert kind is _wire.Kind.READY, (kind, ready)
    return welcome


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("peer closed")
        data += chunk
    return bytes(data)


class FaultyProxy:
    """A TCP proxy on 127.0.0.1 between a client and ``target`` that a test can stall
    (stop forwarding, keep sockets open: a black-holed link) or cut (reset every link)."""

    def __init__(self, target: str) -> None:
        _, self._host, self._port = parse_address(target)
        self._server: asyncio.Server | None = None
        self._links: list[asyncio.StreamWriter] = []
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._allowance: int | None = None  # bytes still let through toward the client
        self.address = ""

    async def __aenter__(self) -> FaultyProxy:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        self.address = f"tcp://127.0.0.1:{port}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.cut()
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()

    def stall(self) -> None:
        self._flowing.clear()

    def stall_after(self, nbytes: int) -> None:
        """Let ``nbytes`` more bytes through toward the client, then stall (a reply that
        stops mid-transfer); :meth:`resume` lets the rest through."""
        self._allowance = nbytes

    def resume(self) -> None:
        self._allowance = None
        self._flowing.set()

    def cut(self) -> None:
        for writer in self._links:
            writer.transport.abort()
        self._links.clear()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(self._host, self._port)
        self._links += [writer, up_writer]
        await asyncio.gather(self._pump(reader, up_writer),
                             self._pump(up_reader, writer, down=True), return_exceptions=True)

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                    down: bool = False) -> None:
        try:
            while data := await reader.read(65536):
                while data:
                    await self._flowing.wait()
                    piece = data
                    if down and self._allowance is not None:
                        piece = data[:self._allowance]
                        self._allowance -= len(piece)
                        if not self._allowance:
                            self._flowing.clear()
                    data = data[len(piece):]
                    writer.write(piece)
                    await writer.drain()
        finally:
            writer.transport.abort()
