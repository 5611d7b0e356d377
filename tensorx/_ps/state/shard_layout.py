"""A shard's layout: the part of a transfer plan one shard needs (its slots, arena size,
the parameters its optimizer sees), and the views of an arena it is cut into."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from tensorx._ps.update import parts
from tensorx._ps.update.optim import ParamSpec, param_specs
from tensorx.errors import UsageError
from tensorx.memregion import MemoryRegion

if TYPE_CHECKING:
    from tensorx._analyzer.plan import TransferPlan

__all__ = ["ShardLayout", "Slot", "dense_splitter", "dynamic_path_ok", "entry_key",
           "flat_splitter", "param_splitter",
           "single_dtype", "to_dtype", "views"]


@dataclass(frozen=True)
class Slot:
    """One tensor (or chunk) of the shard: where it lives in the arena."""

    key: str
    offset: int
    numel: int
    dtype: torch.dtype


@dataclass(frozen=True)
class ShardLayout:
    """The part of a transfer plan one shard needs: its entries and its arena size."""

    shard: int
    num_shards: int
    nbytes: int
    slots: tuple[Slot, ...]
    fingerprint: str
    params: tuple[ParamSpec, ...] = ()  # what the optimizer sees, in model order

    def param_specs(self) -> tuple[ParamSpec, ...]:
        """:attr:`params`, or for a layout made without them, one 1-D parameter per slot."""
        return self.params or tuple(ParamSpec(s.key, s.offset, (s.numel,), s.dtype)
                                    for s in self.slots)

    @classmethod
    def from_plan(cls, plan: TransferPlan, shard: int) -> ShardLayout:
        entries = sorted(plan.shard_entries(shard), key=lambda e: e.offset)
        slots = tuple(Slot(entry_key(e), e.offset, e.numel, to_dtype(e.dtype)) for e in entries)
        return cls(shard, plan.num_shards, plan.arena_bytes(shard), slots, plan.fingerprint,
                   param_specs(entries, to_dtype, dynamic_path_ok(plan)))


def dynamic_path_ok(plan: TransferPlan) -> bool:
    """True when the plan has sparse tensors and none of them was split into chunks: then
    they travel as rows (:mod:`tensorx._ps.rows.sparse`), and both sides lay them out so."""
    dynamic = [e for e in plan.entries if e.kind == "dynamic"]
    return bool(dynamic) and all(e.whole for e in dynamic)


def entry_key(entry: Any) -> str:
    return str(getattr(entry, "label", entry.name))


def to_dtype(dtype: Any) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    found = getattr(torch, str(dtype).removeprefix("torch."), None)
    if not isinstance(found, torch.dtype):
        raise UsageError(f"unknown dtype {dtype!r} in plan")
    return found


def views(layout: ShardLayout, region: MemoryRegion) -> list[torch.Tensor]:
    return [region.view(s.dtype, (s.numel,), s.offset) for s in layout.slots]


def single_dtype(layout: ShardLayout) -> torch.dtype | None:
    dtypes = {s.dtype for s in layout.slots}
    return dtypes.pop() if len(dtypes) == 1 else None


def param_splitter(layout: ShardLayout) -> Callable[[MemoryRegion], list[torch.Tensor]]:
    specs = layout.param_specs()
    return lambda region: [region.view(p.dtype, p.shape, p.offset) for p in specs]


def dense_splitter(layout: ShardLayout) -> Callable[[MemoryRegion], list[torch.Tensor]]:
    """A region's dense tensors as few views as can be: the whole arena as one when it
    holds one dtype and no sparse table, else one per dense tensor (the tables' bytes of a
    slot are never written)."""
    dtype = single_dtype(layout)
    specs = [p for p in layout.param_specs() if not p.sparse]
    if dtype is not None and len(specs) == len(layout.param_specs()):
        size = torch.empty((), dtype=dtype).element_size()
        return lambda region: [region.view(dtype, (layout.nbytes // size,))]
    return lambda region: [region.view(p.dtype, (p.numel,), p.offset) for p in specs]


def flat_splitter(layout: ShardLayout,
                   dtype: torch.dtype) -> Callable[[MemoryRegion], list[torch.Tensor]]:
    size = torch.empty((), dtype=dtype).element_size()
    cuts = parts.bounds(layout.nbytes // size, size)
    return lambda region: [region.view(dtype, (n,), start * size) for start, n in cuts]
