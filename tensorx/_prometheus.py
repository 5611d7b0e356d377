"""Prometheus collectors for :func:`tensorx.metrics.serve_prometheus`.

Imported only when an exporter is started (``prometheus-client`` is optional). Collection
runs on the HTTP server's thread while the event loop keeps counting: every value is read
once (an int or a copied list), so a scrape may lag an event behind, never see a torn one.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Protocol

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)

from tensorx._counters import BOUNDS, OPS, OpStats, Timing

__all__ = ["Collector", "CountedNode", "TimedShard", "TimedWorker"]


# What the collectors read, by shape: a Node, a ParameterServer and a Worker have it, and
# this module (below them) imports none of them.
class CountedEndpoint(Protocol):
    @property
    def peer(self) -> str: ...
    @property
    def transport(self) -> str: ...
    @property
    def stats(self) -> OpStats: ...


class CountedNode(Protocol):
    @property
    def id(self) -> str: ...
    @property
    def endpoints(self) -> Sequence[CountedEndpoint]: ...


class SeenRank(Protocol):
    @property
    def step(self) -> int: ...
    @property
    def version_lag(self) -> int: ...
    @property
    def at(self) -> float: ...


class ShardTimes(Protocol):
    @property
    def apply(self) -> Timing: ...
    @property
    def barrier(self) -> Timing: ...
    @property
    def send(self) -> Timing: ...
    @property
    def ranks(self) -> Mapping[int, SeenRank]: ...
    def summary(self) -> str: ...  # the shard's periodic log line reads it


class TimedShard(Protocol):
    @property
    def shard(self) -> int: ...
    @property
    def version(self) -> int: ...
    @property
    def stats(self) -> Mapping[str, Any]: ...
    @property
    def timings(self) -> ShardTimes: ...


class WorkerTimes(Protocol):
    @property
    def step(self) -> Timing: ...
    @property
    def push(self) -> Timing: ...
    @property
    def wait(self) -> Timing: ...


class TimedWorker(Protocol):
    @property
    def rank(self) -> int: ...
    @property
    def stats(self) -> Mapping[str, Any]: ...
    @property
    def timings(self) -> WorkerTimes: ...


class Collector:
    """Everything one exporter serves: endpoints of nodes, shards' and workers' timings."""

    def __init__(self, nodes: tuple[CountedNode, ...], servers: tuple[TimedShard, ...],
                 workers: tuple[TimedWorker, ...]) -> None:
        self.nodes = nodes
        self.servers = servers
        self.workers = workers

    def collect(self) -> Iterator[Any]:
        yield from endpoint_metrics(self.nodes)
        if self.servers:
            yield from shard_metrics(self.servers)
        if self.workers:
            yield from worker_metrics(self.workers)


def _histogram(name: str, doc: str, labels: list[str]) -> HistogramMetricFamily:
    return HistogramMetricFamily(name, doc, labels=labels)


def _add(family: HistogramMetricFamily, values: list[str], timing: Timing) -> None:
    family.add_metric(values, timing.cumulative(), timing.total)


def endpoint_metrics(nodes: tuple[CountedNode, ...]) -> Iterator[Any]:
    labels = ["node", "peer", "transport", "op"]
    ops = CounterMetricFamily("tensorx_endpoint_ops", "Operations completed", labels=labels)
    nbytes = CounterMetricFamily("tensorx_endpoint_bytes", "Bytes moved", labels=labels)
    errors = CounterMetricFamily("tensorx_endpoint_errors", "Operations failed", labels=labels)
    latency = _histogram("tensorx_endpoint_latency_seconds", "Operation latency", labels)
    for node in nodes:
        for ep in node.endpoints:
            stats = ep.stats
            for op in OPS:
                lv = [node.id, ep.peer, ep.transport, op]
                ops.add_metric(lv, stats.count[op])
                nbytes.add_metric(lv, stats.nbytes[op])
                errors.add_metric(lv, stats.errors[op])
                cumulative, total = [], 0
                for bound, n in zip(BOUNDS, list(stats.hist[op]), strict=True):
                    total += n
                    cumulative.append((bound, total))
                latency.add_metric(lv, cumulative, stats.seconds[op])
    yield from (ops, nbytes, errors, latency)


def shard_metrics(servers: tuple[TimedShard, ...]) -> Iterator[Any]:
    shard, rank = ["shard"], ["shard", "rank"]
    counters = {key: CounterMetricFamily(f"tensorx_ps_{key}", doc, labels=shard) for key, doc in
                (("updates", "Optimizer updates applied"), ("pushes", "Gradient pushes received"),
                 ("sparse_rows", "Sparse gradient rows received"),
                 ("worker_losses", "Workers declared lost (away past worker_loss_timeout)"),
                 ("nonfinite", "Pushed gradients holding NaN or Inf (never applied, see "
                  "on_nonfinite)"),
                 ("checkpoint_failures", "Checkpoints that failed to write (the previous one "
                  "stays)"),
                 ("arena_moves", "Async/bounded updates that went to a copy of the "
                  "parameters because an answer still read the arena"))}
    version = GaugeMetricFamily("tensorx_ps_version", "Parameter version (updates since "
                                "the start, checkpoints included)", labels=shard)
    hists = {key: _histogram(f"tensorx_ps_{key}_seconds", doc, shard) for key, doc in
             (("apply", "One optimizer update"),
              ("barrier_wait", "Sync mode: first push of a round to its last push"),
              ("send", "Writing parameters back to the workers an event released"))}
    step = GaugeMetricFamily("tensorx_ps_worker_step", "Step number of a rank's last push",
                             labels=rank)
    lag = GaugeMetricFamily("tensorx_ps_worker_version_lag",
                            "Updates a rank had not seen when it last pushed", labels=rank)
    age = GaugeMetricFamily("tensorx_ps_worker_last_push_age_seconds",
                            "Seconds since a rank's last push", labels=rank)
    now = time.monotonic()
    for ps in servers:
        sv, t = [str(ps.shard)], ps.timings
        for key, counter in counters.items():
            counter.add_metric(sv, ps.stats[key])
        version.add_metric(sv, ps.version)
        for hist, timing in zip(hists.values(), (t.apply, t.barrier, t.send), strict=True):
            _add(hist, sv, timing)
        for r, seen in list(t.ranks.items()):
            rv = [*sv, str(r)]
            step.add_metric(rv, seen.step)
            lag.add_metric(rv, seen.version_lag)
            age.add_metric(rv, now - seen.at)
    yield from (*counters.values(), version, *hists.values(), step, lag, age)


def worker_metrics(workers: tuple[TimedWorker, ...]) -> Iterator[Any]:
    rank = ["rank"]
    steps = CounterMetricFamily("tensorx_worker_steps", "Steps completed", labels=rank)
    rejoins = CounterMetricFamily("tensorx_worker_rejoins", "Rejoins after a lost server",
                                  labels=rank)
    hists = {key: _histogram(f"tensorx_worker_{key}_seconds", doc, rank) for key, doc in
             (("step", "One whole step: push, wait, pull"),
              ("push", "Pushing a step's gradients"),
              ("wait", "Waiting for the step's fresh parameters"))}
    for w in workers:
        rv, t = [str(w.rank)], w.timings
        steps.add_metric(rv, w.stats["steps"])
        rejoins.add_metric(rv, w.stats["rejoins"])
        for hist, timing in zip(hists.values(), (t.step, t.push, t.wait), strict=True):
            _add(hist, rv, timing)
    yield from (steps, rejoins, *hists.values())

