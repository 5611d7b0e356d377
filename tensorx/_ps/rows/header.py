"""The dynamic path's header slot: what a worker writes for each sparse table it staged,
and what a shard decodes before it reads the rows.

Header slot (``HEADER_BYTES``): five little-endian u64 - rows, nbytes, version, capacity,
offset (of the payload in the staging region; a sender that leaves it 0 stages each table
in a region of its own). ``version`` grows by one per staging; ``capacity`` (bytes of the
staging region) changes when staging grew, and then the sender must re-send its staging
descriptor. A payload is the table's row ids (int64), then its rows from the next
``ALIGN``-aligned byte: :func:`payload_views` splits one; :func:`read_header` and
:class:`HeaderSlots` decode slots and check them against the plan.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tensorx._analyzer.layout import HEADER_BYTES, INDEX_BYTES, DynamicEntry, align_up
from tensorx.errors import RegionError
from tensorx.memregion import MemoryRegion

__all__ = ["ALIGN", "HeaderSlots", "SparseHeader", "aligned", "budget_bytes", "payload_views",
           "read_header", "read_headers", "values_offsets"]

_HEADER = struct.Struct("<QQQQQ")
ALIGN = 64  # each table's payload starts at a multiple of it


@dataclass(frozen=True)
class SparseHeader:
    """One table's header slot, decoded."""

    rows: int
    nbytes: int
    version: int
    capacity: int
    offset: int = 0

    def pack(self) -> bytes:
        raw = _HEADER.pack(self.rows, self.nbytes, self.version, self.capacity, self.offset)
        return raw.ljust(HEADER_BYTES, b"\0")


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


def values_offsets(rows: Any) -> Any:
    """:meth:`DynamicEntry.values_offset` of an array of row counts."""
    return aligned(rows * INDEX_BYTES)


class HeaderSlots:
    """Some entries' header slots (as u64 indices), row budgets and row bytes as arrays,
    made once: their headers are decoded and checked together (a receiver, at every push)
    and their payloads sized together (a sender)."""

    def __init__(self, entries: Sequence[DynamicEntry]) -> None:
        self.entries = list(entries)
        self.slots = np.array([e.header_offset // 8 for e in entries], dtype=np.int64)
        self.budget = np.array([e.budget_rows for e in entries], dtype=np.int64)
        self.row = np.array([e.row_bytes for e in entries], dtype=np.int64)

    def payload_bytes(self, rows: Any) -> Any:
        """:meth:`DynamicEntry.payload_bytes` of each entry for ``rows`` (int64) rows."""
        return values_offsets(rows) + rows * self.row

    def fields(self, region: MemoryRegion) -> Any:
        """uint64 ``[5, entries]``: rows, nbytes, version, capacity, offset (a copy: the
        peer may write the slots meanwhile); RegionError naming the first bad slot."""
        if not self.entries:
            return np.zeros((5, 0), dtype=np.uint64)
        fields = np.frombuffer(region.buffer(), dtype="<u8")[self.slots + np.arange(5)[:, None]]
        rows, nbytes, _, _, offset = fields
        small = rows <= self.budget.astype(np.uint64)  # and so the sizes below fit an int64
        want = self.payload_bytes(np.where(small, rows, 0).astype(np.int64)).astype(np.uint64)
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


def aligned(n: Any) -> Any:
    """``n`` bytes (an int or an array of them) rounded up to a multiple of ``ALIGN``."""
    return (n + (ALIGN - 1)) // ALIGN * ALIGN
