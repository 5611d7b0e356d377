"""Workers that went away, or hang, while a sync barrier needs them: how long to wait,
then what.

A sync barrier waits for every rank. A rank that said goodbye (its worker closed) is
finished: the barrier stops waiting for it at once, no timer, until it joins again. When a
worker's connection drops without a goodbye (killed, crashed, cut off), the shard drops
whatever that rank had pushed for the barrier in progress and starts a timer of
``worker_loss_timeout`` seconds on its event loop (``loop.call_later``: nothing polls). If
the rank has not joined again when the timer fires, it is *lost* and the ``on_worker_loss``
policy decides, with one log line (a WARNING while other workers are connected and therefore
held up; INFO when nobody is):

* ``"wait"`` (default): keep waiting for it; a restarted worker with the same rank
  re-handshakes and the barrier completes with its push.
* ``"continue"``: complete this barrier and the following ones with the ranks still
  counted (the update is the average over those that pushed) until the rank joins again.

Under ``"continue"`` a rank that stays connected and does not push (stopped, hung, stuck
in its data loader) is lost too: each barrier starts a clock at its first push (one timer,
:meth:`LossWatch.opened`), and a connected rank that has not pushed ``worker_loss_timeout``
seconds later (or after it joined, if that is later) misses it (:meth:`LossWatch.overdue`,
one WARNING), whether or not its socket is open. It is then treated as a disconnected
rank: the barrier goes on without it until it joins again, and a push it makes before
that is late (its gradient was computed on parameters an update without it has replaced):
refused with :class:`~tensorx.errors.BrokenError` saying why, its connection closed, so
that a worker with ``reconnect`` rejoins, takes the current parameters and is counted again
from the barrier in progress, as a restarted worker is. A disconnected rank keeps its own
timer, from when it left. ``"wait"`` starts no clock: a barrier waits for a connected rank
as long as it takes.

Joining again cancels the timer, and a rejoined rank is counted at once (see
:meth:`tensorx._ps.service.schedule.Scheduler.join`). A shard that resumed from a checkpoint starts
a timer for every rank (each is expected back); a fresh one waits for its first workers.
``worker_loss_timeout=None``: no timer, the barrier waits silently, as before. The policy
only concerns the sync barrier: in ``async`` and ``bounded`` modes nothing waits for a
departed worker (bounded: its clock stops holding the others back at once), so no timer
runs there.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from tensorx._ps.service.schedule import Decision, Scheduler
from tensorx.errors import BrokenError, UsageError

__all__ = ["POLICIES", "LossWatch"]

logger = logging.getLogger(__name__)

POLICIES = ("wait", "continue")


class LossWatch:
    """One timer per departed rank; :meth:`declare` applies the policy when one ran out.

    ``post(rank)`` is called from the event loop when a timer fires, ``overdue(barrier)``
    when a barrier's clock runs out; the shard queues each as an event so that the policy
    acts between two messages, never in the middle of one.
    """

    def __init__(self, shard: int, policy: str, timeout: float | None,
                 post: Callable[[int], None],
                 overdue: Callable[[int], None] | None = None) -> None:
        if policy not in POLICIES:
            raise UsageError(f"on_worker_loss must be one of {POLICIES}, got {policy!r}")
        if timeout is not None and not timeout >= 0:
            raise UsageError(f"worker_loss_timeout must be >= 0 seconds or None, got {timeout!r}")
        self.shard = shard
        self.policy = policy
        self.timeout = timeout
        self._post = post
        self._post_overdue = overdue
        self._gone: dict[int, float] = {}   # rank -> time.monotonic() its connection dropped
        self._timers: dict[int, asyncio.TimerHandle] = {}
        self._expired: set[int] = set()     # timer fired, event not handled yet
        self._lost: set[int] = set()        # declared lost under "continue", until back
        self._joined: dict[int, float] = {}  # rank -> time.monotonic() it last joined
        self._opened: tuple[int, float] | None = None  # barrier open: number, first push
        self._clock: asyncio.TimerHandle | None = None
        self.declared = 0                   # losses declared so far (instrumentation)

    def gone(self, rank: int) -> None:
        """``rank``'s connection dropped: start its timer (once per absence)."""
        if rank in self._gone:
            return
        self._gone[rank] = time.monotonic()
        if self.timeout is not None and rank not in self._lost:  # lost: nothing to wait for
            loop = asyncio.get_running_loop()
            self._timers[rank] = loop.call_later(self.timeout, self._fire, rank)

    def _fire(self, rank: int) -> None:
        self._timers.pop(rank, None)
        self._expired.add(rank)
        self._post(rank)

    def back(self, rank: int) -> float | None:
        """``rank`` joined (again): cancel its timer; the seconds it was away (None: it was
        not)."""
        handle = self._timers.pop(rank, None)
        if handle is not None:
            handle.cancel()
        self._expired.discard(rank)  # an event already queued for it is stale now
        self._lost.discard(rank)
        self._joined[rank] = time.monotonic()
        since = self._gone.pop(rank, None)
        return None if since is None else time.monotonic() - since

    def departure(self, rank: int, why: str, dropped: bool, finished: bool,
                  sync: bool) -> tuple[int, str]:
        """The log level and text for ``rank`` leaving (``why``): finished (it said goodbye,
        INFO) or gone (WARNING), and what the sync barrier does about it."""
        text = why + (" (its gradient for this step is dropped)" if dropped else "")
        if finished:
            return logging.INFO, text + ("; sync barriers no longer wait for it" if sync else "")
        if rank in self._lost:  # warned when it was lost; this changes nothing for the others
            return logging.INFO, text + (f"; it was lost already: sync barriers go on without "
                                         f"it (on_worker_loss={self.policy!r})")
        if sync and self.timeout is not None:
            text += (f"; the sync barrier waits for it up to {self.timeout:g} s, then "
                     f"on_worker_loss={self.policy!r}")
        return logging.WARNING, text

    def explain(self, ranks: list[int]) -> str:
        """Why a sync barrier waits for ``ranks`` (absent ones), for the held workers: those
        that never joined (no loss timer applies to them), and those that left and what
        the policy does about them."""
        never = [r for r in ranks if r not in self._gone]
        left = [r for r in ranks if r in self._gone]
        parts = []
        if never:
            parts.append(f"{_ranks(never)}, which never joined (start {_them(never)} with "
                         f"rank={never[0]}{', ...' if len(never) > 1 else ''}, or check that "
                         f"{'it reaches' if len(never) == 1 else 'they reach'} this shard)")
        if left:
            parts.append(f"{_ranks(left)}, which {self._left(left)} ({self._then(left)})")
        return "the sync barrier waits for " + ", and for ".join(parts)

    def _left(self, ranks: list[int]) -> str:
        """How ``ranks`` (all gone) went away."""
        if all(r not in self._joined for r in ranks):  # expected back after a resume
            return "have not rejoined since this shard resumed from its checkpoint" \
                if len(ranks) > 1 else "has not rejoined since this shard resumed"
        if len(ranks) == 1:
            return f"disconnected {time.monotonic() - self._gone[ranks[0]]:.0f} s ago"
        return "disconnected"

    def _then(self, ranks: list[int]) -> str:
        """What the barrier does about departed ``ranks``."""
        them = _them(ranks)
        if self.timeout is None:
            return f"it waits for {them} without a time limit (worker_loss_timeout=None)"
        if self.policy == "wait":
            return (f"it waits for {them} to rejoin: on_worker_loss='wait', "
                    f"worker_loss_timeout={self.timeout:g} s")
        return (f"it goes on without {them} {self.timeout:g} s after leaving: "
                "on_worker_loss='continue'")

    def opened(self, barrier: int) -> None:
        """Sync: the first push of barrier number ``barrier`` came now. Under "continue",
        start its clock: :meth:`overdue` when it runs out."""
        if self.policy != "continue" or self.timeout is None or self._post_overdue is None:
            return
        self._opened = (barrier, time.monotonic())
        self._arm(barrier, self.timeout)

    def _arm(self, barrier: int, delay: float) -> None:
        assert self._post_overdue is not None
        if self._clock is not None:
            self._clock.cancel()
        self._clock = asyncio.get_running_loop().call_later(max(delay, 0.0),
                                                            self._post_overdue, barrier)

    def overdue(self, barrier: int, scheduler: Scheduler, connected: list[int]) -> Decision:
        """Barrier ``barrier``'s clock ran out (unless it completed meanwhile): the connected
        ranks it still waits for that have had ``timeout`` s since its first push, or since
        they joined if later, miss it (one WARNING each); the clock runs on for the others."""
        if self._opened is None or self._opened[0] != barrier or scheduler.barrier != barrier:
            return Decision()  # that barrier completed, or another one opened
        assert self.timeout is not None
        self._clock = None
        now = time.monotonic()
        since = {r: max(self._opened[1], self._joined.get(r, 0.0))
                 for r in scheduler.waiting_for() if r in connected}
        late = sorted(r for r, t in since.items() if now - t >= self.timeout)
        rest = [t for r, t in since.items() if r not in late]
        if rest:
            self._arm(barrier, min(rest) + self.timeout - now)
        for rank in late:
            self._lost.add(rank)
            self.declared += 1
            logger.warning("ps shard %d: worker rank %d is connected but has not pushed within "
                           "%g s of the sync barrier's first push (hung or too slow); sync "
                           "barriers go on without it, averaging over the ranks that push, "
                           "and its late push is refused: it is counted again once it rejoins "
                           "(on_worker_loss='continue'; connected ranks: %s)", self.shard,
                           rank, self.timeout, connected)
        return scheduler.miss(late) if late else Decision()

    def late(self, rank: int, step: int) -> BrokenError:
        """The error for ``rank``'s push of ``step`` made after it missed a barrier."""
        return BrokenError(
            f"rank {rank}'s push of step {step} came after the sync barrier went on without "
            f"it: it had not pushed within worker_loss_timeout={self.timeout:g} s of the "
            "barrier's first push (on_worker_loss='continue'); its gradient, computed on "
            "parameters an update has replaced since, is dropped and its connection closed: "
            "rejoin (Worker(reconnect=...)) to be counted again")

    def declare(self, rank: int, scheduler: Scheduler, connected: list[int]) -> Decision:
        """``rank``'s timer ran out (unless it came back meanwhile): log, apply the policy."""
        if rank not in self._expired:
            return Decision()
        self._expired.discard(rank)
        self.declared += 1
        away = time.monotonic() - self._gone[rank]
        level = logging.WARNING if connected else logging.INFO
        if self.policy == "wait":
            logger.log(level, "ps shard %d: worker rank %d has been disconnected for %.1f s; "
                       "the sync barrier keeps waiting for it to rejoin "
                       "(on_worker_loss='wait'; connected ranks: %s)", self.shard, rank, away,
                       connected)
            return Decision()
        self._lost.add(rank)
        logger.log(level, "ps shard %d: worker rank %d has been disconnected for %.1f s; "
                   "sync barriers go on without it, averaging over the ranks that push, until "
                   "it rejoins (on_worker_loss='continue'; connected ranks: %s)", self.shard,
                   rank, away, connected)
        return scheduler.excuse(rank)

    def close(self) -> None:
        """Cancel every timer. Idempotent."""
        for handle in self._timers.values():
            handle.cancel()
        self._timers.clear()
        if self._clock is not None:
            self._clock.cancel()
            self._clock = None


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def _them(ranks: list[int]) -> str:
    return "it" if len(ranks) == 1 else "them"
