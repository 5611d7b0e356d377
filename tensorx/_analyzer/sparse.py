"""The dynamic path: sparse gradient rows staged in registered memory, announced by a header.

Sender (worker): :meth:`SparseStaging.stage` coalesces the gradient, copies indices then
values into the tensor's staging region and fills the header slot in its local ``headers``
region; the worker writes that slot to the same offset of the receiver's ``headers`` arena.
Receiver (PS): :func:`read_header` tells how many bytes to read from the sender's staging
region; :func:`payload_views` splits them into indices and values.

Header slot (``HEADER_BYTES``): four little-endian u64 - rows, nbytes, version, capacity.
``version`` grows by one per staged gradient; ``capacity`` changes when staging grew, and
then the sender must re-send its staging descriptor.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import torch

from tensorx._analyzer.layout import HEADER_BYTES, DynamicEntry, Layout
from tensorx.errors import RegionError, UsageError
from tensorx.memregion import MemoryRegion

__all__ = ["SparseHeader", "SparseStaging", "StagedSparse", "payload_views", "read_header"]

_HEADER = struct.Struct("<QQQQ")


@dataclass(frozen=True)
class SparseHeader:
    rows: int
    nbytes: int
    version: int
    capacity: int

    def pack(self) -> bytes:
        raw = _HEADER.pack(self.rows, self.nbytes, self.version, self.capacity)
        return raw.ljust(HEADER_BYTES, b"\0")


@dataclass(frozen=True)
class StagedSparse:
    """What one staging produced: where the payload is and how to announce it."""

    name: str
    shard: int
    header: SparseHeader
    header_offset: int
    region: MemoryRegion
    grown: bool


def read_header(region: MemoryRegion, entry: DynamicEntry) -> SparseHeader:
    """Decode ``entry``'s header slot in a ``headers`` region; RegionError if it is absurd."""
    raw = bytes(region.buffer()[entry.header_offset:entry.header_offset + _HEADER.size])
    header = SparseHeader(*_HEADER.unpack(raw))
    if header.rows > entry.budget_rows or header.nbytes != entry.payload_bytes(header.rows):
        raise RegionError(f"{entry.name}: header {header} does not fit its plan entry")
    return header


def payload_views(region: MemoryRegion, entry: DynamicEntry,
                  rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(indices int64 [rows], values [rows, *row_shape]) inside a staged payload; no copy."""
    indices = region.view(torch.int64, (rows,), 0)
    values = region.view(getattr(torch, entry.dtype), (rows, *entry.row_shape),
                         entry.values_offset(rows))
    return indices, values


class SparseStaging:
    """The sender's staging regions and local header slots for every dynamic entry."""

    def __init__(self, plan: Layout, device: str = "cpu") -> None:
        self.plan = plan
        self.device = device
        self._headers = {s: MemoryRegion.allocate(plan.header_bytes(s))
                         for s in range(plan.num_shards)}
        self._regions = {d.name: self._allocate(d, d.capacity_rows) for d in plan.dynamic_entries}
        self._capacity = {d.name: d.capacity_rows for d in plan.dynamic_entries}
        self._versions = {d.name: 0 for d in plan.dynamic_entries}

    def _allocate(self, entry: DynamicEntry, rows: int) -> MemoryRegion:
        return MemoryRegion.allocate(entry.payload_bytes(rows), device=self.device)

    def header_regions(self) -> dict[tuple[int, str], MemoryRegion]:
        return {(s, "headers"): r for s, r in self._headers.items()}

    def region(self, name: str) -> MemoryRegion:
        if name not in self._regions:
            raise UsageError(f"{name!r} has no dynamic entry in this plan")
        return self._regions[name]

    def capacity(self, name: str) -> int:
        return self._capacity[name]

    def stage(self, name: str, grad: torch.Tensor) -> StagedSparse:
        entry = self.plan.dynamic(name)
        g = grad.coalesce()
        indices, values = g.indices()[0], g.values()
        rows = int(indices.numel())
        grown = self._ensure_capacity(entry, rows)
        region = self._regions[name]
        idx_view, val_view = payload_views(region, entry, rows)
        idx_view.copy_(indices)
        val_view.copy_(values)
        self._versions[name] += 1
        header = SparseHeader(rows, entry.payload_bytes(rows), self._versions[name],
                              self._capacity[name])
        slot = self._headers[entry.shard].buffer()
        slot[entry.header_offset:entry.header_offset + HEADER_BYTES] = header.pack()
        return StagedSparse(name, entry.shard, header, entry.header_offset, region, grown)

    def _ensure_capacity(self, entry: DynamicEntry, rows: int) -> bool:
        capacity = self._capacity[entry.name]
        if rows <= capacity:
            return False
        if not entry.growable or rows > entry.budget_rows:
            raise RegionError(
                f"{entry.name}: sparse gradient has {rows} rows but staging allows at most "
                f"{entry.budget_rows} ({entry.payload_bytes(entry.budget_rows)} B); raise "
                "sparse_max_rows or sparse_budget_bytes when planning"
            )
        new = min(entry.budget_rows, max(rows, 2 * capacity))
        self._regions[entry.name].close()
        self._regions[entry.name] = self._allocate(entry, new)
        self._capacity[entry.name] = new
        return True

    def close(self) -> None:
        for region in [*self._headers.values(), *self._regions.values()]:
            region.close()
