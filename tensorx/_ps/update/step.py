"""How a shard steps its update: one interface (:class:`Update`), one implementation per way.

:class:`~tensorx._ps.state.shard.ShardState` chooses one when it is built (:func:`choose`) and
from then on calls it without asking which it is:

- :class:`PerTensor`: the optimizer's own step over the model's parameters (any optimizer,
  ``flat=False``, a shard of sparse tables alone, a shard with nothing to optimize); the
  update is one part.
- :class:`FlatParams`: ``flat=True``: the optimizer itself sees a few flat parameters over
  the arena (``"flat.0"``, ...), each one part; its state is saved in the one-parameter
  form (see :mod:`tensorx._ps.update.parts`).
- :class:`FlatRanges`: the flat update of an elementwise optimizer (:mod:`tensorx._ps.update.flat`):
  the sparse tables first, one part each, then the flat ranges, each one part. An optimizer
  state loaded that the flat update cannot hold turns it off for good
  (:meth:`FlatUpdate.adopt`): it steps as :class:`PerTensor` from then on.

Each steps the sparse tables through :class:`TorchStep`, by the row kernel
(:mod:`tensorx._ps.update.rowsgd`) where it gives torch's very bits, else by ``optimizer.step()``.
Pure: torch only, no I/O; the caller fences the device (:func:`tensorx._ps.common.device.fence`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from tensorx._ps.rows.changed import ChangedRows, row_local
from tensorx._ps.rows.tables import SparseRows, no_invariant_checks
from tensorx._ps.update import parts
from tensorx._ps.update.flat import FlatUpdate, elementwise
from tensorx._ps.update.fold import DenseFold, Units
from tensorx._ps.update.optim import ParamSpec
from tensorx._ps.update.rowsgd import RowSGD
from tensorx.errors import OptimizerError, UsageError
from tensorx.memregion import MemoryRegion

__all__ = ["FlatParams", "FlatRanges", "PerTensor", "TorchStep", "Update", "choose",
           "dense_grads"]

Fold = Callable[[Units], DenseFold]  # the shard's fold over these units of its arenas


class Update(Protocol):
    """What a shard asks of its update. Parts (a pipelined round's, or an answer sent part
    by part) are numbered ``0 .. num_parts - 1``; every part applied once, in any order,
    then :meth:`finish`, is the same update as :meth:`apply`."""

    description: str  # what the update is, and why, for the shard's INFO line
    flat: bool  # the optimizer's parameters are flat parts of the arena (flat=True)
    fold: DenseFold  # the shard's fold, over the units the update steps with

    @property
    def fast(self) -> FlatUpdate | None:
        """The flat update of a per-tensor optimizer, while it runs."""

    @property
    def num_parts(self) -> int:
        """Parts the update can be applied in, one after another."""

    def part_bytes(self, k: int) -> tuple[int, int]:
        """(offset, nbytes) of part ``k`` in the arena."""

    def part_table(self, k: int) -> int | None:
        """The sparse table part ``k`` is (its index among the parameters), if it is one."""

    def part_state(self, k: int) -> tuple[dict[Any, Any], Any]:
        """Where the optimizer keeps part ``k``'s state: (mapping, key); flat ranges only."""

    def units(self, parts: list[int]) -> list[int]:
        """The fold's units of ``parts``; UsageError unless the update folds part by part."""

    def worth_parts(self) -> bool:
        """Is applying part by part worth a thread hop per part (in host memory)?"""

    def pipelines(self) -> bool:
        """Can parts be applied while gradients land (in host memory)?"""

    def apply(self, ranks: list[int]) -> None:
        """One step of the whole update, the dense gradient folded (or folded here)."""

    def apply_part(self, ranks: list[int], k: int) -> None:
        """Part ``k``'s step alone: the other parts' gradients are unset meanwhile."""

    def apply_tables(self, ranks: list[int], parts: list[int]) -> None:
        """The sparse-table parts ``parts`` in one optimizer step."""

    def finish(self) -> None:
        """After the last part: what the next update expects of the parameters' ``.grad``."""

    def rebind(self, region: MemoryRegion) -> None:
        """The arena is ``region`` from now on (:meth:`ShardState.move_params`)."""

    def labels(self) -> dict[int, str] | None:
        """``id(param)`` -> label of the optimizer's parameters; None when flat."""

    def same_params(self, names: object) -> bool:
        """Were a checkpoint's optimizer parameters (``names``) this optimizer's?"""

    def saved_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """The optimizer's ``state_dict()`` as a checkpoint holds it."""

    def loaded_state(self, saved: dict[str, Any]) -> dict[str, Any]:
        """A checkpoint's optimizer state as this optimizer loads it."""


class TorchStep:
    """The optimizer's own step over the parameters whose ``.grad`` is set, and the sparse
    tables' step (by :class:`RowSGD` when it may); a failure raised as an
    :class:`OptimizerError` (``failure`` words it), what changed noted in ``changed``."""

    def __init__(self, optimizer: torch.optim.Optimizer | None,
                 params: Sequence[torch.nn.Parameter], acc: Sequence[torch.Tensor],
                 rows: SparseRows, changed: ChangedRows, row_sgd: RowSGD | None,
                 region: MemoryRegion, failure: Callable[[Exception], str]) -> None:
        self.optimizer = optimizer
        self.params = list(params)
        self.acc = list(acc)  # the parameters' dense gradients: views of the fold
        self.rows = rows
        self.changed = changed
        self.row_sgd = row_sgd
        self.region = region  # the arena
        self.gathered = False  # the gradient was gathered to be changed (hook, clipping)
        self._failure = failure

    @property
    def tables(self) -> list[int]:
        return list(self.rows)

    def grad(self, ranks: list[int], i: int) -> torch.Tensor | None:
        """Parameter ``i``'s gradient for an update of ``ranks``: a sparse table's rows, or
        of the fold (made before)."""
        if i in self.rows:
            return self.rows.grad(ranks, i)
        return self.acc[i]

    def reset_grads(self) -> None:
        dense_grads(self.params, self.acc, self.rows)

    def step(self) -> None:
        """One optimizer step."""
        if self.optimizer is None:
            return
        try:
            with no_invariant_checks():
                self.optimizer.step()
        except Exception as exc:
            raise self.failed(exc) from exc
        self.changed.stepped(self.params, row_local(self.optimizer,
                                                    [self.params[i] for i in self.rows]))

    def step_tables(self, ranks: list[int], tables: list[int]) -> None:
        """Step the sparse ``tables`` alone (the face of a flat update): every other
        parameter's ``.grad`` is unset meanwhile, so the optimizer skips it."""
        if not tables or self.fused_tables(ranks, tables):
            return  # (no table: a pass over every parameter, and a step of none)
        saved = [p.grad for p in self.params]
        try:
            for i, p in enumerate(self.params):
                p.grad = self.grad(ranks, i) if i in tables else None
            self.step()
        finally:
            for p, g in zip(self.params, saved, strict=True):
                p.grad = g

    def fused_tables(self, ranks: list[int], tables: list[int]) -> bool:
        """Step all the tables with plain SGD's few ops, if :class:`RowSGD` may now
        (not for some of them, nor a gradient gathered to be changed first)."""
        sgd = self.row_sgd
        if sgd is None or self.gathered or len(tables) != len(self.rows) or not sgd.usable():
            return False
        try:
            changed = sgd.step(ranks, self.region)
        except Exception as exc:
            raise self.failed(exc) from exc
        self.changed.noted(changed)
        return True

    def failed(self, exc: Exception) -> OptimizerError:
        """The error for a step that raised ``exc`` (nothing is known to be unchanged)."""
        self.changed.forget()
        return OptimizerError(self._failure(exc))


class PerTensor:
    """The optimizer steps the model's parameters itself; the update is one part."""

    flat = False

    def __init__(self, step: TorchStep, fold: DenseFold, specs: Sequence[ParamSpec],
                 names: list[str], nbytes: int, description: str) -> None:
        self.step = step
        self.fold = fold
        self.specs = list(specs)
        self.names = names
        self.nbytes = nbytes
        self.description = description

    @property
    def fast(self) -> FlatUpdate | None:
        return None

    @property
    def num_parts(self) -> int:
        return 1

    def part_bytes(self, k: int) -> tuple[int, int]:
        return 0, self.nbytes

    def part_table(self, k: int) -> int | None:
        return None

    def part_state(self, k: int) -> tuple[dict[Any, Any], Any]:
        raise UsageError("only a flat update keeps its state by part")

    def units(self, parts: list[int]) -> list[int]:
        raise UsageError("only a flat update folds part by part")

    def worth_parts(self) -> bool:
        return self.num_parts > 1

    def pipelines(self) -> bool:
        return False

    def apply(self, ranks: list[int]) -> None:
        step, rows = self.step, self.step.rows
        fused = step.fused_tables(ranks, step.tables)
        for i, p in enumerate(step.params):
            p.grad = None if fused and i in rows else step.grad(ranks, i)
        if not fused or len(rows) < len(step.params):
            step.step()

    def apply_part(self, ranks: list[int], k: int) -> None:
        self.fold.ensure(ranks)
        grad = self.step.acc[k]
        for i, p in enumerate(self.step.params):
            p.grad = grad if i == k else None
        self.step.step()

    def apply_tables(self, ranks: list[int], parts: list[int]) -> None:
        tables = self.step.tables
        self.step.step_tables(ranks, [tables[k] for k in parts])

    def finish(self) -> None:
        self.step.reset_grads()

    def rebind(self, region: MemoryRegion) -> None:
        self.step.region = region

    def labels(self) -> dict[int, str] | None:
        return {id(p): s.label for p, s in zip(self.step.params, self.specs, strict=True)}

    def same_params(self, names: object) -> bool:
        return bool(names == self.names)

    def saved_state(self, state: dict[str, Any]) -> dict[str, Any]:
        return state

    def loaded_state(self, saved: dict[str, Any]) -> dict[str, Any]:
        return saved


class FlatParams(PerTensor):
    """``flat=True``: the optimizer's parameters are flat parts of the arena, one part each;
    its state is kept whatever the part size (the one-parameter form, see
    :mod:`tensorx._ps.update.parts`)."""

    flat = True

    @property
    def num_parts(self) -> int:
        return len(self.step.params)

    def part_bytes(self, k: int) -> tuple[int, int]:
        view = self.step.params[k]
        return view.data_ptr() - self.step.region.address, view.numel() * view.element_size()

    def labels(self) -> dict[int, str] | None:
        return None  # a parameter covers several tensors

    def same_params(self, names: object) -> bool:
        return True  # the names count parts, whose size may have changed

    def saved_state(self, state: dict[str, Any]) -> dict[str, Any]:
        return parts.merge_state(state, self._sizes())

    def loaded_state(self, saved: dict[str, Any]) -> dict[str, Any]:
        return parts.split_state(saved, self._sizes())

    def _sizes(self) -> list[int]:
        return [p.numel() for p in self.step.params]


class FlatRanges(PerTensor):
    """The flat update (:mod:`tensorx._ps.update.flat`): the sparse tables, one part each, then
    the ranges; per tensor (:class:`PerTensor`) once the flat update has turned off."""

    def __init__(self, fast: FlatUpdate, step: TorchStep, fold: DenseFold,
                 specs: Sequence[ParamSpec], names: list[str], nbytes: int) -> None:
        super().__init__(step, fold, specs, names, nbytes, fast.describe())
        self._fast = fast

    @property
    def fast(self) -> FlatUpdate | None:
        return self._fast if self._fast.active else None

    @property
    def num_parts(self) -> int:
        if not self._fast.active:
            return super().num_parts
        return len(self.step.rows) + len(self._fast.ranges)

    def part_bytes(self, k: int) -> tuple[int, int]:
        if not self._fast.active:
            return super().part_bytes(k)
        tables = len(self.step.rows)
        if k < tables:
            return self.step.rows.span(self.step.tables[k])
        r = self._fast.ranges[k - tables]
        return r.start, r.nbytes

    def part_table(self, k: int) -> int | None:
        if not self._fast.active or k >= len(self.step.rows):
            return None
        return self.step.tables[k]

    def part_state(self, k: int) -> tuple[dict[Any, Any], Any]:
        return self._fast.engine.state, self._fast.flat[k]

    def units(self, parts: list[int]) -> list[int]:
        if not self._fast.active:
            return super().units(parts)
        tables = len(self.step.rows)
        return [k - tables for k in parts if k >= tables]

    def worth_parts(self) -> bool:
        if not self._fast.active:
            return super().worth_parts()
        return sum(r.nbytes for r in self._fast.ranges) > parts.PART_BYTES

    def pipelines(self) -> bool:
        return self._fast.active and not self.step.rows and self.num_parts > 1

    def apply(self, ranks: list[int]) -> None:
        if not self._fast.active:
            super().apply(ranks)
            return
        self.step.step_tables(ranks, self.step.tables)
        self._step([self._grad(ranks, k) for k in range(len(self._fast.ranges))])

    def apply_part(self, ranks: list[int], k: int) -> None:
        if not self._fast.active:
            super().apply_part(ranks, k)
            return
        tables = len(self.step.rows)
        if k < tables:
            self.step.step_tables(ranks, [self.step.tables[k]])
            return
        k -= tables
        self._step([self._grad(ranks, k) if i == k else None
                    for i in range(len(self._fast.ranges))])

    def finish(self) -> None:
        if not self._fast.active:  # the flat update leaves the parameters' .grad as it is
            super().finish()

    def rebind(self, region: MemoryRegion) -> None:
        super().rebind(region)
        for p, v in zip(self._fast.flat, self._fast.views(region), strict=True):
            p.data = v

    def _grad(self, ranks: list[int], k: int) -> torch.Tensor:
        """Range ``k``'s gradient: of the fold, folded now if need be."""
        self.fold.ensure(ranks, [k])
        return self.fold.acc[k]

    def _step(self, grads: list[torch.Tensor | None]) -> None:
        try:
            self._fast.step(grads)
        except Exception as exc:
            raise self.step.failed(exc) from exc


def choose(flat: bool | None, flat_params: bool, step: TorchStep, fold: Fold,
           dense: Units, specs: Sequence[ParamSpec], names: list[str],
           nbytes: int) -> Update:
    """The update of a shard (``flat``: as asked; ``flat_params``: the optimizer was given
    flat parameters): the flat update when ``flat`` is None and it gives the same result,
    else per tensor; :attr:`Update.description` says which and why. ``fold`` builds the
    shard's fold over the units the update steps with (``dense``: the dense tensors)."""
    if flat_params:
        return FlatParams(step, fold(dense), specs, names, nbytes,
                          f"flat parameters ({len(step.params)}, flat=True)")
    why = _per_tensor(flat, step)
    if why is not None:
        return PerTensor(step, fold(dense), specs, names, nbytes, why)
    assert step.optimizer is not None
    fast = FlatUpdate(step.optimizer, step.params, specs, step.region, parts.PART_BYTES)
    return FlatRanges(fast, step, fold(fast.views), specs, names, nbytes)


def _per_tensor(flat: bool | None, step: TorchStep) -> str | None:
    """Why the update steps per tensor (for the log); None: it may step flat ranges."""
    if step.optimizer is None:
        return "none (no parameters on this shard)"
    if flat is not None:
        return "per-tensor (flat=False)" if not flat else \
            "per-tensor (flat=True needs one dtype in the arena and no sparse table)"
    why = elementwise(step.optimizer)
    if why is not None:
        return f"per-tensor ({why})"
    if len(step.rows) == len(step.params):
        return "per-tensor (only sparse tables on this shard)"
    return None


def dense_grads(params: Sequence[torch.nn.Parameter], acc: Sequence[torch.Tensor],
                rows: SparseRows) -> None:
    """Dense parameters' ``.grad``: the accumulator; sparse tables': none."""
    for i, (p, g) in enumerate(zip(params, acc, strict=True)):
        p.grad = None if i in rows else g
