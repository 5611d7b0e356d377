"""When a shard applies gradients and when it answers a worker. Pure: no I/O, no torch.

Three modes:

* ``sync``: every rank ``0..num_workers-1`` pushes, the gradients are averaged, one update,
  then everybody gets the new parameters. Same result as one process on the union of the
  batches. A rank the shard has excused (lost under ``on_worker_loss="continue"``, see
  :mod:`tensorx._ps.service.losses`: disconnected, or connected but missing a barrier) is not
  waited for until it joins again; the update is then the average over the ranks that
  pushed. A connected rank that missed a barrier and pushes before it joins again is
  :meth:`~Scheduler.late`.
* ``async``: each gradient is applied as it arrives and its sender is answered at once.
* ``bounded``: applied as in ``async``, but a worker that has done more than ``staleness``
  steps beyond the slowest active worker is answered only once the slowest catches up
  (stale synchronous parallel).

In every mode a rank's push of the step it pushed last (since it joined) is that push
again, from a worker retrying a step that timed out: it is taken once (:meth:`Scheduler.again`)
and the worker gets the one answer to that step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tensorx.errors import ProtocolError, UsageError

__all__ = ["MODES", "Decision", "Scheduler"]

MODES = ("sync", "async", "bounded")


@dataclass
class Decision:
    """What to do after an event: average and apply ``apply``'s slots, then answer ``release``."""

    apply: list[int] = field(default_factory=list)
    release: list[int] = field(default_factory=list)


class Scheduler:
    """Tracks which workers pushed, and decides updates and answers for one shard."""

    def __init__(self, mode: str, num_workers: int, staleness: int = 0) -> None:
        if mode not in MODES:
            raise UsageError(f"mode must be one of {MODES}, got {mode!r}")
        if num_workers < 1 or staleness < 0:
            raise UsageError("num_workers must be >= 1 and staleness >= 0")
        self.mode = mode
        self.num_workers = num_workers
        self.staleness = staleness
        self.active: set[int] = set()
        self.pending: set[int] = set()       # pushed, not answered yet
        self.clock: dict[int, int] = {}      # bounded: steps done per active worker
        self.excused: set[int] = set()       # sync: lost ranks the barrier goes on without
        self.last: dict[int, int] = {}       # the step of each rank's latest push since it joined
        self.barrier = 0                     # sync: barriers completed (the one open is next)
        self.max_gap = 0                     # instrumentation: worst clock gap ever released

    def join(self, rank: int) -> Decision:
        if not 0 <= rank < self.num_workers and self.mode == "sync":
            raise UsageError(f"rank {rank} outside 0..{self.num_workers - 1}")
        self.active.add(rank)
        self.pending.discard(rank)
        self.last.pop(rank, None)
        # Counted again at once: its welcome carries the parameters that the barrier in
        # progress (if any) was computed on, so its first gradient belongs to that barrier.
        self.excused.discard(rank)
        self.clock[rank] = min(self.clock.values(), default=0)
        return Decision()

    def leave(self, rank: int) -> Decision:
        self.active.discard(rank)
        self.pending.discard(rank)
        self.last.pop(rank, None)
        self.clock.pop(rank, None)
        return self._release_bounded() if self.mode == "bounded" else Decision()

    def excuse(self, rank: int) -> Decision:
        """Sync: stop waiting for ``rank`` (gone for good, as far as the policy cares) until
        it joins again; completes the barrier when every other counted rank has pushed."""
        if rank in self.active:
            return Decision()  # it came back meanwhile
        self.excused.add(rank)
        return self._sync_ready() if self.mode == "sync" else Decision()

    def miss(self, ranks: list[int]) -> Decision:
        """Sync: ``ranks``, connected, missed the barrier in progress (the loss policy's
        clock ran out on them): it goes on without them, as without lost ranks, until each
        joins again; completes it when every other counted rank has pushed."""
        self.excused.update(ranks)
        return self._sync_ready() if self.mode == "sync" else Decision()

    def late(self, rank: int) -> bool:
        """Sync: did ``rank`` miss a barrier while connected, and not join again since? A
        push of it is then late: computed on parameters that an update without it has
        replaced."""
        return rank in self.excused and rank in self.active

    def reopen(self, ranks: list[int]) -> None:
        """Sync: a barrier that was complete is not any more (one of its ranks went away
        before its update was committed): ``ranks`` pushed for it and wait again."""
        self.pending.update(r for r in ranks if r in self.active)

    def waiting_for(self) -> list[int]:
        """Sync: the ranks a barrier in progress still waits for ([] when none is)."""
        if self.mode != "sync" or not self.pending:
            return []
        return sorted(set(range(self.num_workers)) - self.excused - self.pending)

    def again(self, rank: int, step: int) -> bool:
        """Is ``rank``'s push of ``step`` the push it made last (a worker retrying a step
        that timed out)? Then it changes nothing: that push stands, or was answered."""
        return self.last.get(rank) == step

    def push(self, rank: int, step: int | None = None) -> Decision:
        if rank not in self.active:
            raise ProtocolError(f"push from rank {rank}, which has not joined")
        if rank in self.pending:
            raise ProtocolError(f"rank {rank} pushed twice before its answer")
        if step is not None:
            self.last[rank] = step
        self.pending.add(rank)
        if self.mode == "sync":
            return self._sync_ready()
        if self.mode == "async":
            self.pending.discard(rank)
            return Decision(apply=[rank], release=[rank])
        self.clock[rank] += 1
        decision = self._release_bounded()
        decision.apply = [rank]
        return decision

    def _sync_ready(self) -> Decision:
        if not self.pending or self.waiting_for():
            return Decision()
        ranks = sorted(self.pending)  # fixed order: the same float sums every step
        self.pending.clear()
        self.barrier += 1
        return Decision(apply=ranks, release=ranks)

    def _release_bounded(self) -> Decision:
        if not self.clock:
            return Decision()
        slowest = min(self.clock.values())
        ready = sorted(r for r in self.pending if self.clock[r] - slowest <= self.staleness)
        for r in ready:
            self.max_gap = max(self.max_gap, self.clock[r] - slowest)
            self.pending.discard(r)
        return Decision(release=ready)
