"""Node lifecycle and loud transport choice."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import logging

import numpy as np
import pytest

import tensorx as tx
from tensorx.testing import OwnerProcess, pattern, wait_until
from tests.support.lanes import HAVE_UCX, assert_lane, lanes, node_transport
from tests.support.logs import only_warning


async def test_info_and_one_log_line_per_endpoint(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="tensorx.node")
    async with tx.Node(transport="tcp") as a, tx.Node(listen=None, transport="tcp") as b:
        assert a.address.startswith("tcp://127.0.0.1:")
        ep = await b.connect(a.address)

        def logged() -> list[str]:
            return [r.getMessage() for r in caplog.records if "endpoint" in r.getMessage()]

        await wait_until(lambda: len(logged()) >= 2, what="both sides' endpoint lines")
        assert ep.info["transport"] == "tcp" and ep.info["lanes"] and ep.info["why"]
        assert ep.peer == a.id
        lines = logged()
        assert len(lines) == 2 and all("transport=tcp" in line for line in lines)


async def test_require_rdma_fails_instead_of_falling_back(monkeypatch: pytest.MonkeyPatch) -> None:
    async with tx.Node(transport="tcp") as server:
        with pytest.raises(tx.TransportUnavailableError):
            async with tx.Node(listen=None, transport="auto", require="rdma") as node:
                await node.connect(server.address)
        monkeypatch.setenv("TENSORX_REQUIRE", "rdma")
        with pytest.raises(tx.TransportUnavailableError):
            async with tx.Node(listen=None, transport="auto") as node:
                await node.connect(server.address)


@pytest.mark.skipif(not HAVE_UCX, reason="require='ucx' needs ucxx")
@pytest.mark.parametrize("refuser", ["server", "client"])
async def test_a_require_refusal_reaches_the_peer_naming_the_cause(
        refuser: str, caplog: pytest.LogCaptureFixture) -> None:
    """A node refuses an endpoint that would not meet its ``require=`` once the handshake
    is done, and the peer hears why: a connecting peer's ``connect`` raises the server's
    refusal (it used to return an endpoint that then found the connection closed), a
    server logs the client's refusal once and never hands its handler an endpoint."""
    handled: list[tx.Endpoint] = []

    async def handler(ep: tx.Endpoint) -> None:
        handled.append(ep)

    caplog.set_level(logging.WARNING)
    strict, plain = {"require": "ucx"}, {"transport": "tcp"}
    async with tx.Node(handler=handler, **(strict if refuser == "server" else plain)) as a, \
            tx.Node(None, **(plain if refuser == "server" else strict)) as b:  # type: ignore[arg-type]
        with pytest.raises(tx.TransportUnavailableError, match="require='ucx'"):
            await b.connect(a.address)
        await wait_until(lambda: caplog.records, what="the server's log line")
        await asyncio.sleep(0.1)  # nothing else comes
        line = only_warning(caplog)
        assert line.startswith("refused connection from 127.0.0.1") and "require='ucx'" in line
        assert a.endpoints == b.endpoints == handled == []
        assert a.disconnected.empty()


async def test_bad_arguments_are_usage_errors() -> None:
    with pytest.raises(tx.UsageError):
        tx.Node(transport="carrier-pigeon")
    with pytest.raises(tx.UsageError):
        tx.Node(require="magic")
    with pytest.raises(tx.UsageError, match="address"):
        async with tx.Node(listen="http://x") as _:
            pass
    async with tx.Node(listen=None, transport="tcp") as node:
        with pytest.raises(tx.UsageError, match="address"):
            await node.connect("nonsense")
        with pytest.raises(tx.BrokenError):
            await node.connect("tcp://127.0.0.1:1")


async def test_close_is_idempotent_and_later_use_is_closed_error() -> None:
    node = tx.Node(transport="tcp")
    async with node:
        pass
    await node.aclose()
    with pytest.raises(tx.ClosedError):
        node.export(tx.MemoryRegion.allocate(8))
    with pytest.raises(tx.ClosedError):
        await node.connect("tcp://127.0.0.1:1")


async def test_symmetric_endpoints_and_disconnect_events() -> None:
    async with tx.Node(transport="tcp") as a, tx.Node(listen=None, transport="tcp") as b:
        mine = b.export(np.zeros(8, np.uint8))
        ep = await b.connect(a.address)
        await ep.notify(mine.to_bytes())
        back, payload = await asyncio.wait_for(a.notifications.get(), 5)
        await back.write(tx.MemoryRegion.register(np.full(8, 7, np.uint8)), payload)
        out = np.zeros(8, np.uint8)
        await ep.read(tx.MemoryRegion.register(out), a.export(np.full(8, 9, np.uint8)))
        assert (out == 9).all()
        await ep.aclose()
        await ep.aclose()
        assert await asyncio.wait_for(a.disconnected.get(), 5) is back


async def test_non_loopback_listen_needs_a_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TENSORX_TOKEN", raising=False)
    with pytest.raises(tx.UsageError, match="needs a token"):
        await tx.Node("tcp://0.0.0.0:0", transport="tcp").start()
    async with tx.Node("tcp://0.0.0.0:0", transport="tcp", token="t") as node:
        assert node.address.startswith("tcp://0.0.0.0:")
    async with tx.Node("tcp://0.0.0.0:0", transport="tcp", insecure=True):
        pass


async def test_query_exports_and_counters() -> None:
    async with tx.Node(transport="tcp") as a, tx.Node(listen=None, transport="tcp") as b:
        desc = a.export(tx.MemoryRegion.allocate(4096), access="r")
        ep = await b.connect(a.address)
        out = tx.MemoryRegion.allocate(4096)
        for _ in range(3):
            await ep.read(out, desc)
        with pytest.raises(tx.RegionError):
            await ep.write(out, dataclasses.replace(desc, access="rw"))
        answer = await ep.query("exports")
        assert answer["exports"] == [{"region": f"{desc.region_id:#x}", "nbytes": 4096,
                                      "device": "cpu", "access": "r",
                                      "transports": answer["exports"][0]["transports"]}]
        assert "cookie" not in str(answer)
        stats = ep.info["stats"]
        assert stats["read"]["ops"] == 3
        assert stats["read"]["bytes"] == 3 * 4096
        assert stats["write"]["errors"] == 1
        assert sum(stats["read"]["latency_buckets"].values()) == 3
        peers = await ep.query("endpoints")
        assert [e["peer"] for e in peers["endpoints"]] == [b.id]
        with pytest.raises(tx.UsageError, match="unknown query"):
            await ep.query("secrets")


async def test_prometheus_exporter_serves_endpoint_counters() -> None:
    import socket
    import urllib.request

    from tensorx.metrics import serve_prometheus

    async with tx.Node(transport="tcp") as a, tx.Node(listen=None, transport="tcp") as b:
        desc = a.export(tx.MemoryRegion.allocate(64))
        ep = await b.connect(a.address)
        await ep.write(tx.MemoryRegion.allocate(64), desc)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        server = serve_prometheus(port, b)
        try:
            body = await asyncio.to_thread(
                lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5)
                .read().decode())
        finally:
            server.shutdown()
            server.server_close()
        assert f'tensorx_endpoint_ops_total{{node="{b.id}",op="write",peer="{a.id}"' in body
        assert "tensorx_endpoint_latency_seconds_bucket" in body


async def test_closing_regions_after_a_peer_died_unnoticed_revokes_them_at_the_others(
        caplog: pytest.LogCaptureFixture) -> None:
    """A peer is killed and this node has not noticed yet (its loop has not run since):
    closing exported regions still revokes them at every other peer, and logs no error (a
    revocation is best effort; to the dead peer's socket the second one fails with EPIPE)."""
    from tensorx.testing import OwnerProcess

    caplog.set_level(logging.WARNING)
    async with tx.Node(transport="tcp") as node, OwnerProcess("tcp") as dead, \
            OwnerProcess("tcp") as alive:
        regions = [tx.MemoryRegion.register(np.zeros(4096, np.uint8)) for _ in range(3)]
        descs = [node.export(r) for r in regions]
        await dead.connect(node.address)
        ep = await alive.connect(node.address)
        await wait_until(lambda: len(node.endpoints) == 2, what="both peers connected")
        for desc in descs:
            assert (await alive.transfer(ep, "write", desc))["ok"]
        dead.kill()  # blocking: the process is gone before this loop runs again
        for region in regions:
            region.close()
        assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []
        for desc in descs:
            got = await alive.transfer(ep, "write", desc)
            assert not got["ok"] and got["error"] == "RegionError", got



@pytest.mark.parametrize("lane", [lane for lane in lanes() if lane != "tcp"])
async def test_each_revocation_holds_the_memory_until_its_own_acknowledgement(
        lane: str) -> None:
    """Over a lane that reaches the owner's memory without its code (UCX, CMA), a region
    unexported, exported again and then closed is revoked twice; its memory is held until
    the peer has acknowledged both revocations, not only the first (which says nothing of
    the ops the peer issued under the second export)."""
    async with OwnerProcess(node_transport(lane)) as owner, \
            tx.Node(listen=None, transport=node_transport(lane)) as node:
        ep = await node.connect(owner.address)
        assert_lane(ep, lane)
        desc = tx.RegionDescriptor.from_bytes(await owner.call("export_allocated", 4096, 1))
        await ep.write(tx.MemoryRegion.register(pattern(4096, 2)), desc, nbytes=8)
        acks: list[tuple[object, ...]] = []
        send, ep._channel.revoke_ack = ep._channel.revoke_ack, lambda *ack: acks.append(ack)
        await owner.call("export_again", desc.region_id, "rw", True)
        await owner.call("close_region", desc.region_id)
        await wait_until(lambda: len(acks) >= 2, what="both revocations acknowledged")
        send(*acks[0])
        await ep.query("exports")  # the acknowledgement is ahead of the query
        assert await owner.call("held") >= 1, "released on the first acknowledgement"
        send(*acks[1])
        await ep.query("exports")
        assert await owner.call("held") == 0


@pytest.mark.parametrize("op", ["write_many", "reads", "queries"])
async def test_an_op_that_finds_its_peer_dead_leaves_no_unretrieved_error(
        op: str, caplog: pytest.LogCaptureFixture) -> None:
    """The peer is killed and our loop has not noticed: of two frames sent back to back
    (a write of two frames, two reads or queries at once), the first goes out and the
    second finds the socket gone (EPIPE), which fails the channel and every request in
    flight, its own included. The op raises BrokenError, and its request's failed future is
    not left behind for asyncio to log as 'Future exception was never retrieved' (an ERROR
    with a traceback, for an expected peer death)."""
    from tensorx.testing import OwnerProcess

    caplog.set_level(logging.WARNING)
    async with tx.Node(listen=None, transport="tcp") as node, OwnerProcess("tcp") as owner:
        descs = [await owner.export(4096) for _ in range(2)]
        ep = await node.connect(owner.address)
        regions = [tx.MemoryRegion.register(np.zeros(4096, np.uint8)) for _ in descs]
        owner.kill()  # blocking: the process is gone before this loop runs again
        if op == "write_many":
            calls = [ep.write_many(list(zip(regions, descs, strict=True)))]
        elif op == "reads":
            calls = [ep.read(r, d) for r, d in zip(regions, descs, strict=True)]
        else:
            calls = [ep.query("exports") for _ in descs]
        got = await asyncio.gather(*calls, return_exceptions=True)
        assert [type(g) for g in got] == [tx.BrokenError] * len(calls), got
        assert ep.closed and node.endpoints == []
    del ep, node, got  # the channel's error holds the op's frame (its traceback's) till then
    gc.collect()  # a future nobody retrieved is logged as it is collected
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []


async def test_using_a_closed_endpoint_or_starting_a_node_twice_says_what_to_do() -> None:
    async with tx.Node(transport="tcp") as a, tx.Node(None, transport="tcp") as b:
        with pytest.raises(tx.UsageError, match=r"^this node is running already: start\(\) it "
                           r"once \(`async with Node\(...\)` starts it\)"):
            await a.start()
        ep = await b.connect(a.address)
        await ep.aclose()
        with pytest.raises(tx.ClosedError, match=f"^endpoint to {a.id} at {a.address} is "
                           r"closed \(aclose\(\) or abort\(\) was called on it\): connect "
                           "again to go on$"):
            await ep.notify(b"x")
