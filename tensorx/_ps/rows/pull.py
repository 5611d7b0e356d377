"""The pull of a sparse table's changed rows as one packed write (issue 17).

A worker that holds a recent version needs, of each sparse table, only the rows changed
since (:mod:`tensorx._ps.rows.changed`). Written where they lie in its arena, scattered rows cost
one op each, or a run bridging the unchanged rows between them: a DLRM-shaped step with
Zipf ids wrote 26 MB of runs per worker for 0.8 MB of changed rows. So the worker lends the
shard an *inbox* (a region it exports writable and names in its push), the shard gathers
the changed rows of every table into one payload and writes it there with the rest of the
answer (one op), and the worker scatters them into its arena when the answer's notification
says the inbox holds them (``rows``: the payload's bytes). An inbox too small for an answer
is not used for it (the rows travel in runs, as before) and the answer says how large it
should be (``rows_want``); the worker grows it before its next push.

Payload, for the shard's sparse tables in plan order (``T`` of them)::

    u64 count[T] | int64 row ids, table after table | each table's rows [count, *row_shape]

each part starting at a multiple of :data:`ALIGN`. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from tensorx._ps.rows.tables import first_out_of_range, put_rows, take_rows
from tensorx.errors import ProtocolError
from tensorx.memregion import MemoryRegion, RegionDescriptor

if TYPE_CHECKING:
    from tensorx._analyzer.layout import DynamicEntry
    from tensorx.node import Node

__all__ = ["ALIGN", "Layout", "RowInbox", "RowOutbox", "layout"]

ALIGN = 64
COUNT = 8  # bytes of one count in the header (u64)

# a run of tables (see _spans): first table, end, the run's rows, each table's first row
# in the run (None: a run of one)
Span = tuple[int, int, int, "np.ndarray[Any, np.dtype[np.int64]] | None"]
Spans = dict[tuple[int, ...], list[Span]]  # _runs()' memo: by where the tables lie
# the write of a payload: (source buffer, inbox, source offset, inbox offset, bytes)
RowsWrite = tuple[MemoryRegion, RegionDescriptor, int, int, int]


def _up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass(frozen=True)
class Layout:
    """Where each part of a payload of given counts lies (byte offsets)."""

    counts: tuple[int, ...]
    ids: int  # offset of the ids
    rows: tuple[int, ...]  # offset of each table's rows
    nbytes: int


def layout(counts: Sequence[int], row_bytes: Sequence[int]) -> Layout:
    """The payload layout for ``counts`` rows of tables with rows of ``row_bytes``."""
    ids = _up(COUNT * len(counts))
    at = _up(ids + 8 * sum(counts))
    rows = []
    for count, size in zip(counts, row_bytes, strict=True):
        rows.append(at)
        at = _up(at + count * size)
    return Layout(tuple(counts), ids, tuple(rows), at)


def limit(row_bytes: Sequence[int], num_rows: Sequence[int]) -> int:
    """The largest payload worth sending: every row of every table (whole tables cost
    no more)."""
    return layout(list(num_rows), row_bytes).nbytes


def _bytes_of(region: MemoryRegion) -> torch.Tensor:
    return region.view(torch.uint8)  # type: ignore[no-any-return]


def _rows_view(u8: torch.Tensor, offset: int, count: int, spec: TableSpec) -> torch.Tensor:
    """``count`` rows of table ``spec`` (dtype, row_shape, row_bytes) at ``offset``."""
    part = u8[offset:offset + count * spec.row_bytes]
    return part.view(spec.dtype).view(count, *spec.row_shape)


@dataclass(frozen=True)
class TableSpec:
    """What both sides know of a sparse table from the plan."""

    name: str
    num_rows: int
    row_shape: tuple[int, ...]
    dtype: torch.dtype
    row_bytes: int

    @classmethod
    def of(cls, entry: DynamicEntry) -> TableSpec:
        """From a plan's dynamic entry."""
        return cls(entry.name, entry.num_rows, tuple(entry.row_shape),
                   getattr(torch, entry.dtype), entry.row_bytes)


class RowOutbox:
    """Shard side: each worker's inbox, and the payload buffer its answers are written from
    (one per rank: answers to a rank are sent one at a time)."""

    def __init__(self, entries: Sequence[DynamicEntry], device: str = "cpu") -> None:
        self.tables = [TableSpec.of(e) for e in entries]
        self.device = device
        self._inbox: dict[int, RegionDescriptor] = {}
        self._out: dict[int, MemoryRegion] = {}
        self._limit = limit([t.row_bytes for t in self.tables],
                            [t.num_rows for t in self.tables])
        self._runs: Spans = {}  # see _runs()
        # the last gathered answer: (rank, what stood for its rows, bytes); see op()
        self._done: tuple[int, tuple[object, ...], int] | None = None

    def announce(self, rank: int, raw: bytes) -> None:
        """``rank`` lends a new inbox (``raw``: its descriptor; b"": the one it lent)."""
        if raw:
            self._inbox[rank] = RegionDescriptor.from_bytes(raw)

    def forget(self, rank: int) -> None:
        """``rank`` left: its inbox is gone with its connection."""
        self._inbox.pop(rank, None)
        if self._done is not None and self._done[0] == rank:
            self._done = None
        out = self._out.pop(rank, None)
        if out is not None:
            out.close()

    def size(self, ids: Sequence[torch.Tensor | None]) -> int:
        """Payload bytes for these row ids (per table, plan order; None: none)."""
        counts = [0 if i is None else int(i.numel()) for i in ids]
        return layout(counts, [t.row_bytes for t in self.tables]).nbytes

    def plan(self, rank: int, ids: Sequence[torch.Tensor | None]) -> tuple[int, int]:
        """(bytes the answer to ``rank`` writes into its inbox, or 0: not used;
        the inbox size ``rank`` should have, or 0: it is large enough or no payload is
        worth it)."""
        need = self.size(ids)
        if need > self._limit:
            return 0, 0
        inbox = self._inbox.get(rank)
        if inbox is None or inbox.nbytes < need:
            return 0, need
        return need, 0

    def op(self, rank: int, tables: Sequence[torch.Tensor],
           ids: Sequence[torch.Tensor | None], same: Sequence[object] = ()) -> RowsWrite:
        """Gather the rows ``ids`` of ``tables`` (views of the arena the answer is of) into
        ``rank``'s payload buffer; the write of it into ``rank``'s inbox.

        ``same``: objects that stand for these rows of this arena as they are now (the
        shard's memo of the changed rows, the arena): an answer to another rank made with
        the very same objects (``is``) since holds the same payload, which is copied from
        its buffer instead of gathered from the arena again (the workers of an update all
        get the same rows: one gather of them, not one per worker)."""
        counts = [0 if i is None else int(i.numel()) for i in ids]
        at = layout(counts, [t.row_bytes for t in self.tables])
        out = self._buffer(rank, at.nbytes)
        u8 = _bytes_of(out)
        done = self._done
        if same and done is not None and done[0] != rank and len(done[1]) == len(same) \
                and all(a is b for a, b in zip(done[1], same, strict=True)) \
                and done[2] == at.nbytes:
            u8[:at.nbytes].copy_(_bytes_of(self._out[done[0]])[:at.nbytes])
            return (out, self._inbox[rank], 0, 0, at.nbytes)
        self._done = None  # rank's buffer is being rewritten
        u8[:COUNT * len(counts)].view(torch.int64).copy_(
            torch.tensor(counts, dtype=torch.int64))
        present = [i for i in ids if i is not None and i.numel()]
        flat = u8[at.ids:at.ids + 8 * sum(counts)].view(torch.int64)
        if present:
            _cat_into(present, flat)
        with torch.no_grad():
            for first, block, keys, rows in _runs(tables, self.tables, counts, flat,
                                                  self._runs):
                take_rows(block, keys, out=_rows_view(u8, at.rows[first], rows,
                                                      self.tables[first]))
        if same:  # (held: the objects' ids cannot be reused while they are compared)
            self._done = (rank, tuple(same), at.nbytes)
        return (out, self._inbox[rank], 0, 0, at.nbytes)

    def _buffer(self, rank: int, nbytes: int) -> MemoryRegion:
        out = self._out.get(rank)
        if out is None or out.nbytes < nbytes:
            if out is not None:
                out.close()
            out = self._out[rank] = MemoryRegion.allocate(max(nbytes, 1 << 16),
                                                          device=self.device)
        return out

    def close(self) -> None:
        self._done = None
        for out in self._out.values():
            out.close()
        self._out.clear()


class RowInbox:
    """Worker side, one shard: the inbox region, and the scatter of what lands in it."""

    def __init__(self, entries: Sequence[DynamicEntry], device: str = "cpu") -> None:
        self.tables = [TableSpec.of(e) for e in entries]
        self.device = device
        self.limit = limit([t.row_bytes for t in self.tables], [t.num_rows for t in self.tables])
        # a first guess: the staging's first capacity, for every worker alike; grown on demand
        self.want = min(self.limit, layout([e.capacity_rows for e in entries],
                                           [t.row_bytes for t in self.tables]).nbytes)
        self.region: MemoryRegion | None = None
        self._runs: Spans = {}  # see _runs()

    def announce(self, node: Node) -> bytes:
        """The descriptor to name in the next push: b"" when the shard has ours already."""
        if self.region is not None and self.region.nbytes >= self.want:
            return b""
        if self.region is not None:
            self.region.close()  # unexported with it: nothing is written there any more
        self.region = MemoryRegion.allocate(self.want, device=self.device)
        return node.export(self.region, access="w").to_bytes()  # type: ignore[no-any-return]

    def forget(self) -> None:
        """A new connection: the next push announces the inbox again."""
        self.close()

    def accept(self, msg: Mapping[str, Any], tables: Sequence[torch.Tensor]) -> None:
        """After an answer: scatter the rows it put in the inbox into ``tables`` (the
        arena's views, plan order), and note the size the shard asks for."""
        want = msg["rows_want"]
        if want:
            self.want = min(self.limit, max(want + want // 4, 2 * self.want))
        if msg["rows"]:
            self._scatter(msg["rows"], tables)

    def _scatter(self, nbytes: int, tables: Sequence[torch.Tensor]) -> None:
        if self.region is None or nbytes > self.region.nbytes:
            raise ProtocolError(f"answer says {nbytes} B of rows landed in an inbox of "
                                f"{0 if self.region is None else self.region.nbytes} B")
        u8 = _bytes_of(self.region)
        counts = u8[:COUNT * len(self.tables)].view(torch.int64).tolist()
        if any(c < 0 for c in counts):
            raise ProtocolError("rows answer: negative row count")
        at = layout(counts, [t.row_bytes for t in self.tables])
        if at.nbytes != nbytes:
            raise ProtocolError(f"rows answer of {nbytes} B holds {at.nbytes} B of rows")
        flat = u8[at.ids:at.ids + 8 * sum(counts)].view(torch.int64)
        _check_ids(flat, counts, self.tables)  # all of them, before any row lands
        with torch.no_grad():
            for first, block, keys, rows in _runs(tables, self.tables, counts, flat,
                                                  self._runs):
                put_rows(block, keys, _rows_view(u8, at.rows[first], rows, self.tables[first]))

    def close(self) -> None:
        if self.region is not None:
            self.region.close()
            self.region = None


def _cat_into(ids: Sequence[torch.Tensor], flat: torch.Tensor) -> None:
    """``torch.cat(ids, out=flat)``, where ``flat`` may be on another device than the ids
    (a GPU shard's payload buffer, the changed row ids it keeps in host memory): joined
    where they are, then one copy."""
    if all(i.device == flat.device for i in ids):
        torch.cat(list(ids), out=flat)
    else:
        flat.copy_(torch.cat([i.to(ids[0].device) for i in ids]))


def _runs(tables: Sequence[torch.Tensor], specs: Sequence[TableSpec], counts: Sequence[int],
          flat: torch.Tensor, memo: Spans) -> Iterator[tuple[int, torch.Tensor, torch.Tensor,
                                                          int]]:
    """The copies of a payload's rows, a run of tables at a time: (first table, the run's
    tables as one tensor of rows, the payload's ids of them as its row numbers, how many).

    Tables next to each other in plan order that lie back to back in one piece of memory
    (the arena), of one dtype and row shape with rows a multiple of :data:`ALIGN` bytes
    (so their rows are back to back in the payload too) are one run: one gather or
    scatter for all of them, not one per table (26 of a DLRM-shaped shard's). The runs
    of some tables are found once (``memo``, by where the tables lie)."""
    key = tuple(t.data_ptr() for t in tables)
    spans = memo.get(key)
    if spans is None:
        memo.clear()  # the tables moved: the old runs are of no use
        spans = memo[key] = _spans(tables, specs)
    at = 0
    for first, end, total, starts in spans:
        rows = sum(counts[first:end])
        if rows:
            keys, block = flat[at:at + rows], tables[first]
            if starts is not None:  # the run's tables as one, their ids as its row numbers
                keys = keys + torch.from_numpy(np.repeat(starts, counts[first:end])).to(
                    keys.device)
                block = torch.as_strided(block, (total, *block.shape[1:]), block.stride())
            yield first, block, keys, rows
        at += rows


def _spans(tables: Sequence[torch.Tensor], specs: Sequence[TableSpec]) -> list[Span]:
    """(first table, end, the run's rows, each table's first row in the run or None for a
    run of one) per run of :func:`_runs` (no tensor: a memo must not keep memory alive)."""
    out: list[Span] = []
    k = 0
    while k < len(tables):
        end = k + 1
        while end < len(tables) and _follows(tables[end - 1], tables[end], specs[k],
                                             specs[end]):
            end += 1
        sizes = [int(t.shape[0]) for t in tables[k:end]]
        out.append((k, end, sum(sizes), np.cumsum([0, *sizes[:-1]]) if end > k + 1 else None))
        k = end
    return out


def _follows(a: torch.Tensor, b: torch.Tensor, spec_a: TableSpec, spec_b: TableSpec) -> bool:
    """Does table ``b`` start where table ``a`` ends, both of one run (see :func:`_runs`)?"""
    return (spec_a.dtype == spec_b.dtype and spec_a.row_shape == spec_b.row_shape
            and spec_a.row_bytes % ALIGN == 0 and a.is_contiguous() and b.is_contiguous()
            and a.device == b.device and a.dim() > 0
            and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
            and b.data_ptr() == a.data_ptr() + a.numel() * a.element_size())


def _check_ids(ids: torch.Tensor, counts: Sequence[int], tables: Sequence[TableSpec]) -> None:
    """ProtocolError unless every id lies in its table (one pass over all of them)."""
    table = first_out_of_range(ids, counts, [t.num_rows for t in tables])
    if table is not None:
        raise ProtocolError(f"rows answer: a row of {tables[table].name} out of range")
