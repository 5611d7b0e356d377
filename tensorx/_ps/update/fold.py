"""The dense gradient an update steps with, folded into memory of the shard's own.

A rank's gradient slot is memory that rank can write one-sided at any moment: over a
same-host lane or a mapping while the shard reads it, over TCP whenever the event loop
runs. A check of the slot followed by a step that reads the slot again checks bytes the
sender can still change. So the shard first *folds* the ranks' slots into its accumulator
(the mean in a fixed rank order; one rank's slot copied), memory no peer can reach, then
checks that (:mod:`tensorx._ps.service.nonfinite`) and steps with it: what is checked is what is
applied. Folding is the averaging an update of several ranks does anyway; the check then
reads one gradient instead of one per rank.

A fold that is to be checked is checked as it is made: by the fold kernel
(:mod:`.foldkernel`), each value as it is written, else piece by piece (:data:`CHECK_PIECE`
bytes) while the piece is still in cache. The check then costs no second pass over memory.

Only when the folded gradient is not finite is each rank's slot looked at, and then through
a private copy of it (:meth:`DenseFold.fold_each_checked`): a rank whose copy holds NaN or
Inf pushed it (however it changes its slot afterwards), and the mean of the copies is what
the update steps with if nobody did (it overflowed, or a rank changed its slot while it was
read). Pure: torch only, no I/O.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Sequence

import torch

from tensorx._ps.rows.tables import sum_finite
from tensorx._ps.update import foldkernel
from tensorx.memregion import MemoryRegion

__all__ = ["DenseFold", "kernel"]

Units = Callable[[MemoryRegion], list[torch.Tensor]]
# A fold is checked in pieces of this many bytes as it is made: a piece is summed while it is
# in cache (on a 2-core EPYC with 1 MiB of L2 per core and 32 MiB of L3, folding and checking
# 102 MB took 12-13 ms in 4 MiB pieces against 14.5-15 ms for a fold, then a check).
CHECK_PIECE = 4 << 20


class DenseFold:
    """Folds of the dense part of ``ranks``' slots into ``acc``, unit by unit: ``units``
    cuts a region (the accumulator, or a slot) into the same views, in the same order (the
    flat update's ranges: a pipelined round's parts; or the whole dense arena). Remembers
    which units hold a fold of which ranks, until :meth:`forget`."""

    def __init__(self, units: Units, acc: MemoryRegion,
                 slot: Callable[[int], MemoryRegion]) -> None:
        self._units = units
        self.acc = units(acc)
        self._slot = slot
        self._views: weakref.WeakKeyDictionary[MemoryRegion, list[torch.Tensor]] = \
            weakref.WeakKeyDictionary()  # a renewed slot is a new region: new views
        self._ranks: tuple[int, ...] | None = None
        self._done: set[int] = set()
        self._finite: dict[int, bool] = {}  # units whose fold was checked as it was made

    @property
    def num_units(self) -> int:
        return len(self.acc)

    def folded(self, ranks: Sequence[int], unit: int) -> bool:
        """Does ``unit`` of the accumulator hold the fold of ``ranks``?"""
        return self._ranks == tuple(ranks) and unit in self._done

    def fold(self, ranks: Sequence[int], units: Iterable[int] | None = None, *,
             check: bool = False) -> None:
        """Fold ``ranks``' slots (``units`` of them; default all) into the accumulator,
        afresh; ``check``: and check each unit as it is folded (:meth:`finite` then says)."""
        self._start(ranks)
        slots = [self._of(r) for r in ranks]
        todo = list(self._which(units))
        # more than the cache holds: it is not there when the update reads it, write past it
        stream = foldkernel.streamed(sum(self.acc[u].numel() * self.acc[u].element_size()
                                         for u in todo))
        with torch.no_grad():
            for u in todo:
                if check:
                    self._finite[u] = _mean_into_checked(self.acc[u], [s[u] for s in slots],
                                                         stream=stream)
                else:
                    self._finite.pop(u, None)
                    _mean_into(self.acc[u], [s[u] for s in slots])
                self._done.add(u)

    def ensure(self, ranks: Sequence[int], units: Iterable[int] | None = None) -> None:
        """Fold what of ``units`` does not hold ``ranks``' fold yet."""
        todo = [u for u in self._which(units) if not self.folded(ranks, u)]
        if todo:
            self.fold(ranks, todo)

    def finite(self, units: Iterable[int] | None = None) -> bool:
        """Is every value of the folded ``units`` (default all) finite? As checked when
        they were folded, else one sum each."""
        return all(self._finite[u] if u in self._finite else sum_finite(self.acc[u])
                   for u in self._which(units))

    def fold_each_checked(self, ranks: Sequence[int], units: Iterable[int] | None = None
                          ) -> list[int]:
        """Fold again, each rank's slot through a private copy checked on its own (the same
        sums in the same order as :meth:`fold`); the ranks whose copy holds NaN or Inf.
        Slow (a copy per rank and unit): for a fold found not finite."""
        self._start(ranks)
        slots = [self._of(r) for r in ranks]
        bad: set[int] = set()
        with torch.no_grad():
            for u in self._which(units):
                acc = self.acc[u]
                self._finite.pop(u, None)
                for i, (r, s) in enumerate(zip(ranks, slots, strict=True)):
                    mine = s[u].clone()
                    if not sum_finite(mine):
                        bad.add(r)
                    if i == 0:
                        acc.copy_(mine)
                    else:
                        acc.add_(mine)
                if len(ranks) > 1:
                    acc.div_(len(ranks))
                self._done.add(u)
        return sorted(bad)

    def forget(self) -> None:
        """The accumulator holds no fold (a new update, or other ranks, fold afresh)."""
        self._ranks = None
        self._done.clear()
        self._finite.clear()

    def _start(self, ranks: Sequence[int]) -> None:
        if self._ranks != tuple(ranks):
            self._ranks = tuple(ranks)
            self._done.clear()
            self._finite.clear()

    def _which(self, units: Iterable[int] | None) -> Iterable[int]:
        return range(self.num_units) if units is None else units

    def _of(self, rank: int) -> list[torch.Tensor]:
        region = self._slot(rank)
        views = self._views.get(region)
        if views is None:
            views = self._views[region] = self._units(region)
        return views


def kernel() -> foldkernel.FoldKernel | None:
    """The fold kernel the checked fold uses, or None where the torch ops serve (built,
    loaded and probed against them on first call)."""
    return foldkernel.load(_mean_into)


def _mean_into_checked(acc: torch.Tensor, slots: Sequence[torch.Tensor], *,
                       stream: bool = False) -> bool:
    """:func:`_mean_into`, checked in the same pass: whether every value of the mean is
    finite. The fold kernel where it takes them (:mod:`.foldkernel`: each value checked as
    it is written; ``stream``: ``acc`` written past the caches), else piece by piece, each
    piece summed while it is in cache (see :func:`sum_finite`)."""
    folds = kernel()
    if folds is not None:
        finite = folds.fold(acc, slots, stream=stream)
        if finite is not None:
            return finite
    step = max(1, CHECK_PIECE // acc.element_size())
    if acc.dim() != 1 or acc.numel() <= step or any(s.shape != acc.shape for s in slots):
        _mean_into(acc, slots)
        return sum_finite(acc)
    ok = True
    for i in range(0, acc.numel(), step):
        piece = acc[i:i + step]
        _mean_into(piece, [s[i:i + step] for s in slots])
        ok = sum_finite(piece) and ok
    return ok


def _mean_into(acc: torch.Tensor, slots: Sequence[torch.Tensor]) -> None:
    """The mean of ``slots`` into ``acc``, in their order (one slot: copied)."""
    if len(slots) == 1:
        acc.copy_(slots[0])
        return
    torch.add(slots[0], slots[1], out=acc)
    for s in slots[2:]:
        acc.add_(s)
    acc.div_(len(slots))
