"""PS and worker step timings: histograms, the periodic log line, /metrics over real HTTP."""

from __future__ import annotations

import asyncio
import logging
import re
import urllib.error
import urllib.request
from collections.abc import Sequence

import pytest
from torch import nn

from tensorx._ps.common.stats import ShardTimings
from tensorx.metrics import BUCKETS, Timing, quantile, serve_prometheus, stop_prometheus
from tensorx.testing import wait_until
from tensorx.worker import Worker
from tests.support.clusters import PsProcess, servers, workers
from tests.support.data import backward, batches
from tests.support.models import small_mlp

pytest.importorskip("prometheus_client")

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(port: int) -> Samples:
    """GET /metrics from 127.0.0.1:port and parse it with prometheus_client's parser."""
    from prometheus_client.parser import text_string_to_metric_families

    url = f"http://127.0.0.1:{port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as reply:
        text = reply.read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: Samples, name: str, **labels: str) -> float:
    key = (name, frozenset(labels.items()))
    assert key in samples, f"{name}{labels} not scraped; have {sorted({k[0] for k in samples})}"
    return samples[key]


def check_histogram(samples: Samples, name: str, count: int, **labels: str) -> None:
    """``count`` samples, all in the buckets, a positive sum, cumulative buckets."""
    assert value(samples, f"{name}_count", **labels) == count
    assert value(samples, f"{name}_sum", **labels) > 0
    cumulative = [value(samples, f"{name}_bucket", le=str(b), **labels) for b in BUCKETS]
    assert cumulative == sorted(cumulative)
    assert value(samples, f"{name}_bucket", le="+Inf", **labels) == count


async def train(ws: Sequence[Worker], models: Sequence[nn.Module], steps: int) -> None:
    for step in batches(steps, len(ws)):
        for w, m, (x, y) in zip(ws, models, step, strict=True):
            w.zero_grad()
            backward(m, x, y)
        await asyncio.gather(*(w.step() for w in ws))


def test_timing_buckets_quantiles_and_window() -> None:
    t = Timing(keep=3)
    for seconds in (2e-5, 1e-3, 1e-3, 5.0, 20.0):
        t.observe(seconds)
    assert t.count == 5 and t.total == pytest.approx(25.00202)
    cumulative = dict(t.cumulative())
    assert cumulative["3e-05"] == 1 and cumulative["0.001"] == 3  # le: bound included
    assert cumulative["10.0"] == 4 and cumulative["+Inf"] == 5
    assert t.take_recent() == [1e-3, 5.0, 20.0]  # the latest 3, sorted
    assert t.take_recent() == []
    assert quantile([1.0, 2.0, 3.0, 4.0], 0.5) == 3.0 and quantile([], 0.99) == 0.0


def test_shard_timings_barrier_is_first_to_last_push_in_sync_mode_only() -> None:
    sync, free = ShardTimings(sync=True), ShardTimings(sync=False)
    for t in (sync, free):
        t.pushed(0, step=7, version_lag=0)
        t.pushed(1, step=7, version_lag=2)
    assert sync.barrier_done() > 0 and free.barrier_done() == 0.0
    assert sync.barrier_done() == 0.0  # no push since: no round to end
    assert (sync.barrier.count, free.barrier.count) == (1, 0)
    assert sync.ranks[1].step == 7 and sync.ranks[1].version_lag == 2
    assert sync.sent(0.0, answered=0) == 0.0 and sync.send.count == 0
    line = sync.summary()
    assert "apply -" in line and "barrier wait p50" in line and "max version lag 2" in line
    assert "barrier" not in free.summary()


async def test_ps_and_worker_timings_scraped_over_http() -> None:
    """Sync mode, 2 workers, 5 steps: every count on /metrics is exactly what happened."""
    steps = 5
    models = [small_mlp(), small_mlp(seed=1)]
    async with servers(1, 2, mode="sync", metrics_port=0) as (ps,), \
            workers(models, [ps.address]) as ws:
        assert ps.metrics_port  # port 0 asked: the port bound is known
        exporter = serve_prometheus(0, servers=[ps], workers=ws)
        try:
            await train(ws, models, steps)
            got = await asyncio.to_thread(scrape, ps.metrics_port)
            both = await asyncio.to_thread(scrape, exporter.server_port)
        finally:
            await asyncio.to_thread(stop_prometheus, exporter)
    shard = {"shard": "0"}
    assert value(got, "tensorx_ps_updates_total", **shard) == steps
    assert value(got, "tensorx_ps_pushes_total", **shard) == 2 * steps
    assert value(got, "tensorx_ps_worker_losses_total", **shard) == 0
    assert value(got, "tensorx_ps_nonfinite_total", **shard) == 0
    assert value(got, "tensorx_ps_version", **shard) == steps
    for name in ("apply", "barrier_wait", "send"):  # one update releases both: one send
        check_histogram(got, f"tensorx_ps_{name}_seconds", steps, **shard)
    for rank in ("0", "1"):
        assert value(got, "tensorx_ps_worker_step", rank=rank, **shard) == steps - 1
        assert value(got, "tensorx_ps_worker_version_lag", rank=rank, **shard) == 0
        assert 0 <= value(got, "tensorx_ps_worker_last_push_age_seconds", rank=rank,
                          **shard) < 30
        assert value(both, "tensorx_worker_steps_total", rank=rank) == steps
        for name in ("step", "push", "wait"):
            check_histogram(both, f"tensorx_worker_{name}_seconds", steps, rank=rank)
    assert any(k[0] == "tensorx_endpoint_ops_total" for k in got)  # the shard's node too
    assert value(both, "tensorx_ps_updates_total", **shard) == steps
    assert all(ps.stats[k] > 0 for k in ("apply_s", "barrier_s", "send_s"))
    assert ps.stats["apply_s"] == pytest.approx(ps.timings.apply.total)
    with pytest.raises(urllib.error.URLError):  # closing the server closed its exporter
        await asyncio.to_thread(scrape, ps.metrics_port)


async def test_periodic_log_line_has_the_step_timings(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="tensorx.ps")
    models = [small_mlp(), small_mlp(seed=1)]

    def counted() -> tuple[list[str], int]:
        lines = [r.getMessage() for r in caplog.records if "updates/s" in r.getMessage()]
        return lines, sum(int(m) for m in re.findall(r"apply p50 .*? \(n=(\d+)\)", "".join(lines)))

    async with servers(1, 2, mode="sync", log_every=0.2) as (ps,), \
            workers(models, [ps.address]) as ws:
        await train(ws, models, 4)
        await wait_until(lambda: counted()[1] >= 4, what="the periodic lines of 4 updates")
        lines, n = counted()
    assert n == 4, lines  # each update in exactly one line's quantiles
    assert all("barrier wait p50" in line and "send p50" in line for line in lines)


async def test_cli_metrics_port_serves_the_shard() -> None:
    ps = PsProcess("--listen", "tcp://127.0.0.1:0", "--workers", "1", "--transport", "tcp",
                   "--metrics-port", "0")
    try:
        (address,) = ps.addresses(1)
        line = next(ln for ln in ps.lines if "metrics on" in ln)
        port = int(line.rsplit(":", 1)[1].split("/")[0])
        model = small_mlp()
        async with Worker(model, address, transport="tcp") as w:
            await train([w], [model], 3)
            got = await asyncio.to_thread(scrape, port)
    finally:
        log = ps.stop()
    assert ps.proc.returncode == 0, log
    assert value(got, "tensorx_ps_updates_total", shard="0") == 3
    check_histogram(got, "tensorx_ps_apply_seconds", 3, shard="0")
    assert value(got, "tensorx_ps_worker_step", shard="0", rank="0") == 2

