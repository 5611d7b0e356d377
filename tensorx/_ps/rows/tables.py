"""Sparse tables on a shard: the rows each worker pushed, and the gradient the optimizer sees.

A parameter the plan sends on the dynamic path (``nn.Embedding(sparse=True)``,
``nn.EmbeddingBag(sparse=True)``) gets no dense gradient on the shard. The rows a worker
pushed are kept per rank, whole (a push that failed half-way hands over nothing), until the
next push of that rank replaces them. For an update of ``ranks`` the table's ``.grad`` is a
coalesced sparse COO tensor: every rank's rows summed by row id, divided by the number of
ranks. That is the mean the dense gradients get, and what torch gives one process training
on the union of the ranks' batches (its uncoalesced gradient, coalesced; up to summation
order). So ``torch.optim.SGD``, ``Adagrad`` and ``SparseAdam`` take their sparse paths, a
row-wise optimizer sees rows, and the work is O(rows touched), not O(table). A table no rank
touched gets no gradient (``None``), as in one process where it took no part in the step.
Pure: no I/O.
"""

from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from tensorx.memregion import MemoryRegion

__all__ = ["PushedRows", "RowBatch", "RowGroup", "Rows", "SparseRows", "first_out_of_range",
           "no_invariant_checks", "put_rows", "row_groups", "sum_by_key", "sum_finite",
           "sum_rows", "take_rows"]

Rows = tuple[torch.Tensor, torch.Tensor]  # (row ids int64 [n], values [n, *row_shape])


# dtypes numpy copies rows of: its fancy indexing copies a row at a time, where torch's
# index_copy_ took 2x as long (8192 rows of 64 floats: 0.19 vs 0.40 ms; index_select 1.4x)
_NUMPY = {torch.float32, torch.float64, torch.float16, torch.int64, torch.int32, torch.int16,
          torch.int8, torch.uint8, torch.bool}


def _numpy_rows(table: torch.Tensor) -> bool:
    return table.device.type == "cpu" and table.dtype in _NUMPY and table.dim() > 0


def take_rows(table: torch.Tensor, ids: torch.Tensor,
              out: torch.Tensor | None = None) -> torch.Tensor:
    """Rows ``ids`` of ``table`` (a copy; into ``out`` if given): ``index_select``."""
    if _numpy_rows(table) and (out is None or (out.is_contiguous() and
                               out.dtype == table.dtype and out.device.type == "cpu")):
        got = np.take(table.detach().numpy(), ids.cpu().numpy(), axis=0,
                      out=None if out is None else out.detach().numpy())
        return torch.from_numpy(got) if out is None else out
    if out is None:
        return table.index_select(0, ids.to(table.device))
    return torch.index_select(table, 0, ids.to(table.device), out=out)


def put_rows(table: torch.Tensor, ids: torch.Tensor, rows: torch.Tensor) -> None:
    """``table[ids] = rows`` in place (``ids`` distinct): ``index_copy_``."""
    if _numpy_rows(table) and rows.device.type == "cpu" and rows.dtype == table.dtype:
        table.detach().numpy()[ids.cpu().numpy()] = rows.detach().numpy()
    else:
        table.index_copy_(0, ids.to(table.device), rows)


def first_out_of_range(ids: torch.Tensor, counts: Any, sizes: Any) -> int | None:
    """Which table (its index) holds the first of ``ids`` (table after table, ``counts[k]``
    of table ``k``) outside ``0 .. sizes[k] - 1``; None when every id lies in its table."""
    limits = np.repeat(np.asarray(sizes, dtype=np.int64), counts)
    bad = (ids < 0) | (ids >= torch.from_numpy(limits).to(ids.device))
    if not bool(bad.any()):
        return None
    return int(np.searchsorted(np.cumsum(counts), int(bad.nonzero()[0, 0]), side="right"))


@dataclass(frozen=True)
class RowBatch:
    """Rows a rank pushed of several tables of one dtype and row shape, table after table:
    ``names[k]``'s row ids (in its table) are ``ids[at[k]:at[k + 1]]``, its rows the same
    rows of ``values``. One tensor each, as the shard gathered them from the received bytes."""

    names: tuple[str, ...]
    at: tuple[int, ...]  # len(names) + 1 bounds
    ids: torch.Tensor
    values: torch.Tensor


class PushedRows(Mapping[str, Rows]):
    """A rank's rows of one push by table name (tables it sent none of: absent), held as
    :class:`RowBatch` es: :meth:`SparseRows.put` packs them whole, and a table's own
    (ids, rows) views are made only when somebody asks for one."""

    def __init__(self, batches: Sequence[RowBatch] = ()) -> None:
        self.batches = list(batches)
        self._tables: dict[str, Rows] | None = None

    @property
    def num_rows(self) -> int:
        return sum(int(b.ids.numel()) for b in self.batches)

    def _views(self) -> dict[str, Rows]:
        if self._tables is None:
            self._tables = {name: (b.ids[lo:hi], b.values[lo:hi]) for b in self.batches
                            for name, lo, hi in zip(b.names, b.at, b.at[1:], strict=False)}
        return self._tables

    def __getitem__(self, name: str) -> Rows:
        return self._views()[name]

    def __iter__(self) -> Iterator[str]:
        return (name for b in self.batches for name in b.names)

    def __len__(self) -> int:
        return sum(len(b.names) for b in self.batches)


def sum_finite(values: torch.Tensor) -> bool:
    """Is the sum of ``values`` finite (so is every value: see :mod:`.nonfinite`)? One
    pass, accumulated in at least float32; True for values that are not floating point."""
    if not values.is_floating_point():
        return True
    acc = torch.float64 if values.dtype == torch.float64 else torch.float32
    with torch.no_grad():
        return bool(torch.isfinite(values.sum(dtype=acc)))


def no_invariant_checks() -> contextlib.AbstractContextManager[Any]:
    """Say that sparse tensors go unchecked (our row ids are checked on arrival): torch's
    sparse optimizers build sparse tensors and otherwise warn that checks are implicitly off."""
    return torch.sparse.check_sparse_tensor_invariants(enable=False)  # type: ignore[no-untyped-call]


class SparseRows:
    """The sparse tables among a shard's optimizer parameters (``specs``, in their order)."""

    def __init__(self, specs: Sequence[Any], device: str = "cpu") -> None:
        self.device = device
        self._specs = {i: s for i, s in enumerate(specs) if getattr(s, "sparse", False)}
        self._index = {s.name: i for i, s in self._specs.items()}
        self._rows: dict[int, dict[int, Rows]] = {}
        self._gathered: dict[int, torch.Tensor | None] | None = None
        self.groups = row_groups(self._specs)
        self._packed: dict[int, list[Rows | None]] = {}  # rank -> its rows per group
        self._pushed: dict[int, PushedRows] = {}  # rank -> its push, tables not split yet
        # table name -> (its group, its first row in the group's view)
        self._where = {self._specs[i].name: (k, start) for k, g in enumerate(self.groups)
                       for i, start in g.starts.items()}
        self._finite: dict[int, bool] = {}  # rank -> are its rows finite

    def __contains__(self, i: object) -> bool:
        return i in self._specs

    def __bool__(self) -> bool:
        return bool(self._specs)

    def __iter__(self) -> Iterator[int]:
        return iter(self._specs)

    def __len__(self) -> int:
        return len(self._specs)

    def names(self) -> list[str]:
        return [s.name for s in self._specs.values()]

    def index(self, name: str) -> int:
        """Table ``name``'s index among the shard's parameters."""
        return self._index[name]

    def views(self, region: MemoryRegion, tables: Sequence[int]) -> list[torch.Tensor]:
        """Tables ``tables``, shaped, in ``region`` (an arena of this shard's layout)."""
        u8 = region.view(torch.uint8)
        out = []
        for i in tables:
            s = self._specs[i]
            part = u8[s.offset:s.offset + s.numel * s.dtype.itemsize]
            out.append(part.view(s.dtype).view(s.shape))
        return out

    def span(self, i: int) -> tuple[int, int]:
        """(offset, nbytes) of table ``i`` in the arena."""
        s = self._specs[i]
        return s.offset, s.numel * s.dtype.itemsize

    def put(self, rank: int, rows: Mapping[str, Rows]) -> None:
        """``rank``'s rows of its latest push, by table name (tables it sent none of: none),
        packed and checked at once: while the shard waits for the other ranks' pushes, not
        after the last one."""
        self.drop(rank)
        packed = self._pack_batches(rows) if isinstance(rows, PushedRows) else None
        if packed is None:
            self._rows[rank] = {self._index[name]: r for name, r in rows.items()
                                if r[0].numel()}
        else:
            self._pushed[rank] = rows  # type: ignore[assignment]
            self._packed[rank] = packed
        self._finite[rank] = self._all_finite(rank)

    def _pack_batches(self, pushed: PushedRows) -> list[Rows | None] | None:
        """The rows per group, straight from ``pushed``'s batches when each batch is the
        pushed tables of one group in row order (one add for all their ids); else None."""
        out: list[Rows | None] = [None] * len(self.groups)
        for b in pushed.batches:
            where = [self._where.get(name) for name in b.names]
            group = where[0][0] if where[0] is not None else -1
            starts = [w[1] for w in where if w is not None and w[0] == group]
            if len(starts) != len(where) or out[group] is not None or \
                    any(a >= c for a, c in itertools.pairwise(starts)):
                return None
            shift = np.repeat(np.array(starts, dtype=np.int64), np.diff(b.at))
            out[group] = (b.ids + torch.from_numpy(shift).to(b.ids.device), b.values)
        return out

    def _tables(self, rank: int) -> dict[int, Rows]:
        """``rank``'s rows by table index (a push kept whole split into views now)."""
        got = self._rows.get(rank)
        if got is None:
            pushed = self._pushed.get(rank)
            if pushed is None:
                return {}
            got = self._rows[rank] = {self._index[name]: r for name, r in pushed.items()
                                      if r[0].numel()}
        return got

    def drop(self, rank: int) -> None:
        self._rows.pop(rank, None)
        self._pushed.pop(rank, None)
        self._packed.pop(rank, None)
        self._finite.pop(rank, None)

    def finite(self, rank: int) -> bool:
        """Is every value ``rank`` pushed finite? (:func:`~tensorx._ps.service.nonfinite.finite`)"""
        got = self._finite.get(rank)
        return self._all_finite(rank) if got is None else got

    def _all_finite(self, rank: int) -> bool:
        return all(part is None or sum_finite(part[1]) for part in self.packed(rank))

    def nonfinite(self, rank: int) -> list[str]:
        """The tables whose rows ``rank`` pushed hold NaN or Inf: a second pass, table by
        table, for their names, once :meth:`finite` (a sum per group) has found some."""
        return [self._specs[i].name for i, (_, values) in self._tables(rank).items()
                if not sum_finite(values)]

    def packed(self, rank: int) -> list[Rows | None]:
        """``rank``'s rows per group of :attr:`groups` (None: none in it), keyed by their
        group's row (see :class:`RowGroup`): sorted if each table's ids are."""
        got = self._packed.get(rank)
        if got is None:
            mine = self._tables(rank)
            got = self._packed[rank] = [g.pack(mine) for g in self.groups]
        return got

    def summed(self, ranks: Sequence[int]) -> list[Rows | None]:
        """Per group, the rows of ``ranks`` summed by key and divided by their number: every
        table's gradient at once, the same values :meth:`grad` gives table by table."""
        return [self.summed_group(ranks, k) for k in range(len(self.groups))]

    def parts(self, ranks: Sequence[int], k: int) -> list[Rows]:
        """The rows ``ranks`` pushed of group ``k``, rank by rank (ranks with none left
        out), keyed as :meth:`packed` keys them."""
        return [p for p in (self.packed(r)[k] for r in ranks) if p is not None]

    def summed_group(self, ranks: Sequence[int], k: int) -> Rows | None:
        """Group ``k``'s part of :meth:`summed` (None: no rank pushed rows of it)."""
        parts = self.parts(ranks, k)
        if not parts:
            return None
        with torch.no_grad():
            ids, values = sum_rows(parts, copy=False)
            if len(ranks) > 1:  # never in place in the rows a rank pushed
                values = values.div(len(ranks)) if values is parts[0][1] \
                    else values.div_(len(ranks))
        return ids, values

    def grad(self, ranks: Sequence[int], i: int) -> torch.Tensor | None:
        """Table ``i``'s gradient for an update of ``ranks`` (see the module docstring), or
        the one :meth:`gather` made."""
        if self._gathered is not None:
            return self._gathered.get(i)
        parts = [rows[i] for rows in map(self._tables, ranks) if i in rows]
        if not parts:
            return None
        with torch.no_grad():
            ids, values = sum_rows(parts)
            if len(ranks) > 1:
                values.div_(len(ranks))
        with no_invariant_checks():
            return torch.sparse_coo_tensor(ids.unsqueeze(0), values, self._specs[i].shape,
                                           is_coalesced=True)

    def gather(self, ranks: Sequence[int]) -> None:
        """Make every table's gradient now (it may be changed in place before the step)."""
        self._gathered = None
        self._gathered = {i: self.grad(ranks, i) for i in self._specs}

    def ungather(self) -> None:
        self._gathered = None


def sum_by_key(keys: Any, values: torch.Tensor) -> tuple[Any, torch.Tensor]:
    """The rows of ``values`` summed by ``keys`` (int64, one per row): (sorted unique keys,
    their sums). One stable numpy sort and one ``embedding_bag`` over the rows in that
    order: each key's rows are added one after the other from +0.0, in the order given
    (worker staging and a shard's sum of the ranks' rows both sum this way)."""
    order = np.argsort(keys, kind="stable")
    ordered = keys[order]
    first = np.empty(ordered.size, dtype=bool)
    first[:1] = True
    np.not_equal(ordered[1:], ordered[:-1], out=first[1:])
    starts = np.flatnonzero(first)  # of each run of equal keys
    summed = torch.nn.functional.embedding_bag(
        torch.from_numpy(order), values.reshape(len(order), math.prod(values.shape[1:])),
        torch.from_numpy(starts), mode="sum")
    return ordered[starts], summed.view(-1, *values.shape[1:])


def sum_rows(parts: Sequence[Rows], copy: bool = True) -> Rows:
    """The rows of ``parts`` summed by row id: (sorted unique ids, values), as
    ``coalesce()`` gives them. One part of sorted unique ids (what a worker stages) is
    taken as it is (its values copied unless ``copy`` is False: the gradient may be changed
    in place, the rows a rank pushed may not); else each id's rows added from zero in rank
    order (:func:`_sum_rows_bag` where it can, else one sort and one scatter-add)."""
    if len(parts) == 1:
        ids, values = parts[0]
        if ids.numel() < 2 or bool((ids[1:] > ids[:-1]).all()):
            return ids, values.clone() if copy else values
    if _bag_sums(parts):
        return _sum_rows_bag(parts)
    unique, inverse = _unique(torch.cat([p[0] for p in parts]))
    first = parts[0][1]
    summed = first.new_zeros((int(unique.numel()), *first.shape[1:]))
    at = 0
    for ids, values in parts:  # rank by rank: no copy of them all first
        summed.index_add_(0, inverse[at:at + ids.numel()], values)
        at += ids.numel()
    return unique, summed


def _bag_sums(parts: Sequence[Rows]) -> bool:
    """Can :func:`_sum_rows_bag` sum ``parts``: float32/64 rows in host memory."""
    dtype = parts[0][1].dtype
    return dtype in (torch.float32, torch.float64) and all(
        ids.device.type == "cpu" and values.device.type == "cpu" and values.dtype == dtype
        and values.dim() > 0 for ids, values in parts) and any(ids.numel() for ids, _ in parts)


def _sum_rows_bag(parts: Sequence[Rows]) -> Rows:
    """:func:`sum_rows` by :func:`sum_by_key` over the ranks' rows in rank order: each row
    id's rows added one after the other from zero, as the ``index_add_`` of rank after
    rank adds them (the same bits), in about half the time
    (the DLRM's two pushes of ~3500 rows: 0.10 vs 0.22-0.35 ms)."""
    unique, summed = sum_by_key(np.concatenate([ids.numpy() for ids, _ in parts]),
                                torch.cat([values for _, values in parts]))
    return torch.from_numpy(unique), summed


def _unique(keys: torch.Tensor) -> Rows:
    """``torch.unique(keys, sorted=True, return_inverse=True)``, from one sort: torch's
    unique took ~40% longer on a few thousand sorted runs of ids."""
    ordered, order = torch.sort(keys, stable=True)
    unique, at = torch.unique_consecutive(ordered, return_inverse=True)
    return unique, torch.empty_like(at).index_put_((order,), at)


@dataclass(frozen=True)
class RowGroup:
    """Tables whose rows share dtype and shape and lie a whole number of rows apart in the
    arena: one tensor of rows from ``offset`` views them all, and table ``i``'s row ``r`` is
    its row ``starts[i] + r`` (rows between tables, of other parameters, are never named)."""

    dtype: torch.dtype
    row_shape: tuple[int, ...]
    offset: int
    rows: int  # rows of the view, from offset to the end of the last table
    starts: dict[int, int]  # table index -> its first row in the view, ascending

    @property
    def row_bytes(self) -> int:
        return math.prod(self.row_shape) * self.dtype.itemsize

    def view(self, region: MemoryRegion) -> torch.Tensor:
        """The group's rows in ``region`` (an arena of the shard's layout)."""
        u8: torch.Tensor = region.view(torch.uint8)
        part = u8[self.offset:self.offset + self.rows * self.row_bytes]
        return part.view(self.dtype).view(self.rows, *self.row_shape)

    def pack(self, rows: Mapping[int, Rows]) -> Rows | None:
        """The group's tables' ``rows`` (by table index) as one (keys, values)."""
        mine = [(rows[i], start) for i, start in self.starts.items() if i in rows]
        if not mine:
            return None
        if len(mine) == 1:  # no copy of the rows
            (ids, values), start = mine[0]
            return (ids + start if start else ids), values
        # one add for all the tables' ids, not one per table
        keys = torch.cat([ids for (ids, _), _ in mine])
        counts = torch.tensor([int(ids.numel()) for (ids, _), _ in mine], device=keys.device)
        keys += torch.tensor([start for _, start in mine],
                             device=keys.device).repeat_interleave(counts)
        return keys, torch.cat([values for (_, values), _ in mine])

    def split(self, keys: torch.Tensor) -> dict[int, torch.Tensor]:
        """Sorted ``keys`` of the group as row ids per table (tables without any left out)."""
        starts = torch.tensor(list(self.starts.values()), dtype=keys.dtype)
        cuts = torch.searchsorted(keys, starts).tolist()
        out = {}
        for (i, start), part in zip(self.starts.items(), keys.tensor_split(cuts[1:]),
                                    strict=True):
            if part.numel():
                out[i] = part - start
        return out


def row_groups(specs: Mapping[int, Any]) -> list[RowGroup]:
    """The sparse tables ``specs`` (index -> spec) in :class:`RowGroup` s."""
    by: dict[tuple[Any, ...], list[tuple[int, Any]]] = {}
    for i, s in sorted(specs.items(), key=lambda item: item[1].offset):
        row_shape = tuple(s.shape[1:])
        row_bytes = math.prod(row_shape) * s.dtype.itemsize
        by.setdefault((s.dtype, row_shape, s.offset % max(1, row_bytes)), []).append((i, s))
    out = []
    for (dtype, row_shape, _), members in by.items():
        row_bytes = max(1, math.prod(row_shape) * dtype.itemsize)
        base = members[0][1].offset
        starts = {i: (s.offset - base) // row_bytes for i, s in members}
        end = max(starts[i] + s.shape[0] for i, s in members)
        out.append(RowGroup(dtype, row_shape, base, end, starts))
    return out
