"""A rank that pushes NaN or Inf (issue 16, item 8): never applied, logged, counted.

Before, one rank's NaN made every parameter NaN on every worker for good, with nothing
logged. The gradients cross the transport (share_memory=False) over tcp and ucx.
"""

from __future__ import annotations

import asyncio
import logging
import math

import pytest
import torch
from torch import nn

from tensorx.errors import UsageError
from tensorx.ps import ParameterServer
from tensorx.worker import Worker

from .conftest import transports

TRANSPORTS = transports()


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))


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


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("poison", [math.nan, math.inf])
async def test_nonfinite_gradient_is_skipped_logged_and_counted(
        transport: str, mode: str, poison: float, caplog: pytest.LogCaptureFixture) -> None:
    models = [make_model(), make_model()]
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
    models = [make_model(), make_model()]
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
