"""The control channel and its handshake over a socketpair: no processes, no listener.

Both ends are :class:`tensorx.transport.control.ControlChannel` objects in this event loop,
joined by ``socket.socketpair()``; what crosses is the real wire format. The same code runs under
every lane (the data lanes sit beside this channel), so these tests hold for all of them.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from tensorx import _auth, _wire
from tensorx._exports import ExportTable
from tensorx._wire import Kind
from tensorx.errors import AuthError, ProtocolError, TimeoutError
from tensorx.transport import handshake
from tensorx.transport._sock import FrameReader
from tensorx.transport.control import ChannelEvents, ControlChannel
from tensorx.transport.owner import OwnerService

TOKEN = b"a token both sides were given"


@pytest.fixture
async def pair() -> AsyncIterator[tuple[ControlChannel, ControlChannel]]:
    a, b = socket.socketpair()
    for s in (a, b):
        s.setblocking(False)
    client = ControlChannel(a, "client")
    server = ControlChannel(b, "server")
    yield client, server
    for conn in (client, server):
        await conn.aclose()


async def shake(client: ControlChannel, server: ControlChannel, client_token: bytes = TOKEN,
                client_id: str = "client-1", timeout: float = 10.0) -> list[Any]:
    """[client's Hello or error, server's Hello or error]."""
    return await asyncio.gather(
        handshake.initiate(client, client_id, client_token, {"lane": "c"}, timeout),
        handshake.accept(server, "server-1", TOKEN, lambda binding: {"lane": "s",
                                                                     "bound": binding},
                         timeout),
        return_exceptions=True)


def start(channel: ControlChannel, deliver: Callable[[bytes], Awaitable[None]] | None = None,
          ended: asyncio.Future[BaseException | None] | None = None,
          deliver_now: Callable[[bytes], bool] | None = None) -> None:
    """Serve ``channel`` as an endpoint would: its notifications to ``deliver``, its end
    into ``ended``."""

    async def ignore(payload: bytes) -> None:
        return None

    def end(exc: BaseException | None) -> None:
        if ended is not None and not ended.done():
            ended.set_result(exc)

    owner = OwnerService(channel, ExportTable(channel.label), lambda what, name, start: {})
    channel.start(owner, ChannelEvents(deliver or ignore, lambda *_: None, lambda *_: None,
                                       end, deliver_now))


async def test_a_handshake_exchanges_ids_caps_and_one_binding(
        pair: tuple[ControlChannel, ControlChannel]) -> None:
    client, server = pair
    at_client, at_server = await shake(client, server)
    assert (at_client.peer, at_server.peer) == ("server-1", "client-1")
    assert at_server.caps == {"lane": "c"}
    # the server's caps were made for this connection: both nonces, the same on both ends
    assert at_client.caps == {"lane": "s", "bound": at_client.binding}
    assert at_client.binding == at_server.binding and len(at_client.binding) > 16


async def test_a_wrong_token_is_refused_on_both_sides(
        pair: tuple[ControlChannel, ControlChannel]) -> None:
    client, server = pair
    got = await shake(client, server, client_token=b"a guess")
    assert isinstance(got[0], AuthError) and isinstance(got[1], AuthError)  # nothing learned


async def test_the_client_proves_first(pair: tuple[ControlChannel, ControlChannel]) -> None:
    """A client that has proved nothing gets a challenge with nothing in it that helps
    guess the token: no proof, no capabilities; a bad proof gets a refusal, not one."""
    client, server = pair
    accepting = asyncio.ensure_future(handshake.accept(server, "server-1", TOKEN,
                                                       {"secret": "caps"}, 10))
    await client.send_now(Kind.HELLO, {"id": "guesser", "nonce": _auth.new_nonce()})
    challenge = await client.recv_frame(Kind.CHALLENGE)
    assert set(challenge) == {"id", "nonce"}
    await client.send_now(Kind.AUTH, {"proof": b"\0" * 32})
    with pytest.raises(AuthError):  # the refusal: an ERROR frame, never a WELCOME
        await client.recv_frame(Kind.WELCOME)
    with pytest.raises(AuthError):
        await accepting


@pytest.mark.parametrize("peer_id", ["rank 0 joined\nforged", "", "x" * 65, "é"])
async def test_a_malformed_peer_id_is_refused_with_the_reason(
        pair: tuple[ControlChannel, ControlChannel], peer_id: str) -> None:
    client, server = pair
    got = await shake(client, server, client_id=peer_id)
    assert isinstance(got[1], ProtocolError) and "malformed peer id" in str(got[1])
    assert isinstance(got[0], ProtocolError)  # told why, not left waiting
    assert "\n" not in str(got[0]) and "\n" not in str(got[1])  # escaped


async def test_a_silent_peer_times_the_handshake_out(
        pair: tuple[ControlChannel, ControlChannel]) -> None:
    _, server = pair
    with pytest.raises(TimeoutError, match="handshake timed out"):
        await handshake.accept(server, "server-1", TOKEN, {}, 0.2)


async def test_after_the_handshake_notifications_arrive_in_order_and_close_is_clean(
        pair: tuple[ControlChannel, ControlChannel]) -> None:
    client, server = pair
    await shake(client, server)
    got: asyncio.Queue[bytes] = asyncio.Queue()
    closed: asyncio.Future[BaseException | None] = asyncio.get_running_loop().create_future()
    start(client)
    start(server, got.put, closed)
    for n in range(50):
        await client.notify(n.to_bytes(2, "little") * (n + 1), timeout=10)
    for n in range(50):
        assert await asyncio.wait_for(got.get(), 10) == n.to_bytes(2, "little") * (n + 1)
    await client.aclose()  # says BYE: the server sees a clean close, not a failure
    assert await asyncio.wait_for(closed, 10) is None
    assert server.broken is not None


async def test_a_notification_that_is_here_goes_straight_to_a_queue_with_room(
        pair: tuple[ControlChannel, ControlChannel]) -> None:
    """Where the owner's queue has room, a buffered notification is delivered right in the
    readiness callback (``deliver_now``); where it is full, by the waiting ``deliver``; in
    order either way."""
    client, server = pair
    await shake(client, server)
    got: list[bytes] = []
    how: list[str] = []
    room = asyncio.Event()

    def deliver_now(payload: bytes) -> bool:
        if len(got) % 10 == 9 and not room.is_set():  # full now and then
            return False
        got.append(payload)
        how.append("now")
        return True

    async def deliver(payload: bytes) -> None:
        room.set()
        await asyncio.sleep(0)
        got.append(payload)
        how.append("waited")
        room.clear()

    start(client)
    start(server, deliver, deliver_now=deliver_now)
    sent = [n.to_bytes(2, "little") * (n + 1) for n in range(50)]
    for payload in sent:
        await client.notify(payload, timeout=10)
    await client.requests.query("exports", 10)  # answered after every notification before it
    assert got == sent
    assert "now" in how and "waited" in how


async def test_an_aborted_peer_is_a_failure_for_the_other_side(
        pair: tuple[ControlChannel, ControlChannel]) -> None:
    client, server = pair
    await shake(client, server)
    closed: asyncio.Future[BaseException | None] = asyncio.get_running_loop().create_future()
    start(client)
    start(server, ended=closed)
    client.abort()  # no BYE: the socket just ends
    exc = await asyncio.wait_for(closed, 10)
    assert exc is not None  # a broken connection, reported as one


async def test_a_frame_that_fits_the_buffer_is_read_whole_once_the_buffer_is_consumed() -> None:
    """After frames that filled the read buffer's tail were consumed, the next frame is
    read from the front of the buffer: a WRITE the size of most of the buffer comes in one
    read (not only the tail's worth, which left its payload to be served by a task)."""
    a, b = socket.socketpair()
    with a, b:
        b.setblocking(False)
        reader = FrameReader(b, 1024)
        filler = _wire.reply_frame(Kind.WRITE_ACK, 1)
        for _ in range(1000 // len(filler)):  # frames up to near the end of the buffer
            a.sendall(filler)
            reader.feed()
            assert reader.next_frame() is not None
        frame = _wire.write_frame(1, 2, 3, 0, 900, True) + b"x" * 900
        a.sendall(frame)
        reader.feed()
        assert reader.buffered == len(frame)
