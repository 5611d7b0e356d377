"""A rank that pushes NaN or Inf (issue 16, item 8): never applied, logged, counted.

Before, one rank's NaN made every parameter NaN on every worker for good, with nothing
logged. The gradients cross the transport (share_memory=False) over tcp and ucx.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import math
import re
from collections.abc import Callable

import pytest
import torch
from torch import nn

from tensorx._ps.service import round as rounds
from tensorx._ps.service.nonfinite import finite, listed, nonfinite_names
from tensorx._ps.state.shard import ShardLayout, ShardState
from tensorx._ps.update import parts
from tensorx.errors import UsageError
from tensorx.graph_analyzer import GraphAnalyzer
from tensorx.ps import ParameterServer
from tensorx.worker import Worker
from tests.support.clusters import pipelined_cluster, servers, workers
from tests.support.data import backward as xent_backward
from tests.support.lanes import transports
from tests.support.models import small_mlp, sparse_embedding
from tests.support.training import SGD_MOMENTUM

TRANSPORTS = transports()


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def backward(model: nn.Module, seed: int, poison: float | None = None) -> None:
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(seed))
    model(x).square().mean().backward()
    if poison is not None:
        grad = next(model.parameters()).grad
        assert grad is not None
        grad[0, 0] = poison  # in place: the gradient arena the push sends


def all_finite(model: nn.Module) -> bool:
    return all(bool(torch.isfinite(p).all()) for p in model.parameters())


def snapshot(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def named(text: str) -> str | None:
    """The tensors a refusal or a WARNING says hold NaN or Inf (None: it names none)."""
    found = re.search(r"NaN or Inf in (.+?)(?: \(its step |; push refused)", text)
    return None if found is None else found.group(1)


def warned(caplog: pytest.LogCaptureFixture) -> list[str | None]:
    """What each of the shard's non-finite WARNING lines names."""
    return [named(r.getMessage()) for r in caplog.records
            if "pushed a gradient with NaN or Inf" in r.getMessage()]


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("poison", [math.nan, math.inf])
async def test_nonfinite_gradient_is_skipped_logged_and_counted(
        transport: str, mode: str, poison: float, caplog: pytest.LogCaptureFixture) -> None:
    models = [small_mlp(), small_mlp()]
    async with ParameterServer(num_workers=2, mode=mode, transport=transport) as ps:
        ws = [Worker(m, ps.address, rank=r, num_workers=2, transport=transport, timeout=20,
                     share_memory=False) for r, m in enumerate(models)]
        try:
            await asyncio.gather(*(w.start() for w in ws))

            async def step(n: int, bad: int | None = None) -> None:
                for r, (w, m) in enumerate(zip(ws, models, strict=True)):
                    w.zero_grad()
                    backward(m, 10 * n + r, poison if r == bad else None)
                if mode == "sync":
                    await asyncio.gather(*(w.step() for w in ws))
                else:
                    for w in ws:
                        await w.step()

            await step(0)
            before, version = snapshot(models[0]), ps.version
            with caplog.at_level(logging.WARNING, logger="tensorx"):
                await step(1, bad=1)
            assert all(all_finite(m) for m in models)
            assert ps.stats["nonfinite"] == 1
            assert any("rank 1 pushed a gradient with NaN or Inf" in r.getMessage()
                       for r in caplog.records)
            if mode == "sync":  # the whole step was skipped
                assert ps.version == version
                assert all(torch.equal(a, b) for a, b in
                           zip(before, snapshot(models[0]), strict=True))
            else:  # rank 0's push applied, rank 1's not
                assert ps.version == version + 1
            for n in range(2, 5):
                await step(n)
            assert all(all_finite(m) for m in models)
            assert ps.stats["nonfinite"] == 1
        finally:
            await asyncio.gather(*(w.aclose() for w in ws), return_exceptions=True)


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_refuse_policy_fails_the_offending_worker_only(transport: str) -> None:
    models = [small_mlp(), small_mlp()]
    async with ParameterServer(num_workers=2, mode="sync", transport=transport,
                               on_nonfinite="refuse", worker_loss_timeout=0.5,
                               on_worker_loss="continue") as ps:
        ws = [Worker(m, ps.address, rank=r, num_workers=2, transport=transport, timeout=20,
                     share_memory=False) for r, m in enumerate(models)]
        try:
            await asyncio.gather(*(w.start() for w in ws))
            for r, (w, m) in enumerate(zip(ws, models, strict=True)):
                w.zero_grad()
                backward(m, r, math.nan if r == 1 else None)
            ok, refused = await asyncio.gather(*(w.step() for w in ws),
                                               return_exceptions=True)
            assert ok is None
            assert all_finite(models[0])
            assert isinstance(refused, UsageError)
            assert "rank 1's gradient of step 0 holds NaN or Inf" in str(refused)
            assert all_finite(models[0])
            assert ps.version == 1  # rank 0's gradient alone
            for n in range(1, 3):  # rank 1 is gone; the barrier goes on without it
                ws[0].zero_grad()
                backward(models[0], n)
                await ws[0].step()
            assert ps.version == 3
            assert ps.stats["nonfinite"] == 1
        finally:
            await asyncio.gather(*(w.aclose() for w in ws), return_exceptions=True)


async def test_unknown_policy_is_a_usage_error() -> None:
    with pytest.raises(UsageError, match="on_nonfinite"):
        ParameterServer(num_workers=1, on_nonfinite="ignore")


# -- the tensors concerned are named (the refusal and the WARNING) ------------------------
POLICIES = ["refuse", "skip"]
SHARING = [pytest.param(False, id="copied"), pytest.param(True, id="mapped")]


def sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.5)


def stepped_alone(model: nn.Module, loss: Callable[[nn.Module], torch.Tensor]) -> nn.Module:
    """``model`` after one SGD step on ``loss`` in this process: rank 0's update alone."""
    alone = copy.deepcopy(model)
    loss(alone).backward()
    sgd(list(alone.parameters())).step()
    return alone


def assert_outcome(policy: str, results: list[object], ps: ParameterServer, model: nn.Module,
                   before: nn.Module, alone: nn.Module, name: str) -> None:
    """Refuse: rank 1's step raises naming ``name``, rank 0's update is applied alone;
    skip: no update, both steps return."""
    if policy == "refuse":
        assert results[0] is None, results[0]
        assert isinstance(results[1], UsageError), results[1]
        assert "rank 1's gradient of step 0 holds NaN or Inf" in str(results[1])
        assert named(str(results[1])) == name, str(results[1])
        assert ps.version == 1
        want = alone
    else:
        assert results == [None, None], results
        assert ps.version == 0
        want = before
    for (key, w), got in zip(want.named_parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(got, w, msg=key)


@pytest.mark.parametrize("share_memory", SHARING)
@pytest.mark.parametrize("policy", POLICIES)
async def test_a_nan_in_a_dense_tensor_is_named(
        policy: str, share_memory: bool, caplog: pytest.LogCaptureFixture) -> None:
    """Rank 1's NaN in ``2.weight`` alone: its refusal and the shard's WARNING name that
    tensor and no other; rank 0's update goes on as without the names."""
    models = [small_mlp(), small_mlp()]
    before = copy.deepcopy(models[0])
    alone = stepped_alone(models[0], lambda m: m(torch.randn(
        4, 8, generator=torch.Generator().manual_seed(0))).square().mean())
    caplog.set_level(logging.WARNING, logger="tensorx")
    async with servers(1, 2, mode="sync", optimizer=sgd, on_nonfinite=policy,
                       share_memory=share_memory, on_worker_loss="continue",
                       worker_loss_timeout=1.0) as (ps,), \
            workers(models, [ps.address], share_memory=share_memory, timeout=20) as ws:
        assert [w.mapped == [True] for w in ws] == [share_memory] * 2
        for r, (w, m) in enumerate(zip(ws, models, strict=True)):
            w.zero_grad()
            backward(m, r)
        models[1][2].weight.grad[1, 2] = math.nan
        results = await asyncio.gather(*(w.step() for w in ws), return_exceptions=True)
        assert_outcome(policy, results, ps, models[0], before, alone, "2.weight")
    assert warned(caplog) == ["2.weight"]


def sparse_loss(ids: torch.Tensor) -> Callable[[nn.Module], torch.Tensor]:
    return lambda m: m(ids).square().mean()


@pytest.mark.parametrize("share_memory", SHARING)
@pytest.mark.parametrize("policy", POLICIES)
async def test_an_inf_in_a_sparse_tables_rows_is_named(
        policy: str, share_memory: bool, caplog: pytest.LogCaptureFixture) -> None:
    """Rank 1's Inf in one row it pushes of the sparse table ``bag.weight``: named, alone
    (the other sparse table and the dense head are finite)."""
    models = [sparse_embedding(), sparse_embedding()]
    gen = torch.Generator().manual_seed(3)
    batches = [torch.randint(0, 1000, (8, 4), generator=gen) for _ in range(2)]
    before = copy.deepcopy(models[0])
    alone = stepped_alone(models[0], sparse_loss(batches[0]))
    caplog.set_level(logging.WARNING, logger="tensorx")
    async with servers(1, 2, mode="sync", optimizer=sgd, on_nonfinite=policy,
                       share_memory=share_memory, on_worker_loss="continue",
                       worker_loss_timeout=1.0) as (ps,), \
            workers(models, [ps.address], share_memory=share_memory, timeout=60) as ws:
        for w, m, ids in zip(ws, models, batches, strict=True):
            w.zero_grad()
            sparse_loss(ids)(m).backward()
        models[1].bag.weight.grad._values()[2, 1] = math.inf
        results = await asyncio.gather(*(w.step() for w in ws), return_exceptions=True)
        assert_outcome(policy, results, ps, models[0], before, alone, "bag.weight")
    assert warned(caplog) == ["bag.weight"]


async def test_many_tensors_are_named_a_few_then_counted(
        caplog: pytest.LogCaptureFixture) -> None:
    """Every tensor of rank 1 (two sparse tables, the dense head's two) holds NaN: the
    first three are named, in model order, then how many more."""
    models = [sparse_embedding(), sparse_embedding()]
    ids = torch.randint(0, 1000, (8, 4), generator=torch.Generator().manual_seed(3))
    caplog.set_level(logging.WARNING, logger="tensorx")
    async with servers(1, 2, mode="sync", optimizer=sgd, on_nonfinite="refuse",
                       on_worker_loss="continue", worker_loss_timeout=1.0) as (ps,), \
            workers(models, [ps.address], share_memory=False, timeout=60) as ws:
        for w, m in zip(ws, models, strict=True):
            w.zero_grad()
            sparse_loss(ids)(m).backward()
        for p in models[1].parameters():
            grad = p.grad._values() if p.grad.is_sparse else p.grad  # type: ignore[union-attr]
            grad.view(-1)[0] = math.nan
        ok, refused = await asyncio.gather(*(w.step() for w in ws), return_exceptions=True)
        assert ok is None and ps.version == 1
    want = "emb.weight, bag.weight, head.weight (and 1 more)"
    assert named(str(refused)) == want, refused
    assert warned(caplog) == [want]


@pytest.mark.parametrize("policy", POLICIES)
async def test_a_nan_in_a_late_part_of_a_pipelined_round_is_named(
        policy: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Parts of 64 bytes, applied as they land: the NaN is in the tensor rank 1 pushes
    last, found once the parts before it were applied (and undone); named alone."""
    monkeypatch.setattr(parts, "PART_BYTES", 64)
    monkeypatch.setattr(rounds, "EARLY_BYTES", 0)
    models = [small_mlp(), small_mlp()]
    x, y = torch.randn(4, 8), torch.randint(0, 3, (4,))
    caplog.set_level(logging.WARNING, logger="tensorx")
    async with pipelined_cluster("tcp", SGD_MOMENTUM, models, on_nonfinite=policy,
                                 on_worker_loss="continue", worker_loss_timeout=1.0) as (ps, ws):
        for w, m in zip(ws, models, strict=True):
            w.zero_grad()
            xent_backward(m, x, y)
        name, last = max(models[1].named_parameters(),
                         key=lambda kv: kv[1].grad.data_ptr())  # type: ignore[union-attr]
        last.grad.view(-1)[-1] = math.nan  # type: ignore[union-attr]
        results = await asyncio.gather(*(w.step() for w in ws), return_exceptions=True)
        assert ps.stats["rollbacks"] == 1 and ps.stats["nonfinite"] == 1
    if policy == "refuse":
        assert results[0] is None and isinstance(results[1], UsageError), results
        assert named(str(results[1])) == name, results[1]
    else:
        assert results == [None, None], results
    assert warned(caplog) == [name]


def test_names_are_escaped_cut_and_counted() -> None:
    assert listed([]) == ""
    assert listed(["a\nb", "c", "d", "e", "f"]) == " in a\\nb, c, d (and 2 more)"
    assert listed(["x" * 500]) == " in " + "x" * 100 + "...(400 more)"


def test_only_the_bytes_given_are_read_for_the_names() -> None:
    """A pipelined round names what is in the parts that landed: a NaN left in the rest
    of the slot (its last push's, say) is not named."""
    model = small_mlp()
    state = ShardState(ShardLayout.from_plan(GraphAnalyzer(model).plan(), 0), 2, sgd)
    try:
        slot = {s.name: s for s in state.layout.param_specs()}
        region = state.slot_region(1)
        for name in ("0.bias", "2.weight"):
            region.view(torch.float32, (slot[name].numel,), slot[name].offset)[-1] = math.inf
        assert finite(state, 0) and not finite(state, 1)
        assert nonfinite_names(state, 0) == []
        assert nonfinite_names(state, 1) == [n for n, _ in model.named_parameters()
                                             if n in ("0.bias", "2.weight")]
        weight = slot["2.weight"]
        end = weight.offset + weight.numel * 4
        assert nonfinite_names(state, 1, [(weight.offset, end - weight.offset - 4)]) == []
        assert nonfinite_names(state, 1, [(end - 6, 6)]) == ["2.weight"]  # mid-element
    finally:
        state.close()
