"""The same-host CMA lane (process_vm_writev/readv): real owner processes, real sockets.

The conformance suite also runs over it (tests/transport/test_conformance.py, the ``cma`` param:
forged descriptors, peer death, ... as every lane); these are the lane's own cases: odd
ranges through both paths (inline and the pool) carried by the lane itself, owner death
with another owner still served, revocation while ops are in flight, loud fallback.
"""

from __future__ import annotations

import asyncio
import ctypes
import gc
import logging
import os
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import tensorx as tx
from tensorx import _auth, _wire
from tensorx._wire import Kind
from tensorx.testing import (
    FaultyProxy,
    OwnerProcess,
    digest,
    pattern,
    raw_socket,
    recv_frame,
    wait_until,
)
from tensorx.transport import cma
from tests.support.lanes import cma_lane, lanes_of


async def pair(owner: OwnerProcess, node: tx.Node) -> tx.Endpoint:
    ep = await node.connect(owner.address)
    assert ep.info["host"].startswith("cma"), ep.info["host"]
    return ep


RANGES = [  # (local offset, remote offset, nbytes): inline, pool, many pieces, odd everywhere
    (0, 0, 1), (1, 3, 7), (5, 1000, 4093), (3, 77, cma.POOL_ABOVE - 1),
    (7, 5, cma.POOL_ABOVE + 1), (11, 13, 3 << 20), (1, 2, (17 << 20) + 5),
]


async def test_odd_ranges_byte_for_byte_both_ways() -> None:
    size = (18 << 20) + 37
    async with OwnerProcess("auto") as owner, tx.Node(listen=None) as node:
        ep = await pair(owner, node)
        desc = await owner.export(size, seed=1)
        remote = pattern(size, 1)
        src = pattern(size, 2)
        region = tx.MemoryRegion.register(src)
        for off, roff, n in RANGES:
            await ep.write(region, desc, off, roff, n)
            remote[roff:roff + n] = src[off:off + n]
        assert await owner.call("digest", desc.region_id) == digest(remote)
        out = np.zeros(size, np.uint8)
        dst = tx.MemoryRegion.register(out)
        for off, roff, n in RANGES:
            await ep.read(dst, desc, off, roff, n)
            assert np.array_equal(out[off:off + n], remote[roff:roff + n]), (off, roff, n)
        assert await owner.call("guards_intact")
        assert cma_lane(ep).ops == 2 * len(RANGES)


async def test_write_many_of_more_segments_than_one_syscall_takes() -> None:
    """1500 scattered 7-byte writes (more iovecs than one syscall takes) in one call."""
    async with OwnerProcess("auto") as owner, tx.Node(listen=None) as node:
        ep = await pair(owner, node)
        desc = await owner.export(1500 * 11, seed=3)
        remote = pattern(1500 * 11, 3)
        src = pattern(1500 * 7, 4)
        region = tx.MemoryRegion.register(src)
        ops = [(region, desc, i * 7, i * 11 + 1, 7) for i in range(1500)]
        await ep.write_many(ops)
        for i in range(1500):
            remote[i * 11 + 1:i * 11 + 8] = src[i * 7:i * 7 + 7]
        assert await owner.call("digest", desc.region_id) == digest(remote)
        assert await owner.call("guards_intact")


async def test_owner_killed_is_broken_and_the_node_keeps_serving_others() -> None:
    async with OwnerProcess("auto") as doomed, OwnerProcess("auto") as other, \
            tx.Node(listen=None) as node:
        ep, ep2 = await pair(doomed, node), await pair(other, node)
        desc = await doomed.export(16 << 20)
        desc2 = await other.export(16 << 20, seed=5)
        big = tx.MemoryRegion.register(np.zeros(16 << 20, np.uint8))
        started = asyncio.Event()

        async def hammer() -> None:
            while True:
                await ep.read(big, desc, timeout=20)
                started.set()

        task = asyncio.ensure_future(hammer())
        await asyncio.wait_for(started.wait(), 20)
        doomed.kill()
        with pytest.raises(tx.BrokenError):
            await asyncio.wait_for(task, 25)
        with pytest.raises(tx.BrokenError):
            await ep.write(big, desc, nbytes=8)
        out = np.zeros(16 << 20, np.uint8)
        await ep2.read(tx.MemoryRegion.register(out), desc2)
        assert np.array_equal(out, pattern(16 << 20, 5))


@pytest.mark.parametrize("owner_ucx", ["ucx", "tcp-only"])
async def test_a_region_closed_under_an_op_in_flight_is_held_until_acknowledged(
        owner_ucx: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The owner closes (and drops, and replaces) a region while our copy into it is
    stalled in the pool: its memory is held, not reused, until we acknowledge, which we
    do once the copy has finished. Also for an owner without UCX (no lane factory: the
    node pins the region itself)."""
    gate, stalling = threading.Event(), threading.Event()
    real = cma.copy

    def stalled(pid: int, segments: Any, to_remote: bool, stop: Any) -> None:
        if sum(s[2] for s in segments) > cma.POOL_ABOVE:
            stalling.set()
            gate.wait(30)
        real(pid, segments, to_remote, stop)

    monkeypatch.setattr(cma, "copy", stalled)
    env = {"TENSORX_UCX_TCP": "0"} if owner_ucx == "tcp-only" else {}
    async with OwnerProcess("auto", env=env) as owner, tx.Node(listen=None) as node:
        ep = await pair(owner, node)
        if owner_ucx == "tcp-only":
            assert ep.info["transport"] == "tcp"
        n = 8 << 20
        desc = tx.RegionDescriptor.from_bytes(await owner.call("export_allocated", n, 8))
        await ep.write(tx.MemoryRegion.register(pattern(16, 9)), desc)  # addresses known
        write = asyncio.ensure_future(ep.write(tx.MemoryRegion.register(pattern(n, 10)), desc))
        assert await asyncio.to_thread(stalling.wait, 30)  # the copy is in the pool
        fresh = tx.RegionDescriptor.from_bytes(await owner.call("replace", desc.region_id, 11))
        # the revocation reaches us ahead of the answer to a query
        assert f"{desc.region_id:#x}" not in str(await ep.query("exports"))
        assert await owner.call("held") == 1  # we have not acknowledged: still held
        assert not write.done()
        gate.set()
        await write  # landed in the held (old) memory

        async def released() -> bool:
            return await owner.call("held") == 0

        await wait_until(released, what="our acknowledgement reaching the owner")
        assert await owner.call("digest", fresh.region_id) == digest(pattern(n, 11))
        with pytest.raises(tx.RegionError, match="closed"):
            await ep.write(tx.MemoryRegion.register(pattern(16, 9)), desc)


ZEROS = ctypes.create_string_buffer(16)  # 16 known bytes at a known address


def _forge(monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    real = cma.Probe.caps

    def caps(self: cma.Probe) -> dict[str, Any]:
        if how == "token":  # not what the probe buffer holds
            return {**real(self), "token": bytes(16)}
        # memory of known content (here: of this process; a third process of the user's,
        # for an attacker): it matches what is advertised, but is not this connection's
        return {**real(self), "token": bytes(16), "probe": ctypes.addressof(ZEROS)}

    monkeypatch.setattr(cma.Probe, "caps", caps)


@pytest.mark.usefixtures("fresh_fallbacks")
@pytest.mark.parametrize("how", ["token", "known-bytes"])
async def test_a_failed_probe_falls_back_loudly(how: str, monkeypatch: pytest.MonkeyPatch,
                                                caplog: pytest.LogCaptureFixture) -> None:
    """One WARNING per process saying why and how to change it (the other side, in this
    same process, says it at INFO); ``ep.info`` says it every time."""
    _forge(monkeypatch, how)
    caplog.set_level(logging.INFO, "tensorx")
    async with tx.Node() as server, tx.Node(listen=None) as client:
        ep = await client.connect(server.address)
        assert ep.info["host"].startswith("none (the peer's probe"), ep.info["host"]
        assert not any(isinstance(lane, cma.CmaLane) for lane in lanes_of(ep))
        region = tx.MemoryRegion.register(np.zeros(64, np.uint8))
        desc = server.export(region)
        await ep.write(tx.MemoryRegion.register(pattern(64, 1)), desc)  # the inner lane
        assert np.array_equal(region.view(np.uint8), pattern(64, 1))
    said = [r for r in caplog.records if "no same-host lane" in r.getMessage()]
    assert [r.levelno for r in said] == [logging.WARNING, logging.INFO]  # once per process
    assert "the peer's probe" in said[0].getMessage()
    assert "TENSORX_SAME_HOST=0" in said[0].getMessage()


async def test_explicit_transports_never_get_the_same_host_lane(
        monkeypatch: pytest.MonkeyPatch) -> None:
    async with tx.Node(transport="tcp") as server, \
            tx.Node(listen=None, transport="tcp") as client:
        ep = await client.connect(server.address)
        assert ep.info["transport"] == "tcp"
        assert ep.info["host"].startswith("off"), ep.info["host"]
    async with tx.Node() as server, tx.Node(listen=None, transport="tcp") as client:
        ep = await client.connect(server.address)  # only one side offers it
        assert not ep.info["host"].startswith("cma")
    with pytest.raises(tx.UsageError):
        tx.Node(transport="tcp", same_host=True)
    monkeypatch.setenv("TENSORX_SAME_HOST", "0")
    async with tx.Node() as server, tx.Node(listen=None) as client:
        ep = await client.connect(server.address)
        assert ep.info["host"].startswith("off")


async def test_same_process_peers_use_it_too() -> None:
    async with tx.Node() as server, tx.Node(listen=None, same_host=True) as client:
        ep = await client.connect(server.address)
        assert ep.info["host"].startswith("cma")
        region = tx.MemoryRegion.register(np.zeros(1 << 20, np.uint8))
        desc = server.export(region)
        await ep.write(tx.MemoryRegion.register(pattern(1 << 20, 2)), desc)
        assert np.array_equal(region.view(np.uint8), pattern(1 << 20, 2))
        assert cma_lane(ep).ops == 1


async def test_a_ps_rounds_2_mb_copies_on_the_loop_without_a_thread_hop(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A write of a few MB (the many-small model's 2 MB arena, twice a round) is copied
    by the event loop's own thread: a trip through the pool costs more than the copy on a
    busy host (at 256 KiB the same-host lane lost such a round to TCP)."""
    threads: list[threading.Thread] = []
    real, n = cma.copy, 2 << 20

    def watched(pid: int, segments: Any, to_remote: bool, stop: Any) -> None:
        if sum(s[2] for s in segments) == n:  # (not the probes' reads at connect)
            threads.append(threading.current_thread())
        real(pid, segments, to_remote, stop)

    monkeypatch.setattr(cma, "copy", watched)
    async with tx.Node() as server, tx.Node(listen=None, same_host=True) as client:
        ep = await client.connect(server.address)
        region = tx.MemoryRegion.register(np.zeros(n, np.uint8))
        desc = server.export(region)
        src = tx.MemoryRegion.register(pattern(n, 3))
        for _ in range(2):  # the first asks the owner for the address
            await ep.write_many([(src, desc, 0, 0, n)], notify=b"done")
        assert np.array_equal(region.view(np.uint8), pattern(n, 3))
        assert (await server.notifications.get())[1] == b"done"
    assert threads == [threading.current_thread()] * 2


def _placed(pid: int) -> str:
    """The kernel's answer for a peer it places in ``pid`` (for checks without a link)."""
    return ""


@pytest.mark.parametrize("churn", [0, 20_000])
def test_a_probe_is_still_read_back_after_its_connection_ended(churn: int) -> None:
    """A peer may still be checking our probe when we close the connection right after
    connecting: it must read the token back, not freed memory (which gave a WARNING about
    pid namespaces and no same-host lane)."""
    factory = cma.CmaFactory("node-a", enabled=True)
    binding = bytes(range(32))
    offer = factory.offer(binding)
    factory.forget(binding)
    del binding
    gc.collect()
    reused = [ctypes.create_string_buffer(b"\xff" * 16, 16) for _ in range(churn)]
    pid, why, loud = cma.check(True, offer, cma.token(bytes(range(32)), "node-a"), _placed)
    assert (pid, why, loud) == (os.getpid(), "", False), why
    assert len(reused) == churn


def test_a_peer_that_exited_is_no_reason_for_a_warning() -> None:
    """A probe of a process that has exited: no lane, said quietly (not a permission
    problem to warn about)."""
    import subprocess
    import sys

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    offer = {**cma.Probe(b"b" * 32, "node-b").caps(), "pid": gone.pid}
    pid, why, loud = cma.check(True, offer, offer["token"], _placed)
    assert pid is None and not loud and "exited" in why


# -- whom the lane trusts: the kernel, never what a peer says -------------------------------
TOKEN = "same-host-trust"
QUERY = {"req": 1, "what": "endpoints"}


def _own_offer(welcome: dict[str, Any]) -> dict[str, Any]:
    """An impostor's capabilities: the server's own cma offer (its pid, its probe)."""
    return {"transport": "auto", "cma": welcome["caps"]["cma"]}


def _tcp_only(welcome: dict[str, Any]) -> dict[str, Any]:
    return {"transport": "tcp"}


def _impostor(address: str, node_id: str, caps: Callable[[dict[str, Any]], dict[str, Any]],
              kind: Kind, request: dict[str, Any]) -> tuple[Kind, dict[str, Any]]:
    """A token holder on a raw socket: HELLO as ``node_id``, offer ``caps(welcome)``, send
    one request (req 1) and return its answer; or the server's refusal (an ERROR frame)
    at whatever step it came."""
    with raw_socket(address, timeout=20) as sock:
        nonce = _auth.new_nonce()
        sock.sendall(_wire.encode(Kind.HELLO, {"id": node_id, "nonce": nonce}))
        got, challenge = recv_frame(sock)
        if got is Kind.ERROR:
            return got, challenge
        proof = _auth.make_proof(TOKEN.encode(), b"client", nonce, challenge["nonce"], node_id,
                                 challenge["id"])
        sock.sendall(_wire.encode(Kind.AUTH, {"proof": proof}))
        got, welcome = recv_frame(sock)
        if got is Kind.ERROR:
            return got, welcome
        sock.sendall(_wire.encode(Kind.CAPS, {"caps": caps(welcome)})
                     + _wire.encode(Kind.READY, {}) + _wire.encode(kind, request))
        while True:
            got, answer = recv_frame(sock)
            if isinstance(answer, dict) and answer.get("req") in (0, 1):
                sock.sendall(_wire.encode(Kind.BYE, {}))
                return got, answer


def _hosts(answer: dict[str, Any]) -> dict[str, str]:
    """How each of the server's endpoints moves host memory, by peer (a QUERY's answer)."""
    return {e["peer"]: e["host"] for e in answer["data"]["endpoints"]}


async def _still_serves(server: OwnerProcess, desc: tx.RegionDescriptor) -> None:
    """An honest peer of this host still gets the same-host lane and the right bytes; the
    server logged at most one line, escaped, about whatever came before."""
    async with tx.Node(listen=None, token=TOKEN) as node:
        ep = await node.connect(server.address)
        assert ep.info["host"].startswith("cma"), ep.info["host"]
        out = np.zeros(desc.nbytes, np.uint8)
        await ep.read(tx.MemoryRegion.register(out), desc)
        assert np.array_equal(out, pattern(desc.nbytes, 1))
        assert cma_lane(ep).ops == 1
    warned = await server.call("warnings")
    assert len(warned) <= 1 and all(line.isprintable() for line in warned), warned


async def test_a_peer_claiming_our_node_id_is_refused() -> None:
    """A token holder that says HELLO with the server's own node id (any descriptor names
    it) and offers the server's own pid and probe: the server opened the same-host lane to
    itself (its writes to that peer then went into its own heap at addresses the peer
    chose). Refused at the handshake; the server goes on serving."""
    async with OwnerProcess("auto", token=TOKEN) as server:
        desc = await server.export(64, seed=1)
        kind, got = await asyncio.to_thread(_impostor, server.address, desc.owner,
                                            _own_offer, Kind.QUERY, QUERY)
        assert kind is Kind.ERROR, f"not refused; the server's endpoints: {_hosts(got)}"
        assert got["code"] == "protocol" and "our own node id" in got["msg"], got
        await _still_serves(server, desc)


async def test_a_peer_offering_our_own_pid_and_probe_gets_no_lane() -> None:
    """Under an id of its own, a peer that offers the server's own pid and probe (as told
    in the handshake) gets no same-host lane: the kernel says another process holds its
    end of the connection."""
    async with OwnerProcess("auto", token=TOKEN) as server:
        desc = await server.export(64, seed=1)
        kind, got = await asyncio.to_thread(_impostor, server.address, "impostor", _own_offer,
                                            Kind.QUERY, QUERY)
        assert kind is Kind.ANSWER, (kind, got)
        assert _hosts(got)["impostor"].startswith("none (the peer says it is process "
                                                  f"{server.pid}, the kernel says"), _hosts(got)
        await _still_serves(server, desc)


@pytest.mark.parametrize("offer", [_tcp_only, _own_offer], ids=["tcp-only", "own-offer"])
async def test_a_peer_the_kernel_does_not_place_here_learns_no_address(
        offer: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
    """A descriptor check that asks for the region's address (what the same-host lane
    asks) is answered without one to a peer whose lane could not use it: an address is
    what an attacker needs to aim a write."""
    async with OwnerProcess("auto", token=TOKEN) as server:
        desc = await server.export(64, seed=1)
        ask = {"req": 1, "rid": desc.region_id, "ck": desc.cookie, "addr": True}
        kind, got = await asyncio.to_thread(_impostor, server.address, "impostor", offer,
                                            Kind.VALIDATE, ask)
        assert kind is Kind.VALID and got["n"] == 64, (kind, got)
        assert got.get("addr") is None, got
        await _still_serves(server, desc)


async def test_a_relayed_connection_gets_no_same_host_lane() -> None:
    """Two same-host nodes whose connection runs through a third process (a TCP relay,
    which could rewrite what they say, addresses included) get no same-host lane: each
    offers its probe, and each probe reads back, but the kernel says the relay holds the
    other end. A direct peer still gets it."""
    async with OwnerProcess("auto", token=TOKEN) as server, \
            OwnerProcess("auto", token=TOKEN) as client, \
            FaultyProxy(server.address) as relay:
        desc = await server.export(64, seed=1)
        await client.connect(relay.address)
        result = await client.transfer(0, "read", desc)
        assert result["ok"] and result["digest"] == digest(pattern(64, 1)), result
        async with tx.Node(listen=None, token=TOKEN) as node:
            ep = await node.connect(server.address)
            infos = (await ep.query("endpoints"))["endpoints"]
            hosts = {e["peer"] == node.id: e["host"] for e in infos}
            assert hosts[True].startswith("cma"), hosts
            assert hosts[False].startswith("none (the peer says it is process "
                                           f"{client.pid}, the kernel says"), hosts
