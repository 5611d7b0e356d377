"""Plain SGD on sparse tables' rows in a few ops for all of them (issue 17's apply rate).

``torch.optim.SGD`` steps a table with a sparse gradient as ``param.add_(grad, alpha=-lr)``:
per table, a coalesced gradient and a loop over its rows (one ``axpy`` each), after the
optimizer's per-parameter bookkeeping. When every table's optimizer group is plain SGD (the
exact class; no momentum, weight decay, maximize, differentiable or tensor lr; no step
hooks) the shard does the same arithmetic for all the tables of one
:class:`~tensorx._ps.rows.RowGroup` at once: the rows the ranks pushed, summed by row as
:meth:`~tensorx._ps.rows.SparseRows.grad` sums them, then one gather of those rows of the
arena, ``rows + (-lr) * grad`` and one scatter back. That is used only where it gives the
very bits torch's step gives (checked on the spot for each dtype, row shape and lr: the
two kernels round alike where both use fused multiply-adds); anywhere else, and for every
other optimizer, the tables step through ``optimizer.step()`` as before. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.optim import optimizer as torch_optimizer

from tensorx._ps.rows import RowGroup, SparseRows, no_invariant_checks, put_rows, take_rows

__all__ = ["RowSGD", "why_not"]

PROBE_ROWS = 16


def why_not(optimizer: torch.optim.Optimizer | None, tables: Sequence[torch.Tensor]) -> str | None:
    """None when every group holding one of ``tables`` is plain SGD; else why not."""
    if type(optimizer) is not torch.optim.SGD:
        return f"{type(optimizer).__name__} is not plain SGD"
    if optimizer._optimizer_step_pre_hooks or optimizer._optimizer_step_post_hooks or \
            torch_optimizer._global_optimizer_pre_hooks or \
            torch_optimizer._global_optimizer_post_hooks:
        return "SGD has step hooks"
    ids = {id(t) for t in tables}
    for group in optimizer.param_groups:
        if not any(id(p) in ids for p in group["params"]):
            continue
        if group.get("momentum") or group.get("weight_decay") or group.get("maximize") \
                or group.get("differentiable") or group.get("fused") \
                or not isinstance(group.get("lr"), float | int):
            return "SGD with momentum, weight decay, maximize, fused or a tensor lr"
    return None


class RowSGD:
    """The plain-SGD step of a shard's sparse tables (see the module docstring)."""

    def __init__(self, optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor],
                 rows: SparseRows) -> None:
        self.optimizer = optimizer
        self.rows = rows
        self.tables = [params[i] for i in rows]
        group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
        # one lr per row group: its tables' optimizer group, if they share one
        self._groups: list[dict[str, Any] | None] = []
        for rg in rows.groups:
            owners = {id(group_of[id(params[i])]) for i in rg.starts}
            self._groups.append(group_of[id(params[next(iter(rg.starts))])]
                                if len(owners) == 1 else None)
        self._same: dict[tuple[Any, ...], bool] = {}

    @classmethod
    def build(cls, optimizer: torch.optim.Optimizer | None, params: Sequence[torch.Tensor],
              rows: SparseRows, device: str) -> RowSGD | None:
        """One for a shard with tables and an SGD optimizer (whether a step may use it is
        asked each time: :meth:`usable`) in host memory; else None."""
        if not rows or type(optimizer) is not torch.optim.SGD or device != "cpu":
            return None
        return cls(optimizer, params, rows)

    def usable(self) -> bool:
        """Can the tables' next step be this one (as the optimizer is set now)?"""
        if why_not(self.optimizer, self.tables) is not None:
            return False
        return all(g is not None and self._identical(rg, float(g["lr"]))
                   for rg, g in zip(self.rows.groups, self._groups, strict=True))

    def step(self, ranks: Sequence[int], region: Any) -> dict[int, torch.Tensor]:
        """Step every table with the mean of ``ranks``' rows, in ``region`` (the arena);
        the row ids it changed, per table."""
        changed: dict[int, torch.Tensor] = {}
        with torch.no_grad():
            for rg, group, got in zip(self.rows.groups, self._groups,
                                      self.rows.summed(ranks), strict=True):
                if got is None:
                    continue
                assert group is not None
                keys, grad = got
                _update(rg.view(region), keys, grad, float(group["lr"]))
                changed.update(rg.split(keys))
        self.optimizer._opt_called = True  # type: ignore[attr-defined]  # for LR schedulers
        return changed

    def _identical(self, rg: RowGroup, lr: float) -> bool:
        """Does the gather-add-scatter give torch's bits for these rows and this lr?"""
        key = (rg.dtype, rg.row_shape, lr)
        if key not in self._same:
            if len(self._same) > 256:  # an lr schedule makes one per value
                self._same.clear()
            self._same[key] = _probe(rg.dtype, rg.row_shape, lr)
        return self._same[key]


def _update(table: torch.Tensor, ids: torch.Tensor, grad: torch.Tensor, lr: float) -> None:
    """Rows ``ids`` (distinct) of ``table`` minus ``lr`` times ``grad``: gathered, one
    ``add_``, scattered back."""
    rows = take_rows(table, ids)
    rows.add_(grad, alpha=-lr)
    put_rows(table, ids, rows)


def _probe(dtype: torch.dtype, row_shape: tuple[int, ...], lr: float) -> bool:
    gen = torch.Generator().manual_seed(0)
    table = torch.randn(PROBE_ROWS, *row_shape, generator=gen).to(dtype)
    grad = torch.randn(PROBE_ROWS // 2, *row_shape, generator=gen).to(dtype)
    ids = torch.arange(0, PROBE_ROWS, 2)
    ours = table.clone()
    _update(ours, ids, grad, lr)
    theirs = table.clone()
    with no_invariant_checks():
        theirs.add_(torch.sparse_coo_tensor(ids[None], grad, table.shape, is_coalesced=True),
                    alpha=-lr)
    return bool(torch.equal(ours.view(torch.uint8), theirs.view(torch.uint8)))
