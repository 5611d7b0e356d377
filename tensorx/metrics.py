"""Cheap per-endpoint counters and latency histograms, and an opt-in Prometheus exporter.

Counting is a few integer additions per operation; nothing is formatted on the hot path.
``serve_prometheus(port, *nodes)`` exposes every node's endpoints over HTTP (needs the
``prometheus-client`` package: ``pip install tensorx[metrics]``).
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from tensorx.errors import UsageError

if TYPE_CHECKING:
    from tensorx.node import Node

__all__ = ["BUCKETS", "OpStats", "serve_prometheus"]

# Upper bounds in seconds: 10 us .. 10 s, then +inf.
BUCKETS = (1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0, 3.0, 10.0)
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
                     "latency_buckets": dict(zip([*map(str, BUCKETS), "+Inf"],
                                                 self.hist[op], strict=True))}
                for op in OPS}


def _collect(nodes: tuple[Node, ...]) -> Iterator[Any]:
    from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

    labels = ["node", "peer", "transport", "op"]
    ops = CounterMetricFamily("tensorx_endpoint_ops", "Operations completed", labels=labels)
    nbytes = CounterMetricFamily("tensorx_endpoint_bytes", "Bytes moved", labels=labels)
    errors = CounterMetricFamily("tensorx_endpoint_errors", "Operations failed", labels=labels)
    latency = HistogramMetricFamily("tensorx_endpoint_latency_seconds", "Operation latency",
                                    labels=labels)
    for node in nodes:
        for ep in node.endpoints:
            stats = ep.stats
            for op in OPS:
                lv = [node.id, ep.peer, ep.transport, op]
                ops.add_metric(lv, stats.count[op])
                nbytes.add_metric(lv, stats.nbytes[op])
                errors.add_metric(lv, stats.errors[op])
                cumulative, total = [], 0
                for bound, n in zip([*map(str, BUCKETS), "+Inf"], stats.hist[op], strict=True):
                    total += n
                    cumulative.append((bound, total))
                latency.add_metric(lv, cumulative, stats.seconds[op])
    yield from (ops, nbytes, errors, latency)


def serve_prometheus(port: int, *nodes: Node, addr: str = "127.0.0.1") -> Any:
    """Serve the endpoints' metrics of ``nodes`` at ``http://addr:port/metrics``.

    Returns the HTTP server (call ``.shutdown()`` to stop it). Opt-in: nothing listens
    unless you call this.
    """
    try:
        from prometheus_client import CollectorRegistry, start_http_server
    except ImportError as exc:
        raise UsageError("Prometheus metrics need prometheus-client "
                         "(pip install tensorx[metrics])") from exc

    class _Collector:
        def collect(self) -> Iterator[Any]:
            return _collect(nodes)

    registry = CollectorRegistry()
    registry.register(_Collector())  # type: ignore[arg-type]
    server, _thread = start_http_server(port, addr=addr, registry=registry)
    return server
