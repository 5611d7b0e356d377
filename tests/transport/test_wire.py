"""The frame codec and the auth proofs, without sockets."""

from __future__ import annotations

import struct

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
        Kind.WRITE_ACK: ({"req": 2**64 - 1}, 0),
        Kind.READ_DATA: ({"req": 7}, 9),
        Kind.ERROR: ({"req": 0, "code": "region", "msg": "nope"}, 0),
        Kind.NOTIFY: ({}, 100),
    }
    for kind, (header, plen) in samples.items():
        raw = _wire.encode(kind, header, plen)
        k, hlen, got_plen = _wire.decode_prefix(raw[:_wire.PREFIX.size])
        assert (k, got_plen, hlen) == (kind, plen, len(raw) - _wire.PREFIX.size)
        assert _wire.decode_header(k, raw[_wire.PREFIX.size:], plen) == header


def test_the_op_frames_packers_agree_with_their_layouts() -> None:
    """What the transport sends on every op (packed whole, in one call) is what the
    declared layouts say, notification carried or not."""
    write = {"req": 1, "rid": 2**64 - 1, "ck": 3, "off": 4, "n": 5, "last": False}
    assert _wire.write_frame(1, 2**64 - 1, 3, 4, 5, False) == _wire.encode(Kind.WRITE, write, 5)
    carried = {**write, "last": True, "imm": b"note"}
    assert _wire.write_frame(1, 2**64 - 1, 3, 4, 5, True, b"note") == _wire.encode(
        Kind.WRITE, carried, 5)
    raw = _wire.write_frame(1, 2, 3, 4, 5, True, b"")
    assert _wire.decode_header(Kind.WRITE, raw[_wire.PREFIX.size:], 5)["imm"] == b""
    read = {"req": 1, "rid": 2, "ck": 3, "off": 4, "n": 5}
    assert _wire.read_frame(1, 2, 3, 4, 5) == _wire.encode(Kind.READ, read)
    assert _wire.reply_frame(Kind.READ_DATA, 9, 7) == _wire.encode(Kind.READ_DATA, {"req": 9}, 7)
    assert _wire.reply_frame(Kind.WRITE_ACK, 9) == _wire.encode(Kind.WRITE_ACK, {"req": 9})
    with pytest.raises(ProtocolError, match="last frame"):
        _wire.write_frame(1, 2, 3, 4, 5, False, b"early")


@pytest.mark.parametrize(("header", "match"), [
    ({"req": 1, "rid": 2, "ck": 3, "off": 4, "n": 5}, "last"),
    ({"req": -1, "rid": 2, "ck": 3, "off": 4, "n": 5, "last": True}, "out of range"),
    ({"req": 2**64, "rid": 2, "ck": 3, "off": 4, "n": 5, "last": True}, "out of range"),
    ({"req": True, "rid": 2, "ck": 3, "off": 4, "n": 5, "last": True}, "req"),
    ({"req": 1, "rid": "2", "ck": 3, "off": 4, "n": 5, "last": True}, "rid"),
    ({"req": 1, "rid": 2, "ck": 3, "off": 4, "n": 5, "last": 1}, "last"),
    ({"req": 1, "rid": 2, "ck": 3, "off": 4, "n": 5, "last": True, "imm": 7}, "imm"),
    ({"req": 1, "rid": 2, "ck": 3, "off": 4, "n": 6, "last": True}, "carries"),
])
def test_a_header_that_does_not_fit_its_layout_is_not_sent(header: dict[str, object],
                                                           match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        _wire.encode(Kind.WRITE, header, 5)


# an op frame's prefix and fixed header fill 64 bytes: each fixed header is 48 (zero padded)
OP = _wire.OP_FRAME - _wire.PREFIX.size


def _write_header(flags: int, tail: bytes = b"") -> bytes:
    return struct.pack(f"!QQQQB{OP - 33}x", 1, 2, 3, 4, flags) + tail


@pytest.mark.parametrize(("kind", "raw", "match"), [
    (Kind.WRITE, _write_header(1)[:-1], f"{OP - 1} B, not {OP}"),   # one byte short
    (Kind.WRITE, _write_header(1, b"x"), f"{OP + 1} B, not {OP}"),  # a tail without its flag
    (Kind.WRITE, _write_header(4), "unknown flags 0x04"),            # a flag nobody knows
    (Kind.WRITE, _write_header(0x81), "unknown flags 0x81"),
    (Kind.WRITE, _write_header(2, b"early"), "before its last"),     # a note on a frame before
    (Kind.WRITE_ACK, b"\0" * (OP + 1), f"{OP + 1} B, not {OP}"),
    (Kind.READ_DATA, b"", f"0 B, not {OP}"),
    (Kind.READ, b"\0" * (OP - 1), f"{OP - 1} B, not {OP}"),
    (Kind.READ, b"\0" * (OP + 1), f"{OP + 1} B, not {OP}"),
    (Kind.READ, b"\0" * 40, f"40 B, not {OP}"),                      # protocol v4's READ
])
def test_op_headers_of_the_wrong_form_are_protocol_errors(kind: Kind, raw: bytes,
                                                          match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        _wire.decode_header(kind, raw, 8 if kind is Kind.WRITE else 0)


def test_any_u64_fits_an_op_header() -> None:
    top = 2**64 - 1
    raw = _wire.read_frame(top, top, top, top, top)
    header = _wire.decode_header(Kind.READ, raw[_wire.PREFIX.size:])
    assert header == {"req": top, "rid": top, "ck": top, "off": top, "n": top}


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


def _general(raw: bytes) -> tuple[Kind, object, int]:
    kind, hlen, plen = _wire.decode_prefix(raw)
    return kind, _wire.decode(kind, raw[_wire.PREFIX.size:_wire.PREFIX.size + hlen]), plen


@pytest.mark.parametrize("raw", [
    _wire.write_frame(1, 2, 3, 4, 5, True), _wire.write_frame(2**64 - 1, 2, 3, 4, 0, False),
    _wire.read_frame(1, 2, 3, 4, 5), _wire.reply_frame(Kind.WRITE_ACK, 7),
    _wire.reply_frame(Kind.READ_DATA, 7, 2**40),
    _wire.encode(Kind.NOTIFY, {}, 0), _wire.encode(Kind.NOTIFY, {}, _wire.MAX_NOTIFY),
    _wire.encode(Kind.NOTIFY, {}, 5),
])
def test_the_one_unpack_reading_of_an_op_frame_agrees_with_the_general_one(raw: bytes) -> None:
    kind, row, plen, size = _wire.decode_op(raw + b"payload", 0, len(raw) + 7)  # type: ignore[misc]
    assert (kind, row, plen) == _general(raw)
    assert size == len(raw)
    assert _wire.decode_op(b"x" + raw, 1, len(raw) - 1) is None  # header not all there yet


V = _wire.PROTOCOL_VERSION


def test_a_notify_whose_header_is_not_the_empty_map_is_left_to_the_general_reading() -> None:
    raw = _wire.encode(Kind.NOTIFY, {"x": 1}, 5)
    assert _wire.decode_op(raw, 0, len(raw)) is None
    assert _general(raw)[0] is Kind.NOTIFY


@pytest.mark.parametrize(("raw", "match"), [
    (_wire.write_frame(1, 2, 3, 4, 5, True, b"note"), None),          # a notification
    (_wire.write_frame(1, 2, 3, 4, 5, True, b""), None),
    (struct.pack(f"!2sBBIQQQQQB{OP - 33}x", b"TX", V, Kind.WRITE, OP, 5, 1, 2, 3, 4, 4), "flags"),
    (struct.pack(f"!2sBBIQQQQQB{OP - 33}x", b"TX", V - 1, Kind.WRITE, OP, 5, 1, 2, 3, 4, 1),
     f"v{V - 1}"),
    (struct.pack("!2sBBIQQQQQB", b"TX", V, Kind.WRITE, 33, 5, 1, 2, 3, 4, 1), f"33 B, not {OP}"),
    (struct.pack(f"!2sBBIQQ{OP - 8}x", b"TY", V, Kind.WRITE_ACK, OP, 0, 1), "magic"),
    (struct.pack(f"!2sBBIQQ{OP - 8}x", b"TX", V, Kind.WRITE_ACK, OP, 1, 1), "exceeds"),  # a payload
    (struct.pack(f"!2sBBIQQ{OP - 8}x", b"TX", V, Kind.READ_DATA, OP, 2**40 + 1, 1), "exceeds"),
    (struct.pack("!2sBBIQQQ", b"TX", V, Kind.READ_DATA, 16, 0, 1, 2), f"16 B, not {OP}"),
    (struct.pack("!2sBBIQ", b"TX", V, Kind.NOTIFY, 1, _wire.MAX_NOTIFY + 1) + b"\x80", "exceeds"),
    (struct.pack("!2sBBIQ", b"TX", V - 1, Kind.NOTIFY, 1, 0) + b"\x80", f"v{V - 1}"),
])
def test_an_op_frame_in_any_other_form_is_left_to_the_general_reading(
        raw: bytes, match: str | None) -> None:
    """What the one-unpack reading does not take is decided (and refused) as before."""
    assert _wire.decode_op(raw, 0, len(raw)) is None
    if match is None:
        assert _general(raw)[0] is Kind.WRITE
    else:
        with pytest.raises(ProtocolError, match=match):
            _general(raw)


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
