"""What a boundary's slots are planned for, from what the two stages say at the first step:
how many slots the schedule needs, how large each tensor's slot is, whether an offer, an
acceptance or a transfer fits the plan. Pure: no I/O, no loop."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from tensorx.errors import PlanMismatchError, ProtocolError, UsageError
from tensorx.pipelining._boundary import Edge, Routes
from tensorx.pipelining._protocol import TensorMeta, integer, meta_from, text

__all__ = ["accepted", "capacities", "check_fits", "offered", "slot_counts"]


def slot_counts(schedule: tuple[str, int], num_stages: int, src: int, dst: int,
                override: int | None) -> tuple[int, int]:
    """(activation, gradient) slots of the boundary ``src -> dst`` under ``schedule``
    (name, micro-batches): the most micro-batches that can be in flight across it."""
    name, m = schedule
    if name == "ScheduleGPipe":  # every forward before any backward: all in flight
        act, grad = m, max(2, (m + 1) // 2)
    else:
        act, grad = min(m, num_stages - src), dst - src + 1
    if override is not None:
        act = override
    return max(1, act), max(1, min(m, grad))


def offered(msg: dict[str, Any], who: str, schedule: tuple[str, int], src: int,
            me: int) -> list[TensorMeta]:
    """The tensors a sender's ``meta`` offers, once its schedule is checked to be ours."""
    metas = meta_from(msg.get("tensors"), who)
    theirs = (text(msg, "schedule", who, 40), integer(msg, "microbatches", who, 1))
    if theirs != schedule:
        raise UsageError(
            f"stage {src} runs {theirs[0]} with {theirs[1]} micro-batches and stage {me} "
            f"{schedule[0]} with {schedule[1]}: every stage must build the same schedule")
    return metas


def capacities(edge: Edge, metas: list[TensorMeta], routes: Routes, me: int,
               max_shapes: Sequence[tuple[int, ...]] | None,
               example: Sequence[Any] | None) -> list[TensorMeta]:
    """The slot of each offered tensor: ``max_shapes``, else the example input's shape,
    else the offered shape."""
    positions = routes.inputs_from(edge.src, len(metas))
    out = []
    for pos, meta in zip(positions, metas, strict=True):
        cap = meta.shape
        if max_shapes is not None:
            if pos >= len(max_shapes):
                raise UsageError(f"max_shapes gives {len(max_shapes)} shapes but stage {me} "
                                 f"takes input {pos}")
            cap = tuple(max_shapes[pos])
        elif example is not None and pos < len(example):
            cap = tuple(example[pos].shape)
        if len(cap) != len(meta.shape):
            raise PlanMismatchError(
                f"{edge.name}, input {pos} of stage {me}: stage {edge.src} sends "
                f"{len(meta.shape)}-d tensors {list(meta.shape)}, the slot is planned "
                f"{len(cap)}-d {list(cap)}: fix max_shapes/input_args")
        out.append(TensorMeta(meta.dtype, cap, meta.grad))
    return out


def accepted(edge: Edge, msg: dict[str, Any], who: str) -> tuple[list[TensorMeta], int, int]:
    """The receiver's ``accept`` of what we offered: (slot tensors, activation slots,
    gradient slots); ProtocolError unless it answers our offer."""
    capacity = meta_from(msg.get("tensors"), who)
    if edge.layout is not None or edge.meta_msg is None:
        raise ProtocolError(f"{who} accepted {edge.name} before it was offered")
    ours = edge.meta_msg["metas"]
    if len(capacity) != len(ours) or any(
            c.dtype != o.dtype or c.grad != o.grad or len(c.shape) != len(o.shape)
            for c, o in zip(capacity, ours, strict=True)):
        raise ProtocolError(f"{who} accepted {edge.name} with other tensors than offered")
    return (capacity, integer(msg, "slots", who, 1, 1 << 16),
            integer(msg, "grad_slots", who, 1, 1 << 16))


def check_fits(edge: Edge, tensors: Sequence[torch.Tensor], mb: int, me: int) -> None:
    """PlanMismatchError unless every tensor fits its slot (same dtype and rank, no
    dimension larger)."""
    assert edge.layout is not None
    for i, (t, m) in enumerate(zip(tensors, edge.layout.metas, strict=True)):
        dtype = str(t.dtype).removeprefix("torch.")
        fits = (len(t.shape) == len(m.shape)
                and all(d <= c for d, c in zip(t.shape, m.shape, strict=True)))
        if dtype != m.dtype or not fits:
            raise PlanMismatchError(
                f"{edge.name}, tensor {i}, micro-batch {mb}: stage {me} produced "
                f"{dtype}{list(t.shape)} but the slot was planned for {m.dtype}{list(m.shape)}. "
                f"Give stage {edge.dst} max_shapes= (at least {list(t.shape)} for this input) "
                "and dynamic= (the dimensions that vary), or input_args at the largest size")
