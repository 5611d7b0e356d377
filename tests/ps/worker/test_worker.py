"""The worker side: gradient buckets pushed during backward, and the blocking facade."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import threading
from collections.abc import Iterator

import pytest
import torch
from torch import nn

from tensorx import RemoteOptimizer
from tensorx._ps.common import abtimer
from tensorx._ps.common.gather import together
from tensorx._ps.worker.buckets import Bucket, BucketPusher, make_buckets, merge_adjacent
from tensorx.errors import TransportUnavailableError, UsageError
from tensorx.graph_analyzer import GraphAnalyzer
from tensorx.ps import ParameterServer
from tensorx.worker import Worker
from tests.support.lanes import HAVE_UCX, assert_link, link_options, links
from tests.support.models import mlp


class WithUnused(nn.Module):
    """An MLP plus a parameter no forward pass touches (its gradient stays None)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = mlp()
        self.unused = nn.Parameter(torch.ones(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)  # type: ignore[no-any-return]


def test_buckets_tile_the_dense_entries() -> None:
    plan = GraphAnalyzer(mlp(), num_shards=2).plan()
    buckets = make_buckets(plan, bucket_bytes=4096)
    assert len(buckets) > plan.num_shards  # small buckets: several per shard
    for shard in range(plan.num_shards):
        mine = sorted((b for b in buckets if b.shard == shard), key=lambda b: b.offset)
        entries = plan.shard_entries(shard)
        assert mine[0].offset == entries[0].offset
        assert mine[-1].offset + mine[-1].nbytes == entries[-1].end
        for a, b in itertools.pairwise(mine):
            assert a.offset + a.nbytes <= b.offset
    names = set().union(*(b.names for b in buckets))
    assert names == {e.name for e in plan.entries}


def test_buckets_left_for_step_go_out_as_few_writes() -> None:
    plan = GraphAnalyzer(mlp(), num_shards=2).plan()
    buckets = make_buckets(plan, bucket_bytes=512)
    merged = merge_adjacent(buckets, list(range(len(buckets))))
    assert [b.shard for b in merged] == list(range(plan.num_shards))  # one write per shard
    for shard, b in enumerate(merged):
        entries = plan.shard_entries(shard)
        assert (b.offset, b.offset + b.nbytes) == (entries[0].offset, entries[-1].end)
        assert b.names == {e.name for e in entries}
    # a bucket written early splits the rest: its neighbours are not joined across it
    first = [i for i, b in enumerate(buckets) if b.shard == 0]
    assert len(first) >= 3
    picked = [i for i in range(len(buckets)) if i != first[1]]
    parts = [b for b in merge_adjacent(buckets, picked) if b.shard == 0]
    assert len(parts) == 2
    assert parts[0].offset + parts[0].nbytes <= buckets[first[1]].offset
    assert parts[1].offset >= buckets[first[1]].offset + buckets[first[1]].nbytes


def test_buckets_never_join_across_a_dynamic_entry() -> None:
    from tests.support.models import sparse_embedding

    plan = GraphAnalyzer(sparse_embedding()).plan()
    buckets = make_buckets(plan, bucket_bytes=1 << 30)
    dynamic = [e for e in plan.entries if e.kind == "dynamic"]
    assert dynamic
    for b in merge_adjacent(buckets, list(range(len(buckets)))):
        for e in dynamic:
            assert e.end <= b.offset or e.offset >= b.offset + b.nbytes or e.shard != b.shard


async def test_what_step_writes_follows_each_steps_early_writes() -> None:
    """The buckets left for step (remembered from one step to the next) are each step's
    own: all of them without a backward, none after a full one, then all again."""
    model = mlp()
    buckets = make_buckets(GraphAnalyzer(model, num_shards=2).plan(), bucket_bytes=512)
    early: list[Bucket] = []

    async def write(bucket: Bucket) -> None:
        early.append(bucket)

    pusher = BucketPusher(buckets, model, write, asyncio.get_running_loop(), overlap=True)
    everything = merge_adjacent(buckets, list(range(len(buckets))))
    assert len(everything) == 2  # one write per shard
    assert await pusher.settle() == everything
    model(torch.randn(3, 64)).sum().backward()
    assert await pusher.settle() == []
    assert sorted(early, key=lambda b: (b.shard, b.offset)) == buckets
    assert await pusher.settle() == everything
    early.clear()
    model[4](torch.randn(3, 64)).sum().backward()  # the last layer's bucket(s) only
    left = await pusher.settle()
    assert early
    assert left == merge_adjacent(buckets, [i for i, b in enumerate(buckets) if b not in early])


@pytest.mark.parametrize("faster", ["on", "off"])
async def test_overlap_by_default_is_measured_and_the_faster_kept(
        faster: str, caplog: pytest.LogCaptureFixture) -> None:
    """overlap=None: steps are timed from one push to the next with and without early
    writes, alternately; the faster way is kept (one INFO line) until the next probe."""
    model = mlp()
    buckets = make_buckets(GraphAnalyzer(model).plan(), bucket_bytes=4096)
    async def write(bucket: Bucket) -> None:
        pass

    pusher = BucketPusher(buckets, model, write, asyncio.get_running_loop(), overlap=None)
    now, seen = 0.0, []
    with caplog.at_level(logging.INFO, logger="tensorx._ps.worker.buckets"):
        for _ in range(abtimer.SKIP + 2 * abtimer.PROBE + 1):
            before = pusher.early  # buckets started during backward, so far
            model(torch.randn(3, 64)).sum().backward()
            seen.append(pusher.early > before)
            now += 0.030 if seen[-1] == (faster == "on") else 0.045
            pusher.measure(now)
            await pusher.settle()
    probe = seen[abtimer.SKIP + 1:]
    assert probe.count(True) == probe.count(False) == abtimer.PROBE
    for _ in range(3):
        before = pusher.early
        model(torch.randn(3, 64)).sum().backward()
        assert (pusher.early > before) == (faster == "on")
        pusher.measure(now)
        await pusher.settle()
    want = "during backward" if faster == "on" else "at step()"
    assert [r.getMessage() for r in caplog.records if "overlap:" in r.getMessage()][-1] \
        .endswith(want)


async def test_one_awaitable_is_awaited_in_place_many_together() -> None:
    """together(): gather's results and first error; one awaitable runs in this task."""
    async def task_of() -> asyncio.Task[object] | None:
        return asyncio.current_task()

    assert await together([task_of()]) == [asyncio.current_task()]
    got = await together([task_of(), task_of()])
    assert len(got) == 2 and asyncio.current_task() not in got

    async def fail() -> None:
        raise UsageError("no")

    with pytest.raises(UsageError):
        await together([fail()])


@contextlib.contextmanager
def server_thread(**kw: object) -> Iterator[ParameterServer]:
    """A ParameterServer on its own event loop thread (the test thread blocks in step)."""
    ready = threading.Event()
    box: dict[str, object] = {}
    loop = asyncio.new_event_loop()

    async def serve() -> None:
        ps = ParameterServer(**{"transport": "tcp", **kw})  # type: ignore[arg-type]
        await ps.start()
        box["ps"] = ps
        ready.set()
        await ps.serve()

    thread = threading.Thread(target=loop.run_until_complete, args=(serve(),), daemon=True)
    thread.start()
    try:
        assert ready.wait(30), "server did not start"
        yield box["ps"]  # type: ignore[misc]
    finally:
        ps = box.get("ps")
        if ps is not None:
            loop.call_soon_threadsafe(ps.stop)  # type: ignore[attr-defined]
        thread.join(30)
        loop.close()


@pytest.mark.parametrize("link", links())
@pytest.mark.parametrize("overlap", [True, False, None])
def test_remote_optimizer_equals_local_training(overlap: bool | None, link: str) -> None:
    """Two backward passes per step (accumulation), an unused parameter, small buckets
    pushed from autograd's hooks on the caller's thread: same result as torch.optim."""
    def sgd(p: list[nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.SGD(p, lr=0.05, momentum=0.9)

    gen = torch.Generator().manual_seed(0)
    data = [(torch.randn(8, 64, generator=gen), torch.randint(0, 10, (8,), generator=gen))
            for _ in range(24)]

    def train(model: nn.Module, opt: torch.optim.Optimizer | RemoteOptimizer) -> None:
        for i in range(0, len(data), 2):
            opt.zero_grad()
            for x, y in data[i:i + 2]:
                nn.functional.cross_entropy(model(x), y).backward()
            opt.step()

    with server_thread(num_workers=1, optimizer=sgd, **link_options(link)) as ps:
        model = WithUnused()
        with RemoteOptimizer(model, ps=ps.address, bucket_bytes=2048, overlap=overlap,
                             **link_options(link)) as remote:
            train(model, remote)
            assert_link(remote.worker, link)
            pusher = remote.worker._pusher
            assert pusher is not None
            assert (pusher.early > 0) == (overlap is not False)  # None: on until measured
    want = WithUnused()
    train(want, sgd(list(want.parameters())))
    for (name, g), w in zip(model.named_parameters(), want.parameters(), strict=True):
        torch.testing.assert_close(g.detach(), w.detach(), rtol=1e-5, atol=1e-6, msg=name)


async def test_step_before_start_is_a_clear_error() -> None:
    w = Worker(mlp(), "tcp://127.0.0.1:1", transport="tcp")
    with pytest.raises(UsageError, match="async with"):
        await w.push()


@pytest.mark.skipif(not HAVE_UCX, reason="require='ucx' needs ucxx")
async def test_a_worker_that_a_require_ucx_server_refuses_is_told_why() -> None:
    """It used to learn nothing: its connect succeeded, then the server closed the
    connection."""
    async with ParameterServer(num_workers=1, node_options={"require": "ucx"}) as ps:
        worker = Worker(mlp(), ps.address, transport="tcp", timeout=10)
        with pytest.raises(TransportUnavailableError, match="require='ucx'"):
            await worker.start()


def test_server_and_worker_pass_node_options_on() -> None:
    from tensorx.ps import ParameterServer
    from tensorx.worker import Worker

    ps = ParameterServer(num_workers=1, node_options={"ucx_options": {"tls": "tcp"}})
    worker = Worker(nn.Linear(2, 2), "tcp://127.0.0.1:1",
                    node_options={"require": "ucx"})
    assert ps.node._ucx_options == {"tls": "tcp"}
    assert worker.node.require == "ucx"
    with pytest.raises(TypeError):
        ParameterServer(num_workers=1, node_options={"no_such_option": 1})


@pytest.mark.parametrize("link", links())
def test_an_edit_between_backward_and_step_reaches_the_server(
        link: str, caplog: pytest.LogCaptureFixture) -> None:
    """torch's habit: clip_grad_norm_ between backward() and step(). With overlap on (the
    default) buckets left during backward; the edit must still reach the server, as it
    would a local optimizer, and the trainer is told what keeps the overlap."""
    share_memory = link_options(link)["share_memory"]
    def sgd(p: list[nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.SGD(p, lr=0.1)

    gen = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, 64, generator=gen), torch.randint(0, 10, (8,), generator=gen))
            for _ in range(6)]

    def train(model: nn.Module, opt: torch.optim.Optimizer | RemoteOptimizer) -> None:
        for x, y in data:
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            norm = nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            assert norm > 0.05  # it really clips
            opt.step()

    with caplog.at_level(logging.WARNING, logger="tensorx._ps.worker.buckets"), \
            server_thread(num_workers=1, optimizer=sgd, **link_options(link)) as ps:
        model = WithUnused()
        with RemoteOptimizer(model, ps=ps.address, bucket_bytes=2048,
                             **link_options(link)) as remote:
            train(model, remote)
            mapped = all(remote.worker.mapped)
            assert_link(remote.worker, link)
            pusher = remote.worker._pusher
            assert pusher is not None
    assert mapped == share_memory
    want = WithUnused()
    train(want, sgd(list(want.parameters())))
    for (name, g), w in zip(model.named_parameters(), want.parameters(), strict=True):
        torch.testing.assert_close(g.detach(), w.detach(), rtol=1e-5, atol=1e-6, msg=name)
    warned = [r for r in caplog.records if "changed after backward()" in r.getMessage()]
    # copied: the edit is found in the first step, written again, and overlap turned off;
    # mapped: autograd and clip_grad_norm_ wrote the shard's own slot, nothing to find
    assert len(warned) == (0 if share_memory else 1)
    assert (pusher.edited_after_send > 0) == (not share_memory)


def test_a_rank_out_of_range_says_ranks_count_from_0() -> None:
    with pytest.raises(UsageError, match=r"^rank 2 is not one of 0..1 \(num_workers=2; ranks "
                       r"count from 0\)$"):
        Worker(torch.nn.Linear(2, 2), "tcp://127.0.0.1:1", rank=2, num_workers=2)
