"""Per-endpoint message streams: ``ep.messages`` and ``Node(handler=...)``."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import tensorx as tx
from tensorx._queues import MessageStream


# -- the stream alone ------------------------------------------------------------------------
async def test_a_full_stream_holds_the_producer_back_and_loses_nothing() -> None:
    stream = MessageStream("test", max_count=2, max_bytes=1 << 20)
    await stream.put(b"a")
    await stream.put(b"b")
    third = asyncio.create_task(stream.put(b"c"))
    await asyncio.sleep(0)  # one turn: the put had every chance to finish, and must not
    assert not third.done() and len(stream) == 2
    assert await stream.get() == b"a"
    await asyncio.wait_for(third, 5)
    assert [await stream.get(), await stream.get()] == [b"b", b"c"]


async def test_put_nowait_takes_what_fits_and_refuses_the_rest_untouched() -> None:
    stream = MessageStream("test", max_count=2, max_bytes=1 << 20)
    assert stream.put_nowait(b"a") and stream.put_nowait(b"b")
    assert not stream.put_nowait(b"c")  # full: nothing done, the caller waits instead
    assert len(stream) == 2 and await stream.get() == b"a"
    assert stream.put_nowait(b"c")
    stream.end(None)
    assert stream.put_nowait(b"d")  # after the end: dropped, as put drops it
    assert [await stream.get(), await stream.get()] == [b"b", b"c"]


async def test_bytes_bound_the_stream_too() -> None:
    stream = MessageStream("test", max_count=100, max_bytes=10)
    await stream.put(b"x" * 10)
    blocked = asyncio.create_task(stream.put(b"y"))
    await asyncio.sleep(0)
    assert not blocked.done()
    assert await stream.get() == b"x" * 10
    await asyncio.wait_for(blocked, 5)


async def test_the_end_comes_after_every_message_and_says_why() -> None:
    clean = MessageStream("clean")
    await clean.put(b"last words")
    clean.end(None)
    assert await clean.get() == b"last words"
    with pytest.raises(tx.ClosedError):
        await clean.get()
    broken = MessageStream("broken")
    await broken.put(b"1")
    broken.end(tx.BrokenError("reset by peer"))
    assert [m async for m in broken] == [b"1"]
    assert isinstance(broken.ended_by, tx.BrokenError)
    with pytest.raises(tx.BrokenError, match="reset by peer"):
        await broken.get()


async def test_get_times_out_with_a_tensorx_timeout() -> None:
    with pytest.raises(tx.TimeoutError):
        await MessageStream("idle").get(timeout=0.01)


async def test_ending_releases_a_waiting_producer() -> None:
    stream = MessageStream("test", max_count=1)
    await stream.put(b"a")
    blocked = asyncio.create_task(stream.put(b"b"))
    await asyncio.sleep(0)
    stream.end(None)
    await asyncio.wait_for(blocked, 5)  # dropped: nobody will read it
    assert await stream.get() == b"a"
    with pytest.raises(tx.ClosedError):
        await stream.get()


# -- over real connections -------------------------------------------------------------------
@pytest.mark.parametrize("transport", ["tcp"])
async def test_a_handler_gets_each_peer_in_order_and_its_goodbye_before_its_end(
        transport: str) -> None:
    seen: dict[str, list[bytes]] = {}
    ends: dict[str, BaseException | None] = {}
    done = asyncio.Event()

    async def handler(ep: tx.Endpoint) -> None:
        got = seen.setdefault(ep.peer, [])
        async for payload in ep.messages:
            got.append(payload)
        ends[ep.peer] = ep.messages.ended_by
        if len(ends) == 2:
            done.set()

    async with tx.Node(transport=transport, handler=handler) as server, \
            tx.Node(listen=None, transport=transport) as a, \
            tx.Node(listen=None, transport=transport) as b:
        eps = [await a.connect(server.address), await b.connect(server.address)]
        for i in range(50):
            for ep in eps:
                await ep.notify(b"%d" % i)
        for ep in eps:  # the last message, then the close at once
            await ep.notify(b"bye")
            await ep.aclose()
        await asyncio.wait_for(done.wait(), 10)
        assert server.notifications.empty()  # claimed: none of them went there
    want = [b"%d" % i for i in range(50)] + [b"bye"]
    assert seen == {a.id: want, b.id: want}
    assert ends == {a.id: None, b.id: None}  # clean closes


async def test_a_peer_that_breaks_ends_its_stream_with_a_broken_error() -> None:
    ended: asyncio.Future[BaseException | None] = asyncio.get_running_loop().create_future()

    async def handler(ep: tx.Endpoint) -> None:
        async for _ in ep.messages:
            pass
        ended.set_result(ep.messages.ended_by)

    async with tx.Node(transport="tcp", handler=handler) as server, \
            tx.Node(listen=None, transport="tcp") as client:
        ep = await client.connect(server.address)
        await ep.notify(b"hello")
        ep._channel.sock.close()  # gone without a goodbye, as a killed process would be
        assert isinstance(await asyncio.wait_for(ended, 10), tx.BrokenError)


async def test_a_client_claims_its_endpoint_right_after_connect() -> None:
    async def greet(ep: tx.Endpoint) -> None:
        await ep.notify(b"welcome")  # sent the moment the connection is up
        async for _ in ep.messages:
            pass

    async with tx.Node(transport="tcp", handler=greet) as server, \
            tx.Node(listen=None, transport="tcp") as client:
        ep = await client.connect(server.address)
        assert await ep.messages.get(timeout=10) == b"welcome"
        assert client.notifications.empty()


async def test_a_failing_handler_aborts_its_endpoint_and_the_node_serves_on(
        caplog: pytest.LogCaptureFixture) -> None:
    calls = 0

    async def handler(ep: tx.Endpoint) -> None:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("a bug in the first session")
        await ep.notify(b"served")
        async for _ in ep.messages:
            pass

    async with tx.Node(transport="tcp", handler=handler) as server, \
            tx.Node(listen=None, transport="tcp") as client:
        first = await client.connect(server.address)
        with pytest.raises(tx.TensorxError):
            await first.messages.get(timeout=10)
        second = await client.connect(server.address)
        assert await second.messages.get(timeout=10) == b"served"
    assert "a bug in the first session" in caplog.text


@pytest.mark.parametrize("transport", ["tcp", "auto"])
async def test_writes_with_notifications_into_a_full_stream_keep_their_order_and_data(
        transport: str) -> None:
    """Writes that carry a notification land in the socket's readiness callback; once the
    peer's stream is full, the notification waits (the connection stops reading), and
    everything after it comes after it: each notification arrives after its data, in the
    order sent, none lost, while the stream overflows its bound several times."""
    count = 3 * 256 + 5  # the stream holds 256
    region = tx.MemoryRegion.allocate(count)
    region.view(np.uint8)[:] = 0
    gate = asyncio.Event()
    seen: list[bytes] = []

    async def slow_reader(ep: tx.Endpoint) -> None:
        await gate.wait()
        async for payload in ep.messages:
            if payload.startswith(b"w"):  # its data must be there already
                i = int(payload[1:])
                assert region.view(np.uint8)[i] == i % 251 + 1, f"write {i} not landed"
            seen.append(payload)
            if len(seen) == 2 * count:
                return

    async with tx.Node(transport=transport, handler=slow_reader) as server, \
            tx.Node(listen=None, transport=transport) as client:
        server.export(region, name="cells")
        ep = await client.connect(server.address)
        desc = await ep.lookup("cells")
        one = tx.MemoryRegion.allocate(1)

        async def send() -> None:
            for i in range(count):
                one.view(np.uint8)[0] = i % 251 + 1
                await ep.write(one, desc, remote_offset=i, notify=b"w%d" % i)
                await ep.notify(b"n%d" % i)

        sender = asyncio.create_task(send())
        await asyncio.sleep(0.5)  # the stream fills (over TCP the sender is held back)
        gate.set()
        await asyncio.wait_for(sender, 60)
        for _ in range(600):
            if len(seen) == 2 * count:
                break
            await asyncio.sleep(0.05)
    assert seen == [m for i in range(count) for m in (b"w%d" % i, b"n%d" % i)]
