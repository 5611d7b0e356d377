"""A shard's own observability: its Prometheus exporter and its periodic throughput line.

What is counted lives in :mod:`tensorx._ps.common.stats` (and ``ParameterServer.stats``); this
module only shows it, on a schedule or on request.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tensorx._prometheus import CountedNode, TimedShard

__all__ = ["report", "start_exporter", "stop_exporter"]

logger = logging.getLogger("tensorx.ps")


def start_exporter(port: int | None, addr: str, node: CountedNode, server: TimedShard
                   ) -> Any:
    """Serve ``server``'s and ``node``'s metrics on ``addr:port`` (None: off; 0: any port,
    see the returned exporter's ``server_port``)."""
    if port is None:
        return None
    from tensorx.metrics import serve_prometheus  # noqa: PLC0415 (metrics support loads only when metrics are on)

    exporter = serve_prometheus(port, node, servers=[server], addr=addr)
    logger.info("ps shard %d: metrics on http://%s:%d/metrics", server.shard, addr,
                exporter.server_port)
    return exporter


async def stop_exporter(exporter: Any) -> None:
    if exporter is None:
        return
    from tensorx.metrics import stop_prometheus  # noqa: PLC0415 (metrics support loads only when metrics are on)

    await asyncio.to_thread(stop_prometheus, exporter)  # bounded: 5 s at most


async def report(server: TimedShard, every: float, workers: Callable[[], int]) -> None:
    """Every ``every`` seconds in which updates were applied: one INFO line of throughput."""
    last, t0 = 0, time.monotonic()
    while True:
        await asyncio.sleep(every)
        now, updates = time.monotonic(), server.stats["updates"]
        if updates != last:
            logger.info("ps shard %d: version %d, %.1f updates/s, %d worker(s); %s",
                        server.shard, server.version, (updates - last) / (now - t0),
                        workers(), server.timings.summary())
        last, t0 = updates, now
