"""Metrics: the counters tensorx keeps (re-exported from :mod:`tensorx._counters`) and an
opt-in Prometheus exporter over nodes, parameter-server shards and workers.

``serve_prometheus(port, *nodes, servers=..., workers=...)`` exposes them over HTTP (needs
the ``prometheus-client`` package: ``pip install 'tensorx-rdma[metrics]'``); the collectors
live in :mod:`tensorx._prometheus`. The counters stand alone below everything; this exporter sits
above the objects it reads.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from tensorx._counters import BOUNDS, BUCKETS, OPS, OpStats, Timing, quantile
from tensorx.errors import UsageError

if TYPE_CHECKING:  # what it reads, by shape (Node, ParameterServer, Worker fit)
    from tensorx._prometheus import CountedNode, TimedShard, TimedWorker

__all__ = ["BOUNDS", "BUCKETS", "OPS", "OpStats", "Timing", "quantile", "serve_prometheus",
           "stop_prometheus"]


def serve_prometheus(port: int, *nodes: CountedNode, addr: str = "127.0.0.1",
                     servers: Iterable[TimedShard] = (),
                     workers: Iterable[TimedWorker] = ()) -> Any:
    """Serve metrics at ``http://addr:port/metrics``: the endpoints of ``nodes``, the step
    timings of parameter-server shards ``servers`` and of ``workers``.

    Returns the HTTP server: ``.server_port`` is the port bound (``port=0``: any free one);
    stop it with :func:`stop_prometheus`. Opt-in: nothing listens unless you call this.
    """
    try:
        from prometheus_client import CollectorRegistry, start_http_server  # noqa: PLC0415 (optional dependency)
    except ImportError as exc:
        raise UsageError("Prometheus metrics need prometheus-client "
                         "(pip install 'tensorx-rdma[metrics]')") from exc
    from tensorx._prometheus import Collector  # noqa: PLC0415 (imports prometheus_client, optional)

    registry = CollectorRegistry()
    registry.register(Collector(nodes, tuple(servers), tuple(workers)))
    try:
        server, _thread = start_http_server(port, addr=addr, registry=registry)
    except OSError as exc:
        raise UsageError(f"cannot serve metrics on {addr}:{port}: {exc}") from exc
    return server


def stop_prometheus(server: Any, timeout: float = 5.0) -> None:
    """Stop a server from :func:`serve_prometheus` and close its socket. Blocking: about
    half a second (the server's poll interval), never more than ``timeout`` (the stopping
    runs on a daemon thread, so even a stuck server cannot hold up the interpreter's exit).
    """
    stopper = threading.Thread(target=server.shutdown, daemon=True,
                               name="tensorx-metrics-stop")
    stopper.start()
    stopper.join(timeout)
    server.server_close()
