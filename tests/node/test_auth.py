"""Who may connect: the client proves first, a per-user secret guards tokenless loopback,
refusals are logged once per address, and nothing a peer sends can forge a log line."""

from __future__ import annotations

import asyncio
import concurrent.futures.thread  # noqa: F401 (the other user's child cannot import it)
import contextlib
import encodings.idna  # noqa: F401 (likewise)
import io
import logging
import multiprocessing as mp
import os
import shutil
import socket
import stat
import tempfile
import threading
from collections.abc import Iterator
from multiprocessing.connection import Connection as Pipe
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import tensorx as tx
from tensorx import _auth, _wire, cli
from tensorx._text import printable
from tensorx._wire import Kind
from tensorx.testing import OwnerProcess, authenticate, raw_socket, recv_frame, wait_until
from tensorx.transport.handshake import FailureLog

TOKEN = b"a-weak-token"
NOBODY = 65534


def _tx_lines(caplog: pytest.LogCaptureFixture, level: int = logging.DEBUG) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name.startswith("tensorx") and r.levelno >= level]


# -- #16 item 11: the side that has proved nothing learns nothing ---------------------------
async def test_server_proves_nothing_to_a_client_that_proved_nothing() -> None:
    async with tx.Node(transport="tcp", token=TOKEN) as owner:
        def probe() -> tuple[dict[str, Any], Kind, dict[str, Any]]:
            with raw_socket(owner.address) as sock:
                sock.sendall(_wire.encode(Kind.HELLO, {"id": "guesser",
                                                       "nonce": _auth.new_nonce()}))
                _, challenge = recv_frame(sock)
                sock.sendall(_wire.encode(Kind.AUTH, {"proof": b"\0" * 32}))
                kind, reply = recv_frame(sock)
                return challenge, kind, reply

        challenge, kind, reply = await asyncio.to_thread(probe)
        assert set(challenge) == {"id", "nonce"}  # no proof, nothing derived from the token
        assert kind is Kind.ERROR and reply["code"] == "auth"
        assert set(reply) == {"req", "code", "msg"}


def _fake_server(sock: socket.socket, got: list[Any]) -> None:
    """Plays a server that does not know the token: answers with a made-up proof."""
    conn, _ = sock.accept()
    with conn:
        conn.settimeout(10)
        got.append(recv_frame(conn))
        conn.sendall(_wire.encode(Kind.CHALLENGE, {"id": "fake", "nonce": _auth.new_nonce()}))
        got.append(recv_frame(conn))
        conn.sendall(_wire.encode(Kind.WELCOME, {"proof": b"\1" * 32, "caps": {}}))
        try:
            got.append(recv_frame(conn))  # the client's capabilities must not come
        except (ConnectionError, OSError):
            got.append(None)


async def test_client_refuses_a_server_that_cannot_prove_and_tells_it_why_only() -> None:
    """The server hears why (an ERROR frame), never the client's capabilities."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        got: list[Any] = []
        fake = threading.Thread(target=_fake_server, args=(listener, got), daemon=True)
        fake.start()
        port = listener.getsockname()[1]
        async with tx.Node(listen=None, transport="auto", token=TOKEN) as node:
            with pytest.raises(tx.AuthError, match="could not prove"):
                await node.connect(f"tcp://127.0.0.1:{port}")
        await asyncio.to_thread(fake.join, 10)
    assert [g[0] for g in got[:2]] == [Kind.HELLO, Kind.AUTH]
    kind, refusal = got[2]  # no CAPS: a UCX address never reaches an unproven server
    assert kind is Kind.ERROR and refusal["code"] == "auth", got[2]
    assert "could not prove the shared token" in refusal["msg"]


def _mirror(sock: socket.socket, got: list[Any]) -> None:
    """Plays a server that answers with the client's own node id."""
    conn, _ = sock.accept()
    with conn:
        conn.settimeout(10)
        kind, hello = recv_frame(conn)
        got.append(kind)
        conn.sendall(_wire.encode(Kind.CHALLENGE, {"id": hello["id"],
                                                   "nonce": _auth.new_nonce()}))
        try:
            got.append(recv_frame(conn))  # the client's proof must not come
        except (ConnectionError, OSError):
            got.append(None)


async def test_client_refuses_a_server_that_says_its_own_node_id() -> None:
    """Each side refuses a peer that says its own node id (what it would derive from the
    peer's id, it holds itself), telling it why; the server side: tests/transport/test_cma.py."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        got: list[Any] = []
        mirror = threading.Thread(target=_mirror, args=(listener, got), daemon=True)
        mirror.start()
        port = listener.getsockname()[1]
        async with tx.Node(listen=None, token=TOKEN) as node:
            with pytest.raises(tx.ProtocolError, match="our own node id"):
                await node.connect(f"tcp://127.0.0.1:{port}")
        await asyncio.to_thread(mirror.join, 10)
    assert got[0] is Kind.HELLO
    kind, refusal = got[1]  # no AUTH: nothing derived from the token
    assert kind is Kind.ERROR and refusal["code"] == "protocol", got[1]
    assert "our own node id" in refusal["msg"]


async def test_refused_handshakes_are_logged_once_per_address(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="tensorx")
    async with tx.Node(transport="tcp", token=TOKEN) as owner:
        for _ in range(20):
            async with tx.Node(listen=None, transport="tcp", token=b"guess") as node:
                with pytest.raises(tx.AuthError):
                    await node.connect(owner.address)
        refused = [m for m in _tx_lines(caplog, logging.WARNING) if "refused" in m]
        assert len(refused) == 1 and "127.0.0.1" in refused[0]


def test_failure_log_summarises_per_address(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="tensorx")
    log = FailureLog(interval=0.0, max_addresses=2)
    log.failed("10.0.0.1", tx.AuthError("wrong\ntoken"))
    log.failed("10.0.0.1", tx.AuthError("again"))
    for i in range(5):
        log.failed(f"10.0.0.{i + 2}", tx.AuthError("x"))
    lines = _tx_lines(caplog)
    assert "refused connection from 10.0.0.1: wrong\\ntoken" in lines[0]
    assert "refused 1 more connection(s) from 10.0.0.1" in lines[1]
    assert all("\n" not in line for line in lines)
    assert len(log._seen) == 2  # bounded


# -- #16 item 13: peer-supplied strings are escaped before they are logged -------------------
def test_printable_escapes_and_caps() -> None:
    assert printable("a\nb\r\x1b[31m") == "a\\nb\\r\\x1b[31m"
    assert printable("é\u2028") == "\\xe9\\u2028"
    assert printable("x" * 300) == "x" * 200 + "...(100 more)"
    assert printable(printable("a\nb")) == printable("a\nb")


async def test_hello_with_a_newline_in_its_id_forges_no_log_line(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="tensorx")
    forged = "x\nINFO tensorx.ps: ps shard 0: worker rank 0 joined"
    async with tx.Node(transport="tcp", token=TOKEN) as owner:
        def hello() -> tuple[Kind, dict[str, Any]]:
            with raw_socket(owner.address) as sock:
                sock.sendall(_wire.encode(Kind.HELLO, {"id": forged,
                                                       "nonce": _auth.new_nonce()}))
                return recv_frame(sock)

        kind, reply = await asyncio.to_thread(hello)
        assert kind is Kind.ERROR and reply["code"] == "protocol"
        assert "malformed peer id" in reply["msg"]
        await wait_until(lambda: any("malformed peer id" in r.getMessage()
                                     for r in caplog.records), what="the refusal logged")
    lines = _tx_lines(caplog)
    assert any("malformed peer id" in line for line in lines)
    assert all("\n" not in line for line in lines), lines


async def test_error_text_from_a_peer_forges_no_log_line(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="tensorx")
    async with tx.Node(transport="tcp", token=TOKEN) as owner:
        def say_goodbye_rudely() -> None:
            with raw_socket(owner.address) as sock:
                authenticate(sock, TOKEN)
                sock.sendall(_wire.encode(Kind.ERROR, {
                    "req": 0, "code": "broken", "msg": "bye\nWARNING tensorx.ps: forged"}))
                sock.settimeout(10)
                while sock.recv(4096):
                    pass

        await asyncio.to_thread(say_goodbye_rudely)
        await wait_until(lambda: not owner.endpoints, what="the owner dropping the peer")
    lines = _tx_lines(caplog)
    assert any("bye\\nWARNING" in line for line in lines), lines
    assert all("\n" not in line for line in lines), lines


# -- #16 item 12: no token on loopback means this user's secret, not "anyone" ---------------
def test_per_user_secret_default_location_and_permissions(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(_auth.SECRET_DIR_ENV, raising=False)
    monkeypatch.delenv("XDG_CONFIG_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert _auth.secret_path() == tmp_path / "home" / ".config" / "tensorx" / "secret"
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    path = _auth.secret_path()
    assert path == tmp_path / "config" / "tensorx" / "secret"
    secret = _auth.user_secret()
    assert len(secret) >= _auth.SECRET_BYTES and _auth.user_secret() == secret
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    path.chmod(0o644)
    with pytest.raises(tx.AuthError, match="open to other users"):
        _auth.user_secret()
    path.chmod(0o600)
    if os.geteuid() == 0:
        os.chown(path.parent, NOBODY, NOBODY)
        with pytest.raises(tx.AuthError, match="belongs to uid"):
            _auth.user_secret()


async def test_tokenless_nodes_of_one_user_meet_with_no_flags(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TENSORX_TOKEN", raising=False)
    async with OwnerProcess("tcp") as owner, tx.Node(listen=None, transport="tcp") as node:
        desc = await owner.export(64, seed=3)
        out = np.zeros(64, np.uint8)
        await (await node.connect(owner.address)).read(tx.MemoryRegion.register(out), desc)
        assert out.any()
    assert _auth.secret_path().exists()


def _as_nobody(pipe: Pipe, address: str, own_dir: str) -> None:
    """Forked child: become another user of this host and try every way in."""
    results: dict[str, str] = {}
    try:
        secret = _auth.secret_path()
        os.setgid(NOBODY)
        os.setuid(NOBODY)
        try:
            secret.read_bytes()
            results["read"] = "read the other user's secret"
        except PermissionError:
            results["read"] = "refused"
        os.environ[_auth.SECRET_DIR_ENV] = own_dir
        os.environ.pop("TENSORX_TOKEN", None)

        async def attempt(**options: Any) -> str:
            try:
                async with tx.Node(listen=None, transport="tcp", **options) as node:
                    ep = await node.connect(address, timeout=20)
                    await ep.query("exports")
                    return "joined"
            except tx.AuthError:
                return "refused"

        results["own secret"] = asyncio.run(attempt())
        results["no secret"] = asyncio.run(attempt(insecure=True))
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            status = cli.main(["info", "--node", address])
        refused = status != 0 and "the peer refused our proof" in out.getvalue()
        results["info"] = "refused" if refused else f"{status}: {out.getvalue()}"
    except BaseException as exc:  # report, never hang the parent
        results["error"] = repr(exc)
    pipe.send(results)


@pytest.fixture
def nobody_dir() -> Iterator[Path]:
    """A folder the other user owns, where it keeps its own per-user secret."""
    path = Path(tempfile.mkdtemp(prefix="tensorx-nobody-"))
    os.chown(path, NOBODY, NOBODY)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to become another user")
async def test_another_user_cannot_join_a_tokenless_node(
        nobody_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """#16 item 12: another uid joined a tokenless PS and listed its exports; now it is
    refused whichever way it tries, and cannot read this user's secret."""
    monkeypatch.delenv("TENSORX_TOKEN", raising=False)
    own_dir = nobody_dir
    async with tx.Node(transport="tcp") as owner:
        owner.export(np.zeros(64, np.uint8))
        cli.build_parser()  # the child cannot read this user's files: import what it needs
        parent, child = mp.get_context("fork").Pipe()
        proc = mp.get_context("fork").Process(
            target=_as_nobody, args=(child, owner.address, str(own_dir)), daemon=True)
        proc.start()
        ready = await asyncio.to_thread(parent.poll, 90)
        results = parent.recv() if ready else {"error": "no answer"}
        await asyncio.to_thread(proc.join, 10)
        assert owner.endpoints == []
    assert results == {"read": "refused", "own secret": "refused", "no secret": "refused",
                       "info": "refused"}


async def test_a_client_without_a_token_is_told_it_used_the_per_user_secret() -> None:
    """A client given no token proves with its user's per-user secret: refused by a server
    that has a token, it hears that, and where tokens come from (it was told "wrong
    token")."""
    async with tx.Node(transport="tcp", token=TOKEN) as owner, \
            tx.Node(None, transport="tcp") as client:
        with pytest.raises(tx.AuthError) as info:
            await client.connect(owner.address)
    assert str(info.value).endswith(
        f": the peer refused our proof: this node proved with its user's per-user secret "
        f"({_auth.secret_path()}), as no token was given; the peer uses a token, or runs as "
        "another user or on another host: pass the peer's token (token= or $TENSORX_TOKEN; "
        "whoever started the peer chose it), or run both as one user on one host with no "
        "token")
    assert "wrong token" not in str(info.value)


async def test_a_client_with_another_token_is_told_to_give_both_the_same(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="tensorx")
    async with tx.Node(transport="tcp") as owner, \
            tx.Node(None, transport="tcp", token=b"other") as client:
        with pytest.raises(tx.AuthError, match=r"the peer refused our proof: this node proved "
                           r"with the token given to it \(token= or \$TENSORX_TOKEN\), and the "
                           "peer holds another: give both nodes the same token$"):
            await client.connect(owner.address)
        await wait_until(lambda: _tx_lines(caplog, logging.WARNING), what="the server's line")
    line = _tx_lines(caplog, logging.WARNING)[0]
    assert "this node proves with its user's per-user secret" in line, line
