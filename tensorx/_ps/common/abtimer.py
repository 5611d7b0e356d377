"""Choosing between two ways of running a round by timing both (an A/B timer). Pure.

Both sides use it: a shard chooses whether a pipelined round applies parts as they land
(:class:`EarlyChooser`'s own labels), a worker whether it pushes gradient buckets during
backward (:mod:`tensorx._ps.worker.buckets`).

Applying part ``k`` while later parts are still arriving (see :mod:`tensorx._ps.service.round`)
shortens a round only where moving the bytes leaves the shard's cores time to spare: an
RDMA NIC or another machine's CPU does the copying, or the host has cores to spare. Where
the copies themselves keep every core busy and memory bandwidth is the limit (two
processes on a small host, measured on this project's 2-core VM: same-host lane and TCP,
ResNet-50 and BERT-base, 10-30% slower), the backups an early part needs are pure cost.
So a shard measures: it runs its first eligible rounds both ways, alternately, keeps the
faster (by median) and measures again every :data:`RECHECK` rounds. A round is eligible
when enough of the gradient is still on its way when the barrier completes (else both ways
are the same round). ``ParameterServer(pipeline=True/False)`` forces the choice. A choice
measured before on this host for the same plan (:mod:`tensorx._ps.common.remembered`) is taken
from the first round instead (:meth:`EarlyChooser.recall`): no probe until ``RECHECK``.
"""

from __future__ import annotations

import statistics

__all__ = ["PROBE", "RECHECK", "SKIP", "EarlyChooser"]

SKIP = 2       # eligible rounds not measured at first (the first ones warm caches up)
PROBE = 4      # rounds measured each way per probe
RECHECK = 500  # rounds between two probes


class EarlyChooser:
    """Decides, round by round, whether parts are applied as they land (``early()``), from
    the durations it is told (``observe``). ``forced``: always that answer. ``labels``:
    the two ways and their short names, for :attr:`decided` (a worker's gradient overlap
    is chosen the same way, see :mod:`tensorx._ps.worker.buckets`)."""

    LABELS = ("parts applied as they land", "once all have landed", "as they land",
              "once all have landed", "rounds")

    def __init__(self, forced: bool | None = None,
                 labels: tuple[str, str, str, str, str] | None = None) -> None:
        self.forced = forced
        self.labels = labels or self.LABELS
        self.choice = True      # until measured
        self.rounds = 0         # eligible rounds observed
        self._samples: dict[bool, list[float]] = {True: [], False: []}
        self._next_probe = SKIP
        self.decided: str | None = None  # the last decision, for the log
        self.probed = 0         # rounds observed while probing
        self.recalled = False   # the choice is one remembered from an earlier run

    def early(self) -> bool:
        """Apply parts as they land in the round that starts now?"""
        if self.forced is not None:
            return self.forced
        if self.rounds < self._next_probe:
            return self.choice
        # probing: alternate, starting with the way that has fewer samples
        return len(self._samples[True]) <= len(self._samples[False])

    def recall(self, choice: bool | None) -> None:
        """``choice`` was measured before for this host and plan (None: nothing was): take
        it as if just decided, so the next probe comes after ``RECHECK`` rounds."""
        if choice is None or self.forced is not None:
            return
        self.choice, self.recalled = choice, True
        self._samples = {True: [], False: []}
        self._next_probe = self.rounds + RECHECK

    def observe(self, early: bool, seconds: float) -> None:
        """An eligible round took ``seconds`` (first push to commit), applied ``early``."""
        probing = self.forced is None and self.rounds >= self._next_probe
        self.rounds += 1
        if not probing:
            return
        self.probed += 1
        self._samples[early].append(seconds)
        if min(len(s) for s in self._samples.values()) < PROBE:
            return
        on, off = (statistics.median(self._samples[k]) for k in (True, False))
        self.choice = on < off
        yes, no, yes_short, no_short, unit = self.labels
        self.decided = (f"{yes}: {on * 1e3:.1f} ms, {no}: {off * 1e3:.1f} ms (medians of "
                        f"{PROBE} {unit} each): {yes_short if self.choice else no_short}")
        self._samples = {True: [], False: []}
        self._next_probe = self.rounds + RECHECK
