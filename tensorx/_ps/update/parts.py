"""A flat shard in parts: the update can be applied, and sent, one part after another.

With ``flat=True`` the optimizer sees a shard's arena as a few flat parameters of at most
:data:`PART_BYTES` each instead of one. For an elementwise optimizer (the only kind
``flat`` is right for) stepping the parts one at a time is the same update as stepping all
of them at once, so the shard can write part ``k`` of the new parameters back to a worker
while it computes part ``k + 1``.

Checkpoints keep the one-parameter form (:func:`merge_state` on save, :func:`split_state` on
load), so a checkpoint does not depend on the part size. A pipelined round's parts (see
:mod:`tensorx._ps.service.round`) as a worker sees them: :func:`check_parts` checks the welcome's
list, :func:`split_ops` cuts a push at their bounds. Pure: no I/O.
"""

from __future__ import annotations

import bisect
from typing import Any

import torch

from tensorx.errors import ProtocolError

__all__ = ["PART_BYTES", "bounds", "check_parts", "merge_state", "split_ops", "split_state"]

PART_BYTES = 16 << 20


def bounds(count: int, itemsize: int, part_bytes: int | None = None) -> list[tuple[int, int]]:
    """(first element, number of elements) of each part of a flat run of ``count`` items
    (parts of ``part_bytes``, default :data:`PART_BYTES`)."""
    per = max(1, (PART_BYTES if part_bytes is None else part_bytes) // itemsize)
    return [(start, min(per, count - start)) for start in range(0, count, per)] or [(0, 0)]


def merge_state(state: dict[str, Any], sizes: list[int]) -> dict[str, Any]:
    """An optimizer ``state_dict`` over parts of ``sizes`` elements, as if over one flat
    parameter: per-element tensors are concatenated, per-parameter scalars (e.g. Adam's
    step, equal in every part) are taken from the first part."""
    if len(sizes) == 1:
        return state
    per_part = [state["state"].get(i) for i in range(len(sizes))]
    merged: dict[str, Any] = {}
    if all(s is not None for s in per_part):
        for key, first in per_part[0].items():
            merged[key] = (torch.cat([s[key] for s in per_part])
                           if _per_element(first, sizes[0]) else first)
    groups = [{**g, "params": [0]} for g in state["param_groups"][:1]]
    return {"state": {0: merged} if merged else {}, "param_groups": groups}


def split_state(state: dict[str, Any], sizes: list[int]) -> dict[str, Any]:
    """The inverse of :func:`merge_state`: a one-parameter state over parts of ``sizes``."""
    if len(sizes) == 1 or len(state["param_groups"][0]["params"]) == len(sizes):
        return state
    whole = state["state"].get(0, {})
    total = sum(sizes)
    parts: dict[int, dict[str, Any]] = {}
    if whole:
        start = 0
        for i, n in enumerate(sizes):
            parts[i] = {key: (value[start:start + n].clone() if _per_element(value, total)
                              else _copy(value)) for key, value in whole.items()}
            start += n
    groups = [{**g, "params": list(range(len(sizes)))} for g in state["param_groups"][:1]]
    return {"state": parts, "param_groups": groups}


def _per_element(value: Any, numel: int) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == numel


def _copy(value: Any) -> Any:
    return value.clone() if isinstance(value, torch.Tensor) else value


def check_parts(parts: Any, nbytes: int) -> list[tuple[int, int]]:
    """A welcome's ``parts`` ([[offset, nbytes], ...] in order, inside an arena of
    ``nbytes``), checked."""
    out: list[tuple[int, int]] = []
    at = 0
    for part in parts:
        if not (isinstance(part, list) and len(part) == 2
                and all(isinstance(v, int) and not isinstance(v, bool) for v in part)):
            raise ProtocolError(f"welcome: malformed part {part!r}")
        off, n = part
        if off < at or n <= 0 or off + n > nbytes:
            raise ProtocolError(f"welcome: part {part!r} out of order or outside the arena")
        out.append((off, n))
        at = off + n
    return out


def split_ops(ops: list[tuple[Any, ...]], parts: list[tuple[int, int]]
              ) -> dict[int, list[tuple[Any, ...]]]:
    """``ops`` (region, desc, offset, remote offset, nbytes: the same offsets on both
    sides) cut at the ``parts``' bounds, by part; bytes outside every part (alignment
    padding) go with the part before them, or the first."""
    out: dict[int, list[tuple[Any, ...]]] = {}
    starts = [off for off, _ in parts]
    for region, desc, off, _, n in ops:
        end = off + n
        while off < end:
            k = max(0, bisect.bisect_right(starts, off) - 1)
            stop = end if k + 1 == len(parts) else min(end, max(starts[k + 1], off + 1))
            out.setdefault(k, []).append((region, desc, off, off, stop - off))
            off = stop
    return out
