"""Which rows of a shard's sparse tables each update changed, so that an answer to a worker
holding a recent version writes only those rows, not whole tables (issue 17, item 1).

An update changes exactly the rows of a table's sparse gradient when the optimizer is
*row-local* for it: ``SGD`` without momentum and weight decay, ``Adagrad`` without weight
decay, ``SparseAdam`` (exact classes; torch's sparse paths of these touch the gradient's rows
only). Then the shard remembers, for its last :data:`HISTORY` versions, the row ids each
table's update touched. A worker that says (in its push) it holds version ``h`` needs, from
every table, the union of the rows changed by versions ``h+1 .. now``; every other byte it
holds already equals the shard's. Anything the shard cannot vouch for (an optimizer that is
not row-local, a failed step, parameters loaded from a checkpoint, a version older than the
history) makes the answer whole again. Pure: no I/O.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["HISTORY", "ChangedRows", "describe", "row_local", "runs"]

HISTORY = 16  # versions remembered


def row_local(optimizer: torch.optim.Optimizer | None, tables: Sequence[torch.Tensor]) -> bool:
    """Does a step of ``optimizer`` change only the rows of each table's sparse gradient?"""
    if optimizer is None or not tables:
        return True
    ids = {id(t) for t in tables}
    for group in optimizer.param_groups:
        if not any(id(p) in ids for p in group["params"]):
            continue
        kind = type(optimizer)
        if kind is torch.optim.SparseAdam:
            continue
        if kind is torch.optim.Adagrad and not group.get("weight_decay"):
            continue
        if kind is torch.optim.SGD and not group.get("momentum") \
                and not group.get("weight_decay"):
            continue
        return False
    return True


class ChangedRows:
    """The rows each recent update changed, per table (index among the shard's params)."""

    def __init__(self, tables: Sequence[int]) -> None:
        self.tables = list(tables)
        self._history: collections.deque[tuple[int, dict[int, torch.Tensor]]] = \
            collections.deque(maxlen=HISTORY)
        self._current: dict[int, list[torch.Tensor]] = {}
        self._known = True  # the update in progress is row-local so far
        # since()'s answers until the rows change: every worker of an update asks alike
        self._memo: dict[tuple[int, int, bool], dict[int, torch.Tensor] | None] = {}

    def stepped(self, params: Sequence[torch.Tensor], local: bool) -> None:
        """After a successful optimizer step: note the rows of each table's gradient;
        ``local``: the optimizer (as it is set now) is row-local for every table."""
        self._memo.clear()
        if not local:
            self._known = False
        for i in self.tables:
            grad = params[i].grad
            if grad is None:
                continue
            if not grad.is_sparse:  # a dense gradient may change every row
                self._known = False
                continue
            self._current.setdefault(i, []).append(grad.coalesce().indices()[0].cpu())

    def noted(self, changed: dict[int, torch.Tensor]) -> None:
        """After a row-local step that changed the rows ``changed`` (sorted unique ids per
        table) without sparse gradients in ``.grad`` (see :mod:`tensorx._ps.update.rowsgd`)."""
        self._memo.clear()
        for i, ids in changed.items():
            self._current.setdefault(i, []).append(ids.cpu())

    def finished(self, version: int) -> None:
        """The update that made ``version`` is complete."""
        self._memo.clear()
        if self._known:
            changed = {i: _union(ids) for i, ids in self._current.items()}
            if self._history and self._history[-1][0] != version - 1:
                self._history.clear()
            self._history.append((version, changed))
        else:
            self._history.clear()
        self._current, self._known = {}, True

    def forget(self) -> None:
        """The parameters changed outside an update (loaded, a failed step): answers are
        whole until new updates are remembered."""
        self._memo.clear()
        self._history.clear()
        self._current, self._known = {}, True

    def since(self, held: int, version: int, current: bool = False
              ) -> dict[int, torch.Tensor] | None:
        """Rows changed after version ``held`` up to ``version`` (and, with ``current``, by
        the update in progress so far), per table (a table absent: none changed); None
        when that is not known (the answer must be whole)."""
        key = (held, version, current)
        if key not in self._memo:
            self._memo[key] = self._since(held, version, current)
        return self._memo[key]

    def _since(self, held: int, version: int, current: bool
               ) -> dict[int, torch.Tensor] | None:
        if held < 0 or held > version:
            return None
        have = dict(self._history)
        if any(v not in have for v in range(held + 1, version + 1)):
            return None
        if current and not self._known:
            return None
        parts: dict[int, list[torch.Tensor]] = {}
        for v in range(held + 1, version + 1):
            for i, ids in have[v].items():
                parts.setdefault(i, []).append(ids)
        if current:
            for i, more in self._current.items():
                parts.setdefault(i, []).extend(more)
        return {i: _union(got) for i, got in parts.items()}


def _union(ids: list[torch.Tensor]) -> torch.Tensor:
    """Sorted unique ids of all of ``ids`` (each sorted unique: a coalesced gradient's)."""
    return ids[0] if len(ids) == 1 else torch.unique(torch.cat(ids))


def runs(ids: torch.Tensor, row_bytes: int, gap_bytes: int) -> list[tuple[int, int]]:
    """(first row, row count) runs covering the sorted unique ``ids``; rows between two ids
    are included when fewer than ``gap_bytes`` lie between them (they are unchanged, so
    sending them again is harmless, and one op costs more than a few KiB)."""
    if ids.numel() == 0:
        return []
    gap = max(1, gap_bytes // max(1, row_bytes))
    values = ids.tolist()
    out: list[tuple[int, int]] = []
    start = prev = values[0]
    for v in values[1:]:
        if v - prev > gap:
            out.append((start, prev - start + 1))
            start = v
        prev = v
    out.append((start, prev - start + 1))
    return out


def describe(changed: dict[int, Any] | None) -> str:
    if changed is None:
        return "whole"
    return f"{sum(int(t.numel()) for t in changed.values())} rows"
