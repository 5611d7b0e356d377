"""The pipelined sync round (tensorx._ps.service.round, tensorx._ps.service.pipelined): a
shard applies each part of the update as soon as every worker's part has landed, and nothing
of a push that does not complete (a worker gone after k of n parts, NaN in a later part, the
server closing) stays in the parameters or the optimizer's state."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from tensorx._ps.common import abtimer
from tensorx._ps.service import round as rounds
from tensorx._ps.service.round import PartBackups, Round
from tensorx._ps.update import parts
from tensorx._ps.update.parts import check_parts, split_ops
from tensorx._ps.wire import protocol
from tensorx.errors import ProtocolError, TensorxError, UsageError
from tensorx.ps import ParameterServer
from tensorx.worker import Worker
from tests.support.clusters import pipelined_cluster
from tests.support.data import backward, batches
from tests.support.lanes import lanes, node_transport
from tests.support.models import small_mlp
from tests.support.training import ADAM, SGD_MOMENTUM, train_single

pytestmark = pytest.mark.usefixtures("one_torch_thread")

OptFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


@pytest.fixture
def tiny_parts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Parts of 64 bytes (the small test models' tensors are cut into several), each applied
    as soon as it can be (a real model's parts are 16 MiB, applied early while 8 MiB are
    still on their way)."""
    monkeypatch.setattr(parts, "PART_BYTES", 64)
    monkeypatch.setattr(rounds, "EARLY_BYTES", 0)


# -- bookkeeping, without I/O ------------------------------------------------------------
def test_a_part_is_ready_once_every_rank_of_the_barrier_has_it() -> None:
    rnd = Round([10, 20, 30])
    rnd.header(0, [])
    rnd.header(1, [2])
    assert rnd.ready() == []  # no barrier yet
    rnd.start([0, 1])
    rnd.land(0, 0)
    assert rnd.ready() == [] and rnd.outstanding() == 10 + 20 + 30 + 10 + 20 - 10
    rnd.land(1, 0)
    rnd.land(0, 2)
    assert rnd.ready() == [0, 2]
    rnd.applied += [0, 2]
    assert not rnd.complete() and rnd.open
    with pytest.raises(ProtocolError):
        rnd.land(0, 0)  # twice
    with pytest.raises(ProtocolError):
        rnd.land(3, 1)  # no push
    with pytest.raises(ProtocolError):
        rnd.header(2, [3])  # no such part


def test_dropping_a_rank_of_the_barrier_reopens_it() -> None:
    rnd = Round([4, 4])
    rnd.header(0, [0, 1])
    rnd.header(1, [0])
    rnd.start([0, 1])
    rnd.applied.append(0)
    assert rnd.drop(1) == [0]
    assert rnd.ranks is None and not rnd.applied and rnd.landed == {0: {0, 1}}
    assert rnd.drop(5) is None  # not one of its ranks


def test_a_restored_part_is_as_it_was_optimizer_state_included() -> None:
    params = torch.arange(8, dtype=torch.float32)
    arena = params.view(torch.uint8)
    momentum = torch.ones(8)
    owner: dict[Any, Any] = {"flat": {"momentum_buffer": momentum, "step": torch.tensor(3.0)}}
    face_view = momentum[2:4]  # what the optimizer's face holds: a view of it
    backups = PartBackups(arena.numel())
    backups.backup(0, arena, 0, owner["flat"])
    backups.backup(1, arena, 0, None)  # a part whose state does not exist yet
    params.add_(5)
    momentum.mul_(7)
    owner["flat"]["step"] += 1
    owner["new"] = {"momentum_buffer": torch.zeros(8)}
    backups.restore(0, arena, 0, owner, "flat")
    backups.restore(1, arena, 0, owner, "new")
    assert torch.equal(params, torch.arange(8, dtype=torch.float32))
    assert torch.equal(face_view, torch.ones(2))  # restored in place
    assert owner["flat"]["step"].item() == 3.0
    assert "new" not in owner  # it had no state before: it has none again


def test_a_push_is_cut_at_the_parts_bounds() -> None:
    ps = check_parts([[0, 64], [64, 128], [256, 64]], 320)
    ops = [("r", "d", 0, 0, 100), ("r", "d", 200, 200, 100)]
    cut = split_ops(ops, ps)
    assert cut == {0: [("r", "d", 0, 0, 64)], 1: [("r", "d", 64, 64, 36),
                                                  ("r", "d", 200, 200, 56)],
                   2: [("r", "d", 256, 256, 44)]}
    for bad in ([[0, 64], [32, 64]], [[0, 400]], [[0, -1]], [["a", 1]], [[0, True]]):
        with pytest.raises(ProtocolError):
            check_parts(bad, 320)


def test_the_faster_way_is_chosen_by_measuring_both() -> None:
    slow_early = abtimer.EarlyChooser()
    seen = []
    for _ in range(abtimer.SKIP + 2 * abtimer.PROBE):
        early = slow_early.early()
        seen.append(early)
        slow_early.observe(early, 0.048 if early else 0.033)
    assert seen[abtimer.SKIP:].count(True) == seen[abtimer.SKIP:].count(False) == abtimer.PROBE
    assert slow_early.early() is False and "once all have landed" in str(slow_early.decided)
    for _ in range(abtimer.RECHECK - 1):  # until the next probe it sticks to it
        assert slow_early.early() is False
        slow_early.observe(False, 0.033)
    fast_early = abtimer.EarlyChooser()
    for _ in range(abtimer.SKIP + 2 * abtimer.PROBE):
        early = fast_early.early()
        fast_early.observe(early, 0.020 if early else 0.033)
    assert fast_early.early() is True
    assert abtimer.EarlyChooser(forced=False).early() is False


# -- end to end --------------------------------------------------------------------------
def _lane_used(ws: list[Worker], lane: str) -> None:
    """Bytes crossed the lane asked for (nothing mapped)."""
    for w in ws:
        assert w.mapped == [False]
        info = w.node.endpoints[0].info
        assert info["stats"]["write"]["bytes"] > 0
        if lane == "cma":
            assert info["host"].startswith("cma"), info["host"]
        else:
            assert info["transport"] == lane


async def _steps(ws: list[Worker], models: list[nn.Module],
                 data: list[list[tuple[torch.Tensor, ...]]]) -> None:
    for step in data:
        for w, m, (x, y) in zip(ws, models, step, strict=True):
            w.zero_grad()
            backward(m, x, y)
        await asyncio.gather(*(w.step() for w in ws))


@pytest.mark.parametrize("lane", lanes())
@pytest.mark.parametrize("opt", [SGD_MOMENTUM, ADAM], ids=["sgd-momentum", "adam"])
@pytest.mark.usefixtures("tiny_parts")
async def test_a_pipelined_sync_round_equals_single_process(lane: str, opt: OptFactory) -> None:
    models = [small_mlp(), small_mlp(seed=99)]
    async with pipelined_cluster(lane, opt, models) as (ps, ws):
        assert len(ws[0]._links.shards[0].parts) > 4  # tensors over 64 bytes cut into several parts
        await _steps(ws, models, batches(6, 2))
        assert ps.stats["parts_early"] > 0 and ps.stats["rollbacks"] == 0
        _lane_used(ws, lane)
        got = [p.detach().clone() for p in models[0].parameters()]
        assert all(torch.equal(a, b) for a, b in
                   zip(models[0].parameters(), models[1].parameters(), strict=True))
    for g, w in zip(got, train_single(opt, 6), strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


async def test_a_large_model_is_pipelined_by_default() -> None:
    """No option: a shard whose flat update has several parts offers them."""
    model = nn.Sequential(nn.Linear(2048, 2048), nn.Linear(2048, 2048))  # 32 MiB
    async with ParameterServer(num_workers=1, transport="tcp", share_memory=False,
                               log_every=None, pipeline=True) as ps, \
            Worker(model, ps.address, rank=0, num_workers=1, transport="tcp",
                   share_memory=False, overlap=False) as w:
        assert len(w._links.shards[0].parts) > 1
        w.zero_grad()
        model(torch.randn(2, 2048)).sum().backward()
        await w.step()
        assert ps.stats["parts_early"] > 0 and ps.version == 1


async def _push_partly(worker: Worker, k: int) -> None:
    """``worker``'s push of this step cut after ``k`` of its parts, as a worker that dies
    mid-push leaves it (the caller then drops its connection)."""
    worker.binding.ensure_bound()
    rest = await worker._pusher.settle()  # type: ignore[union-attr]
    by_part = split_ops([worker._bucket_op(b) for b in rest], worker._links.shards[0].parts)
    ep = worker._eps[0]
    await ep.notify(protocol.encode("push", step=worker.steps, version=worker.version[0],
                                    staging={}, mapped=False, hyper=[], inbox=b"",
                                    parts=[]))
    for part in sorted(by_part)[:k]:
        await ep.write_many(by_part[part], notify=protocol.encode("part", k=part))


def _watch(ps: ParameterServer) -> asyncio.Condition:
    """A condition notified each time ``ps`` has handled a message."""
    handled = asyncio.Condition()
    handle = ps.service._handle

    async def watched(ep: Any, payload: bytes) -> None:
        await handle(ep, payload)
        async with handled:
            handled.notify_all()

    ps.service._handle = watched  # type: ignore[method-assign]
    return handled


async def _until(handled: asyncio.Condition, predicate: Callable[[], bool]) -> None:
    async with handled:
        await asyncio.wait_for(handled.wait_for(predicate), 20)


async def _rank_1_stops_after_2_parts(ps: ParameterServer, ws: list[Worker],
                                      models: list[nn.Module],
                                      step: list[tuple[torch.Tensor, ...]]) -> asyncio.Task[None]:
    """Rank 0 pushes this step whole (its step, returned, waits for the round), rank 1
    only 2 of its parts; returns once the shard has applied those 2 (an open round)."""
    for w, m, (x, y) in zip(ws, models, step, strict=True):
        w.zero_grad()
        backward(m, x, y)
    handled = _watch(ps)
    first = asyncio.create_task(ws[0].step())
    await _until(handled, lambda: 0 in (ps.rounds.current.landed if ps.rounds.current else {}))
    await _push_partly(ws[1], 2)
    await _until(handled, lambda: len(ps.rounds.current.applied if ps.rounds.current else []) >= 2)
    return first


# Long enough for rank 1's push to follow rank 0's (its header queues behind rank 0's many
# tiny parts): under "continue" a connected rank that has not pushed by then misses the round.
LOSS_TIMEOUT = 0.5


async def _dies_mid_push(policy: str, lane: str) -> tuple[list[torch.Tensor], int]:
    """Rank 1 dies after 2 of its parts at step 2 (its parts 0 and 1 already applied);
    then, under "wait", a new rank 1 redoes its step, under "continue" rank 0 goes on
    alone. Rank 0's parameters after 4 steps, and the shard's rollbacks."""
    data = batches(4, 2)
    models = [small_mlp(), small_mlp(seed=99)]
    server = {"on_worker_loss": policy, "worker_loss_timeout": LOSS_TIMEOUT}
    async with pipelined_cluster(lane, SGD_MOMENTUM, models, **server) as (ps, ws):
        await _steps(ws, models, data[:2])
        first = await _rank_1_stops_after_2_parts(ps, ws, models, data[2])
        ws[1]._eps[0].abort()  # gone mid-push, as if killed
        if policy == "wait":
            ws[1] = Worker(models[1], ps.address, rank=1, num_workers=2,
                           transport=node_transport(lane), share_memory=False, overlap=False)
            await ws[1].start()  # the shard's parameters, as of before step 2
            ws[1].zero_grad()
            backward(models[1], *data[2][1])
            await asyncio.gather(first, ws[1].step())
            await _steps(ws, models, data[3:])
        else:
            await first
            x, y = data[3][0]
            ws[0].zero_grad()
            backward(models[0], x, y)
            await ws[0].step()
        return [p.detach().clone() for p in models[0].parameters()], ps.stats["rollbacks"]


async def _never_pushed(policy: str) -> list[torch.Tensor]:
    """The same run where rank 1's step-2 push never happened: under "wait" its step is
    done whole, under "continue" it leaves before pushing."""
    data = batches(4, 2)
    models = [small_mlp(), small_mlp(seed=99)]
    server = {"on_worker_loss": policy, "worker_loss_timeout": LOSS_TIMEOUT}
    async with pipelined_cluster("tcp", SGD_MOMENTUM, models, **server) as (_, ws):
        if policy == "wait":
            await _steps(ws, models, data)
        else:
            await _steps(ws, models, data[:2])
            ws[1]._eps[0].abort()
            for x, y in (data[2][0], data[3][0]):
                ws[0].zero_grad()
                backward(models[0], x, y)
                await ws[0].step()
        return [p.detach().clone() for p in models[0].parameters()]


@pytest.mark.parametrize("lane", ["tcp", "cma"])
@pytest.mark.parametrize("policy", ["wait", "continue"])
@pytest.mark.usefixtures("tiny_parts")
async def test_a_worker_gone_after_k_of_n_parts_leaves_no_trace(policy: str,
                                                                lane: str) -> None:
    got, rollbacks = await _dies_mid_push(policy, lane)
    assert rollbacks == 1
    want = await _never_pushed(policy)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))  # bit for bit


@pytest.mark.parametrize("policy", ["skip", "refuse"])
@pytest.mark.usefixtures("tiny_parts")
async def test_nan_in_a_late_part_undoes_the_parts_applied_before(policy: str) -> None:
    models = [small_mlp(), small_mlp(seed=99)]
    data = batches(2, 2)
    async with pipelined_cluster("tcp", SGD_MOMENTUM, models, on_nonfinite=policy) as (ps, ws):
        await _steps(ws, models, data[:1])
        before = [p.detach().clone() for p in models[0].parameters()]
        for w, m, (x, y) in zip(ws, models, data[1], strict=True):
            w.zero_grad()
            backward(m, x, y)
        # the tensor rank 1 pushes last: the arena holds gradients in gradient-ready order
        last = max(models[1].parameters(), key=lambda p: p.grad.data_ptr())  # type: ignore[union-attr]
        last.grad.view(-1)[-1] = float("nan")  # type: ignore[union-attr]
        results = await asyncio.gather(*(w.step() for w in ws), return_exceptions=True)
        assert ps.stats["rollbacks"] == 1 and ps.stats["nonfinite"] == 1
        after = [p.detach().clone() for p in models[0].parameters()]
        has_state = bool(ps.state.part_state(0)[0])  # type: ignore[union-attr]
    if policy == "skip":  # no update at all: exactly the parameters before
        assert results == [None, None]
        assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True))
        return
    assert results[0] is None and isinstance(results[1], UsageError)
    model = small_mlp()  # one process: step 2 on rank 0's batch alone
    opt = SGD_MOMENTUM(list(model.parameters()))
    for i, step in enumerate(data):
        opt.zero_grad()
        xs = [step[0][0]] if i == 1 else [x for x, _ in step]
        ys = [step[0][1]] if i == 1 else [y for _, y in step]
        backward(model, torch.cat(xs), torch.cat(ys))
        opt.step()
    want = [p.detach() for p in model.parameters()]
    for g, w in zip(after, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    assert has_state  # momentum exists: the update that stood was applied with it


@pytest.mark.usefixtures("tiny_parts")
async def test_a_server_closing_mid_round_checkpoints_the_version_before(
        tmp_path: Path) -> None:
    models = [small_mlp(), small_mlp(seed=99)]
    data = batches(2, 2)
    async with pipelined_cluster("tcp", SGD_MOMENTUM, models, checkpoint_dir=tmp_path) as (ps, ws):
        await _steps(ws, models, data[:1])
        before = ps.state.params_region.view(torch.uint8).clone()  # type: ignore[union-attr]
        first = await _rank_1_stops_after_2_parts(ps, ws, models, data[1])
        assert ps.rounds.current is not None and ps.rounds.current.open
        await ps.aclose()  # SIGTERM in the CLI: checkpoint, then close
        with contextlib.suppress(TensorxError):
            await first
    async with ParameterServer(num_workers=2, optimizer=SGD_MOMENTUM, transport="tcp",
                               checkpoint_dir=tmp_path, log_every=None) as again:
        assert again.version == 1
        assert torch.equal(again.state.params_region.view(torch.uint8), before)  # type: ignore[union-attr]


@pytest.mark.usefixtures("tiny_parts")
async def test_by_default_the_shard_measures_both_ways_and_says_which_it_keeps(
        caplog: pytest.LogCaptureFixture) -> None:
    models = [small_mlp(), small_mlp(seed=99)]
    rounds = abtimer.SKIP + 2 * abtimer.PROBE
    with caplog.at_level(logging.INFO, logger="tensorx.ps"):
        async with pipelined_cluster("tcp", SGD_MOMENTUM, models, pipeline=None) as (ps, ws):
            await _steps(ws, models, batches(rounds + 1, 2))
            assert ps.rounds.chooser.rounds >= rounds
    assert "pipelined rounds: parts applied as they land:" in caplog.text


@pytest.mark.usefixtures("tiny_parts")
async def test_a_second_run_takes_the_choices_the_first_measured(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The shard's pipelined rounds and the workers' overlap are measured by the first run
    and remembered (tensorx._ps.common.remembered): a second run of the plan takes both from its
    first round and probes neither."""
    monkeypatch.setenv("TENSORX_REMEMBER", "1")
    monkeypatch.setenv("TENSORX_CACHE_DIR", str(tmp_path))

    async def run(steps: int) -> tuple[ParameterServer, list[Worker]]:
        models = [small_mlp(), small_mlp(seed=99)]
        async with ParameterServer("tcp://127.0.0.1:0", num_workers=2, optimizer=SGD_MOMENTUM,
                                   transport="tcp", log_every=None) as ps:
            ws = [Worker(m, ps.address, rank=r, num_workers=2, transport="tcp",
                         share_memory=False) for r, m in enumerate(models)]
            try:
                await asyncio.gather(*(w.start() for w in ws))
                await _steps(ws, models, batches(steps, 2))
            finally:
                await asyncio.gather(*(w.aclose() for w in ws), return_exceptions=True)
        return ps, ws

    ps, ws = await run(abtimer.SKIP + 2 * abtimer.PROBE + 2)
    assert ps.rounds.chooser.decided and all(w._pusher.choice.decided for w in ws)  # type: ignore[union-attr]
    assert ps.rounds.chooser.probed > 0 and not ps.rounds.chooser.recalled
    ps, ws = await run(abtimer.SKIP + 2)
    assert ps.rounds.chooser.recalled and ps.rounds.chooser.probed == 0
    for w in ws:
        assert w._pusher.choice.recalled and w._pusher.choice.probed == 0  # type: ignore[union-attr]
