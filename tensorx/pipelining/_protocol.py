"""The messages pipeline stages exchange over one endpoint per pair of stages.

Every message is a notification (msgpack map, bounded), so it is ordered after the writes
issued before it on the same endpoint: the ``F`` that tells a stage its activations are
ready arrives only once their bytes have landed in its slot. The data itself never travels
in a message.

``hello``   the lower stage opens the endpoint and says who it is
``meta``    sender -> receiver, once per edge: the tensors of the edge (dtype, shape of the
            first micro-batch, whether they need a gradient) and the schedule it runs
``accept``  receiver -> sender: the slot capacities, the activation ring (descriptor, slots)
            and how many gradient slots the sender must register
``grads``   sender -> receiver: the gradient ring (descriptor)
``F``/``B`` the activations / gradients of transfer ``n`` (micro-batch ``mb`` of ``step``)
            are in slot ``n % slots``; ``F`` carries each tensor's shape, ``B`` which
            tensors have a gradient
``FR``/``BR`` the receiver is done with transfers up to ``n`` (a credit)
``abort``   a stage failed (``origin``, ``why``): every stage stops waiting
``bye``     a clean close
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

from tensorx._text import printable
from tensorx.errors import ProtocolError

__all__ = ["MAX_DIMS", "MAX_MESSAGE", "MAX_TENSORS", "TensorMeta", "decode", "encode",
           "meta_from", "shapes_from"]

MAX_MESSAGE = 64 << 10
MAX_TENSORS = 256
MAX_DIMS = 8
MAX_DIM = 1 << 40
KINDS = frozenset({"hello", "meta", "accept", "grads", "F", "B", "FR", "BR", "abort", "bye"})
DTYPES = frozenset({"float16", "bfloat16", "float32", "float64", "int8", "uint8", "int16",
                    "int32", "int64", "bool", "complex64", "complex128"})


@dataclass(frozen=True)
class TensorMeta:
    """One tensor of an edge: its dtype, its shape (first micro-batch, or capacity) and
    whether the sender wants its gradient back."""

    dtype: str
    shape: tuple[int, ...]
    grad: bool

    def pack(self) -> list[Any]:
        return [self.dtype, list(self.shape), self.grad]


def encode(kind: str, **fields: Any) -> bytes:
    data: bytes = msgpack.packb({"t": kind, **fields}, use_bin_type=True)
    return data


def decode(payload: bytes, peer: str) -> dict[str, Any]:
    """A message from ``peer`` (a stage's name), checked for shape; ProtocolError if not."""
    if len(payload) > MAX_MESSAGE:
        raise ProtocolError(f"{peer} sent a pipeline message of {len(payload)} B "
                            f"(at most {MAX_MESSAGE})")
    try:
        msg = msgpack.unpackb(payload, raw=False, strict_map_key=True, max_bin_len=MAX_MESSAGE,
                              max_str_len=MAX_MESSAGE, max_array_len=4 * MAX_TENSORS,
                              max_map_len=32)
    except Exception as exc:  # msgpack raises several types for malformed input
        raise ProtocolError(f"{peer} sent a malformed pipeline message: {exc}") from None
    if not isinstance(msg, dict) or msg.get("t") not in KINDS:
        kind = msg.get("t") if isinstance(msg, dict) else type(msg).__name__
        raise ProtocolError(f"{peer} sent an unknown pipeline message "
                            f"{printable(repr(kind))[:60]}")
    return msg


def integer(msg: dict[str, Any], key: str, peer: str, low: int = 0,
            high: int = 1 << 62) -> int:
    value = msg.get(key)
    if type(value) is not int or not low <= value <= high:
        raise ProtocolError(f"{peer} sent {msg['t']!r} with {key}={printable(repr(value))[:40]}"
                            f" (expected an int in [{low}, {high}])")
    return value


def text(msg: dict[str, Any], key: str, peer: str, limit: int = 2000) -> str:
    value = msg.get(key)
    if not isinstance(value, str):
        raise ProtocolError(f"{peer} sent {msg['t']!r} without a text {key!r}")
    return printable(value, limit)


def meta_from(value: Any, peer: str) -> list[TensorMeta]:
    """The tensor list of a ``meta`` or ``accept`` message."""
    if not isinstance(value, list) or not 0 < len(value) <= MAX_TENSORS:
        raise ProtocolError(f"{peer} sent a tensor list that is not a list of 1 to "
                            f"{MAX_TENSORS} entries")
    out = []
    for item in value:
        if (not isinstance(item, list) or len(item) != 3 or item[0] not in DTYPES
                or not isinstance(item[2], bool)):
            raise ProtocolError(f"{peer} sent a malformed tensor entry "
                                f"{printable(repr(item))[:80]}")
        out.append(TensorMeta(item[0], _shape(item[1], peer), item[2]))
    return out


def shapes_from(value: Any, capacity: Sequence[tuple[int, ...]], peer: str,
                what: str) -> list[tuple[int, ...]]:
    """The per-tensor shapes of an ``F`` message, each within its slot's ``capacity``."""
    if not isinstance(value, list) or len(value) != len(capacity):
        raise ProtocolError(f"{peer} sent {what} with {printable(repr(value))[:80]} for "
                            f"{len(capacity)} tensors")
    shapes = [_shape(v, peer) for v in value]
    for shape, cap in zip(shapes, capacity, strict=True):
        if len(shape) != len(cap) or any(d > c for d, c in zip(shape, cap, strict=True)):
            raise ProtocolError(f"{peer} sent {what} with shape {shape}, outside its slot's "
                                f"capacity {cap}")
    return shapes


def _shape(value: Any, peer: str) -> tuple[int, ...]:
    if (not isinstance(value, list) or len(value) > MAX_DIMS
            or any(type(d) is not int or not 0 <= d <= MAX_DIM for d in value)):
        raise ProtocolError(f"{peer} sent a malformed shape {printable(repr(value))[:80]}")
    return tuple(value)
