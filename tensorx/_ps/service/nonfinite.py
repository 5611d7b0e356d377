"""Gradients holding NaN or Inf: found before they reach the optimizer, never applied.

One rank's NaN, averaged in, would make every parameter NaN on every worker for good. So
before each update the shard checks the gradient it is about to apply: the ranks' slots
folded into memory of its own (:mod:`tensorx._ps.update.fold`), never the slots themselves, which
their ranks can still write while the shard reads them. The check is one sum per piece of
a folded range (per tensor when the arena mixes dtypes), taken as the piece is folded, while
it is in cache, and accumulated in at least float32: a sum is finite only if every term is,
so nothing non-finite passes; a finite gradient so large that the sum of a piece (or the
ranks' mean) overflows is flagged too, and such a step would not be worth applying. It
reads one gradient, whatever the number of ranks, with no allocation (see
``benchmarks/ps_round.py`` for its cost next to a round's). Only a fold found not finite is
looked at further: each rank's slot through a private copy, checked on its own, for who
pushed NaN or Inf, then tensor by tensor (and a sparse push table by table) for the names
of the tensors concerned. A fold that is not finite while every rank's copy is (the mean
overflowed, or a rank changed its slot while it was read) is not applied either: no update
for this step, whatever the policy, with one WARNING.

``on_nonfinite`` says what then, with one WARNING naming the rank, its step and those
tensors (their names in ``model.named_parameters()``: the first :data:`SHOWN`, then how
many more), and the ``nonfinite`` counter in :attr:`ParameterServer.stats` (and Prometheus):

* ``"skip"`` (default): no update for this step. Sync: the whole barrier is skipped (as
  ``torch.cuda.amp.GradScaler`` skips a step with an overflow) and every worker gets the
  parameters unchanged; async/bounded: that push applies nothing and its sender gets the
  current parameters.
* ``"refuse"``: the offending push is refused: that worker's step raises
  :class:`~tensorx.errors.UsageError` naming its rank and those tensors, and it is
  disconnected (in sync mode the barrier then treats it as a departed worker, see
  ``on_worker_loss``); the other ranks' gradients are averaged and applied as usual.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from tensorx._ps.rows.tables import sum_finite
from tensorx._ps.service.schedule import Decision
from tensorx._ps.state.shard_layout import ShardLayout, views
from tensorx._text import printable
from tensorx.errors import UsageError

if TYPE_CHECKING:
    from tensorx._ps.state.shard import ShardState
    from tensorx._ps.update.optim import ParamSpec
    from tensorx.memregion import MemoryRegion

__all__ = ["POLICIES", "SHOWN", "NonFiniteGuard", "Verdict", "all_finite", "checked", "finite",
           "listed", "nonfinite_names"]

logger = logging.getLogger(__name__)

POLICIES = ("skip", "refuse")
SHOWN = 3  # tensors named in a WARNING or a refusal; then how many more
NAME_LIMIT = 100  # characters of one name there (a plan's names are the model's, but still)


class Verdict(NamedTuple):
    """What :func:`checked` found: the ranks whose gradient holds NaN or Inf, and whether
    the folded gradient is finite (then it is what the update steps with)."""

    bad: list[int]
    finite: bool


def checked(state: ShardState, ranks: list[int], parts: list[int] | None = None) -> Verdict:
    """Fold ``ranks``' gradients (``parts`` of them; default all) into ``state``'s own
    memory and check the fold, and each rank's sparse rows (the shard's copies)."""
    state.fold(ranks, parts)
    rows_bad = [r for r in ranks if not state.rows.finite(r)] if state.rows and \
        parts is None else []
    if state.folded_finite(parts):
        return Verdict(rows_bad, not rows_bad)
    bad = sorted(set(rows_bad) | set(state.fold_each_checked(ranks, parts)))
    return Verdict(bad, not bad and state.folded_finite(parts))


def finite(state: ShardState, rank: int) -> bool:
    """Is every value in ``rank``'s gradient slot, and every sparse row it pushed, finite?
    (The slot as it is now: its rank may still change it. For what an update applies, see
    :func:`checked`.)"""
    tensors = _checked(state, state.slot_region(rank))
    return all_finite(tensors) and (not state.rows or state.rows.finite(rank))


# what to sum of a slot, by slot region: worked out once per region (the layout's dtypes
# over 2000 small tensors cost more than summing them); a renewed slot is a new region
_CHECKED: weakref.WeakKeyDictionary[Any, list[torch.Tensor]] = weakref.WeakKeyDictionary()


def _checked(state: ShardState, region: MemoryRegion) -> list[torch.Tensor]:
    tensors = _CHECKED.get(region)
    if tensors is None:
        tensors = _CHECKED[region] = _to_check(state.layout, region, bool(state.rows))
    return tensors


def _to_check(layout: ShardLayout, region: MemoryRegion, rows: bool) -> list[torch.Tensor]:
    if rows:  # the tables' part of the slot is never written: O(rows), not O(table)
        return [region.view(s.dtype, (s.numel,), s.offset) for s in layout.param_specs()
                if not s.sparse and s.dtype.is_floating_point]
    dtypes = {s.dtype for s in layout.slots}
    if len(dtypes) == 1:
        (dtype,) = dtypes
        if not dtype.is_floating_point:
            return []
        size = torch.empty((), dtype=dtype).element_size()
        return [region.view(dtype, (layout.nbytes // size,))]  # padding is zero or ours
    return [v for v in views(layout, region) if v.is_floating_point()]


def nonfinite_names(state: ShardState, rank: int,
                    spans: Sequence[tuple[int, int]] | None = None) -> list[str]:
    """The tensors of ``rank``'s gradient that hold NaN or Inf, by name, in model order:
    the second pass, one sum per tensor (per sparse table), made only once :func:`finite`
    has found something. With ``spans`` ((offset, nbytes) in the arena), only the dense
    tensors' bytes within them are read (the rest of the slot may not hold this push)."""
    region = state.slot_region(rank)
    tables = set(state.rows.nonfinite(rank)) if state.rows else set()
    dense = [s for s in state.layout.param_specs() if not s.sparse]
    bad = {s.name for s in dense if not all_finite(_within(region, s, spans))}
    return [s.name for s in state.layout.param_specs() if s.name in tables or s.name in bad]


def _within(region: MemoryRegion, spec: ParamSpec, spans: Sequence[tuple[int, int]] | None
            ) -> list[torch.Tensor]:
    """Dense tensor ``spec`` of ``region`` (floating point only), cut to ``spans``."""
    if not spec.dtype.is_floating_point:
        return []
    size = spec.dtype.itemsize
    start, end = spec.offset, spec.offset + spec.numel * size
    out = []
    for at, n in [(start, end - start)] if spans is None else spans:
        lo, hi = max(start, at), min(end, at + n)
        lo += -(lo - start) % size  # on an element of the tensor
        if hi - lo >= size:
            out.append(region.view(spec.dtype, ((hi - lo) // size,), lo))
    return out


def listed(names: Sequence[str]) -> str:
    """`` in a, b, c (and 2 more)`` for a message ("": no name; then a sum overflowed)."""
    if not names:
        return ""
    shown = ", ".join(printable(n, NAME_LIMIT) for n in names[:SHOWN])
    more = len(names) - SHOWN
    return f" in {shown}" + (f" (and {more} more)" if more > 0 else "")


def all_finite(tensors: list[torch.Tensor]) -> bool:
    """Is every value of every tensor finite? (One sum each, see the module docstring.)"""
    return all(map(sum_finite, tensors))


class NonFiniteGuard:
    """The ``on_nonfinite`` policy of one shard, and its count."""

    def __init__(self, shard: int, policy: str) -> None:
        if policy not in POLICIES:
            raise UsageError(f"on_nonfinite must be one of {POLICIES}, got {policy!r}")
        self.shard = shard
        self.policy = policy
        self.count = 0

    def check(self, state: ShardState, ranks: list[int], steps: dict[int, int]
              ) -> tuple[dict[int, list[str]], bool]:
        """Fold ``ranks``' gradients and check them (:func:`checked`): the ranks whose
        gradient is not finite, each with the tensors concerned, and whether the fold is
        finite (logged and counted)."""
        verdict = checked(state, ranks)
        bad = {r: nonfinite_names(state, r) for r in verdict.bad}
        for r, names in bad.items():
            self.flag(r, steps.get(r, -1), names)
        if not verdict.finite and not bad:
            self.overflowed(ranks)
        return bad, verdict.finite

    def overflowed(self, ranks: Sequence[int]) -> None:
        """The fold of ``ranks``' gradients holds NaN or Inf though no rank's does."""
        self.count += 1
        logger.warning("ps shard %d: the mean of ranks %s's gradients holds NaN or Inf though "
                       "each rank's is finite (it overflowed, or a rank changed its slot while "
                       "it was read); not applied, no update for this step", self.shard,
                       list(ranks))

    def flag(self, rank: int, step: int, names: Sequence[str]) -> None:
        """Count and log ``rank``'s non-finite gradient of ``step`` (in tensors ``names``)."""
        self.count += 1
        logger.warning("ps shard %d: rank %d pushed a gradient with NaN or Inf%s (its step "
                       "%d); %s (on_nonfinite=%r)", self.shard, rank, listed(names), step,
                       "not applied, no update for this step" if self.policy == "skip"
                       else "push refused, the worker is disconnected", self.policy)

    def decide(self, decision: Decision, bad: Collection[int]) -> Decision:
        """What remains of ``decision`` once ``bad`` ranks' gradients are left out (none
        named: the fold of them all is not finite, nothing is applied)."""
        if self.policy == "skip" or not bad:
            return Decision(apply=[], release=decision.release)
        return Decision(apply=[r for r in decision.apply if r not in bad],
                        release=[r for r in decision.release if r not in bad])

    def error(self, rank: int, step: int, names: Sequence[str]) -> UsageError:
        return UsageError(f"rank {rank}'s gradient of step {step} holds NaN or Inf"
                          f"{listed(names)}; push refused (on_nonfinite='refuse')")
