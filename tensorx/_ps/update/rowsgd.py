"""Plain SGD on sparse tables' rows in a few ops for all of them (issue 17's apply rate).

``torch.optim.SGD`` steps a table with a sparse gradient as ``param.add_(grad, alpha=-lr)``:
per table, a coalesced gradient and a loop over its rows (one ``axpy`` each), after the
optimizer's per-parameter bookkeeping. When every table's optimizer group is plain SGD (the
exact class; no momentum, weight decay, maximize, differentiable or tensor lr; no step
hooks) the shard does the same arithmetic for all the tables of one
:class:`~tensorx._ps.rows.tables.RowGroup` at once: the rows the ranks pushed, summed by row as
:meth:`~tensorx._ps.rows.tables.SparseRows.grad` sums them, and each of those rows of the arena
plus ``(-lr) * grad``. By the C kernel of :mod:`.rowkernel` where it is built (float32/64
rows, one read and one write of each row: about 2x faster), else with torch ops (one
gather of the rows, one ``add_``, one scatter back). Either is used only where it gives
the very bits torch's step gives (checked on the spot for each dtype, row shape and lr:
kernels round alike where both use fused multiply-adds); anywhere else, and for every
other optimizer, the tables step through ``optimizer.step()`` as before. No I/O but the
kernel's one build (see :mod:`.rowkernel`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch.optim import optimizer as torch_optimizer

from tensorx._ps.rows.tables import (
    RowGroup,
    Rows,
    SparseRows,
    no_invariant_checks,
    put_rows,
    sum_rows,
    take_rows,
)
from tensorx._ps.update import rowkernel

if TYPE_CHECKING:
    from tensorx.memregion import MemoryRegion

__all__ = ["RowSGD", "why_not"]

PROBE_ROWS = 16


def why_not(optimizer: torch.optim.Optimizer | None, tables: Sequence[torch.Tensor]) -> str | None:
    """None when every group holding one of ``tables`` is plain SGD; else why not."""
    if type(optimizer) is not torch.optim.SGD:
        return f"{type(optimizer).__name__} is not plain SGD"
    if (optimizer._optimizer_step_pre_hooks or optimizer._optimizer_step_post_hooks  # noqa: SLF001 (torch.optim keeps its hooks private)
            or torch_optimizer._global_optimizer_pre_hooks  # noqa: SLF001 (torch.optim keeps its hooks private)
            or torch_optimizer._global_optimizer_post_hooks):  # noqa: SLF001 (torch.optim keeps its hooks private)
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
        self._kernel = rowkernel.load()
        self._modes: dict[tuple[Any, ...], bool | None] = {}

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

    def step(self, ranks: Sequence[int], region: MemoryRegion) -> dict[int, torch.Tensor]:
        """Step every table with the mean of ``ranks``' rows, in ``region`` (the arena);
        the row ids it changed, per table."""
        changed: dict[int, torch.Tensor] = {}
        with torch.no_grad():
            for k, (rg, group) in enumerate(zip(self.rows.groups, self._groups, strict=True)):
                assert group is not None
                lr = float(group["lr"])
                keys = self._kernel_step(rg, k, ranks, region, lr)
                if keys is None:
                    got = self.rows.summed_group(ranks, k)
                    if got is None:
                        continue
                    keys, grad = got
                    _update(rg.view(region), keys, grad, lr)
                changed.update(rg.split(keys))
        self.optimizer._opt_called = True  # type: ignore[attr-defined]  # for LR schedulers  # noqa: SLF001 (torch's LR schedulers read it)
        return changed

    def _kernel_step(self, rg: RowGroup, k: int, ranks: Sequence[int], region: MemoryRegion,
                     lr: float) -> torch.Tensor | None:
        """Group ``k``'s step by the C kernel (:mod:`.rowkernel`): the row ids it changed;
        None (nothing done) where the kernel is missing, rounds unlike torch here, or
        cannot take these rows."""
        fused = self._kernel_mode(rg, lr)
        if fused is None or self._kernel is None:
            return None
        parts = self.rows.parts(ranks, k)
        if not parts:
            return None
        return self._kernel.sgd(rg.view(region).view(rg.rows, -1),
                                [(ids, values.reshape(ids.numel(), -1)) for ids, values in parts],
                                len(ranks), -lr, fused)

    def _kernel_mode(self, rg: RowGroup, lr: float) -> bool | None:
        """Which of the kernel's updates gives torch's bits for these rows and this lr
        (True: the fused multiply-add); None: neither, or no kernel."""
        if self._kernel is None:
            return None
        key = (rg.dtype, rg.row_shape, lr)
        if key not in self._modes:
            if len(self._modes) > 256:
                self._modes.clear()
            self._modes[key] = _probe_kernel(self._kernel, rg.dtype, rg.row_shape, lr)
        return self._modes[key]

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


def _probe_kernel(kernel: rowkernel.RowKernel, dtype: torch.dtype, row_shape: tuple[int, ...],
                  lr: float) -> bool | None:
    """True if the kernel's fused update gives torch's bits (one rank, two with a row in
    common, three ranks of which one sent none, a -0.0 row and a -0.0 parameter), False if
    its plain one does, None if neither."""
    if dtype not in (torch.float32, torch.float64):
        return None
    gen = torch.Generator().manual_seed(1)
    table = torch.randn(PROBE_ROWS, *row_shape, generator=gen).to(dtype)
    table[0] = -0.0

    def rows(ids: torch.Tensor) -> Rows:
        values = torch.randn(len(ids), *row_shape, generator=gen).to(dtype)
        values[0] = -0.0
        return ids, values

    a, b = rows(torch.arange(0, PROBE_ROWS, 2)), rows(torch.arange(0, PROBE_ROWS, 3))
    cases = [([a], 1), ([a, b], 2), ([b, a], 3)]
    expected = []
    for parts, ranks in cases:
        theirs = table.clone()
        ids, grad = sum_rows(parts)
        if ranks > 1:
            grad.div_(ranks)
        with no_invariant_checks():
            theirs.add_(torch.sparse_coo_tensor(ids[None], grad, table.shape,
                                                is_coalesced=True), alpha=-lr)
        expected.append(theirs)
    for fused in (True, False):
        if fused and not kernel.fused_available():
            continue
        same = True
        for (parts, ranks), theirs in zip(cases, expected, strict=True):
            ours = table.clone()
            flat = [(ids, v.reshape(len(ids), -1)) for ids, v in parts]
            done = kernel.sgd(ours.view(PROBE_ROWS, -1), flat, ranks, -lr, fused)
            same = same and done is not None and \
                torch.equal(ours.view(torch.uint8), theirs.view(torch.uint8))
        if same:
            return fused
    return None
