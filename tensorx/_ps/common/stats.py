"""Where a shard's and a worker's step time goes: histograms the service fills as it runs.

Pure bookkeeping: no I/O, no torch. The hot path is a ``perf_counter`` call and a few
additions per event; text is only made for the periodic log line (:meth:`summary`), and
:mod:`tensorx._prometheus` reads the same objects for ``/metrics``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from tensorx._counters import Timing, quantile

__all__ = ["RankSeen", "ShardTimings", "WorkerTimings", "describe"]


@dataclass
class RankSeen:
    """What a shard last heard from one worker rank."""

    step: int = 0          # the step number of its last push
    version_lag: int = 0   # updates it had not seen yet when it pushed (0: up to date)
    at: float = 0.0        # time.monotonic() of that push


class ShardTimings:
    """One shard's step timings.

    ``apply``: each optimizer update. ``barrier`` (sync mode only): from the first push of a
    round to the last one, i.e. how long the fastest worker's gradient waited for the
    slowest. ``send``: writing the parameters (and the answer) back to the workers released
    by an event. ``ranks``: per worker rank, its last push.
    """

    def __init__(self, sync: bool) -> None:
        self.sync = sync
        self.apply = Timing()
        self.barrier = Timing()
        self.send = Timing()
        self.ranks: dict[int, RankSeen] = {}
        self._round_started: float | None = None

    def pushed(self, rank: int, step: int, version_lag: int) -> None:
        seen = self.ranks.get(rank)
        if seen is None:
            seen = self.ranks[rank] = RankSeen()
        seen.step, seen.version_lag, seen.at = step, version_lag, time.monotonic()
        if self._round_started is None:
            self._round_started = time.perf_counter()

    def barrier_done(self) -> float:
        """An update is about to be applied: end the round's barrier; returns its seconds
        (0.0 outside sync mode, where nothing waits for a barrier)."""
        started, self._round_started = self._round_started, None
        if not self.sync or started is None:
            return 0.0
        return self.barrier.since(started)

    def sent(self, started: float, answered: int) -> float:
        """Parameters went out to ``answered`` workers since ``started`` (none: nothing)."""
        return self.send.since(started) if answered else 0.0

    def summary(self) -> str:
        """Quantiles of the samples since the last summary, for the periodic log line."""
        parts = [describe("apply", self.apply.take_recent())]
        if self.sync:
            parts.append(describe("barrier wait", self.barrier.take_recent()))
        parts.append(describe("send", self.send.take_recent()))
        worst = max((seen.version_lag for seen in self.ranks.values()), default=0)
        if worst:
            parts.append(f"max version lag {worst}")
        return "; ".join(parts)


class WorkerTimings:
    """One worker's step timings: ``push`` (gradients out), ``wait`` (until fresh parameters
    are in the model) and the whole ``step``."""

    def __init__(self) -> None:
        self.push = Timing()
        self.wait = Timing()
        self.step = Timing()

    def step_done(self, started: float, pushed: float) -> None:
        now = time.perf_counter()
        self.push.observe(pushed - started)
        self.wait.observe(now - pushed)
        self.step.observe(now - started)


def describe(name: str, ordered: list[float]) -> str:
    """``"apply p50 0.21 p99 0.90 mean 0.30 ms (n=40)"`` from sorted samples."""
    if not ordered:
        return f"{name} -"
    ms = [1e3 * quantile(ordered, q) for q in (0.5, 0.99)]
    mean = 1e3 * sum(ordered) / len(ordered)
    return f"{name} p50 {ms[0]:.2f} p99 {ms[1]:.2f} mean {mean:.2f} ms (n={len(ordered)})"
