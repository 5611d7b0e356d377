"""Bad input gets a clear tensorx error, the owner keeps serving, no byte outside changes."""

from __future__ import annotations

import dataclasses
import socket
import struct
from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tensorx as tx
from tensorx import _wire
from tensorx._wire import Kind
from tensorx.testing import OwnerProcess, authenticate, digest, pattern, raw_socket, recv_frame

TOKEN = "s3cret"


@pytest.fixture(scope="module")
def owner() -> Iterator[OwnerProcess]:
    proc = OwnerProcess("tcp", token=TOKEN).start()
    yield proc
    proc.stop_blocking()


async def _connect(owner: OwnerProcess) -> tuple[tx.Node, tx.Endpoint]:
    node = await tx.Node(listen=None, transport="tcp", token=TOKEN).start()
    return node, await node.connect(owner.address)


async def _still_serving(owner: OwnerProcess) -> None:
    """A fresh, well-behaved peer can still write and read, and all guards are intact."""
    node, ep = await _connect(owner)
    async with node:
        desc = await owner.export(4096, seed=7)
        data = pattern(4096, seed=8)
        await ep.write(tx.MemoryRegion.register(data), desc)
        assert await owner.call("digest", desc.region_id) == digest(data)
    assert await owner.call("guards_intact")


async def test_out_of_range_is_refused_locally_and_by_the_owner(owner: OwnerProcess) -> None:
    node, ep = await _connect(owner)
    async with node:
        desc = await owner.export(1000, seed=1)
        src = tx.MemoryRegion.register(np.ones(4096, np.uint8))
        with pytest.raises(tx.RegionError, match="outside"):
            await ep.write(src, desc, remote_offset=999, nbytes=2)
        with pytest.raises(tx.RegionError):
            await ep.read(src, desc, remote_offset=1001, nbytes=0)
        with pytest.raises(tx.UsageError):
            await ep.write(src, desc, offset=4000, nbytes=200)
        forged = dataclasses.replace(desc, nbytes=1 << 20)  # lies about the size
        with pytest.raises(tx.RegionError, match="outside"):
            await ep.write(src, forged, remote_offset=900, nbytes=4096)
        with pytest.raises(tx.RegionError, match="outside"):
            await ep.read(src, forged, remote_offset=0, nbytes=4096)
        assert await owner.call("digest", desc.region_id) == digest(pattern(1000, 1))
    await _still_serving(owner)


async def test_write_to_read_only_export_is_refused(owner: OwnerProcess) -> None:
    node, ep = await _connect(owner)
    async with node:
        desc = await owner.export(4096, access="r", seed=2)
        src = tx.MemoryRegion.register(np.ones(4096, np.uint8))
        with pytest.raises(tx.RegionError, match="cannot be written"):
            await ep.write(src, desc)
        with pytest.raises(tx.RegionError, match="cannot be written"):
            await ep.write(src, dataclasses.replace(desc, access="rw"))
        out = np.zeros(4096, np.uint8)
        await ep.read(tx.MemoryRegion.register(out), desc)
        assert np.array_equal(out, pattern(4096, 2))
    await _still_serving(owner)


async def test_stale_descriptor_after_close_is_refused(owner: OwnerProcess) -> None:
    node, ep = await _connect(owner)
    async with node:
        desc = await owner.export(4096, seed=3)
        await owner.call("close_region", desc.region_id)
        src = tx.MemoryRegion.register(np.ones(4096, np.uint8))
        with pytest.raises(tx.RegionError, match=r"not exported|closed"):
            await ep.write(src, desc)
        with pytest.raises(tx.RegionError, match=r"not exported|closed"):
            await ep.read(src, desc)
    await _still_serving(owner)


async def test_forged_region_id_and_cookie_are_refused(owner: OwnerProcess) -> None:
    node, ep = await _connect(owner)
    async with node:
        desc = await owner.export(4096, seed=4)
        src = tx.MemoryRegion.register(np.ones(4096, np.uint8))
        for forged in (dataclasses.replace(desc, region_id=desc.region_id ^ 1),
                       dataclasses.replace(desc, cookie=desc.cookie ^ 1)):
            with pytest.raises(tx.RegionError, match="not exported"):
                await ep.write(src, forged)
        other_owner = dataclasses.replace(desc, owner="0" * 16)
        with pytest.raises(tx.RegionError, match="belongs to node"):
            await ep.write(src, other_owner)
        assert await owner.call("digest", desc.region_id) == digest(pattern(4096, 4))
    await _still_serving(owner)


async def test_descriptor_bytes_are_checked_on_every_op(owner: OwnerProcess) -> None:
    """Descriptor bytes are decoded once and kept (callers pass the same bytes on every
    op): the genuine bytes keep working, forged bytes are refused every time after them,
    and malformed bytes are a ProtocolError every time (a refusal is not kept)."""
    node, ep = await _connect(owner)
    async with node:
        desc = await owner.export(4096, seed=9)
        raw, forged = desc.to_bytes(), dataclasses.replace(desc, cookie=desc.cookie ^ 1)
        src = tx.MemoryRegion.register(pattern(4096, seed=10))
        for _ in range(3):
            await ep.write(src, raw)
            with pytest.raises(tx.RegionError, match="not exported"):
                await ep.write(src, forged.to_bytes())
            with pytest.raises(tx.ProtocolError, match="not a region descriptor"):
                await ep.write(src, raw[:-3])
        assert await owner.call("digest", desc.region_id) == digest(pattern(4096, 10))
    await _still_serving(owner)


async def test_wrong_token_is_refused(owner: OwnerProcess) -> None:
    async with tx.Node(listen=None, transport="tcp", token="wrong") as node:
        with pytest.raises(tx.AuthError, match="token"):
            await node.connect(owner.address)
    async with tx.Node(listen=None, transport="tcp", token=None) as node:
        with pytest.raises(tx.AuthError):
            await node.connect(owner.address)
    await _still_serving(owner)


async def test_unusable_calls_are_usage_errors(owner: OwnerProcess) -> None:
    node, ep = await _connect(owner)
    async with node:
        desc = await owner.export(64)
        with pytest.raises(tx.UsageError, match="MemoryRegion"):
            await ep.write(np.zeros(64, np.uint8), desc)  # type: ignore[arg-type]
        with pytest.raises(tx.ProtocolError):
            await ep.write(tx.MemoryRegion.allocate(64), b"garbage")
        closed = tx.MemoryRegion.allocate(64)
        closed.close()
        with pytest.raises(tx.ClosedError):
            await ep.write(closed, desc)
        await ep.aclose()
        with pytest.raises(tx.ClosedError):
            await ep.write(tx.MemoryRegion.allocate(64), desc)


# -- raw frames: speak the protocol by hand, then misbehave --------------------------------
def _raw_socket(owner: OwnerProcess) -> socket.socket:
    return raw_socket(owner.address)


def _authenticated_socket(owner: OwnerProcess) -> socket.socket:
    sock = _raw_socket(owner)
    authenticate(sock, TOKEN.encode(), "fuzzer")
    return sock


def _closed_by_owner(sock: socket.socket) -> bool:
    """The owner drops a misbehaving connection: reads end in EOF/reset within the timeout."""
    sock.settimeout(10)
    try:
        while sock.recv(65536):
            pass
    except (ConnectionResetError, BrokenPipeError):
        pass
    finally:
        sock.close()
    return True


frames = st.one_of(
    st.binary(min_size=1, max_size=256),
    st.builds(lambda kind, version, hlen, plen, tail: _wire.PREFIX.pack(
        b"TX", version, kind, hlen, plen) + tail,
        st.integers(0, 255), st.sampled_from([3, 3, 2, 1, 4, 0]), st.integers(0, 2**20),
        st.integers(0, 2**41), st.binary(max_size=64)),
)


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(garbage=frames, authenticated=st.booleans())
def test_garbage_frames_close_only_that_connection(owner: OwnerProcess, garbage: bytes,
                                                   authenticated: bool) -> None:
    sock = _authenticated_socket(owner) if authenticated else _raw_socket(owner)
    try:
        sock.sendall(garbage)
        sock.shutdown(socket.SHUT_WR)
    except OSError:
        pass  # the owner may already have hung up: that is the point
    assert _closed_by_owner(sock)
    assert owner.alive()
    assert owner.call_blocking("guards_intact")


def test_forged_write_frame_past_the_end_changes_nothing(owner: OwnerProcess) -> None:
    desc = owner.call_blocking("export", 128, "rw", 5)
    d = tx.RegionDescriptor.from_bytes(desc)
    sock = _authenticated_socket(owner)
    header = {"req": 1, "rid": d.region_id, "ck": d.cookie, "off": 64, "n": 4096, "last": True}
    sock.sendall(_wire.encode(Kind.WRITE, header, 4096) + b"\xff" * 4096)
    kind, reply = recv_frame(sock)
    assert kind is Kind.ERROR and reply["code"] == "region"
    sock.close()
    assert owner.call_blocking("digest", d.region_id) == digest(pattern(128, 5))
    assert owner.call_blocking("guards_intact")


@pytest.mark.parametrize("flags", [0b10, 0b110, 0b11 | 0x80])
def test_malformed_carried_notification_is_a_protocol_error(owner: OwnerProcess,
                                                            flags: int) -> None:
    """A WRITE's carried notification must come on the last frame of its write, and a
    WRITE has no flags but 'last' and 'carries a notification'."""
    d = tx.RegionDescriptor.from_bytes(owner.call_blocking("export", 128, "rw", 6))
    sock = _authenticated_socket(owner)
    header = struct.pack("!QQQQB", 1, d.region_id, d.cookie, 0, flags) + b"early"
    sock.sendall(_wire.PREFIX.pack(b"TX", V, Kind.WRITE, len(header), 8) + header + b"\xff" * 8)
    kind, reply = recv_frame(sock)
    assert kind is Kind.ERROR and reply["code"] == "protocol"
    assert _closed_by_owner(sock)
    assert owner.call_blocking("digest", d.region_id) == digest(pattern(128, 6))
    assert b"early" not in owner.call_blocking("notes")


async def test_owner_keeps_serving_after_all_of_the_above(owner: OwnerProcess) -> None:
    await _still_serving(owner)


V = _wire.PROTOCOL_VERSION


@pytest.mark.parametrize("frame", [
    b"XX" + b"\x00" * 14,                                            # bad magic
    _wire.PREFIX.pack(b"TX", 9, Kind.WRITE, 0, 0),                   # protocol version 9
    _wire.PREFIX.pack(b"TX", V, Kind.WRITE, 1 << 20, 0),             # header over the limit
    _wire.encode(Kind.HELLO, {"id": "again", "nonce": b"x"}),        # handshake frame later
    _wire.PREFIX.pack(b"TX", V, Kind.QUERY, 3, 0) + b"\xc1\xc1\xc1",  # undecodable header
    _wire.PREFIX.pack(b"TX", V, Kind.WRITE, 3, 0) + b"\xc1\xc1\xc1",  # op header cut short
])
def test_malformed_frame_gets_a_protocol_error_reply(owner: OwnerProcess, frame: bytes) -> None:
    sock = _authenticated_socket(owner)
    sock.sendall(frame)  # no EOF from us: the owner must notice by itself
    kind, reply = recv_frame(sock)
    assert kind is Kind.ERROR and reply["code"] == "protocol" and reply["req"] == 0
    assert _closed_by_owner(sock)
    assert owner.call_blocking("guards_intact")
