"""Shared-token authentication: HMAC challenge-response. Pure: no asyncio, no sockets.

Both sides prove they hold the token without sending it: each sends a fresh random nonce
and answers with HMAC-SHA256(key, role | both nonces | both ids), where the key is stretched
from the token (PBKDF2), so an offline guess costs as much as a login. The client proves
first; the server proves only to a client that did, so a peer that proved nothing learns
nothing about the token. A recorded exchange is useless later: the nonces are new each time.

With no token given, both sides use the **per-user secret**: random bytes in a file only
this user can read (created on first use), so processes of one user on one host meet with no
configuration while other users of the host are refused.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import os
import secrets
import stat
from pathlib import Path

from tensorx.errors import AuthError

__all__ = ["credential", "make_proof", "new_nonce", "refused", "resolve_token", "secret_path",
           "user_secret", "verify_proof"]

NONCE_BYTES = 32
SECRET_DIR_ENV = "TENSORX_SECRET_DIR"
SECRET_FILE = "secret"
SECRET_BYTES = 32
KDF_ITERATIONS = 50_000


def resolve_token(token: str | bytes | None) -> bytes:
    """The token given: the argument, else ``$TENSORX_TOKEN``, else empty (none given)."""
    if token is None:
        token = os.environ.get("TENSORX_TOKEN", "")
    return token.encode() if isinstance(token, str) else bytes(token)


def credential(given: bytes, insecure: bool) -> str:
    """What a node proves with, in words (after "proves with"): the token given, none, or
    the per-user secret."""
    if given:
        return "the token given to it (token= or $TENSORX_TOKEN)"
    if insecure:
        return "no token (insecure=True)"
    return f"its user's per-user secret ({secret_path()}), as no token was given"


def refused(what: str, given: bytes) -> str:
    """Why a peer may have refused a node that proved with ``what`` (:func:`credential`
    of ``given``), and what to do."""
    if given:
        return (f"this node proved with {what}, and the peer holds another: give both "
                "nodes the same token")
    return (f"this node proved with {what}; the peer uses a token, or runs as another user "
            "or on another host: pass the peer's token (token= or $TENSORX_TOKEN; whoever "
            "started the peer chose it), or run both as one user on one host with no token")


def secret_path() -> Path:
    """Where the per-user secret lives: ``$TENSORX_SECRET_DIR/secret``, else
    ``$XDG_CONFIG_HOME/tensorx/secret``, else ``~/.config/tensorx/secret``."""
    override = os.environ.get(SECRET_DIR_ENV)
    if override:
        return Path(override) / SECRET_FILE
    config = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(config) / "tensorx" / SECRET_FILE


def user_secret(path: Path | None = None) -> bytes:
    """This user's secret, created on first use (folder 0700, file 0600, written atomically).
    AuthError if the folder or file belongs to another user or others may read it."""
    path = secret_path() if path is None else path
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        raise AuthError(f"cannot create the per-user secret folder {path.parent}: {exc}; "
                        f"set {SECRET_DIR_ENV} or pass a token") from exc
    _check_private(path.parent, os.lstat(path.parent), "folder")
    if not path.exists():
        _create(path)
    return _read(path)


def _check_private(path: Path, st: os.stat_result, what: str) -> None:
    kind_ok = stat.S_ISDIR(st.st_mode) if what == "folder" else stat.S_ISREG(st.st_mode)
    if not kind_ok:
        raise AuthError(f"per-user secret {what} {path} is not a plain {what}")
    if st.st_uid != os.geteuid():
        raise AuthError(f"per-user secret {what} {path} belongs to uid {st.st_uid}, not to "
                        f"this user (uid {os.geteuid()}); refusing to use it")
    if st.st_mode & 0o077:
        want = "0700" if what == "folder" else "0600"
        raise AuthError(f"per-user secret {what} {path} is open to other users (mode "
                        f"{stat.S_IMODE(st.st_mode):04o}); make it {want}")


def _create(path: Path) -> None:
    """Write a fresh secret to a private temporary file, then link it into place: a
    concurrent first use by another process of this user keeps whichever came first."""
    tmp = path.with_name(f".{SECRET_FILE}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, secrets.token_hex(SECRET_BYTES).encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.link(tmp, path)
    except FileExistsError:
        pass
    finally:
        os.unlink(tmp)


def _read(path: Path) -> bytes:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as exc:
        raise AuthError(f"cannot read the per-user secret {path}: {exc}") from exc
    try:
        _check_private(path, os.fstat(fd), "file")
        data = os.read(fd, 4 * SECRET_BYTES + 1).strip()
    finally:
        os.close(fd)
    if len(data) < SECRET_BYTES:
        raise AuthError(f"per-user secret {path} is too short; delete it to make a new one")
    return data


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


@functools.lru_cache(maxsize=16)
def _key(token: bytes) -> bytes:
    """The HMAC key: the token stretched once per process (offline guesses cost as much)."""
    return hashlib.pbkdf2_hmac("sha256", token, b"tensorx-v2", KDF_ITERATIONS)


def make_proof(token: bytes, role: bytes, client_nonce: bytes, server_nonce: bytes,
               client_id: str, server_id: str) -> bytes:
    msg = b"|".join([b"tensorx-v2", role, client_nonce, server_nonce,
                     client_id.encode(), server_id.encode()])
    return hmac.new(_key(token), msg, hashlib.sha256).digest()


def verify_proof(expected: bytes, got: bytes) -> bool:
    return hmac.compare_digest(expected, got)
