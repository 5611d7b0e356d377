"""From a model to a layout: which tensors cross, in what order, split how, on which shard.

Layout rules, and why:

* Order. Entries follow the order in which backward makes gradients ready (the reverse of
  the forward pass), so a worker can push a prefix of an arena as soon as it is complete.
  Without sample inputs, registration order stands in for forward order.
* Split. A tensor larger than ``chunk_bytes`` becomes chunks of whole rows (slices along
  its first dimension, ``t[a:b]``) of at most ``chunk_bytes``, the last one shorter; a
  chunk's bytes are a multiple of the alignment, so consecutive chunks stay byte-contiguous,
  and any run of chunks (a shard's part of a tensor) is itself a slice of whole rows with
  the tensor's number of dimensions. A 1-D tensor is split into runs of elements. A tensor
  whose smallest aligned group of rows is larger than ``chunk_bytes`` is not split.
* Shard. The ordered sequence is cut into ``num_shards`` contiguous runs of near-equal
  bytes. Shard ``k+1``'s arena continues where shard ``k``'s ends in the global sequence, so
  when arenas are carved from one block (the default) every tensor, even one split across
  two shards, is a single view: binding is zero-copy for every dense tensor.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tensorx._analyzer.layout import (
    HEADER_BYTES,
    INDEX_BYTES,
    ITEMSIZE,
    DynamicEntry,
    PlanEntry,
    PlanOptions,
    TransferPlan,
    align_up,
    numel_of,
)
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
        units = _split(self.tensors(), self.options.chunk_bytes, self.options.alignment)
        sizes = [align_up(u.nbytes, self.options.alignment) for u in units]
        cuts = _cuts(sizes, self.options.num_shards)
        entries = _place(units, sizes, cuts)
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


def _split(infos: list[TensorInfo], chunk_bytes: int, alignment: int) -> list[_Unit]:
    """Chunks of whole rows for dense tensors above ``chunk_bytes``; sparse tensors, and
    tensors too wide to be cut into aligned groups of rows, stay whole."""
    units = []
    for info in infos:
        step = _chunk_numel(info, chunk_bytes, alignment)
        if info.sparse or info.numel <= step or step == 0:
            units.append(_Unit(info, 0, 0, info.numel))
            continue
        starts = range(0, info.numel, step)
        units += [_Unit(info, i, s, min(step, info.numel - s)) for i, s in enumerate(starts)]
    return units


def _chunk_numel(info: TensorInfo, chunk_bytes: int, alignment: int) -> int:
    """Elements per chunk: the most whole rows within ``chunk_bytes`` whose bytes are a
    multiple of ``alignment`` (0: not even one such group of rows fits)."""
    row = numel_of(info.shape[1:]) if len(info.shape) > 1 else 1
    row_bytes = row * info.itemsize
    if row_bytes == 0:
        return 0
    group = alignment // math.gcd(row_bytes, alignment)  # rows per aligned group
    return chunk_bytes // (row_bytes * group) * group * row


def _cuts(sizes: list[int], num_shards: int) -> list[int]:
    """Unit indices where each shard starts (plus the end): contiguous, near-equal bytes."""
    prefix = [0]
    for s in sizes:
        prefix.append(prefix[-1] + s)
    cuts = [0]
    for k in range(1, num_shards):
        target = prefix[-1] * k / num_shards
        i = bisect.bisect_left(prefix, target, lo=cuts[-1])
        if i > cuts[-1] and (i == len(prefix) or target - prefix[i - 1] <= prefix[i] - target):
            i -= 1
        cuts.append(min(i, len(sizes)))
    return [*cuts, len(sizes)]


def _place(units: list[_Unit], sizes: list[int], cuts: list[int]) -> list[PlanEntry]:
    entries = []
    for shard, (lo, hi) in enumerate(itertools.pairwise(cuts)):
        offset = 0
        for unit, size in zip(units[lo:hi], sizes[lo:hi], strict=True):
            entries.append(_entry(unit, shard, offset))
            offset += size
    return entries


def _entry(u: _Unit, shard: int, offset: int) -> PlanEntry:
    kind = "dynamic" if u.info.sparse else "static"
    return PlanEntry(u.info.name, u.chunk, u.start, u.numel, u.info.shape, u.info.dtype,
                     u.nbytes, kind, shard, "params", offset, u.info.role, u.info.index)


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
