"""The dynamic path: sparse gradient rows staged in registered memory, announced by a header.

Sender (worker): :meth:`SparseStaging.stage` coalesces the gradients of one shard's tables,
packs each table's indices then values into the shard's staging region, one table after
another, and fills each table's header slot in
its local ``headers`` region; the worker writes those slots to the same offsets of the
receiver's ``headers`` arena. Receiver (PS): :func:`read_header` tells where in the sender's
staging region a table's payload lies and how long it is, so one read brings every table of
the shard; :func:`payload_views` splits a payload into indices and values.

Header slot (``HEADER_BYTES``): five little-endian u64 - rows, nbytes, version, capacity,
offset (of the payload in the staging region; a sender that leaves it 0 stages each table
in a region of its own). ``version`` grows by one per staging; ``capacity`` (bytes of the
staging region) changes when staging grew, and then the sender must re-send its staging
descriptor.
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tensorx._analyzer.layout import HEADER_BYTES, DynamicEntry, Layout, align_up
from tensorx.errors import RegionError, UsageError
from tensorx.memregion import MemoryRegion

__all__ = ["SparseHeader", "SparseStaging", "StagedSparse", "payload_views", "read_header",
           "read_headers"]

_HEADER = struct.Struct("<QQQQQ")
ALIGN = 64  # each table's payload starts at a multiple of it


@dataclass(frozen=True)
class SparseHeader:
    rows: int
    nbytes: int
    version: int
    capacity: int
    offset: int = 0

    def pack(self) -> bytes:
        raw = _HEADER.pack(self.rows, self.nbytes, self.version, self.capacity, self.offset)
        return raw.ljust(HEADER_BYTES, b"\0")


@dataclass(frozen=True)
class StagedSparse:
    """What one staging of a shard produced: where the payloads are, their headers, and
    whether the staging region is new (then its descriptor must be announced again)."""

    shard: int
    names: tuple[str, ...]
    fields: Any  # uint64 [5, tables]: the header slots' rows, nbytes, version, capacity, offset
    region: MemoryRegion
    grown: bool

    @functools.cached_property
    def headers(self) -> dict[str, SparseHeader]:
        """Each table's header, by name (made when asked: a push never asks, and 26 of
        them were a tenth of a DLRM-shaped worker's staging)."""
        return {name: SparseHeader(*values)
                for name, values in zip(self.names, self.fields.T.tolist(), strict=True)}


def read_header(region: MemoryRegion, entry: DynamicEntry) -> SparseHeader:
    """Decode ``entry``'s header slot in a ``headers`` region; RegionError if it is absurd."""
    raw = bytes(region.buffer()[entry.header_offset:entry.header_offset + _HEADER.size])
    header = SparseHeader(*_HEADER.unpack(raw))
    if header.rows > entry.budget_rows or header.nbytes != entry.payload_bytes(header.rows) \
            or header.offset % ALIGN or header.offset >= 1 << 62:
        raise RegionError(f"{entry.name}: header {header} does not fit its plan entry")
    return header


def read_headers(region: MemoryRegion, entries: Sequence[DynamicEntry]) -> list[SparseHeader]:
    """:func:`read_header` of every entry of ``entries``: the fields decoded and checked
    for all of them at once (a DLRM-shaped shard decoded 26 slots one by one per push)."""
    rows, nbytes, version, capacity, offset = HeaderSlots(entries).fields(region)
    return [SparseHeader(*fields) for fields in
            zip(rows.tolist(), nbytes.tolist(), version.tolist(), capacity.tolist(),
                offset.tolist(), strict=True)]


class HeaderSlots:
    """The header slots of some entries, decoded and checked together (what a receiver
    does at every push: the entries' arrays are made once)."""

    def __init__(self, entries: Sequence[DynamicEntry]) -> None:
        self.entries = list(entries)
        self._at = np.array([e.header_offset // 8 for e in entries], dtype=np.int64) + \
            np.arange(5)[:, None]
        self._budget = np.array([e.budget_rows for e in entries], dtype=np.uint64)
        self._row_bytes = np.array([e.row_bytes for e in entries], dtype=np.uint64)

    def fields(self, region: MemoryRegion) -> Any:
        """uint64 ``[5, entries]``: rows, nbytes, version, capacity, offset (a copy: the
        peer may write the slots meanwhile); RegionError naming the first bad slot."""
        if not self.entries:
            return np.zeros((5, 0), dtype=np.uint64)
        fields = np.frombuffer(region.buffer(), dtype="<u8")[self._at]
        rows, nbytes, _, _, offset = fields
        small = rows <= self._budget  # and so no product below can overflow
        want = (rows * 8 + (ALIGN - 1)) // ALIGN * ALIGN + rows * self._row_bytes
        bad = ~small | (nbytes != want) | (offset % ALIGN != 0) | (offset >= 1 << 62)
        if bad.any():
            entry = self.entries[int(np.flatnonzero(bad)[0])]
            read_header(region, entry)  # raises, naming the entry and its header
            raise RegionError(f"{entry.name}: header does not fit its plan entry")
        return fields


def payload_views(region: MemoryRegion, entry: DynamicEntry, rows: int,
                  offset: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(indices int64 [rows], values [rows, *row_shape]) of a payload at ``offset`` of a
    staged region; no copy."""
    indices = region.view(torch.int64, (rows,), offset)
    values = region.view(getattr(torch, entry.dtype), (rows, *entry.row_shape),
                         offset + entry.values_offset(rows))
    return indices, values


def budget_bytes(entries: Sequence[DynamicEntry]) -> int:
    """The most a packed staging of ``entries`` can take: each at its row budget."""
    return sum(align_up(e.payload_bytes(e.budget_rows), ALIGN) for e in entries)


class SparseStaging:
    """The sender's staging region and local header slots, per shard."""

    def __init__(self, plan: Layout, device: str = "cpu") -> None:
        self.plan = plan
        self.device = device
        self._headers = {s: MemoryRegion.allocate(plan.header_bytes(s))
                         for s in range(plan.num_shards)}
        self._entries = {s: [d for d in plan.dynamic_entries if d.shard == s]
                         for s in range(plan.num_shards)}
        self._regions = {s: MemoryRegion.allocate(self._first_size(s), device=device)
                         for s, entries in self._entries.items() if entries}
        self._versions = {s: np.zeros(len(e), dtype=np.uint64)
                          for s, e in self._entries.items()}

    def _first_size(self, shard: int) -> int:
        return sum(align_up(e.payload_bytes(e.capacity_rows), ALIGN)
                   for e in self._entries[shard])

    def header_regions(self) -> dict[tuple[int, str], MemoryRegion]:
        return {(s, "headers"): r for s, r in self._headers.items()}

    def region(self, shard: int) -> MemoryRegion:
        if shard not in self._regions:
            raise UsageError(f"shard {shard} has no dynamic entry in this plan")
        return self._regions[shard]

    def stage(self, shard: int, grads: Mapping[str, torch.Tensor]) -> StagedSparse:
        """Stage the sparse gradients ``grads`` (by name; every table of ``shard``) packed
        into the shard's staging region, and fill their header slots."""
        entries = self._entries.get(shard) or []
        if not entries or set(grads) != {e.name for e in entries}:
            raise UsageError(f"staging shard {shard} takes the gradients of "
                             f"{sorted(e.name for e in entries)}, got {sorted(grads)}")
        coalesced = [grads[e.name].coalesce() for e in entries]
        ids = [g.indices()[0] for g in coalesced]
        values = [g.values() for g in coalesced]
        counts = [int(i.numel()) for i in ids]
        offsets, end = self._offsets(entries, counts)
        grown = self._ensure_capacity(shard, entries, end)
        region = self._regions[shard]
        typed = {torch.int64: region.view(torch.int64)}  # the region once per dtype
        for entry, i, v, off, rows in zip(entries, ids, values, offsets, counts, strict=True):
            typed[torch.int64][off // 8:off // 8 + rows].copy_(i)  # offsets are 64-aligned
            view = typed.get(v.dtype)
            if view is None:
                view = typed[v.dtype] = region.view(v.dtype)
            start = (off + entry.values_offset(rows)) // v.element_size()
            view[start:start + v.numel()].view_as(v).copy_(v)
        fields = self._write_headers(shard, entries, counts, offsets, region.nbytes)
        return StagedSparse(shard, tuple(e.name for e in entries), fields, region, grown)

    def _write_headers(self, shard: int, entries: Sequence[DynamicEntry], rows: Sequence[int],
                       offsets: Sequence[int], capacity: int) -> Any:
        """Fill the header slots of ``entries`` (one vector store per field); the fields."""
        slots = self._headers[shard].view("<u8")  # the header is little-endian
        at = np.array([e.header_offset // 8 for e in entries])
        versions = self._versions[shard]
        versions += 1
        fields = np.array([rows, [e.payload_bytes(n) for e, n in zip(entries, rows, strict=True)],
                           versions, [capacity] * len(entries), offsets], dtype="<u8")
        for k, values in enumerate(fields):
            slots[at + k] = values
        return fields

    @staticmethod
    def _offsets(entries: Sequence[DynamicEntry], rows: Sequence[int]) -> tuple[list[int], int]:
        offsets, at = [], 0
        for entry, n in zip(entries, rows, strict=True):
            if n > entry.budget_rows:
                raise RegionError(
                    f"{entry.name}: sparse gradient has {n} rows but staging allows at most "
                    f"{entry.budget_rows} ({entry.payload_bytes(entry.budget_rows)} B); raise "
                    "sparse_max_rows or sparse_budget_bytes when planning")
            offsets.append(at)
            at = align_up(at + entry.payload_bytes(n), ALIGN)
        return offsets, at

    def _ensure_capacity(self, shard: int, entries: Sequence[DynamicEntry], need: int) -> bool:
        region = self._regions[shard]
        if need <= region.nbytes:
            return False
        new = min(budget_bytes(entries), max(need, 2 * region.nbytes))
        region.close()
        self._regions[shard] = MemoryRegion.allocate(new, device=self.device)
        return True

    def close(self) -> None:
        for region in [*self._headers.values(), *self._regions.values()]:
            region.close()
