"""Cheap counters and latency histograms. Pure: imports nothing else of tensorx.

Counting is a few integer additions per operation; nothing is formatted on the hot path.
:class:`OpStats` counts one endpoint's ops; :class:`Timing` is one latency histogram (the
parameter server's and worker's step timings, see :mod:`tensorx._ps.common.stats`). Exporters
read them from above (:mod:`tensorx.metrics`, :mod:`tensorx._prometheus`); nothing here
knows who counts or who reads.
"""

from __future__ import annotations

import bisect
import collections
import time
from collections.abc import Sequence
from typing import Any

__all__ = ["BOUNDS", "BUCKETS", "OPS", "OpStats", "Timing", "quantile"]

# Upper bounds in seconds: 10 us .. 10 s, then +inf.
BUCKETS = (1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0, 3.0, 10.0)
BOUNDS = [*map(str, BUCKETS), "+Inf"]  # Prometheus "le" labels
OPS = ("write", "read", "notify")


class OpStats:
    """Counters for one endpoint: per op kind, count/bytes/errors and a latency histogram."""

    def __init__(self) -> None:
        self.count = dict.fromkeys(OPS, 0)
        self.nbytes = dict.fromkeys(OPS, 0)
        self.errors = dict.fromkeys(OPS, 0)
        self.seconds = dict.fromkeys(OPS, 0.0)
        self.hist = {op: [0] * (len(BUCKETS) + 1) for op in OPS}

    def record(self, op: str, nbytes: int, started: float, failed: bool) -> None:
        elapsed = time.perf_counter() - started
        self.count[op] += 1
        self.seconds[op] += elapsed
        if failed:
            self.errors[op] += 1
        else:
            self.nbytes[op] += nbytes
        self.hist[op][bisect.bisect_left(BUCKETS, elapsed)] += 1

    def snapshot(self) -> dict[str, Any]:
        return {op: {"ops": self.count[op], "bytes": self.nbytes[op],
                     "errors": self.errors[op], "seconds": round(self.seconds[op], 6),
                     "latency_buckets": dict(zip(BOUNDS, self.hist[op], strict=True))}
                for op in OPS}


class Timing:
    """One latency histogram: ``count``, ``total`` seconds and per-bucket counts (upper bounds
    :data:`BUCKETS`, then +inf) for Prometheus, plus the latest samples (at most ``keep``)
    for quantiles in log lines. :meth:`observe` is a few additions and an append."""

    __slots__ = ("buckets", "count", "recent", "total")

    def __init__(self, keep: int = 4096) -> None:
        self.count = 0
        self.total = 0.0
        self.buckets = [0] * (len(BUCKETS) + 1)
        self.recent: collections.deque[float] = collections.deque(maxlen=keep)

    def observe(self, seconds: float) -> float:
        """Count one sample; returns it (so ``total_s += t.observe(dt)`` reads well)."""
        self.count += 1
        self.total += seconds
        self.buckets[bisect.bisect_left(BUCKETS, seconds)] += 1
        self.recent.append(seconds)
        return seconds

    def since(self, started: float) -> float:
        """Observe ``time.perf_counter() - started``."""
        return self.observe(time.perf_counter() - started)

    def cumulative(self) -> list[tuple[str, int]]:
        """``[(upper bound, samples at or below it), ..., ("+Inf", count)]``."""
        out, total = [], 0
        for bound, n in zip(BOUNDS, list(self.buckets), strict=True):
            total += n
            out.append((bound, total))
        return out

    def take_recent(self) -> list[float]:
        """The samples since the last call (the latest ``keep``), sorted; forgets them."""
        samples = sorted(self.recent)
        self.recent.clear()
        return samples



def quantile(ordered: Sequence[float], q: float) -> float:
    """The ``q`` quantile (nearest rank) of sorted samples; 0.0 when there are none."""
    if not ordered:
        return 0.0
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]
