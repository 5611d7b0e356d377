"""Frame encoding for the tensorx control protocol. Pure: no asyncio, no sockets.

A frame is a 16-byte prefix, a header and an optional raw payload that the transport moves
straight between socket and region memory::

    prefix  = magic b"TX" | version u8 | kind u8 | header_len u32 | payload_len u64   (big endian)

The frames of every one-sided op (WRITE, WRITE_ACK, READ, READ_DATA) have a fixed binary
header (a :class:`tensorx._schema.Packed`: u64 fields, a flags byte; a WRITE's size is its
payload's), packed and checked with one ``struct`` call each; every other kind's header is a
msgpack map with short string keys, checked against its :class:`tensorx._schema.Record`.
Nothing acts on a header before it passed.
"""

from __future__ import annotations

import enum
import struct
from typing import Any

import msgpack

from tensorx._schema import Field, Packed, Record, blob, choice, table, text, uint
from tensorx.errors import ProtocolError

__all__ = [
    "MAX_HEADER",
    "MAX_NOTIFY",
    "MAX_PAYLOAD",
    "PREFIX",
    "PROTOCOL_VERSION",
    "Kind",
    "decode",
    "decode_header",
    "decode_op",
    "decode_prefix",
    "encode",
    "page",
    "read_frame",
    "reply_frame",
    "write_frame",
]

MAGIC = b"TX"
# 2: the client proves the token first (v1 servers proved first); 3: the op frames' headers
# are fixed binary layouts (they were msgpack maps); 4: the handshake ends with READY from
# each side once its lanes are open (or the ERROR that refuses the peer), and a revocation
# names the export (its cookie); 5: an op frame's prefix and fixed header take 64 bytes
PROTOCOL_VERSION = 5
PREFIX = struct.Struct("!2sBBIQ")
# An op frame's prefix and fixed header fill one cache line, so that the payload behind them
# starts aligned in the socket's buffers and in the reader's (with 24-byte frames, copying a
# 64 KiB READ_DATA into the socket took a third more of the owner's CPU).
OP_FRAME = 64
MAX_HEADER = 64 * 1024
MAX_NOTIFY = 16 * 1024 * 1024
MAX_PAYLOAD = 1 << 40


class Kind(enum.IntEnum):
    HELLO = 1       # client -> server: who I am, my nonce
    CHALLENGE = 2   # server -> client: who I am, my nonce (no proof: the client proves first)
    AUTH = 3        # client -> server: my proof
    WELCOME = 4     # server -> client: your proof is good; my proof, my capabilities
    CAPS = 5        # client -> server: your proof is good; my capabilities
    WRITE = 10      # payload = data to land in the owner's region
    WRITE_ACK = 11
    READ = 12
    READ_DATA = 13  # payload = data read from the owner's region
    NOTIFY = 14     # payload = user bytes
    ERROR = 15
    VALIDATE = 16   # is this descriptor valid? (lanes that bypass the owner, e.g. UCX)
    VALID = 17
    BYE = 18
    QUERY = 19      # what do you export / who is connected? (authenticated peers only)
    ANSWER = 20
    REVOKE = 21     # owner -> peers: this export of a region is closed or unexported; drop it
    REVOKE_ACK = 22  # peer -> owner: none of my ops on that export is in flight any more
    READY = 23      # both ways, last in the handshake: my lanes are open, I go on


def _header(kind: Kind, **fields: Field) -> Record:
    return Record(f"{kind.name} header", fields)


# (an id's format, 1-64 of a few characters, is the handshake's to check and explain)
_ID, _NONCE, _CAPS, _CODE = text(256), blob(64), table(64), text(64)
_U = uint(64)
# One record per kind; the ints are request ids, region ids, cookies, offsets and sizes.
SCHEMAS: dict[Kind, Record] = {k: _header(k, **f) for k, f in {
    Kind.HELLO: {"id": _ID, "nonce": _NONCE},
    Kind.CHALLENGE: {"id": _ID, "nonce": _NONCE},
    Kind.AUTH: {"proof": _NONCE},
    Kind.WELCOME: {"proof": _NONCE, "caps": _CAPS},
    Kind.CAPS: {"caps": _CAPS},
    Kind.READY: {},
    Kind.NOTIFY: {},
    Kind.ERROR: {"req": _U, "code": _CODE, "msg": text(MAX_HEADER)},
    Kind.VALIDATE: {"req": _U, "rid": _U, "ck": _U},
    Kind.VALID: {"req": _U, "n": _U, "access": choice("r", "w", "rw")},
    Kind.BYE: {},
    Kind.QUERY: {"req": _U, "what": _CODE, "name": text(64) | None,  # name: a lookup's
                  "from": _U | None},  # from: the first item of the page asked for
    Kind.ANSWER: {"req": _U, "data": table(64)},
    Kind.REVOKE: {"rid": _U, "ck": _U},
    Kind.REVOKE_ACK: {"rid": _U, "ck": _U},
}.items()}
# The op frames: fixed layouts. A WRITE's "n" is its payload's length (not on the wire);
# "last": the write's last frame; "imm": a notification it carries (on the last frame only).
_OP = OP_FRAME - PREFIX.size
PACKED: dict[Kind, Packed] = {
    Kind.WRITE: Packed("WRITE header", ("req", "rid", "ck", "off"), ("last", "imm"), "imm",
                       size=_OP),
    Kind.WRITE_ACK: Packed("WRITE_ACK header", ("req",), size=_OP),
    Kind.READ: Packed("READ header", ("req", "rid", "ck", "off", "n"), size=_OP),
    Kind.READ_DATA: Packed("READ_DATA header", ("req",), size=_OP),
}
_LAST, _IMM = 1, 2  # WRITE's flag bits
_WRITE = struct.Struct(PREFIX.format + PACKED[Kind.WRITE].struct.format[1:])
_READ = struct.Struct(PREFIX.format + PACKED[Kind.READ].struct.format[1:])
_REPLY = struct.Struct(PREFIX.format + PACKED[Kind.READ_DATA].struct.format[1:])
_KINDS = {int(kind): kind for kind in Kind}  # a lookup, not Kind(value): on every frame
# Kinds whose payload is region data; every other kind but NOTIFY carries none.
DATA_KINDS = frozenset({Kind.WRITE, Kind.READ_DATA})


# An ANSWER lists what a node exports or who is connected to it, which grows with the node:
# it goes in pages of at most this many bytes of listed items (QUERY "from": the first item
# wanted; the answer's "next": where the next page starts, absent on the last page).
ANSWER_PAGE = MAX_HEADER - 4096
OMITTED = "too large for an answer"


def page(data: dict[str, Any], key: str, start: int) -> dict[str, Any]:
    """``data`` with only the items of its list ``key`` from ``start`` on that fit in one
    ANSWER (at least one; an item that alone does not fit is replaced by a note)."""
    items = data[key]
    out: list[Any] = []
    size = 0
    for item in items[start:]:
        n = len(msgpack.packb(item, use_bin_type=True))
        if n > ANSWER_PAGE:
            item = {"omitted": f"{n} B: {OMITTED}"}
            n = 64
        if out and size + n > ANSWER_PAGE:
            break
        out.append(item)
        size += n
    rest = start + len(out)
    return {**data, key: out, **({"next": rest} if rest < len(items) else {})}


def encode(kind: Kind, header: dict[str, Any], payload_len: int = 0) -> bytes:
    """Prefix + header bytes of one frame; the payload (if any) is sent after them."""
    packed = PACKED.get(kind)
    if packed is not None:
        if kind is Kind.WRITE and header.get("n", payload_len) != payload_len:
            raise ProtocolError(f"WRITE says {header['n']} B but carries {payload_len} B")
        raw = packed.pack(header)
    elif not header:  # NOTIFY, READY, BYE: no msgpack for the empty map
        raw = _EMPTY_MAP
    else:
        raw = msgpack.packb(header, use_bin_type=True)
    if len(raw) > MAX_HEADER:
        raise ProtocolError(f"{kind.name} header of {len(raw)} B exceeds {MAX_HEADER} B")
    return PREFIX.pack(MAGIC, PROTOCOL_VERSION, kind, len(raw), payload_len) + raw


# The op frames, packed whole (prefix and header) in one call: what the transport sends on
# every op. Their fields are ours (checked by the endpoint), never a peer's.
def write_frame(req: int, rid: int, ck: int, off: int, n: int, last: bool,
                imm: bytes | None = None) -> bytes:
    """A WRITE frame's prefix and header; ``n`` bytes of payload follow."""
    if imm is None:
        return _WRITE.pack(MAGIC, PROTOCOL_VERSION, Kind.WRITE, _WRITE.size - PREFIX.size, n,
                           req, rid, ck, off, _LAST if last else 0)
    if len(imm) > MAX_HEADER - _WRITE.size or not last:
        raise ProtocolError(f"a WRITE carries a notification of at most "
                            f"{MAX_HEADER - _WRITE.size} B, on its last frame")
    return _WRITE.pack(MAGIC, PROTOCOL_VERSION, Kind.WRITE, _WRITE.size - PREFIX.size + len(imm),
                       n, req, rid, ck, off, _LAST | _IMM) + imm


def read_frame(req: int, rid: int, ck: int, off: int, n: int) -> bytes:
    return _READ.pack(MAGIC, PROTOCOL_VERSION, Kind.READ, _READ.size - PREFIX.size, 0,
                      req, rid, ck, off, n)


def reply_frame(kind: Kind, req: int, payload_len: int = 0) -> bytes:
    """A WRITE_ACK (no payload) or READ_DATA (``payload_len`` bytes follow) frame."""
    return _REPLY.pack(MAGIC, PROTOCOL_VERSION, kind, _REPLY.size - PREFIX.size, payload_len,
                       req)


# An op frame in its usual form, prefix and header unpacked in one call: by its kind byte,
# (kind, its struct, its header's length, the slice of the values that is its row).
_OPS = {int(k): (k, s, s.size - PREFIX.size, slice(5, None)) for k, s in (
    (Kind.WRITE, _WRITE), (Kind.READ, _READ), (Kind.WRITE_ACK, _REPLY),
    (Kind.READ_DATA, _REPLY))}
_NO_PAYLOAD = (Kind.READ, Kind.WRITE_ACK)
_EMPTY_MAP = b"\x80"  # msgpack's {}: what encode() writes for an empty header
_NOTIFY = int(Kind.NOTIFY)


def decode_op(data: bytes | bytearray, offset: int, available: int
              ) -> tuple[Kind, Any, int, int] | None:
    """(kind, header, payload length, frame size without payload) of the frame at
    ``offset`` if it is one in its usual form (a WRITE without a notification, a READ, a
    WRITE_ACK, a READ_DATA, each with a header of its fixed size; a NOTIFY with an empty
    map) and all of its prefix and header are among the ``available`` bytes (at least a
    prefix's); else None, and :func:`decode_prefix` and :func:`decode` decide (and raise on
    what is wrong). The header is what :func:`decode` gives: an op frame's row, a map."""
    op = _OPS.get(data[offset + 3])
    if op is None:
        return _decode_notify(data, offset, available) if data[offset + 3] == _NOTIFY else None
    kind, packed, header_len, row = op
    if available < packed.size:
        return None
    values = packed.unpack_from(data, offset)
    if (values[0] != MAGIC or values[1] != PROTOCOL_VERSION or values[3] != header_len
            or values[4] > MAX_PAYLOAD or (values[4] and kind in _NO_PAYLOAD)):
        return None
    if kind is Kind.WRITE:
        if values[9] & ~_LAST:  # a notification, or flags we do not know
            return None
        return kind, (*values[5:9], values[9] == _LAST, None), values[4], packed.size
    return kind, values[row], values[4], packed.size


def _decode_notify(data: bytes | bytearray, offset: int, available: int
                   ) -> tuple[Kind, dict[str, Any], int, int] | None:
    """:func:`decode_op` of a NOTIFY in the form we send (an empty map for its header)."""
    if available < PREFIX.size + 1 or data[offset + PREFIX.size] != _EMPTY_MAP[0]:
        return None
    magic, version, _, header_len, payload_len = PREFIX.unpack_from(data, offset)
    if magic != MAGIC or version != PROTOCOL_VERSION or header_len != 1 \
            or payload_len > MAX_NOTIFY:
        return None
    return Kind.NOTIFY, {}, payload_len, PREFIX.size + 1


def decode_prefix(data: bytes | bytearray | memoryview, offset: int = 0
                  ) -> tuple[Kind, int, int]:
    """(kind, header_len, payload_len) of the 16-byte prefix at ``offset``; ProtocolError
    if it is bad."""
    magic, version, kind, header_len, payload_len = PREFIX.unpack_from(data, offset)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {bytes(magic)!r}: not a tensorx peer")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(
            f"peer speaks tensorx protocol v{version}; this process speaks v{PROTOCOL_VERSION}"
        )
    k = _KINDS.get(kind)
    if k is None:
        raise ProtocolError(f"unknown frame kind {kind}")
    if header_len > MAX_HEADER:
        raise ProtocolError(f"header of {header_len} B exceeds the {MAX_HEADER} B limit")
    _check_payload_len(k, payload_len)
    return k, header_len, payload_len


def _check_payload_len(kind: Kind, payload_len: int) -> None:
    limit = MAX_PAYLOAD if kind in DATA_KINDS else MAX_NOTIFY if kind is Kind.NOTIFY else 0
    if payload_len > limit:
        raise ProtocolError(f"{kind.name} payload of {payload_len} B exceeds {limit} B")


def decode_header(kind: Kind, raw: bytes | bytearray | memoryview,
                  payload_len: int = 0) -> dict[str, Any]:
    """Unpack and validate a header against its kind's schema, as a map."""
    packed = PACKED.get(kind)
    if packed is None:
        return _decode_map(kind, raw)
    header = dict(zip(packed.names, decode(kind, raw), strict=True))
    if kind is Kind.WRITE:
        header["n"] = payload_len
        if header["imm"] is None:
            del header["imm"]
    return header


def decode(kind: Kind, raw: bytes | bytearray | memoryview) -> Any:
    """What the transport reads: the header of an op frame as its row (its values in the
    order :data:`PACKED` names them: a WRITE's is ``(req, rid, ck, off, last, imm)``), of
    any other kind as a map; validated either way."""
    packed = PACKED.get(kind)
    if packed is None:
        return _decode_map(kind, raw)
    row = packed.row(raw)
    if kind is Kind.WRITE and row[5] is not None and not row[4]:
        raise ProtocolError("WRITE carries a notification on a frame before its last")
    return row


def _decode_map(kind: Kind, raw: bytes | bytearray | memoryview) -> dict[str, Any]:
    try:
        unpacked = msgpack.unpackb(raw, raw=False, strict_map_key=True, max_bin_len=MAX_HEADER)
    except Exception as exc:
        raise ProtocolError(f"undecodable {kind.name} header: {exc}") from exc
    return SCHEMAS[kind].check(unpacked)
