"""The dynamic path between a worker and a shard: sparse gradients as rows, not tables.

Worker: stages each sparse gradient (indices, then rows) in a registered staging region,
exports it read-only, writes the header slots into its header region on the shard, and
names any new staging region in the push message. Shard: for each dynamic entry, decodes
the header, reads ``nbytes`` straight out of the worker's staging region (one-sided), checks
the indices and keeps a copy of the rows; the rows of a push are handed over only once all
of them arrived (:mod:`tensorx._ps.rows` makes the optimizer's sparse gradient of them).
Only the touched rows cross the network, and the shard's work scales with them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from tensorx._analyzer.sparse import ALIGN, budget_bytes, read_headers
from tensorx._ps.device import fence
from tensorx._ps.rowpull import RowInbox, RowOutbox
from tensorx.errors import ProtocolError, RegionError
from tensorx.memregion import MemoryRegion, RegionDescriptor

__all__ = ["SparseReceiver", "SparseSender", "dynamic_path_ok"]


def dynamic_path_ok(plan: Any) -> bool:
    """True when the plan has sparse tensors and none of them was split into chunks."""
    dynamic = [e for e in plan.entries if e.kind == "dynamic"]
    return bool(dynamic) and all(e.whole for e in dynamic)


class SparseSender:
    """Worker side: stage, export, and say which staging regions are new."""

    def __init__(self, binding: Any, model: torch.nn.Module, node: Any) -> None:
        self.binding = binding
        self.node = node
        self.entries = list(binding.plan.dynamic_entries)
        self._params = dict(model.named_parameters())
        self._exported: dict[int, int] = {}  # shard -> staging region id we last announced
        device = str(next(iter(binding.regions.values())).device) if binding.regions else "cpu"
        self.inboxes = {s: RowInbox([e for e in self.entries if e.shard == s], device)
                        for s in {e.shard for e in self.entries}}

    def rebind(self, binding: Any) -> None:
        """The model was bound anew (arenas mapped or unmapped): stage into the new
        binding's regions, and announce them."""
        self.binding = binding
        self._exported.clear()

    def forget_exports(self) -> None:
        """A new server knows none of our staging regions: announce them all again."""
        self._exported.clear()
        for inbox in self.inboxes.values():
            inbox.forget()

    def inbox(self, shard: int) -> bytes:
        """The descriptor of our inbox for ``shard``'s rows to name in the push (b"": the
        shard has it; see :mod:`tensorx._ps.rowpull`)."""
        inbox = self.inboxes.get(shard)
        return b"" if inbox is None else inbox.announce(self.node)

    def accept(self, shard: int, msg: dict[str, Any]) -> None:
        """``shard``'s answer landed: scatter the rows it wrote into our inbox."""
        inbox = self.inboxes.get(shard)
        if inbox is not None and (msg["rows"] or msg["rows_want"]):
            tables = [self.binding.tensor_view(e.name, "params") for e in self.entries
                      if e.shard == shard]
            inbox.accept(msg, tables)

    def close(self) -> None:
        for inbox in self.inboxes.values():
            inbox.close()

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
        staged = self.binding.stage_sparse(shard)
        if self._exported.get(shard) == staged.region.region_id:
            return {}
        raw = self.node.export(staged.region, access="r").to_bytes()
        self._exported[shard] = staged.region.region_id
        return {entry.name: raw for entry in entries}


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

    def __init__(self, plan: Any, shard: int, num_workers: int, device: str = "cpu") -> None:
        self.device = device
        self.entries = [d for d in plan.dynamic_entries if d.shard == shard]
        offsets = {e.name: e.offset for e in plan.shard_entries(shard) if e.kind == "dynamic"}
        self._offsets = offsets
        self._budget = {e.name: budget_bytes([e]) for e in self.entries}  # packed, aligned
        size = plan.header_bytes(shard)
        self.headers = [MemoryRegion.allocate(size) for _ in range(num_workers)]
        self._staging: dict[tuple[int, str], RegionDescriptor] = {}
        self._recv: MemoryRegion | None = None
        self.answers = RowOutbox(self.entries, device)  # the rows each answer writes

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
        self.answers.announce(rank, inbox)
        names = {d.name for d in self.entries}
        for name, raw in staging.items():
            if name not in names or not isinstance(raw, bytes):
                raise ProtocolError(f"staging announcement for unknown tensor {name!r}")
            self._staging[(rank, name)] = RegionDescriptor.from_bytes(raw)

    async def receive(self, ep: Any, rank: int,
                      timeout: float | None) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Every sparse gradient of ``rank``: table name -> (row ids, rows), on the shard's
        device. One read per staging region of the worker (one per shard, whatever the
        number of tables); raises, handing over nothing, if any read or check fails."""
        parts = self._parts(rank)
        if not parts:
            return {}
        recv = self._buffer(sum(p.size for p in parts))
        at, reads = 0, []
        for part in parts:
            reads.append(ep.read(recv, part.desc, offset=at, remote_offset=part.lo,
                                 nbytes=part.hi - part.lo, timeout=timeout))
            at += part.size
        for result in await asyncio.gather(*reads, return_exceptions=True):
            if isinstance(result, BaseException):
                raise result
        # one copy of it all: the next push's rows are read into the same buffer
        data = recv.view(torch.uint8, (at,), 0).clone()
        fence(self.device)
        got, at, typed = {}, 0, _Typed(data)
        for part in parts:
            for entry, header in part.tables:
                got[entry.name] = typed.payload(entry, header, at + header.offset - part.lo)
            at += part.size
        _check_rows(rank, got, self.entries)
        return got

    def _parts(self, rank: int) -> list[_Part]:
        """``rank``'s staged tables, by the staging region they lie in."""
        parts: dict[int, _Part] = {}
        for entry, header in zip(self.entries, read_headers(self.headers[rank], self.entries),
                                 strict=True):
            if header.rows == 0:
                continue
            desc = self._staging.get((rank, entry.name))
            if desc is None:
                raise ProtocolError(f"rank {rank} sent rows of {entry.name} without staging")
            parts.setdefault(desc.region_id, _Part(desc)).tables.append((entry, header))
        for part in parts.values():
            part.check(rank, self._budget)
        return list(parts.values())

    def _buffer(self, nbytes: int) -> MemoryRegion:
        region = self._recv
        if region is None or region.nbytes < nbytes:
            if region is not None:
                region.close()
            region = self._recv = MemoryRegion.allocate(max(nbytes, 1 << 16),
                                                        device=self.device)
        return region

    def rows_plan(self, rank: int, state: Any, changed: dict[int, Any]) -> tuple[int, int]:
        """For an answer to ``rank`` of the rows ``changed`` (see
        :meth:`tensorx._ps.changed.ChangedRows.since`): (bytes of rows it writes into the
        worker's inbox, 0: none; the inbox size to ask for, 0: none)."""
        return self.answers.plan(rank, self._ids(state, changed))

    def rows_op(self, rank: int, state: Any, region: MemoryRegion,
                changed: dict[int, Any]) -> tuple[Any, ...]:
        """The write of the rows ``changed`` of the arena ``region`` into ``rank``'s inbox
        (after :meth:`rows_plan` said it fits)."""
        tables = state.rows.views(region, [state.rows.index(e.name) for e in self.entries])
        return self.answers.op(rank, tables, self._ids(state, changed))

    def _ids(self, state: Any, changed: dict[int, Any]) -> list[Any]:
        return [changed.get(state.rows.index(e.name)) for e in self.entries]

    def close(self) -> None:
        self.answers.close()
        for region in [*self.headers, *([self._recv] if self._recv else [])]:
            region.close()


@dataclass
class _Part:
    """The tables a worker staged in one of its staging regions, and the span they take."""

    desc: RegionDescriptor
    tables: list[tuple[Any, Any]] = field(default_factory=list)  # (entry, header)
    lo: int = 0
    hi: int = 0

    @property
    def size(self) -> int:
        """Its bytes in the receive buffer (aligned: the next part's ids view int64)."""
        return -(-(self.hi - self.lo) // ALIGN) * ALIGN

    def check(self, rank: int, budget: Mapping[str, int]) -> None:
        """Set the span; RegionError if it is more than its tables can take when packed
        (``budget``: each table's most, by name), before anything is allocated or read."""
        self.lo = min(h.offset for _, h in self.tables)
        self.hi = max(h.offset + h.nbytes for _, h in self.tables)
        if self.hi - self.lo > sum(budget[e.name] for e, _ in self.tables):
            raise RegionError(f"rank {rank}: staged rows span {self.hi - self.lo} B, more "
                              "than their tables can take")


class _Typed:
    """The received bytes viewed once per dtype: a table's ids and rows are then one slice
    each (the bytes are 64-aligned; five view ops per table were a tenth of a push)."""

    def __init__(self, data: torch.Tensor) -> None:
        self.data = data
        self.views: dict[str, torch.Tensor] = {"int64": data.view(torch.int64)}

    def view(self, dtype: str) -> torch.Tensor:
        got = self.views.get(dtype)
        if got is None:
            got = self.views[dtype] = self.data.view(getattr(torch, dtype))
        return got

    def payload(self, entry: Any, header: Any, at: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(row ids, rows) of the payload at byte ``at``; views."""
        rows = header.rows
        ids = self.views["int64"][at // 8:at // 8 + rows]
        values = self.view(entry.dtype)
        size = values.element_size()
        start = (at + entry.values_offset(rows)) // size
        return ids, values[start:start + (header.nbytes - entry.values_offset(rows)) // size
                           ].view(rows, *entry.row_shape)


def _check_rows(rank: int, got: dict[str, tuple[torch.Tensor, torch.Tensor]],
                entries: list[Any]) -> None:
    """RegionError unless every row id lies in its table (one pass over all of them)."""
    sizes = {e.name: e.num_rows for e in entries}
    ids = torch.cat([i for i, _ in got.values()])
    counts = torch.tensor([int(i.numel()) for i, _ in got.values()], device=ids.device)
    limits = torch.tensor([sizes[n] for n in got], device=ids.device).repeat_interleave(counts)
    bad = (ids < 0) | (ids >= limits)
    if bool(bad.any()):
        first = int(bad.nonzero()[0, 0])
        name = list(got)[int((counts.cumsum(0) > first).nonzero()[0, 0])]
        raise RegionError(f"rank {rank}: {name} row index out of range")
