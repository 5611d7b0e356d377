"""The authenticated handshake on a fresh control connection (both roles).

client -> HELLO{id, nonce}; server -> CHALLENGE{id, nonce}; client -> AUTH{proof};
server checks it and answers WELCOME{proof, caps}; client checks that and sends CAPS{caps}.
The client proves first and the server proves only to a client that did, so a peer that has
proved nothing learns nothing that helps guess the token; capabilities (e.g. a UCX worker
address) only reach a peer that proved it. Each side then opens its lanes from the other's
capabilities and :func:`conclude` ends the handshake: both send READY and wait for the
other's, so a connection either side will not use (its ``require=``, a lane it could not
open) fails on both.

A side that refuses the other, at any step, tells it why before it closes: an ERROR frame
(:meth:`ControlChannel.refuse`), which the other side raises as the error it names.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from tensorx import _auth
from tensorx._deadline import wait_for
from tensorx._text import printable
from tensorx._wire import Kind
from tensorx.errors import AuthError, ProtocolError, TensorxError, TimeoutError
from tensorx.transport.control import ControlChannel

__all__ = ["FailureLog", "Hello", "accept", "conclude", "initiate"]

logger = logging.getLogger(__name__)

PEER_ID = re.compile(r"[A-Za-z0-9_.:-]{1,64}")
T = TypeVar("T")


Caps = dict[str, Any] | Callable[[bytes], dict[str, Any]]
"""Capabilities, or a function of the connection's binding (both nonces, see
:attr:`Hello.binding`) that returns them: for values that must belong to this connection."""


@dataclass(frozen=True)
class Hello:
    """What a handshake established about the peer."""

    peer: str
    """The peer node's id."""
    caps: dict[str, Any]
    """The capabilities it offered (what each of its lane factories offers, by name)."""
    binding: bytes
    """Both nonces: unique to this connection, known to both ends only."""


async def initiate(conn: ControlChannel, node_id: str, token: bytes, caps: Caps,
                   timeout: float | None, why_refused: str = "wrong token?", *,
                   prepare: Callable[[dict[str, Any]], Awaitable[None]] | None = None
                   ) -> Hello:
    """Client side; AuthError on a bad token (``why_refused``: what to tell our caller
    if the peer refuses our proof, see :func:`tensorx._auth.refused`). ``prepare``: awaited
    with the peer's capabilities once it has proved the token, before ours are made (a
    node may start a backend the peer offers, see ``_ucx_later.py``)."""
    async with _refusing(conn):
        return await _within(_initiate(conn, node_id, token, caps, why_refused, prepare),
                             timeout, conn.label)


async def accept(conn: ControlChannel, node_id: str, token: bytes, caps: Caps,
                 timeout: float | None, ours: str = "its token") -> Hello:
    """Server side; AuthError on a bad proof (``ours``: what we prove with, in words, for
    the log line, see :func:`tensorx._auth.credential`)."""
    async with _refusing(conn):
        return await _within(_accept(conn, node_id, token, caps, ours), timeout, conn.label)


async def conclude(conn: ControlChannel, timeout: float | None) -> None:
    """The last step, on both sides, once this side has opened its lanes (a side that
    will not use the connection refuses it instead, :meth:`ControlChannel.refuse`): say
    READY and wait for the peer's. Raises the peer's refusal as the error it names (a
    ``TransportUnavailableError`` for its ``require=``)."""
    async with _refusing(conn):
        await _within(_conclude(conn), timeout, conn.label)


@contextlib.asynccontextmanager
async def _refusing(conn: ControlChannel) -> AsyncIterator[None]:
    """A step of the handshake that fails refuses the peer, telling it why (not when the
    refusal is the peer's own)."""
    try:
        yield
    except TensorxError as exc:
        await conn.refuse(exc)
        raise


async def _within(coro: Awaitable[T], timeout: float | None, label: str) -> T:
    try:
        return await wait_for(coro, timeout)
    except asyncio.TimeoutError:
        raise TimeoutError(f"{label}: handshake timed out after {timeout} s") from None


def _peer_id(value: str, ours: str) -> str:
    """The peer's id, checked: well formed, and not ours. A node never connects to itself,
    and a peer that says our id (any of our descriptors names it) is an impostor: what we
    derive from the peer's id (its same-host probe token) would then be what we hold."""
    if not PEER_ID.fullmatch(value):
        raise ProtocolError(f"malformed peer id {printable(value)}: expected 1-64 letters, "
                            "digits or '_.:-'")
    if value == ours:
        raise ProtocolError(f"the peer says our own node id {value}: refused")
    return value


def _caps(caps: Caps, binding: bytes) -> dict[str, Any]:
    return caps(binding) if callable(caps) else caps


async def _initiate(conn: ControlChannel, node_id: str, token: bytes, caps: Caps,
                    why_refused: str,
                    prepare: Callable[[dict[str, Any]], Awaitable[None]] | None) -> Hello:
    nonce = _auth.new_nonce()
    await conn.send_now(Kind.HELLO, {"id": node_id, "nonce": nonce})
    ch = await conn.recv_frame(Kind.CHALLENGE)
    peer = _peer_id(ch["id"], node_id)
    proof = _auth.make_proof(token, b"client", nonce, ch["nonce"], node_id, peer)
    await conn.send_now(Kind.AUTH, {"proof": proof})
    try:
        welcome = await conn.recv_frame(Kind.WELCOME)
    except AuthError as exc:  # the peer refused our proof: say with what we proved
        raise AuthError(f"{conn.label}: the peer refused our proof: {why_refused}") from exc
    expected = _auth.make_proof(token, b"server", nonce, ch["nonce"], node_id, peer)
    if not _auth.verify_proof(expected, welcome["proof"]):
        raise AuthError(f"{conn.label}: the peer could not prove the shared token "
                        "(different TENSORX_TOKEN / token= on the two sides?)")
    binding = nonce + ch["nonce"]
    if prepare is not None:
        await prepare(welcome["caps"])
    await conn.send_now(Kind.CAPS, {"caps": _caps(caps, binding)})
    return Hello(peer, welcome["caps"], binding)


async def _accept(conn: ControlChannel, node_id: str, token: bytes, caps: Caps,
                  ours: str) -> Hello:
    hello = await conn.recv_frame(Kind.HELLO)
    peer = _peer_id(hello["id"], node_id)
    nonce = _auth.new_nonce()
    await conn.send_now(Kind.CHALLENGE, {"id": node_id, "nonce": nonce})
    auth = await conn.recv_frame(Kind.AUTH)
    expected = _auth.make_proof(token, b"client", hello["nonce"], nonce, peer, node_id)
    if not _auth.verify_proof(expected, auth["proof"]):
        await conn.refuse(AuthError("authentication failed: the proof does not match this "
                                    "node's credentials"))
        raise AuthError(f"{conn.label}: peer {peer} failed authentication: this node proves "
                        f"with {ours}, and the peer's proof does not match (a peer with no "
                        "token proves with its user's per-user secret; give both sides the "
                        "same token)")
    proof = _auth.make_proof(token, b"server", hello["nonce"], nonce, peer, node_id)
    binding = hello["nonce"] + nonce
    await conn.send_now(Kind.WELCOME, {"proof": proof, "caps": _caps(caps, binding)})
    return Hello(peer, (await conn.recv_frame(Kind.CAPS))["caps"], binding)


async def _conclude(conn: ControlChannel) -> None:
    await conn.send_now(Kind.READY, {})
    await conn.recv_frame(Kind.READY)


class FailureLog:
    """Refused handshakes, logged per address without flooding: the first at once, then at
    most one summary line per ``interval`` seconds per address. Bounded: remembers at most
    ``max_addresses`` addresses (the least recent are forgotten)."""

    def __init__(self, interval: float = 60.0, max_addresses: int = 1024) -> None:
        self.interval = interval
        self._max = max_addresses
        # address -> [failures not yet reported, time of the last line]
        self._seen: collections.OrderedDict[str, list[float]] = collections.OrderedDict()

    def failed(self, address: str, why: BaseException) -> None:
        now = time.monotonic()
        entry = self._seen.pop(address, None)
        if entry is None:
            logger.warning("refused connection from %s: %s", address, printable(str(why)))
            entry = [0, now]
        else:
            entry[0] += 1
            if now - entry[1] >= self.interval:
                logger.warning("refused %d more connection(s) from %s in the last %.0f s "
                               "(latest: %s)", entry[0], address, now - entry[1],
                               printable(str(why)))
                entry = [0, now]
        self._seen[address] = entry
        while len(self._seen) > self._max:
            self._seen.popitem(last=False)
