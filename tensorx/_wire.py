"""Frame encoding for the tensorx control protocol. Pure: no asyncio, no sockets.

A frame is a 16-byte prefix, a msgpack header (a map with short string keys) and an
optional raw payload that the transport moves straight between socket and region memory::

    prefix  = magic b"TX" | version u8 | kind u8 | header_len u32 | payload_len u64   (big endian)

Every header is validated against the schema of its kind (a :class:`tensorx._schema.Record`)
before anything acts on it.
"""

from __future__ import annotations

import enum
import struct
from typing import Any

import msgpack

from tensorx._schema import Field, Record, blob, choice, flag, table, text, uint
from tensorx.errors import ProtocolError

__all__ = [
    "MAX_HEADER",
    "MAX_NOTIFY",
    "MAX_PAYLOAD",
    "PREFIX",
    "PROTOCOL_VERSION",
    "Kind",
    "decode_header",
    "decode_prefix",
    "encode",
]

MAGIC = b"TX"
PROTOCOL_VERSION = 2  # 2: the client proves the token first (v1 servers proved first)
PREFIX = struct.Struct("!2sBBIQ")
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
    REVOKE = 21     # owner -> peers: this region is closed or unexported; drop it
    REVOKE_ACK = 22  # peer -> owner: none of my ops on that region is in flight any more


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
    Kind.WRITE: {"req": _U, "rid": _U, "ck": _U, "off": _U, "n": _U, "last": flag()},
    Kind.WRITE_ACK: {"req": _U},
    Kind.READ: {"req": _U, "rid": _U, "ck": _U, "off": _U, "n": _U},
    Kind.READ_DATA: {"req": _U},
    Kind.NOTIFY: {},
    Kind.ERROR: {"req": _U, "code": _CODE, "msg": text(MAX_HEADER)},
    Kind.VALIDATE: {"req": _U, "rid": _U, "ck": _U},
    Kind.VALID: {"req": _U, "n": _U, "access": choice("r", "w", "rw")},
    Kind.BYE: {},
    Kind.QUERY: {"req": _U, "what": _CODE},
    Kind.ANSWER: {"req": _U, "data": table(64)},
    Kind.REVOKE: {"rid": _U},
    Kind.REVOKE_ACK: {"rid": _U},
}.items()}
_KINDS = {int(kind): kind for kind in Kind}  # a lookup, not Kind(value): on every frame
# Kinds whose payload is region data; every other kind but NOTIFY carries none.
DATA_KINDS = frozenset({Kind.WRITE, Kind.READ_DATA})


def encode(kind: Kind, header: dict[str, Any], payload_len: int = 0) -> bytes:
    """Prefix + header bytes of one frame; the payload (if any) is sent after them."""
    raw: bytes = msgpack.packb(header, use_bin_type=True)
    if len(raw) > MAX_HEADER:
        raise ProtocolError(f"{kind.name} header of {len(raw)} B exceeds {MAX_HEADER} B")
    return PREFIX.pack(MAGIC, PROTOCOL_VERSION, kind, len(raw), payload_len) + raw


def decode_prefix(data: bytes | bytearray | memoryview) -> tuple[Kind, int, int]:
    """(kind, header_len, payload_len) of a 16-byte prefix; ProtocolError if it is bad."""
    magic, version, kind, header_len, payload_len = PREFIX.unpack(data)
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
    """Unpack and validate a header against its kind's schema."""
    try:
        unpacked = msgpack.unpackb(raw, raw=False, strict_map_key=True, max_bin_len=MAX_HEADER)
    except Exception as exc:
        raise ProtocolError(f"undecodable {kind.name} header: {exc}") from exc
    header = SCHEMAS[kind].check(unpacked)
    if kind is Kind.WRITE and header["n"] != payload_len:
        raise ProtocolError(f"WRITE says {header['n']} B but carries {payload_len} B")
    return header
