"""Shared-token authentication: HMAC challenge-response. Pure: no asyncio, no sockets.

Both sides prove they hold the token without sending it: each sends a fresh random nonce
and answers with HMAC-SHA256(token, role | both nonces | both ids). A recorded exchange is
useless later because the nonces are new on every connection.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets

__all__ = ["make_proof", "new_nonce", "resolve_token", "verify_proof"]

NONCE_BYTES = 32


def resolve_token(token: str | bytes | None) -> bytes:
    """The token to use: the argument, else ``$TENSORX_TOKEN``, else empty (no secret)."""
    if token is None:
        token = os.environ.get("TENSORX_TOKEN", "")
    return token.encode() if isinstance(token, str) else bytes(token)


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def make_proof(token: bytes, role: bytes, client_nonce: bytes, server_nonce: bytes,
               client_id: str, server_id: str) -> bytes:
    msg = b"|".join([b"tensorx-v1", role, client_nonce, server_nonce,
                     client_id.encode(), server_id.encode()])
    return hmac.new(token, msg, hashlib.sha256).digest()


def verify_proof(expected: bytes, got: bytes) -> bool:
    return hmac.compare_digest(expected, got)
