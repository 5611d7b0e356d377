"""Parameter server and workers end to end, in one event loop over real endpoints."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from tensorx.errors import AuthError, PlanMismatchError
from tensorx.ps import ParameterServer
from tensorx.worker import Worker

OptFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]
SGD_MOMENTUM: OptFactory = lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9)  # noqa: E731
ADAM: OptFactory = lambda p: torch.optim.Adam(p, lr=0.01)  # noqa: E731
TRANSPORT = "tcp"


def make_model(seed: int = 0, hidden: int = 16) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, hidden), nn.Tanh(), nn.Linear(hidden, 3))


def batches(steps: int, workers: int, size: int = 4) -> list[list[tuple[torch.Tensor, ...]]]:
    gen = torch.Generator().manual_seed(123)
    return [[(torch.randn(size, 8, generator=gen), torch.randint(0, 3, (size,), generator=gen))
             for _ in range(workers)] for _ in range(steps)]


def backward(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    nn.functional.cross_entropy(model(x), y).backward()


@contextlib.asynccontextmanager
async def servers(num_shards: int, num_workers: int,
                  **kw: Any) -> AsyncIterator[list[ParameterServer]]:
    async with contextlib.AsyncExitStack() as stack:
        shards = [await stack.enter_async_context(ParameterServer(
            "tcp://127.0.0.1:0", num_workers=num_workers, shard=s, num_shards=num_shards,
            transport=TRANSPORT, **kw)) for s in range(num_shards)]
        yield shards


@contextlib.asynccontextmanager
async def workers(models: Sequence[nn.Module], addresses: list[str],
                  **kw: Any) -> AsyncIterator[list[Worker]]:
    ws = [Worker(m, addresses, rank=r, num_workers=len(models), transport=TRANSPORT, **kw)
          for r, m in enumerate(models)]
    try:
        await asyncio.gather(*(w.start() for w in ws))
        yield ws
    finally:
        await asyncio.gather(*(w.aclose() for w in ws), return_exceptions=True)


async def train_sync(opt: OptFactory, steps: int, num_shards: int) -> list[torch.Tensor]:
    data = batches(steps, 2)
    models = [make_model(), make_model(seed=99)]  # rank 1's own init must be overwritten
    async with servers(num_shards, 2, mode="sync", optimizer=opt) as shards, \
            workers(models, [ps.address for ps in shards], verify=True) as ws:
        for step in data:
            for w, m, (x, y) in zip(ws, models, step, strict=True):
                w.zero_grad()
                backward(m, x, y)
            await asyncio.gather(*(w.step() for w in ws))
        assert all(torch.equal(a, b) for a, b in
                   zip(models[0].parameters(), models[1].parameters(), strict=True))
        return [p.detach().clone() for p in models[0].parameters()]


def train_single(opt: OptFactory, steps: int) -> list[torch.Tensor]:
    model = make_model()
    optimizer = opt(list(model.parameters()))  # type: ignore[arg-type]
    for step in batches(steps, 2):
        optimizer.zero_grad()
        backward(model, torch.cat([x for x, _ in step]), torch.cat([y for _, y in step]))
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("opt", [SGD_MOMENTUM, ADAM], ids=["sgd-momentum", "adam"])
@pytest.mark.parametrize("num_shards", [1, 2])
async def test_sync_equals_single_process(opt: OptFactory, num_shards: int) -> None:
    got = await train_sync(opt, 24, num_shards)
    want = train_single(opt, 24)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", ["async", "bounded"])
async def test_async_modes_train_and_respect_staleness(mode: str) -> None:
    models = [make_model(), make_model()]
    data = batches(30, 2)

    async def run(w: Worker, m: nn.Module, rank: int) -> float:
        loss = 0.0
        for i, step in enumerate(data):
            x, y = step[rank]
            w.zero_grad()
            out = nn.functional.cross_entropy(m(x), y)
            out.backward()
            loss = float(out.detach())
            await w.step()
            if rank == 0 and i % 3 == 0:
                await asyncio.sleep(0.005)  # a slow worker: the fast one must wait (bounded)
        return loss

    async with servers(1, 2, mode=mode, staleness=1, optimizer=ADAM) as (ps,):
        async with workers(models, [ps.address], verify=True) as ws:
            losses = await asyncio.gather(*(run(w, m, r) for r, (w, m) in
                                            enumerate(zip(ws, models, strict=True))))
        assert ps.stats["updates"] == 60
        assert all(loss == loss for loss in losses)  # finite, no NaN
        if mode == "bounded":
            assert ps.stats["max_gap"] <= 1


async def test_bounded_staleness_is_held_by_the_server() -> None:
    async with ParameterServer(num_workers=2, mode="bounded", staleness=2,
                               transport=TRANSPORT) as ps:
        models = [make_model(), make_model()]
        async with workers(models, [ps.address]) as ws:
            async def run(w: Worker, delay: float) -> None:
                for _ in range(20):
                    w.zero_grad()
                    await w.step()
                    await asyncio.sleep(delay)

            await asyncio.gather(run(ws[0], 0.0), run(ws[1], 0.01))
        assert ps.stats["max_gap"] == 2  # the fast worker ran ahead, and no further
        assert ps.stats["updates"] == 40


async def test_plan_mismatch_names_the_tensor() -> None:
    async with ParameterServer(num_workers=2, transport=TRANSPORT) as ps:
        w0 = Worker(make_model(), ps.address, rank=0, num_workers=2, transport=TRANSPORT)
        w1 = Worker(make_model(hidden=17), ps.address, rank=1, num_workers=2,
                    transport=TRANSPORT)
        async with w0:
            with pytest.raises(PlanMismatchError, match=r"0\.(weight|bias)|2\.weight"):
                await w1.start()


async def test_wrong_token_is_an_auth_error() -> None:
    async with ParameterServer(num_workers=1, token="right", transport=TRANSPORT) as ps:
        w = Worker(make_model(), ps.address, token="wrong", transport=TRANSPORT, timeout=5)
        with pytest.raises(AuthError):
            await w.start()


async def test_checkpoint_and_resume(tmp_path: Path) -> None:
    data = batches(6, 1)

    async def train(model: nn.Module, rounds: list[list[tuple[torch.Tensor, ...]]]) -> int:
        async with ParameterServer(num_workers=1, checkpoint_dir=tmp_path, optimizer=ADAM,
                                   transport=TRANSPORT) as ps, \
                workers([model], [ps.address]) as (w,):
            for step in rounds:
                w.zero_grad()
                backward(model, *step[0])
                await w.step()
            return ps.version

    model = make_model()
    assert await train(model, data[:3]) == 3
    fresh = make_model(seed=5)  # resuming: the checkpoint, not rank 0, seeds the server
    assert await train(fresh, data[3:]) == 6
    want = make_model()
    opt = ADAM(list(want.parameters()))  # type: ignore[arg-type]
    for step in data:
        opt.zero_grad()
        backward(want, *step[0])
        opt.step()
    for g, w in zip(fresh.parameters(), want.parameters(), strict=True):
        torch.testing.assert_close(g.detach(), w.detach(), rtol=1e-5, atol=1e-6)
