"""From a model to a layout: which tensors cross, in what order, split how, on which shard.

Layout rules, and why:

* Order. Entries follow the order in which backward makes gradients ready (the reverse of
  the forward pass), so a worker can push a prefix of an arena as soon as it is complete.
  Without sample inputs, registration order stands in for forward order.
* Split. A tensor larger than ``chunk_bytes`` becomes chunks of whole rows (slices along
  its first dimension, ``t[a:b]``) of at most ``chunk_bytes``; a chunk's bytes are a
  multiple of the alignment (but for a tensor's last chunk), so consecutive chunks stay
  byte-contiguous, and any run of chunks (a shard's part of a tensor) is itself a slice of
  whole rows with the tensor's number of dimensions. A 1-D tensor is split into runs of
  elements. A tensor whose smallest aligned group of rows is larger than ``chunk_bytes`` is
  not chunked (it may still be cut between shards).
* Shard. The dense sequence is cut into ``num_shards`` contiguous runs whose dense bytes
  are within one cut step (an aligned group of whole rows) of the mean, cutting a tensor
  between two shards where the balance needs it (:mod:`tensorx._analyzer.balance` has the
  rule and the bound). Shard ``k+1``'s arena continues where shard ``k``'s ends in the
  sequence, so when arenas are carved from one block (the default) every tensor, even one
  cut across shards, is a single view: binding is zero-copy for every dense tensor. Sparse
  tables stay whole and are spread by size over the shards that no tensor runs through.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tensorx._analyzer import balance
from tensorx._analyzer.layout import (
    HEADER_BYTES,
    INDEX_BYTES,
    ITEMSIZE,
    DynamicEntry,
    PlanEntry,
    PlanOptions,
    align_up,
    numel_of,
)
from tensorx._analyzer.plan import TransferPlan
from tensorx._analyzer.sample import traceless
from tensorx.errors import UsageError

__all__ = ["GraphAnalyzer", "TensorInfo"]

INITIAL_SPARSE_ROWS = 256


@dataclass(frozen=True)
class TensorInfo:
    """One tensor that crosses the boundary, before layout."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    role: str
    sparse: bool
    index: int = -1  # position in the model (named_parameters, then named_buffers)

    @property
    def itemsize(self) -> int:
        return ITEMSIZE[self.dtype]

    @property
    def numel(self) -> int:
        return numel_of(self.shape)


@dataclass(frozen=True)
class _Unit:
    info: TensorInfo
    chunk: int
    start: int
    numel: int
    shard: int = 0

    @property
    def nbytes(self) -> int:
        return self.numel * self.info.itemsize


class GraphAnalyzer:
    """Plan the transfer layout of ``model``'s parameters (and, on request, buffers).

    ``sample_inputs`` (a tuple of positional arguments) lets the analyzer run one forward
    pass under ``no_grad`` to learn the real execution order; buffers and the RNG state are
    restored afterwards. Every process must plan with the same inputs' *order* to agree.
    """

    def __init__(self, model: nn.Module, num_shards: int = 1, chunk_bytes: int = 4 << 20,
                 alignment: int = 64, include_buffers: bool = False,
                 sparse_max_rows: int | None = None, sparse_budget_bytes: int | None = None,
                 sample_inputs: Sequence[Any] | None = None) -> None:
        if not isinstance(model, nn.Module):
            raise UsageError(f"GraphAnalyzer needs a torch.nn.Module, got {type(model).__name__}")
        self.model = model
        self.sample_inputs = None if sample_inputs is None else tuple(sample_inputs)
        self.options = PlanOptions(
            num_shards=num_shards, chunk_bytes=chunk_bytes, alignment=alignment,
            include_buffers=include_buffers, sparse_max_rows=sparse_max_rows,
            sparse_budget_bytes=sparse_budget_bytes,
            order="registration" if sample_inputs is None else "traced",
        )
        self.options.validate()

    def tensors(self) -> list[TensorInfo]:
        """Every tensor that crosses the boundary, in gradient-ready order."""
        sparse = _sparse_param_ids(self.model)
        named = list(self.model.named_parameters())
        rank = self._forward_rank([n for n, _ in named])
        params = [(i, n, p) for i, (n, p) in enumerate(named) if p.requires_grad]
        params.sort(key=lambda inp: rank[inp[1]], reverse=True)
        out = [_info(n, p, "param", id(p) in sparse, i) for i, n, p in params]
        if self.options.include_buffers:
            out += [_info(n, b, "buffer", False, len(named) + i)
                    for i, (n, b) in enumerate(self.model.named_buffers())]
        return out

    def plan(self) -> TransferPlan:
        entries = _place(_units(self.tensors(), self.options), self.options)
        return TransferPlan(entries, self.options, _dynamic(entries, self.options))

    def _forward_rank(self, names: list[str]) -> dict[str, tuple[int, int]]:
        calls = self._module_calls() if self.sample_inputs is not None else {}
        return {n: (calls.get(n.rpartition(".")[0], -1), i) for i, n in enumerate(names)}

    def _module_calls(self) -> dict[str, int]:
        order: dict[str, int] = {}
        hooks = [m.register_forward_pre_hook(_recorder(order, name))
                 for name, m in self.model.named_modules()]
        inputs = self.sample_inputs or ()
        try:
            with traceless(self.model, inputs):
                self.model(*inputs)
        finally:
            for h in hooks:
                h.remove()
        return order


def _recorder(order: dict[str, int], name: str) -> Any:
    def hook(module: nn.Module, args: Any) -> None:
        order.setdefault(name, len(order))

    return hook


def _sparse_param_ids(model: nn.Module) -> set[int]:
    return {id(m.weight) for m in model.modules()
            if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse}


def _info(name: str, t: torch.Tensor, role: str, sparse: bool, index: int) -> TensorInfo:
    dtype = str(t.dtype).removeprefix("torch.")
    if dtype not in ITEMSIZE:
        raise UsageError(f"{name}: dtype {dtype} cannot be planned")
    if sparse and t.dim() < 1:
        raise UsageError(f"{name}: a sparse-gradient parameter needs at least one dimension")
    return TensorInfo(name, tuple(t.shape), dtype, role, sparse, index)


def _units(infos: list[TensorInfo], opts: PlanOptions) -> list[_Unit]:
    """The plan's pieces in gradient-ready order: dense tensors cut at ``chunk_bytes`` and
    at the shard cuts (see :mod:`tensorx._analyzer.balance`), sparse tables whole."""
    dense = [i for i in infos if not i.sparse]
    cuts = balance.dense_cuts(dense, opts.num_shards, opts.alignment)
    units: list[_Unit] = []
    sparse: list[_Unit] = []
    position = 0
    for info in infos:
        if info.sparse:
            sparse.append(_Unit(info, 0, 0, info.numel))
            units.append(sparse[-1])
            continue
        units += _pieces(info, position, cuts, opts)
        position += balance.padded(info, opts.alignment)
    shards = balance.place_sparse([balance.padded(u.info, opts.alignment) for u in sparse],
                                  _uncrossed(units, opts.num_shards), opts.num_shards)
    where = dict(zip(map(id, sparse), shards, strict=True))
    return [dataclasses.replace(u, shard=where[id(u)]) if u.info.sparse else u for u in units]


def _pieces(info: TensorInfo, position: int, cuts: list[int],
            opts: PlanOptions) -> list[_Unit]:
    """``info`` (at ``position`` in the padded dense sequence) cut into chunks of whole rows
    at most ``chunk_bytes`` long (when a group of aligned rows fits) and at shard cuts."""
    size = info.itemsize
    step = _chunk_numel(info, opts.chunk_bytes, opts.alignment)
    bounds = {0, info.numel}
    if step and info.numel > step:
        bounds.update(range(step, info.numel, step))
    end = position + info.numel * size
    bounds.update((c - position) // size for c in cuts if position < c < end)
    edges = sorted(bounds)
    if len(edges) == 1:  # an empty tensor
        return [_Unit(info, 0, 0, 0, balance.shard_of(cuts, position))]
    return [_Unit(info, i, a, b - a, balance.shard_of(cuts, position + a * size))
            for i, (a, b) in enumerate(itertools.pairwise(edges))]


def _uncrossed(units: list[_Unit], num_shards: int) -> list[int]:
    """Shards that no tensor runs through (a cut tensor's pieces must meet at arena edges,
    so nothing else may sit in a shard it spans)."""
    crossed: set[int] = set()
    span: dict[str, list[int]] = {}
    for u in units:
        span.setdefault(u.info.name, []).append(u.shard)
    for shards in span.values():
        crossed.update(range(shards[0] + 1, shards[-1]))
    return [s for s in range(num_shards) if s not in crossed]


def _chunk_numel(info: TensorInfo, chunk_bytes: int, alignment: int) -> int:
    """Elements per chunk: the most whole rows within ``chunk_bytes`` whose bytes are a
    multiple of ``alignment`` (0: not even one such group of rows fits)."""
    row = balance.row_numel(info)
    row_bytes = row * info.itemsize
    if row_bytes == 0:
        return 0
    group = alignment // math.gcd(row_bytes, alignment)  # rows per aligned group
    return chunk_bytes // (row_bytes * group) * group * row


def _place(units: list[_Unit], opts: PlanOptions) -> list[PlanEntry]:
    """Offsets, shard after shard. In a shard, pieces keep gradient-ready order, except that
    a piece continued from the shard before comes first and one continued on the next
    shard last, so a cut tensor is contiguous across adjacent arenas."""
    entries = []
    for shard in range(opts.num_shards):
        mine = [(_edge(units, i), i) for i, u in enumerate(units) if u.shard == shard]
        offset = 0
        for _, i in sorted(mine):
            entries.append(_entry(units[i], offset))
            offset += align_up(units[i].nbytes, opts.alignment)
    return entries


def _edge(units: list[_Unit], i: int) -> int:
    """0: continues a tensor from an earlier shard; 2: continues on a later one; else 1."""
    u = units[i]
    if u.start > 0 and units[i - 1].shard != u.shard:
        return 0
    if u.start + u.numel < u.info.numel and units[i + 1].shard != u.shard:
        return 2
    return 1


def _entry(u: _Unit, offset: int) -> PlanEntry:
    kind = "dynamic" if u.info.sparse else "static"
    return PlanEntry(u.info.name, u.chunk, u.start, u.numel, u.info.shape, u.info.dtype,
                     u.nbytes, kind, u.shard, "params", offset, u.info.role, u.info.index)


def _dynamic(entries: list[PlanEntry], opts: PlanOptions) -> list[DynamicEntry]:
    slots = [0] * opts.num_shards
    out = []
    for e in entries:
        if e.kind != "dynamic":
            continue
        out.append(_dynamic_entry(e, slots[e.shard] * HEADER_BYTES, opts))
        slots[e.shard] += 1
    return out


def _dynamic_entry(e: PlanEntry, header_offset: int, opts: PlanOptions) -> DynamicEntry:
    num_rows, row_shape = e.shape[0], e.shape[1:]
    row_cost = INDEX_BYTES + numel_of(row_shape) * ITEMSIZE[e.dtype]
    budget = num_rows
    if opts.sparse_budget_bytes is not None:
        budget = min(num_rows, opts.sparse_budget_bytes // row_cost)
    if opts.sparse_max_rows is not None:
        budget = min(budget, opts.sparse_max_rows)
    budget = max(budget, 1)
    capacity = budget if opts.sparse_max_rows is not None else min(budget, INITIAL_SPARSE_ROWS)
    return DynamicEntry(e.name, e.shard, header_offset, num_rows, row_shape, e.dtype,
                        capacity, budget, capacity < budget)
