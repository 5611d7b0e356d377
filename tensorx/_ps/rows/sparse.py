"""The dynamic path between a worker and a shard: sparse gradients as rows, not tables.

Worker: its :class:`SparseSender` owns the staging (:mod:`tensorx._ps.rows.staging`): it
stages each sparse gradient (indices, then rows) in a registered staging region, exports it
read-only, writes the header slots (:mod:`tensorx._ps.rows.header`) into its header region
on the shard, and names any new staging region in the push message. Shard: for each
dynamic entry, decodes the header, reads ``nbytes`` straight out of the worker's staging
region (one-sided), checks the indices and keeps a copy of the rows; the rows of a push
are handed over only once all of them arrived (:mod:`tensorx._ps.rows.tables` makes the
optimizer's sparse gradient of them). Only the touched rows cross the network, and the
shard's work scales with them.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from tensorx._ps.common.device import fence
from tensorx._ps.rows.header import ALIGN, HeaderSlots, budget_bytes, values_offsets
from tensorx._ps.rows.pull import RowInbox, RowOutbox
from tensorx._ps.rows.staging import SparseStaging
from tensorx._ps.rows.tables import PushedRows, RowBatch, SparseRows, first_out_of_range
from tensorx._text import printable
from tensorx.errors import ProtocolError, RegionError
from tensorx.memregion import MemoryRegion, RegionDescriptor

if TYPE_CHECKING:
    from tensorx._analyzer.binding import Binding
    from tensorx._analyzer.plan import TransferPlan
    from tensorx.endpoint import Endpoint
    from tensorx.node import Node

__all__ = ["SparseReceiver", "SparseSender"]


class HasRows(Protocol):
    """What the answers read of a shard's state (a ``ShardState``, which sits above rows/):
    its sparse tables."""

    @property
    def rows(self) -> SparseRows: ...


class SparseSender:
    """Worker side: stage, export, and say which staging regions are new. It owns the
    staging and header regions (on the model's device, and host memory), from its
    construction to :meth:`close`, whatever arenas the model is bound to meanwhile."""

    def __init__(self, binding: Binding, model: torch.nn.Module, node: Node) -> None:
        self.binding = binding
        self.node = node
        self.entries = list(binding.plan.dynamic_entries)
        self._params = dict(model.named_parameters())
        self.staging = SparseStaging(binding.plan, _model_device(self._params))
        self._exported: dict[int, int] = {}  # shard -> staging region id we last announced
        self._tables: dict[int, list[torch.Tensor]] = {}  # shard -> its tables' views
        device = str(next(iter(binding.regions.values())).device) if binding.regions else "cpu"
        self.inboxes = {s: RowInbox([e for e in self.entries if e.shard == s], device)
                        for s in {e.shard for e in self.entries}}

    def rebind(self, binding: Binding) -> None:
        """The model was bound anew (arenas mapped or unmapped): its tables are views of
        the new binding's arenas. The staging is ours and stays, and so do its exports."""
        self.binding = binding
        self._tables.clear()

    def forget_exports(self) -> None:
        """A new server knows none of our staging regions: announce them all again."""
        self._exported.clear()
        for inbox in self.inboxes.values():
            inbox.forget()

    def headers(self, shard: int) -> MemoryRegion:
        """Our header slots for ``shard`` (what :meth:`stage` last wrote), to write to its
        ``headers`` arena with the push."""
        return self.staging.headers(shard)

    def inbox(self, shard: int) -> bytes:
        """The descriptor of our inbox for ``shard``'s rows to name in the push (b"": the
        shard has it; see :mod:`tensorx._ps.rows.pull`)."""
        inbox = self.inboxes.get(shard)
        return b"" if inbox is None else inbox.announce(self.node)

    def accept(self, shard: int, msg: dict[str, Any]) -> None:
        """``shard``'s answer landed: scatter the rows it wrote into our inbox."""
        inbox = self.inboxes.get(shard)
        if inbox is not None and (msg["rows"] or msg["rows_want"]):
            tables = self._tables.get(shard)
            if tables is None:  # made once per binding (see rebind())
                tables = self._tables[shard] = [self.binding.tensor_view(e.name, "params")
                                                for e in self.entries if e.shard == shard]
            inbox.accept(msg, tables)

    def close(self) -> None:
        self._tables.clear()
        for inbox in self.inboxes.values():
            inbox.close()
        self.staging.close()

    def stage(self, shard: int) -> dict[str, bytes]:
        """Stage this shard's sparse gradients; descriptors of staging regions to announce
        (every table of a shard shares one region: the shard reads them in one op)."""
        entries = [e for e in self.entries if e.shard == shard]
        if not entries:
            return {}
        for entry in entries:
            param = self._params[entry.name]
            if param.grad is None or not param.grad.is_sparse:
                param.grad = _empty_sparse(param, entry)
        staged = self.staging.stage_params(shard, self._params)
        if self._exported.get(shard) == staged.region.region_id:
            return {}
        raw = self.node.export(staged.region, access="r").to_bytes()
        self._exported[shard] = staged.region.region_id
        return {entry.name: raw for entry in entries}


def _model_device(params: Mapping[str, torch.Tensor]) -> str:
    """Where the staging goes: the model's device (its first parameter's)."""
    return next((str(p.device) for p in params.values()), "cpu")


def _empty_sparse(param: torch.Tensor, entry: Any) -> torch.Tensor:
    """A sparse gradient for ``param`` (on its device, of its dtype: torch refuses a
    ``.grad`` that is not) holding no rows, or the nonzero rows of a dense one."""
    dense = param.grad
    if dense is not None:  # somebody handed us a dense gradient: send its nonzero rows
        return dense.to_sparse(1)
    # not sparse_coo_tensor(): on torch 2.11 (CUDA) it warns that invariants go unchecked
    rows = torch.zeros((0, *entry.row_shape), dtype=param.dtype, device=param.device)
    return rows.to_sparse(1).sparse_resize_(param.shape, 1, rows.dim() - 1)


class SparseReceiver:
    """Shard side: per-worker header regions, staging descriptors, and the scatter.

    The rows are read into a buffer on the shard's ``device`` (next to the slots they are
    scattered into); the small headers stay in host memory, where they are decoded."""

    def __init__(self, plan: TransferPlan, shard: int, num_workers: int,
                 device: str = "cpu") -> None:
        self.device = device
        self.entries = [d for d in plan.dynamic_entries if d.shard == shard]
        offsets = {e.name: e.offset for e in plan.shard_entries(shard) if e.kind == "dynamic"}
        self._offsets = offsets
        self._budget = np.array([budget_bytes([e]) for e in self.entries])  # packed, aligned
        self._num_rows = np.array([e.num_rows for e in self.entries])
        self._kinds = _kinds(self.entries, offsets)
        self._slots = HeaderSlots(self.entries)
        size = plan.header_bytes(shard)
        self.headers = [MemoryRegion.allocate(size) for _ in range(num_workers)]
        self._staging: dict[tuple[int, str], RegionDescriptor] = {}
        self._recv: MemoryRegion | None = None
        self._recv_bytes = torch.empty(0, dtype=torch.uint8)
        self._views: dict[tuple[torch.dtype, int], torch.Tensor] = {}
        self.answers = RowOutbox(self.entries, device)  # the rows each answer writes
        self._views_of: tuple[Any, list[torch.Tensor]] = (None, [])  # rows_op()'s tables

    def renew(self, rank: int) -> None:
        """``rank`` left: fresh header memory, and forget its staging regions (a new
        connection announces its own)."""
        old = self.headers[rank]
        self.headers[rank] = MemoryRegion.allocate(old.nbytes)
        old.close()
        for key in [k for k in self._staging if k[0] == rank]:
            del self._staging[key]
        self.answers.forget(rank)

    def announce(self, rank: int, staging: Mapping[Any, Any], inbox: bytes = b"") -> None:
        """``rank``'s new staging regions (table name -> descriptor) and inbox; taken whole
        or not at all (ProtocolError)."""
        names = {d.name for d in self.entries}
        new = {}
        for name, raw in staging.items():
            if name not in names or not isinstance(raw, bytes):
                raise ProtocolError("staging announcement for unknown tensor "
                                    f"{printable(name, 100)}")
            new[(rank, name)] = RegionDescriptor.from_bytes(raw)
        self.answers.announce(rank, inbox)
        self._staging.update(new)

    async def receive(self, ep: Endpoint, rank: int, timeout: float | None) -> PushedRows:
        """Every sparse gradient of ``rank``: table name -> (row ids, rows), on the shard's
        device. One read per staging region of the worker (one per shard, whatever the
        number of tables); raises, handing over nothing, if any read or check fails."""
        fields = self._slots.fields(self.headers[rank]).astype(np.int64)
        parts = self._parts(rank, fields)
        if not parts:
            return PushedRows()
        recv, data = self._buffer(sum(p.size for p in parts))
        at, reads = 0, []
        base = np.zeros(len(self.entries), dtype=np.int64)  # table -> its bytes' shift
        for part in parts:
            reads.append(ep.read(recv, part.desc, offset=at, remote_offset=part.lo,
                                 nbytes=part.hi - part.lo, timeout=timeout))
            base[part.tables] = at - part.lo
            at += part.size
        for result in await asyncio.gather(*reads, return_exceptions=True):
            if isinstance(result, BaseException):
                raise result
        # the rows are gathered out of the buffer (the next push is read into it)
        pushed = PushedRows([self._gather(rank, data, kind, fields, base)
                             for kind in self._kinds if fields[0][kind.tables].any()])
        fence(self.device)
        return pushed

    def _parts(self, rank: int, fields: Any) -> list[_Part]:
        """``rank``'s staged tables, by the staging region they lie in."""
        rows, nbytes, offset = fields[0], fields[1], fields[4]
        parts: dict[int, _Part] = {}
        for k in np.flatnonzero(rows).tolist():
            desc = self._staging.get((rank, self.entries[k].name))
            if desc is None:
                raise ProtocolError(f"rank {rank} sent rows of {self.entries[k].name} "
                                    "without staging")
            parts.setdefault(desc.region_id, _Part(desc)).tables.append(k)
        for part in parts.values():
            part.check(rank, offset[part.tables], nbytes[part.tables], self._budget,
                       self.entries)
        return list(parts.values())

    def _gather(self, rank: int, data: torch.Tensor, kind: _Kind, fields: Any,
                base: Any) -> RowBatch:
        """The rows of ``kind``'s tables out of the received bytes ``data`` (a table's
        payload at ``base + offset``): one gather for all their ids, one for all their
        rows, and every id checked against its table's size."""
        tables = kind.tables[fields[0][kind.tables] > 0]
        counts = fields[0][tables]
        at = base[tables] + fields[4][tables]  # each payload's first byte in data
        first = np.cumsum(counts) - counts  # each table's first row in the batch
        total = int(counts.sum())
        pos = np.repeat(at // 8 - first, counts) + np.arange(total)
        ids = self._typed(data, torch.int64, 8).index_select(
            0, torch.from_numpy(pos).to(data.device)).view(-1)
        bad = first_out_of_range(ids, counts, self._num_rows[tables])
        if bad is not None:
            raise RegionError(f"rank {rank}: {self.entries[tables[bad]].name} row index out "
                              "of range")
        shape = (total, *kind.row_shape)
        if not kind.row_bytes:  # rows of no element: nothing to read
            values = torch.empty(shape, dtype=kind.dtype, device=data.device)
        else:
            per_row = kind.row_bytes // kind.chunk
            rows = np.repeat((at + values_offsets(counts)) // kind.chunk - first * per_row,
                             counts) + np.arange(total) * per_row
            if per_row > 1:
                rows = (rows[:, None] + np.arange(per_row)).ravel()
            values = self._typed(data, kind.dtype, kind.chunk).index_select(
                0, torch.from_numpy(rows).to(data.device)).view(shape)
        return RowBatch(tuple(self.entries[k].name for k in tables.tolist()),
                        (*first.tolist(), total), ids, values)

    def _typed(self, data: torch.Tensor, dtype: torch.dtype, chunk: int) -> torch.Tensor:
        """``data`` (the receive buffer) as rows of ``chunk`` bytes of ``dtype`` (made once
        per buffer)."""
        key = (dtype, chunk)
        got = self._views.get(key)
        if got is None:
            got = self._views[key] = data[:data.numel() // chunk * chunk].view(dtype).view(
                -1, chunk // dtype.itemsize)
        return got

    def _buffer(self, nbytes: int) -> tuple[MemoryRegion, torch.Tensor]:
        """The receive buffer, at least ``nbytes``, and its bytes as a tensor."""
        region = self._recv
        if region is None or region.nbytes < nbytes:
            if region is not None:
                region.close()
            region = self._recv = MemoryRegion.allocate(max(nbytes, 1 << 16),
                                                        device=self.device)
            self._recv_bytes = region.view(torch.uint8)
            self._views = {}
        return region, self._recv_bytes

    def rows_plan(self, rank: int, state: HasRows, changed: dict[int, Any]) -> tuple[int, int]:
        """For an answer to ``rank`` of the rows ``changed`` (see
        :meth:`tensorx._ps.rows.changed.ChangedRows.since`): (bytes of rows it writes into the
        worker's inbox, 0: none; the inbox size to ask for, 0: none)."""
        return self.answers.plan(rank, self._ids(state, changed))

    def rows_op(self, rank: int, state: HasRows, region: MemoryRegion,
                changed: dict[int, Any]) -> tuple[Any, ...]:
        """The write of the rows ``changed`` of the arena ``region`` into ``rank``'s inbox
        (after :meth:`rows_plan` said it fits)."""
        key = (region.region_id, id(state))
        if self._views_of[0] != key:  # the tables' views, made once per arena
            self._views_of = (key, state.rows.views(
                region, [state.rows.index(e.name) for e in self.entries]))
        return self.answers.op(rank, self._views_of[1], self._ids(state, changed),
                               same=(changed, region))

    def _ids(self, state: HasRows, changed: dict[int, Any]) -> list[Any]:
        return [changed.get(state.rows.index(e.name)) for e in self.entries]

    def close(self) -> None:
        self._views_of = (None, [])
        self.answers.close()
        for region in [*self.headers, *([self._recv] if self._recv else [])]:
            region.close()


@dataclass
class _Part:
    """The tables a worker staged in one of its staging regions, and the span they take."""

    desc: RegionDescriptor
    tables: list[int] = field(default_factory=list)  # indices of the receiver's entries
    lo: int = 0
    hi: int = 0

    @property
    def size(self) -> int:
        """Its bytes in the receive buffer (aligned: the next part's ids view int64)."""
        return -(-(self.hi - self.lo) // ALIGN) * ALIGN

    def check(self, rank: int, offset: Any, nbytes: Any, budget: Any, entries: Any) -> None:
        """Set the span of payloads at ``offset`` of ``nbytes``; RegionError if it is more
        than its tables can take when packed (``budget``: each table's most) or a payload
        ends past the staging region (naming its table: the read's refusal names none),
        before anything is allocated or read."""
        ends = offset + nbytes
        self.lo, self.hi = int(offset.min()), int(ends.max())
        if self.hi - self.lo > int(budget[self.tables].sum()):
            raise RegionError(f"rank {rank}: staged rows span {self.hi - self.lo} B, more "
                              "than their tables can take")
        past = np.flatnonzero(ends > self.desc.nbytes)
        if past.size:
            raise RegionError(f"rank {rank}: {entries[self.tables[int(past[0])]].name} rows "
                              f"end past their staging region of {self.desc.nbytes} B")


@dataclass(frozen=True)
class _Kind:
    """The tables of one dtype and row shape (indices of the receiver's entries, in arena
    order): their rows are gathered together, in chunks of ``chunk`` bytes (payloads are
    ``ALIGN``-aligned, so a row may start on any multiple of it, not of its size)."""

    dtype: torch.dtype
    row_shape: tuple[int, ...]
    row_bytes: int
    chunk: int
    tables: Any  # numpy int64 array


def _kinds(entries: list[Any], offsets: Mapping[str, int]) -> list[_Kind]:
    by: dict[tuple[str, tuple[int, ...]], list[int]] = {}
    for k, e in enumerate(entries):
        by.setdefault((e.dtype, tuple(e.row_shape)), []).append(k)
    out = []
    for (dtype, row_shape), members in by.items():
        members.sort(key=lambda k: offsets[entries[k].name])
        row_bytes = entries[members[0]].row_bytes
        out.append(_Kind(getattr(torch, dtype), row_shape, row_bytes,
                         math.gcd(row_bytes, ALIGN), np.array(members, dtype=np.int64)))
    return out
