"""The frame codec and the auth proofs, without sockets."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tensorx import _auth, _wire
from tensorx._wire import Kind
from tensorx.errors import ProtocolError


def test_roundtrip_every_kind_with_valid_header() -> None:
    samples = {
        Kind.WRITE: ({"req": 1, "rid": 2, "ck": 3, "off": 4, "n": 5, "last": True}, 5),
        Kind.READ: ({"req": 1, "rid": 2, "ck": 3, "off": 4, "n": 5}, 0),
        Kind.ERROR: ({"req": 0, "code": "region", "msg": "nope"}, 0),
        Kind.NOTIFY: ({}, 100),
    }
    for kind, (header, plen) in samples.items():
        raw = _wire.encode(kind, header, plen)
        k, hlen, got_plen = _wire.decode_prefix(raw[:_wire.PREFIX.size])
        assert (k, got_plen) == (kind, plen)
        assert _wire.decode_header(k, raw[_wire.PREFIX.size:], plen) == header


@pytest.mark.parametrize(("header", "match"), [
    ({"req": 1, "rid": 2, "ck": 3, "off": 4, "n": 5}, "last"),
    ({"req": -1, "rid": 2, "ck": 3, "off": 4, "n": 5, "last": True}, "out of range"),
    ({"req": True, "rid": 2, "ck": 3, "off": 4, "n": 5, "last": True}, "req"),
    ({"req": 1, "rid": "2", "ck": 3, "off": 4, "n": 5, "last": True}, "rid"),
])
def test_schema_violations_are_protocol_errors(header: dict[str, object], match: str) -> None:
    raw = _wire.encode(Kind.WRITE, header, 5)
    with pytest.raises(ProtocolError, match=match):
        _wire.decode_header(Kind.WRITE, raw[_wire.PREFIX.size:], 5)


def test_write_payload_must_match_its_header() -> None:
    header = {"req": 1, "rid": 2, "ck": 3, "off": 0, "n": 10, "last": True}
    raw = _wire.encode(Kind.WRITE, header, 10)
    with pytest.raises(ProtocolError, match="carries"):
        _wire.decode_header(Kind.WRITE, raw[_wire.PREFIX.size:], 11)


def test_limits_and_versions() -> None:
    v = _wire.PROTOCOL_VERSION
    for other in (v - 1, v + 1):
        with pytest.raises(ProtocolError, match=f"v{other}"):
            _wire.decode_prefix(_wire.PREFIX.pack(b"TX", other, Kind.WRITE, 0, 0))
    with pytest.raises(ProtocolError, match="exceeds"):
        _wire.decode_prefix(_wire.PREFIX.pack(b"TX", v, Kind.NOTIFY, 0, _wire.MAX_NOTIFY + 1))
    with pytest.raises(ProtocolError, match="exceeds"):
        _wire.decode_prefix(_wire.PREFIX.pack(b"TX", v, Kind.READ, 0, 1))
    with pytest.raises(ProtocolError, match="exceeds"):
        _wire.encode(Kind.NOTIFY, {"x": b"y" * (_wire.MAX_HEADER + 1)})


@given(st.binary(min_size=_wire.PREFIX.size, max_size=_wire.PREFIX.size), st.binary(max_size=512))
def test_decoding_garbage_raises_only_protocol_error(prefix: bytes, body: bytes) -> None:
    try:
        kind, _, plen = _wire.decode_prefix(prefix)
        _wire.decode_header(kind, body, plen)
    except ProtocolError:
        pass


def test_proofs_bind_token_role_and_nonces() -> None:
    a, b = _auth.new_nonce(), _auth.new_nonce()
    p = _auth.make_proof(b"t", b"client", a, b, "x", "y")
    assert _auth.verify_proof(p, _auth.make_proof(b"t", b"client", a, b, "x", "y"))
    for other in (_auth.make_proof(b"u", b"client", a, b, "x", "y"),
                  _auth.make_proof(b"t", b"server", a, b, "x", "y"),
                  _auth.make_proof(b"t", b"client", b, a, "x", "y")):
        assert not _auth.verify_proof(p, other)


def test_token_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TENSORX_TOKEN", "envtoken")
    assert _auth.resolve_token(None) == b"envtoken"
    assert _auth.resolve_token("arg") == b"arg"
