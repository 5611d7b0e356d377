"""Receive rings: one registered region per boundary and direction, ``slots`` slots, each
slot holding every tensor of the boundary at a fixed, aligned offset, sized for its
capacity shape. A slot is written one-sided by the sender and read in place."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from tensorx.memregion import MemoryRegion
from tensorx.pipelining._protocol import TensorMeta

__all__ = ["ALIGN", "Layout", "Ring", "nbytes_of"]

ALIGN = 64


def nbytes_of(dtype: str, shape: Sequence[int]) -> int:
    return math.prod(shape) * torch.empty((), dtype=getattr(torch, dtype)).element_size()


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class Layout:
    """Where each tensor of a boundary lies in one slot (capacities from ``metas``)."""

    def __init__(self, metas: Sequence[TensorMeta]) -> None:
        self.metas = list(metas)
        self.offsets: list[int] = []
        end = 0
        for m in self.metas:
            self.offsets.append(end)
            end = _align(end + nbytes_of(m.dtype, m.shape))
        self.slot_bytes = max(end, ALIGN)

    @property
    def capacity(self) -> list[tuple[int, ...]]:
        return [m.shape for m in self.metas]


class Ring:
    """``slots`` slots of ``layout`` in one region of ``device`` memory."""

    def __init__(self, layout: Layout, slots: int, device: torch.device) -> None:
        self.layout = layout
        self.slots = slots
        self.region = MemoryRegion.allocate(layout.slot_bytes * slots, _device_name(device))
        # per slot, per tensor: a flat view of its capacity (a micro-batch's view is a
        # slice of it: no per-transfer work on the region)
        self._flat = [[self._view(m, (math.prod(m.shape),), k * layout.slot_bytes + off)
                       for m, off in zip(layout.metas, layout.offsets, strict=True)]
                      for k in range(slots)]

    @property
    def nbytes(self) -> int:
        return self.region.nbytes

    def base(self, n: int) -> int:
        """Byte offset of the slot transfer ``n`` uses."""
        return (n % self.slots) * self.layout.slot_bytes

    def views(self, n: int, shapes: Sequence[tuple[int, ...]]) -> list[torch.Tensor]:
        """The tensors of transfer ``n``, in place, at ``shapes`` (each within capacity)."""
        flats = self._flat[n % self.slots]
        return [flat[:math.prod(shape)].view(shape) for flat, shape in zip(flats, shapes,
                                                                           strict=True)]

    def _view(self, meta: TensorMeta, shape: tuple[int, ...], offset: int) -> torch.Tensor:
        view: torch.Tensor = self.region.view(getattr(torch, meta.dtype), shape, offset)
        return view

    def fill(self, n: int, tensors: Sequence[torch.Tensor | None]) -> list[tuple[int, int]]:
        """Copy ``tensors`` into transfer ``n``'s slot; (offset, nbytes) of each one copied
        (``None`` entries are skipped and have no op)."""
        base = self.base(n)
        ops = []
        for flat, t, off in zip(self._flat[n % self.slots], tensors, self.layout.offsets,
                                strict=True):
            if t is None:
                continue
            flat[:t.numel()].view(t.shape).copy_(t.detach())
            ops.append((base + off, t.numel() * t.element_size()))
        return ops

    def close(self) -> None:
        self.region.close()


def _device_name(device: Any) -> str:
    dev = torch.device(device)
    if dev.type == "cuda":
        return f"cuda:{dev.index if dev.index is not None else torch.cuda.current_device()}"
    return "cpu"
