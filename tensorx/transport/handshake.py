"""The authenticated handshake on a fresh control connection (both roles).

client -> HELLO{id, nonce}; server -> CHALLENGE{id, nonce, proof}; client checks the proof
and sends AUTH{proof, caps}; server checks it and answers WELCOME{caps}. Capabilities
(e.g. a UCX worker address) therefore only reach a peer that proved the token.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from tensorx import _auth
from tensorx._wire import Kind
from tensorx.errors import AuthError, ProtocolError, TensorxError, TimeoutError
from tensorx.transport.tcp import Connection

__all__ = ["accept", "initiate"]

logger = logging.getLogger(__name__)


async def initiate(conn: Connection, node_id: str, token: bytes, caps: dict[str, Any],
                   timeout: float | None) -> None:
    """Client side. Sets ``conn.peer`` and ``conn.peer_caps``; AuthError on a bad token."""
    await _within(_initiate(conn, node_id, token, caps), timeout, conn.label)


async def accept(conn: Connection, node_id: str, token: bytes, caps: dict[str, Any],
                 timeout: float | None) -> None:
    """Server side. Sets ``conn.peer`` and ``conn.peer_caps``; AuthError on a bad proof."""
    await _within(_accept(conn, node_id, token, caps), timeout, conn.label)


async def _within(coro: Any, timeout: float | None, label: str) -> None:
    try:
        await asyncio.wait_for(coro, timeout)
    except asyncio.TimeoutError:
        raise TimeoutError(f"{label}: handshake timed out after {timeout} s") from None


async def _initiate(conn: Connection, node_id: str, token: bytes, caps: dict[str, Any]) -> None:
    nonce = _auth.new_nonce()
    await conn.send_now(Kind.HELLO, {"id": node_id, "nonce": nonce})
    ch = await conn.recv_frame(Kind.CHALLENGE)
    expected = _auth.make_proof(token, b"server", nonce, ch["nonce"], node_id, ch["id"])
    if not _auth.verify_proof(expected, ch["proof"]):
        raise AuthError(f"{conn.label}: the peer could not prove the shared token "
                        "(different TENSORX_TOKEN / token= on the two sides?)")
    proof = _auth.make_proof(token, b"client", nonce, ch["nonce"], node_id, ch["id"])
    await conn.send_now(Kind.AUTH, {"proof": proof, "caps": caps})
    welcome = await conn.recv_frame(Kind.WELCOME)
    conn.peer, conn.peer_caps = ch["id"], welcome["caps"]


async def _accept(conn: Connection, node_id: str, token: bytes, caps: dict[str, Any]) -> None:
    try:
        hello = await conn.recv_frame(Kind.HELLO)
    except ProtocolError as exc:  # e.g. another protocol version: tell the peer why
        await _refuse(conn, str(exc), "protocol")
        raise
    nonce = _auth.new_nonce()
    proof = _auth.make_proof(token, b"server", hello["nonce"], nonce, hello["id"], node_id)
    await conn.send_now(Kind.CHALLENGE, {"id": node_id, "nonce": nonce, "proof": proof})
    auth = await conn.recv_frame(Kind.AUTH)
    expected = _auth.make_proof(token, b"client", hello["nonce"], nonce, hello["id"], node_id)
    if not _auth.verify_proof(expected, auth["proof"]):
        await _refuse(conn, "authentication failed: wrong token", "auth")
        raise AuthError(f"{conn.label}: peer {hello['id']} failed authentication")
    await conn.send_now(Kind.WELCOME, {"caps": caps})
    conn.peer, conn.peer_caps = hello["id"], auth["caps"]


async def _refuse(conn: Connection, msg: str, code: str) -> None:
    try:
        await conn.send_now(Kind.ERROR, {"req": 0, "code": code, "msg": msg})
    except TensorxError:
        logger.debug("%s: could not deliver the refusal", conn.label)
