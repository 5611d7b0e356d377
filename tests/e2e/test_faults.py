"""Links that stall or break, replayed handshakes, version mismatches: nothing hangs or leaks."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import socket

import numpy as np
import pytest

import tensorx as tx
from tensorx import _auth, _wire
from tensorx._wire import Kind
from tensorx.testing import (
    FaultyProxy,
    OwnerProcess,
    raw_socket,
    recv_frame,
    recv_refusal,
    wait_until,
)
from tests.support.lanes import transports


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def test_stalled_link_times_out_then_recovers_and_cut_link_breaks() -> None:
    async with tx.Node(transport="tcp") as owner, FaultyProxy(owner.address) as proxy, \
            tx.Node(listen=None, transport="tcp", timeout=1.0) as node:
        desc = owner.export(tx.MemoryRegion.allocate(1 << 20))
        ep = await node.connect(proxy.address)
        buf = tx.MemoryRegion.allocate(1 << 20)
        await ep.write(buf, desc)
        proxy.stall()
        with pytest.raises(tx.TimeoutError, match=r"read timed out after 1\.0 s"):
            await ep.read(buf, desc)  # the node's timeout, as no other was given
        proxy.resume()
        await ep.write(buf, desc, nbytes=8, timeout=5)  # the link works again, nothing stuck
        proxy.cut()
        async def read_until_broken() -> None:
            for _ in range(100):
                await ep.read(buf, desc, timeout=5)

        with pytest.raises(tx.BrokenError):
            await read_until_broken()
        assert await asyncio.wait_for(node.disconnected.get(), 5) is ep


async def test_read_whose_reply_stalls_mid_transfer_never_lands_late() -> None:
    """#16 item 2: the owner's reply stops after 32 KiB; the read times out; when the rest
    arrives it is dropped (the buffer is not written after the raise) and the endpoint
    serves the next read."""
    async with tx.Node(transport="tcp") as owner, FaultyProxy(owner.address) as proxy, \
            tx.Node(listen=None, transport="tcp") as node:
        data = np.arange(1 << 20, dtype=np.uint32).view(np.uint8)[: 1 << 20]
        desc = owner.export(data, access="r")
        ep = await node.connect(proxy.address)
        out = np.zeros(1 << 20, np.uint8)
        proxy.stall_after(32 << 10)
        with pytest.raises(tx.TimeoutError):
            await ep.read(tx.MemoryRegion.register(out), desc, timeout=0.5)
        landed = out.copy()
        assert 0 < np.count_nonzero(landed) < 1 << 20  # it really stopped mid-transfer
        proxy.resume()
        check = np.zeros(4096, np.uint8)
        await ep.read(tx.MemoryRegion.register(check), desc, nbytes=4096, timeout=10)
        assert np.array_equal(check, data[:4096])  # usable: the late reply was drained
        assert np.array_equal(out, landed)  # and none of it reached the timed-out buffer
        assert not ep.closed


@pytest.mark.parametrize("transport", transports())
async def test_clean_closes_are_never_warnings(transport: str,
                                               caplog: pytest.LogCaptureFixture) -> None:
    """#16 item 15: 50 clean ``ep.aclose()`` on either side log no WARNING on either side
    (the owner process's log is checked through its stderr-free counter of warnings)."""
    caplog.set_level(logging.INFO, logger="tensorx")
    async with OwnerProcess(transport) as owner, tx.Node(transport=transport) as node:
        desc = await owner.export(4096)
        buf = tx.MemoryRegion.allocate(4096)
        for i in range(50):
            ep = await node.connect(owner.address)
            if i % 2:
                await ep.write(buf, desc)
            await ep.aclose()
        for _ in range(10):  # the owner connects to us and closes: we are the server side
            await owner.connect(node.address)
            await owner.call("close_endpoints")

        async def all_closed() -> bool:
            return not node.endpoints and await owner.call("endpoints") == 0

        await wait_until(all_closed, what="both sides dropping every endpoint")
        assert await owner.call("warnings") == []
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert warnings == []


async def test_connections_that_come_and_go_leak_nothing() -> None:
    async with tx.Node(transport="tcp") as owner, \
            tx.Node(listen=None, transport="tcp") as node:
        desc = owner.export(tx.MemoryRegion.allocate(4096))
        buf = tx.MemoryRegion.allocate(4096)

        async def one_round() -> None:
            ep = await node.connect(owner.address)
            await ep.write(buf, desc)
            await ep.aclose()

        def closed() -> bool:
            return not node.endpoints and not owner.endpoints

        for _ in range(5):
            await one_round()
        await wait_until(closed, what="both sides dropping every endpoint")
        before, tasks_before = open_fds(), len(asyncio.all_tasks())
        for _ in range(50):
            await one_round()

        def settled() -> bool:  # a closed connection's tasks end on a later loop turn
            return closed() and open_fds() <= before and len(asyncio.all_tasks()) <= tasks_before

        with contextlib.suppress(TimeoutError):
            await wait_until(settled, 5)
        assert open_fds() <= before
        assert len(asyncio.all_tasks()) <= tasks_before
        assert node.endpoints == []
        assert owner.endpoints == []


async def test_replayed_handshake_is_refused() -> None:
    token = b"tok"
    async with tx.Node(transport="tcp", token=token) as owner:
        def record_then_replay() -> tuple[Kind, dict[str, object]]:
            nonce = _auth.new_nonce()
            with raw_socket(owner.address) as first:
                first.sendall(_wire.encode(Kind.HELLO, {"id": "me", "nonce": nonce}))
                _, ch = recv_frame(first)
                proof = _auth.make_proof(token, b"client", nonce, ch["nonce"], "me",
                                         ch["id"])  # type: ignore[arg-type]
                auth = _wire.encode(Kind.AUTH, {"proof": proof})
                first.sendall(auth)
                assert recv_frame(first)[0] is Kind.WELCOME
            with raw_socket(owner.address) as second:  # an eavesdropper replays both messages
                second.sendall(_wire.encode(Kind.HELLO, {"id": "me", "nonce": nonce}))
                recv_frame(second)
                second.sendall(auth)
                return recv_frame(second)

        kind, header = await asyncio.to_thread(record_then_replay)
        assert kind is Kind.ERROR
        assert header["code"] == "auth"


@pytest.mark.parametrize("old", [1, 2, 3, 4])
async def test_protocol_version_mismatch_is_explained_to_the_peer(old: int) -> None:
    """A peer of protocol v1 (whose server proved the token first), v2 (whose op frames
    had msgpack headers), v3 (whose handshake ended with CAPS) or v4 (whose op frames were
    shorter) is told why it is refused; this process speaks v5."""
    assert _wire.PROTOCOL_VERSION == 5
    async with tx.Node(transport="tcp") as owner:
        def speak_old() -> tuple[Kind, dict[str, object]]:
            with raw_socket(owner.address) as sock:
                sock.sendall(_wire.PREFIX.pack(b"TX", old, Kind.HELLO, 0, 0))
                prefix = sock.recv(_wire.PREFIX.size, socket.MSG_WAITALL)
                assert _wire.PREFIX.unpack(prefix)[1] == 5  # the refusal is a v5 frame
                kind, hlen, _ = _wire.PREFIX.unpack(prefix)[2], _wire.PREFIX.unpack(prefix)[3], 0
                header = _wire.decode_header(Kind(kind), sock.recv(hlen, socket.MSG_WAITALL))
                return Kind(kind), header

        kind, header = await asyncio.to_thread(speak_old)
        assert kind is Kind.ERROR
        assert header["code"] == "protocol"
        assert f"v{old}" in str(header["msg"]) and "v5" in str(header["msg"])
        async with tx.Node(listen=None, transport="tcp") as node:  # still serving
            await node.connect(owner.address)


async def test_silent_peer_handshake_times_out_and_node_keeps_serving() -> None:
    async with tx.Node(transport="tcp", timeout=0.5) as owner:
        with await asyncio.to_thread(raw_socket, owner.address, 30) as silent:
            refusal = await asyncio.to_thread(recv_refusal, silent)  # dropped at its deadline
        assert refusal["code"] == "timeout", refusal
        async with tx.Node(listen=None, transport="tcp") as node:
            ep = await node.connect(owner.address)
            out = np.zeros(4, np.uint8)
            await ep.read(tx.MemoryRegion.register(out),
                          owner.export(np.arange(4, dtype=np.uint8)))
            assert out.tolist() == [0, 1, 2, 3]


async def test_connect_to_a_silent_listener_times_out_within_one_budget() -> None:
    with socket.socket() as listener:  # accepts (kernel backlog) but never answers
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        port = listener.getsockname()[1]
        async with tx.Node(listen=None, transport="tcp") as node:
            with pytest.raises(tx.TimeoutError) as info:
                await node.connect(f"tcp://127.0.0.1:{port}", timeout=0.5)
            # the handshake had what was left of the one 0.5 s budget, not a budget of its own
            found = re.search(r"timed out after ([0-9.]+) s", str(info.value))
            assert found is not None, info.value
            assert float(found.group(1)) <= 0.5
