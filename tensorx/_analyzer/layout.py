"""The plan as plain data: entries, arenas, options, fingerprint and wire form.

The lowest module of the analyzer: it imports none of the others. Above it, in this
order: :mod:`~tensorx._analyzer.wire` (decode, check, compare, print), ``sparse`` and
``binding`` (torch views and registered arenas), :mod:`~tensorx._analyzer.plan` (the
:class:`TransferPlan` users get) and the planner that makes one from a model.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields
from typing import Any

import msgpack

from tensorx.errors import ProtocolError, UsageError

__all__ = ["HEADER_BYTES", "DynamicEntry", "Layout", "PlanEntry", "PlanOptions"]

PLAN_VERSION = 3  # 3: shards cut at whole rows to balance dense bytes (2: whole-row chunks)
HEADER_BYTES = 64  # one header slot: rows, nbytes, version, capacity (u64 each), padding
INDEX_BYTES = 8  # sparse row indices travel as int64

ITEMSIZE = {
    "bool": 1, "uint8": 1, "int8": 1, "int16": 2, "int32": 4, "int64": 8,
    "float16": 2, "bfloat16": 2, "float32": 4, "float64": 8,
    "complex64": 8, "complex128": 16,
}
MAX_SHARDS = 1 << 16
KINDS = ("static", "dynamic")
ROLES = ("param", "buffer")


def align_up(n: int, alignment: int) -> int:
    return -(-n // alignment) * alignment


def numel_of(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


@dataclass(frozen=True)
class PlanOptions:
    """Everything besides the model that decides a layout; part of the fingerprint."""

    num_shards: int = 1
    chunk_bytes: int = 4 << 20
    alignment: int = 64
    include_buffers: bool = False
    sparse_max_rows: int | None = None
    sparse_budget_bytes: int | None = None
    order: str = "registration"

    def validate(self) -> None:
        if not _pos_int(self.num_shards) or self.num_shards > MAX_SHARDS:
            raise UsageError(f"num_shards must be an int in [1, {MAX_SHARDS}], "
                             f"got {self.num_shards!r}")
        a = self.alignment
        if not _pos_int(a) or a < 64 or a & (a - 1):
            raise UsageError(f"alignment must be a power of two >= 64, got {a!r}")
        if not _pos_int(self.chunk_bytes) or self.chunk_bytes % a:
            raise UsageError(f"chunk_bytes must be a positive multiple of alignment {a}, "
                             f"got {self.chunk_bytes!r}")
        for name in ("sparse_max_rows", "sparse_budget_bytes"):
            value = getattr(self, name)
            if value is not None and not _pos_int(value):
                raise UsageError(f"{name} must be a positive int or None, got {value!r}")


def _pos_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


@dataclass(frozen=True)
class PlanEntry:
    """One tensor, or one chunk of a tensor, in a shard's arenas.

    The gradient of a parameter entry sits at the same ``offset`` in the shard's ``"grads"``
    arena as its value does in the ``"params"`` arena.
    """

    name: str
    chunk: int
    start: int
    numel: int
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    kind: str
    shard: int
    arena: str
    offset: int
    role: str = "param"
    index: int = -1  # the tensor's position in the model: named_parameters(), then buffers

    @property
    def end(self) -> int:
        return self.offset + self.nbytes

    @property
    def whole(self) -> bool:
        """True when this entry covers the whole tensor (it was not split)."""
        return self.start == 0 and self.numel == numel_of(self.shape)

    @property
    def key(self) -> str | tuple[str, int]:
        return self.name if self.whole else (self.name, self.chunk)

    @property
    def label(self) -> str:
        return self.name if self.whole else f"{self.name}[{self.chunk}]"


@dataclass(frozen=True)
class DynamicEntry:
    """The run-time-sized gradient of a sparse parameter (embedding rows).

    The sender stages ``rows`` int64 indices followed (at the next aligned offset) by
    ``rows`` value rows in its staging region, then writes a header into the receiver's
    ``"headers"`` arena at ``header_offset``. Staging starts at ``capacity_rows`` and may grow
    up to ``budget_rows`` when ``growable``; past that, staging raises ``RegionError``.
    """

    name: str
    shard: int
    header_offset: int
    num_rows: int
    row_shape: tuple[int, ...]
    dtype: str
    capacity_rows: int
    budget_rows: int
    growable: bool

    @property
    def row_bytes(self) -> int:
        return numel_of(self.row_shape) * ITEMSIZE[self.dtype]

    def values_offset(self, rows: int, alignment: int = 64) -> int:
        return align_up(rows * INDEX_BYTES, alignment)

    def payload_bytes(self, rows: int, alignment: int = 64) -> int:
        return self.values_offset(rows, alignment) + rows * self.row_bytes


class Layout:
    """Where every tensor that crosses the worker/PS boundary lives, per shard and arena:
    the plan as data (:class:`~tensorx._analyzer.plan.TransferPlan` adds what decodes,
    checks, prints and binds it, from the modules above this one)."""

    def __init__(self, entries: Iterable[PlanEntry], options: PlanOptions,
                 dynamic_entries: Iterable[DynamicEntry] = ()) -> None:
        self.entries: list[PlanEntry] = list(entries)
        self.options = options
        self.dynamic_entries: list[DynamicEntry] = list(dynamic_entries)
        self._fingerprint: str | None = None

    # -- shape of the layout ------------------------------------------------------------
    @property
    def num_shards(self) -> int:
        return self.options.num_shards

    @property
    def alignment(self) -> int:
        return self.options.alignment

    def shard_entries(self, shard: int) -> list[PlanEntry]:
        """The entries of one shard, in arena order (gradient-ready order)."""
        self._check_shard(shard)
        return sorted((e for e in self.entries if e.shard == shard), key=lambda e: e.offset)

    def arena_bytes(self, shard: int) -> int:
        """Size of the shard's params arena; its grads arena has the same size and layout."""
        ends = [e.end for e in self.entries if e.shard == self._check_shard(shard)]
        return align_up(max(ends, default=0), self.alignment)

    def header_bytes(self, shard: int) -> int:
        """Size of the shard's ``"headers"`` arena (one slot per dynamic entry)."""
        ends = [d.header_offset + HEADER_BYTES for d in self.dynamic_entries
                if d.shard == self._check_shard(shard)]
        return max(ends, default=0)

    def _check_shard(self, shard: int) -> int:
        if not isinstance(shard, int) or not 0 <= shard < self.num_shards:
            raise UsageError(f"shard must be in [0, {self.num_shards}), got {shard!r}")
        return shard

    @property
    def total_bytes(self) -> int:
        return sum(self.arena_bytes(s) for s in range(self.num_shards))

    def dense_bytes(self, shard: int) -> int:
        """The bytes of the shard's dense (static) entries, each padded to the alignment:
        what every round moves and updates on it. Sparse tables are not counted (their
        rounds move the rows touched)."""
        self._check_shard(shard)
        return sum(align_up(e.nbytes, self.alignment) for e in self.entries
                   if e.shard == shard and e.kind == "static")

    @property
    def imbalance(self) -> float:
        """``max / mean - 1`` over the shards' :meth:`dense_bytes` (0.0: perfectly
        balanced; 0.02: the busiest shard holds 2% more than the mean). The planner keeps
        every shard within one cut step of the mean (see :mod:`tensorx._analyzer.balance`)."""
        sizes = [self.dense_bytes(s) for s in range(self.num_shards)]
        mean = sum(sizes) / len(sizes)
        return max(sizes) / mean - 1 if mean else 0.0

    def tensors(self) -> dict[str, list[PlanEntry]]:
        """Entries grouped per tensor name, chunks in order."""
        out: dict[str, list[PlanEntry]] = {}
        for e in sorted(self.entries, key=lambda e: (e.name, e.chunk)):
            out.setdefault(e.name, []).append(e)
        return out

    def dynamic(self, name: str) -> DynamicEntry:
        for d in self.dynamic_entries:
            if d.name == name:
                return d
        raise UsageError(f"{name!r} has no dynamic entry in this plan")

    # -- identity and wire form ---------------------------------------------------------
    def _payload(self) -> list[Any]:
        opts = [[f.name, getattr(self.options, f.name)] for f in fields(self.options)]
        entries = [_entry_row(e) for e in self.entries]
        dynamic = [_dynamic_row(d) for d in self.dynamic_entries]
        return [PLAN_VERSION, opts, entries, dynamic]

    @property
    def fingerprint(self) -> str:
        """Hash of layout and options: equal in every process that planned the same thing."""
        if self._fingerprint is None:
            packed = msgpack.packb(self._payload(), use_bin_type=True)
            self._fingerprint = "txp1-" + hashlib.sha256(packed).hexdigest()[:32]
        return self._fingerprint

    def to_bytes(self) -> bytes:
        packed: bytes = msgpack.packb([*self._payload(), self.fingerprint], use_bin_type=True)
        return packed


_ENTRY_FIELDS = tuple(f.name for f in fields(PlanEntry))
_DYNAMIC_FIELDS = tuple(f.name for f in fields(DynamicEntry))


def _entry_row(e: PlanEntry) -> list[Any]:
    row = [getattr(e, f) for f in _ENTRY_FIELDS]  # astuple deep-copies: 65k chunks took s
    row[4] = list(e.shape)
    return row


def _dynamic_row(d: DynamicEntry) -> list[Any]:
    row = [getattr(d, f) for f in _DYNAMIC_FIELDS]
    row[4] = list(d.row_shape)
    return row


def check_kind(value: str, allowed: tuple[str, ...], what: str) -> None:
    if value not in allowed:
        raise ProtocolError(f"{what} must be one of {allowed}, got {value!r}")
