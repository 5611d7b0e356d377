"""Extra TCP data streams: striping, negotiation, and what a forged or broken stream gets."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import secrets
import socket
from collections.abc import AsyncIterator

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import tensorx as tx
from tensorx import _auth, _wire
from tensorx._wire import Kind
from tensorx.testing import OwnerProcess, digest, pattern, raw_socket, recv_frame
from tensorx.transport.streams import ALIGN, stripe

MiB = 1 << 20


@given(st.lists(st.integers(0, 5 * ALIGN), min_size=1, max_size=6), st.integers(1, 5))
def test_stripe_covers_every_byte_once_in_order(sizes: list[int], n: int) -> None:
    data = np.arange(sum(sizes), dtype=np.uint32).view(np.uint8)
    pieces, pos = [], 0
    for i, size in enumerate(sizes):
        pieces.append((memoryview(data)[pos * 4:(pos + size) * 4], i, 7, 100 * i))
        pos += size
    runs = stripe(pieces, n)
    assert len(runs) <= n
    flat = [p for run in runs for p in run]
    assert b"".join(bytes(p[0]) for p in flat) == data.tobytes()
    for i, size in enumerate(sizes):  # each source piece's parts keep their offsets
        mine = [p for p in flat if p[1] == i]
        assert sum(len(p[0]) for p in mine) == size * 4
        expect = 100 * i
        for mv, _, _, off in mine:
            assert off == expect
            expect += len(mv)


@contextlib.asynccontextmanager
async def pair(server: int | None = 2, client: int | None = 2
               ) -> AsyncIterator[tuple[tx.Node, tx.Node, tx.Endpoint]]:
    async with tx.Node(transport="tcp", tcp_streams=server) as owner, \
            tx.Node(listen=None, transport="tcp", tcp_streams=client) as node:
        ep = await node.connect(owner.address)
        yield owner, node, ep


async def test_large_ops_take_the_streams_small_ones_the_control_socket() -> None:
    async with pair() as (owner, _, ep):
        assert ep.info["lanes"] == ["tcp/socket", "tcp/streams:2"]
        target = np.zeros(8 * MiB, np.uint8)
        desc = owner.export(target)
        streams = ep._conn.streams
        assert streams is not None
        small = pattern(4096, seed=1)
        await ep.write(tx.MemoryRegion.register(small), desc)
        assert streams.stats["bytes_out"] == 0
        big = pattern(8 * MiB, seed=2)
        await ep.write(tx.MemoryRegion.register(big), desc)
        assert streams.stats["bytes_out"] >= 8 * MiB
        assert np.array_equal(target, big)
        back = np.zeros_like(big)
        await ep.read(tx.MemoryRegion.register(back), desc)
        assert np.array_equal(back, big)
        assert streams.stats["bytes_in"] >= 8 * MiB


@pytest.mark.parametrize(("server", "client", "expect"), [(3, 2, 2), (1, 4, 1), (2, 0, 0),
                                                         (0, 2, 0)])
async def test_peers_use_the_smaller_count(server: int, client: int, expect: int) -> None:
    async with pair(server, client) as (owner, _, ep):
        await asyncio.sleep(0.05)
        (theirs,) = owner.endpoints
        for side in (ep, theirs):
            got = side._conn.streams
            assert (got.n if got is not None else 0) == expect
        data = pattern(3 * MiB, seed=3)
        target = np.zeros_like(data)
        await ep.write(tx.MemoryRegion.register(data), owner.export(target))
        assert np.array_equal(target, data)


def test_stream_count_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(tx.UsageError):
        tx.Node(tcp_streams=99)
    monkeypatch.setenv("TENSORX_TCP_STREAMS", "many")
    with pytest.raises(tx.UsageError, match="TENSORX_TCP_STREAMS"):
        tx.Node()
    monkeypatch.setenv("TENSORX_TCP_STREAMS", "0")
    assert tx.Node().tcp_streams == 0


def _attach(address: str, conn_id: bytes, index: int, proof: bytes
            ) -> tuple[Kind, dict[str, object]]:
    with raw_socket(address) as sock:
        sock.sendall(_wire.encode(Kind.STREAM, {"conn": conn_id, "i": index, "proof": proof}))
        return recv_frame(sock)


async def test_a_stream_that_cannot_prove_its_connection_is_refused() -> None:
    async with pair() as (owner, _, ep):
        conn = ep._conn
        kind, header = await asyncio.to_thread(
            _attach, owner.address, secrets.token_bytes(16), 0, secrets.token_bytes(32))
        assert kind is Kind.ERROR and header["code"] == "auth"
        # replaying a real attach (right key, right id) once the connection holds its streams
        conn_id = conn.peer_caps["streams"]["id"]
        proof = _auth.stream_proof(conn.session_key, conn_id, 0)
        kind, header = await asyncio.to_thread(_attach, owner.address, conn_id, 0, proof)
        assert kind is Kind.ERROR and header["code"] == "auth"
        data = pattern(2 * MiB, seed=4)  # the connection itself is unharmed
        target = np.zeros_like(data)
        await ep.write(tx.MemoryRegion.register(data), owner.export(target))
        assert np.array_equal(target, data)


async def test_a_forged_size_is_refused_by_the_owner_on_the_streams() -> None:
    async with OwnerProcess("tcp") as owner, \
            tx.Node(listen=None, transport="tcp", tcp_streams=2) as node:
        ep = await node.connect(owner.address)
        assert "tcp/streams:2" in ep.info["lanes"]
        desc = await owner.export(1000, seed=5)
        forged = dataclasses.replace(desc, nbytes=64 * MiB)  # lies about the size
        src = tx.MemoryRegion.register(np.ones(4 * MiB, np.uint8))
        with pytest.raises(tx.RegionError, match="outside"):
            await ep.write(src, forged, nbytes=4 * MiB)
        with pytest.raises(tx.RegionError, match="outside"):
            await ep.read(src, forged, nbytes=4 * MiB)
        assert await owner.call("digest", desc.region_id) == digest(pattern(1000, 5))
        assert await owner.call("guards_intact")
        ok = await owner.export(4 * MiB)  # the same endpoint and streams still work
        await ep.write(src, ok)
        assert await owner.call("digest", ok.region_id) == digest(np.ones(4 * MiB, np.uint8))


async def test_garbage_on_a_stream_closes_that_connection_only() -> None:
    async with pair() as (owner, node, ep):
        streams = ep._conn.streams
        assert streams is not None
        sock: socket.socket = streams._streams[0]._sock
        await asyncio.to_thread(sock.sendall, b"garbage that is no frame")
        gone = await asyncio.wait_for(node.disconnected.get(), 10)
        assert gone is ep
        with pytest.raises(tx.BrokenError):
            await ep.write(tx.MemoryRegion.register(np.ones(2 * MiB, np.uint8)),
                           owner.export(np.zeros(2 * MiB, np.uint8)))
        fresh = await node.connect(owner.address)  # the owner still serves everyone else
        data = pattern(2 * MiB, seed=6)
        target = np.zeros_like(data)
        await fresh.write(tx.MemoryRegion.register(data), owner.export(target))
        assert np.array_equal(target, data)


def test_server_and_worker_pass_node_options_on() -> None:
    from torch import nn

    from tensorx.ps import ParameterServer
    from tensorx.worker import Worker

    ps = ParameterServer(num_workers=1, node_options={"tcp_streams": 3})
    worker = Worker(nn.Linear(2, 2), "tcp://127.0.0.1:1",
                    node_options={"tcp_streams": 0, "require": "ucx"})
    assert ps.node.tcp_streams == 3
    assert (worker.node.tcp_streams, worker.node.require) == (0, "ucx")
    with pytest.raises(TypeError):
        ParameterServer(num_workers=1, node_options={"no_such_option": 1})
