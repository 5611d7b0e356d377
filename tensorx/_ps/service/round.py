"""A sync update applied part by part while the workers' gradients are still arriving.

A shard whose update runs as flat ranges (:mod:`tensorx._ps.update.flat`) can apply each range (a
*part*) on its own: the same update as applying them all at once. In sync mode it applies
part ``k`` as soon as every rank of the barrier has pushed its part ``k``, and writes that
part of the new parameters back while later parts are still on their way
(:mod:`tensorx._ps.service.pipelined` does the I/O). What keeps every guarantee:

* A part applied before the whole gradient has landed is *backed up* first (its
  parameters and the optimizer's state for it): if a rank of the barrier goes away, or a
  later part of its gradient turns out to hold NaN or Inf, every applied part is restored
  and the shard is exactly as if that push never happened (:meth:`PartBackups.restore`).
* Once every part of every rank has landed (and been checked), the rest is applied with
  no backup: nothing can undo the update any more but the optimizer itself.
* The new version is *committed* (version counted, schedule stepped, workers notified) only
  after the last part: a worker's step never returns with part of a version.

:class:`Round` is the bookkeeping (pure); :class:`PartBackups` the copies (torch, no I/O).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

from tensorx.errors import ProtocolError

__all__ = ["EARLY_BYTES", "PartBackups", "Round"]

# A part is applied before the whole gradient has landed (at the price of a backup) only
# while at least this much is still on its way; with less, waiting for it is cheaper.
EARLY_BYTES = 8 << 20


class Round:
    """Which parts of which ranks have landed, the barrier's ranks once complete, and which
    parts are applied. ``sizes``: bytes of each part."""

    def __init__(self, sizes: Sequence[int]) -> None:
        self.sizes = list(sizes)
        self.landed: dict[int, set[int]] = {}  # rank -> parts landed, for this barrier
        self.ranks: list[int] | None = None    # the barrier's ranks, once every push is in
        self.applied: list[int] = []           # in the order applied
        self.backed_up: set[int] = set()
        self.checked = False  # every part of every rank landed and found finite
        self.skip = False     # no update this time (NaN or Inf): answer once all landed
        self.early = True     # parts may be applied before all have landed (_ps.common.abtimer)
        self.eligible = False  # that could matter in this round (enough was on its way)
        self.t_first: float | None = None  # when its first push arrived

    @property
    def num_parts(self) -> int:
        return len(self.sizes)

    @property
    def open(self) -> bool:
        """Part of an update is in the arena, not yet committed."""
        return bool(self.applied)

    def header(self, rank: int, done: Iterable[int], now: float = 0.0) -> None:
        """``rank`` pushed (its header) at ``now``: the parts in ``done`` have landed."""
        if not self.landed:
            self.t_first = now
        parts = set(done)
        if any(not isinstance(k, int) or not 0 <= k < self.num_parts for k in parts):
            raise ProtocolError(f"push from rank {rank} names parts outside "
                                f"0..{self.num_parts - 1}")
        self.landed[rank] = parts

    def land(self, rank: int, k: int) -> None:
        """Part ``k`` of ``rank``'s gradient has landed."""
        parts = self.landed.get(rank)
        if parts is None:
            raise ProtocolError(f"part {k} from rank {rank} before its push")
        if not 0 <= k < self.num_parts or k in parts:
            raise ProtocolError(f"part {k} from rank {rank}: out of range or twice")
        parts.add(k)

    def start(self, ranks: Sequence[int]) -> None:
        """The barrier is complete: ``ranks`` are averaged, part by part."""
        self.ranks = list(ranks)

    def ready(self) -> list[int]:
        """Parts not applied yet that every rank of the barrier has landed."""
        if self.ranks is None:
            return []
        done = set(self.applied)
        return [k for k in range(self.num_parts) if k not in done and all(
            k in self.landed.get(r, ()) for r in self.ranks)]

    def outstanding(self) -> int:
        """Bytes of the barrier's gradients still on their way."""
        assert self.ranks is not None
        return sum(self.sizes[k] for r in self.ranks for k in range(self.num_parts)
                   if k not in self.landed.get(r, ()))

    def all_landed(self) -> bool:
        return self.ranks is not None and self.outstanding() == 0

    def complete(self) -> bool:
        return self.ranks is not None and len(self.applied) == self.num_parts

    def drop(self, rank: int) -> list[int] | None:
        """``rank`` is gone (or its push is dropped): forget its parts. If it was one of the
        barrier's ranks, the barrier is open again: returns the other ranks (their pushes
        stand), else None. The caller restores what was applied first."""
        self.landed.pop(rank, None)
        if self.ranks is None or rank not in self.ranks:
            return None
        others = [r for r in self.ranks if r != rank]
        self.reset()
        return others

    def reset(self) -> None:
        """Nothing applied, no barrier (what has landed stays)."""
        self.ranks = None
        self.applied.clear()
        self.backed_up.clear()
        self.checked = False
        self.skip = False
        self.eligible = False  # a round that was reopened says nothing of either way

    def finish(self) -> None:
        """Committed: the next barrier starts from nothing."""
        self.landed.clear()
        self.t_first = None
        self.reset()


class PartBackups:
    """Copies of what applying a part changes: its byte range of the parameter arena and
    the optimizer's state for it (the flat update's engine state for that range), kept in
    buffers allocated once and reused every round."""

    def __init__(self, nbytes: int) -> None:
        self._params = torch.empty(nbytes, dtype=torch.uint8)
        self._state: dict[int, dict[str, Any] | None] = {}

    def backup(self, k: int, params: torch.Tensor, start: int, state: dict[str, Any] | None
               ) -> None:
        """Save part ``k``: ``params`` (its bytes, at ``start`` in the arena) and ``state``
        (the engine's state dict for it; None: it has none yet)."""
        self._params[start:start + params.numel()].copy_(params)
        if state is None:
            self._state[k] = None
            return
        old = self._state.get(k) or {}
        self._state[k] = {key: _save(value, old.get(key)) for key, value in state.items()}

    def restore(self, k: int, params: torch.Tensor, start: int, owner: dict[Any, Any],
                key: Any) -> None:
        """Put part ``k`` back as :meth:`backup` saw it: the bytes into ``params``, the state
        into ``owner[key]`` in place (views of it stay valid), or removed if there was none."""
        params.copy_(self._params[start:start + params.numel()])
        saved = self._state.get(k)
        if saved is None:
            owner.pop(key, None)
            return
        current = owner.setdefault(key, {})
        for name, value in saved.items():
            now = current.get(name)
            if isinstance(value, torch.Tensor) and isinstance(now, torch.Tensor) \
                    and now.shape == value.shape:
                now.copy_(value)
            else:
                current[name] = value.clone() if isinstance(value, torch.Tensor) else value
        for name in [n for n in current if n not in saved]:
            del current[name]


def _save(value: object, into: object) -> object:
    if not isinstance(value, torch.Tensor):
        return value
    if isinstance(into, torch.Tensor) and into.shape == value.shape \
            and into.dtype == value.dtype:
        return into.copy_(value)
    return value.clone()
