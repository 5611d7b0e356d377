"""The TCP connection serves frames however the stream cuts them: several in one segment,
one dribbled a byte at a time, some sent along with the handshake's last frame. (Frames
whose payload is all there are served in the socket's readiness callback, the others by a
task; both paths must give the same answers.)"""

from __future__ import annotations

import asyncio
import socket

import numpy as np

import tensorx as tx
from tensorx import _wire
from tensorx._wire import Kind
from tensorx.testing import authenticate, raw_socket

TOKEN = b"tcp-frames"


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        assert chunk, "the node closed the connection"
        data += chunk
    return bytes(data)


def _frame(sock: socket.socket) -> tuple[Kind, dict[str, object], bytes]:
    """One whole frame, payload included."""
    kind, hlen, plen = _wire.decode_prefix(_recv_exact(sock, _wire.PREFIX.size))
    header = _wire.decode_header(kind, _recv_exact(sock, hlen), plen)
    return kind, header, _recv_exact(sock, plen)


def _write(req: int, desc: tx.RegionDescriptor, off: int, data: bytes) -> bytes:
    header = {"req": req, "rid": desc.region_id, "ck": desc.cookie, "off": off,
              "n": len(data), "last": True}
    return _wire.encode(Kind.WRITE, header, len(data)) + data


def _read(req: int, desc: tx.RegionDescriptor, off: int, n: int) -> bytes:
    header = {"req": req, "rid": desc.region_id, "ck": desc.cookie, "off": off, "n": n}
    return _wire.encode(Kind.READ, header)


async def _owner_with_region(nbytes: int) -> tuple[tx.Node, np.ndarray, tx.RegionDescriptor]:
    node = tx.Node(transport="tcp", token=TOKEN)
    await node.start()
    memory = np.zeros(nbytes, np.uint8)
    return node, memory, node.export(memory, access="rw")


async def test_frames_sent_with_the_handshakes_last_frame_are_served() -> None:
    node, memory, desc = await _owner_with_region(64)
    memory[:] = np.arange(64, dtype=np.uint8)
    async with node:
        def client() -> tuple[Kind, bytes]:
            with raw_socket(node.address) as sock:
                authenticate(sock, TOKEN, then=_read(1, desc, 8, 16))
                kind, _, payload = _frame(sock)
                return kind, payload

        kind, payload = await asyncio.to_thread(client)
    assert kind is Kind.READ_DATA
    assert payload == bytes(range(8, 24))


async def test_many_frames_in_one_segment_are_all_served_in_order() -> None:
    node, memory, desc = await _owner_with_region(50 * 1024)
    pieces = [bytes([i]) * 1024 for i in range(50)]
    async with node:
        def client() -> tuple[list[tuple[Kind, int]], bytes]:
            with raw_socket(node.address) as sock:
                authenticate(sock, TOKEN)
                burst = b"".join(_write(i + 1, desc, i * 1024, p) for i, p in enumerate(pieces))
                sock.sendall(burst + _read(99, desc, 0, 50 * 1024))
                acks = [_frame(sock)[:2] for _ in pieces]
                kind, header, payload = _frame(sock)
                assert (kind, header["req"]) == (Kind.READ_DATA, 99)
                return [(k, int(h["req"])) for k, h in acks], payload  # type: ignore[call-overload]

        acks, payload = await asyncio.to_thread(client)
    assert acks == [(Kind.WRITE_ACK, i + 1) for i in range(50)]
    assert payload == b"".join(pieces)
    assert memory.tobytes() == b"".join(pieces)


async def test_a_frame_dribbled_one_byte_at_a_time_is_served() -> None:
    """Each byte its own segment: prefix, header and payload all arrive in pieces."""
    node, memory, desc = await _owner_with_region(4096)
    data = bytes(np.random.default_rng(1).integers(0, 256, 3000, dtype=np.uint8))
    async with node:
        def client() -> tuple[Kind, bytes]:
            with raw_socket(node.address) as sock:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                authenticate(sock, TOKEN)
                for byte in _write(1, desc, 100, data) + _read(2, desc, 100, len(data)):
                    sock.sendall(bytes([byte]))
                kind, header, _ = _frame(sock)
                assert (kind, header["req"]) == (Kind.WRITE_ACK, 1), (kind, header)
                kind, _, payload = _frame(sock)
                return kind, payload

        kind, payload = await asyncio.to_thread(client)
    assert kind is Kind.READ_DATA
    assert payload == data
    assert memory[100:3100].tobytes() == data
    assert not memory[:100].any() and not memory[3100:].any()
