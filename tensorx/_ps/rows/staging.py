"""The worker's side of the dynamic path: sparse gradient rows staged in registered memory.

:meth:`SparseStaging.stage` coalesces the gradients of one shard's tables, packs each
table's indices then values into the shard's staging region, one table after another, and
fills each table's header slot (:mod:`tensorx._ps.rows.header`) in its local ``headers``
region; the worker writes those slots to the same offsets of the shard's ``headers`` arena,
and the shard reads every table's payload out of the staging region in one op.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tensorx._analyzer.layout import INDEX_BYTES, DynamicEntry, Layout, align_up
from tensorx._ps.rows.header import (
    ALIGN,
    HeaderSlots,
    SparseHeader,
    aligned,
    budget_bytes,
    values_offsets,
)
from tensorx._ps.rows.tables import sum_by_key
from tensorx.errors import RegionError, UsageError
from tensorx.memregion import MemoryRegion

__all__ = ["SparseStaging", "StagedSparse"]


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


class SparseStaging:
    """The sender's staging region and local header slots, per shard (a worker's
    :class:`~tensorx._ps.rows.sparse.SparseSender` owns one for its whole life)."""

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
        self._limits = {s: _Limits(e, self._regions[s].is_cuda)
                        for s, e in self._entries.items() if e}

    def _first_size(self, shard: int) -> int:
        return sum(align_up(e.payload_bytes(e.capacity_rows), ALIGN)
                   for e in self._entries[shard])

    def headers(self, shard: int) -> MemoryRegion:
        """Our ``headers`` region for ``shard``: its slots, written to the shard's at a push."""
        return self._headers[shard]

    def region(self, shard: int) -> MemoryRegion:
        if shard not in self._regions:
            raise UsageError(f"shard {shard} has no dynamic entry in this plan")
        return self._regions[shard]

    def stage_params(self, shard: int, params: Mapping[str, torch.Tensor]) -> StagedSparse:
        """:meth:`stage` the ``.grad`` of each of ``shard``'s tables among ``params`` (name
        -> parameter); UsageError naming the first whose gradient is not sparse."""
        grads = {}
        for entry in self._entries.get(shard) or []:
            grad = params[entry.name].grad
            if grad is None or not grad.is_sparse:
                raise UsageError(f"{entry.name} has no sparse gradient to stage")
            grads[entry.name] = grad
        return self.stage(shard, grads)

    def stage(self, shard: int, grads: Mapping[str, torch.Tensor]) -> StagedSparse:
        """Stage the sparse gradients ``grads`` (by name; every table of ``shard``) packed
        into the shard's staging region, and fill their header slots. A table past its
        row budget raises RegionError before anything is written."""
        entries = self._entries.get(shard) or []
        if not entries or set(grads) != {e.name for e in entries}:
            raise UsageError(f"staging shard {shard} takes the gradients of "
                             f"{sorted(e.name for e in entries)}, got {sorted(grads)}")
        tensors = [grads[e.name] for e in entries]
        limits = self._limits[shard]
        rows = _Packed.of(tensors, limits.dtype, limits.row_shape) or \
            _PerTable.of(tensors, entries)
        offsets, nbytes, end = limits.place(entries, rows.counts)
        grown = self._ensure_capacity(shard, entries, end)
        region = self._regions[shard]
        rows.write(region, offsets, offsets + values_offsets(rows.counts))
        fields = self._write_headers(shard, rows.counts, nbytes, offsets, region.nbytes)
        return StagedSparse(shard, tuple(e.name for e in entries), fields, region, grown)

    def _write_headers(self, shard: int, rows: Any, nbytes: Any, offsets: Any,
                       capacity: int) -> Any:
        """Fill the shard's header slots (one vector store per field); the fields."""
        slots = self._headers[shard].view("<u8")  # the header is little-endian
        versions = self._versions[shard]
        versions += 1
        fields = np.array([rows, nbytes, versions, np.full_like(versions, capacity), offsets],
                          dtype="<u8")
        for k, values in enumerate(fields):
            slots[self._limits[shard].slots + k] = values
        return fields

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


class _Limits(HeaderSlots):
    """A shard's tables as arrays (see :class:`HeaderSlots`), and the dtype and shape of
    their rows when they can be staged packed (one dtype and row shape, and a staging
    region in host memory)."""

    def __init__(self, entries: Sequence[DynamicEntry], on_device: bool) -> None:
        super().__init__(entries)
        kinds = {(e.dtype, tuple(e.row_shape)) for e in entries}
        dtype = getattr(torch, next(iter(kinds))[0]) if len(kinds) == 1 else None
        self.dtype = dtype if dtype in _NUMPY and not on_device else None  # packed staging
        self.row_shape: tuple[int, ...] = next(iter(kinds))[1] if self.dtype else ()

    def place(self, entries: Sequence[DynamicEntry], rows: Any) -> tuple[Any, Any, int]:
        """(offsets, nbytes) of each table's payload packed one after another at ``ALIGN``,
        and where the last ends; RegionError naming the first table past its budget."""
        over = np.flatnonzero(rows > self.budget)
        if over.size:
            entry, n = entries[int(over[0])], int(rows[over[0]])
            raise RegionError(
                f"{entry.name}: sparse gradient has {n} rows but staging allows at most "
                f"{entry.budget_rows} ({entry.payload_bytes(entry.budget_rows)} B); raise "
                "sparse_max_rows or sparse_budget_bytes when planning")
        nbytes = self.payload_bytes(rows)
        ends = np.cumsum(aligned(nbytes))
        return ends - aligned(nbytes), nbytes, int(ends[-1])


class _PerTable:
    """Each table's gradient coalesced on its own (``coalesce()``), where they cannot be
    packed: tables of mixed dtypes or row shapes, rows other than float32/64, or rows or
    staging on a device."""

    def __init__(self, ids: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        self.ids, self.values = ids, values
        self.counts = np.array([i.numel() for i in ids], dtype=np.int64)

    @classmethod
    def of(cls, grads: Sequence[torch.Tensor], entries: Sequence[DynamicEntry]) -> _PerTable:
        """UsageError naming the first gradient unlike its table (staged, its rows would
        run past its payload), before anything is written."""
        for g, e in zip(grads, entries, strict=True):
            if g.dtype != getattr(torch, e.dtype) or tuple(g.shape[1:]) != tuple(e.row_shape):
                raise UsageError(f"{e.name}: a sparse gradient of {g.dtype} rows of "
                                 f"{tuple(g.shape[1:])}, not the table's {e.dtype} rows of "
                                 f"{tuple(e.row_shape)}")
        coalesced = [g.coalesce() for g in grads]
        return cls([g.indices()[0] for g in coalesced], [g.values() for g in coalesced])

    def write(self, region: MemoryRegion, offsets: Any, values_at: Any) -> None:
        typed = {torch.int64: region.view(torch.int64)}  # the region once per dtype
        for i, v, off, at in zip(self.ids, self.values, offsets.tolist(), values_at.tolist(),
                                 strict=True):
            typed[torch.int64][off // 8:off // 8 + i.numel()].copy_(i)  # offsets are aligned
            view = typed.get(v.dtype)
            if view is None:
                view = typed[v.dtype] = region.view(v.dtype)
            start = at // v.element_size()
            view[start:start + v.numel()].view_as(v).copy_(v)


class _Packed:
    """Every table's gradient coalesced at once, when they share a dtype and row shape and
    live in host memory (the normal case): one sort over all the tables' ids (tagged with
    their table's number, so that they sort table by table) and one embedding_bag that
    sums the duplicates, instead of a ``coalesce()`` and a dozen small ops per table (26
    of them were most of a DLRM-shaped worker's staging).

    The sums are ``coalesce()``'s but for their order and the sign of a zero: duplicates
    are added in the order autograd made them (``coalesce()`` adds them in the order its
    unstable sort leaves, which rounds differently where a row has three or more), from
    +0.0 (so a row whose every contribution is -0.0 sums to +0.0)."""

    def __init__(self, ids: Any, values: torch.Tensor, counts: Any) -> None:
        self.ids, self.values, self.counts = ids, values, counts

    @staticmethod
    def of(grads: Sequence[torch.Tensor], dtype: torch.dtype | None,
           row_shape: tuple[int, ...]) -> _Packed | None:
        """The tables coalesced together; None if they do not all hold ``dtype`` rows of
        ``row_shape`` in host memory (``dtype`` None: the plan's tables differ in dtype or
        row shape; :class:`_PerTable` names a gradient unlike its table)."""
        if dtype is None or {(g.dtype, g.is_cpu, g.sparse_dim()) for g in grads} \
                != {(dtype, True, 1)}:
            return None
        try:  # one check of every table's row shape (cat refuses rows of unlike shapes)
            values = torch.cat([g._values() for g in grads])  # noqa: SLF001 (torch: uncoalesced sparse COO has no public accessor)
        except RuntimeError:
            return None
        if values.shape[1:] != row_shape:
            return None
        ids = torch.cat([g._indices() for g in grads], 1).numpy()[0]  # noqa: SLF001 (torch: uncoalesced sparse COO has no public accessor)
        keys = ids | np.repeat(np.arange(len(grads), dtype=np.int64) << _TABLE_SHIFT,
                               [g._nnz() for g in grads])  # noqa: SLF001 (torch: uncoalesced sparse COO has no public accessor)
        unique, summed = sum_by_key(keys, values)  # duplicates in autograd's order
        counts = np.bincount(unique >> _TABLE_SHIFT, minlength=len(grads))
        return _Packed(unique & _ID_MASK, summed, counts)

    def write(self, region: MemoryRegion, offsets: Any, values_at: Any) -> None:
        """Each table's ids at its offset and its rows at ``values_at`` (numpy slices: one
        fancy-indexed store of all the rows took five times as long)."""
        ids, values = region.view("<i8"), region.view(_NUMPY[self.values.dtype])
        row = math.prod(self.values.shape[1:])
        flat = self.values.numpy().reshape(-1)
        first = 0
        for off, at, n in zip((offsets // INDEX_BYTES).tolist(),
                              (values_at // flat.itemsize).tolist(), self.counts.tolist(),
                              strict=True):
            ids[off:off + n] = self.ids[first:first + n]
            values[at:at + n * row] = flat[first * row:(first + n) * row]
            first += n


_TABLE_SHIFT = 40  # a table's ids are tagged with its number above them: none has 2**40 rows
_ID_MASK = (1 << _TABLE_SHIFT) - 1
_NUMPY = {torch.float32: np.float32, torch.float64: np.float64}  # what embedding_bag sums
