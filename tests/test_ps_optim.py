"""The server's optimizer sees the model's parameters: named, shaped, in model order.

Real servers and workers over real endpoints (share_memory=False, so the bytes cross the
transport), against single-process training on the union of the workers' batches.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn

from tensorx.errors import UsageError
from tensorx.graph_analyzer import GraphAnalyzer

from .test_ps_train import TRANSPORTS, servers, workers

Named = list[tuple[str, nn.Parameter]]
# chunks of 4 rows of 64 B: the plan splits 1.weight (24 rows) across the two shards
PLAN = {"chunk_bytes": 256}


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 24), nn.Tanh(),
                         nn.Linear(24, 3))


def decay_by_dim(named_params: Named) -> torch.optim.Optimizer:
    """nanoGPT's rule: 2-D and larger tensors decay, biases and norms do not."""
    return torch.optim.AdamW([
        {"params": [p for _, p in named_params if p.dim() >= 2], "weight_decay": 0.5},
        {"params": [p for _, p in named_params if p.dim() < 2], "weight_decay": 0.0},
    ], lr=0.02)


def decay_by_dim_positional(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    """The same rule in the plain ``lambda params:`` form."""
    return decay_by_dim([("", p) for p in params])


def lr_by_layer(named_params: Named) -> torch.optim.Optimizer:
    return torch.optim.SGD([
        {"params": [p for n, p in named_params if n.startswith("0.")], "lr": 0.2},
        {"params": [p for n, p in named_params if not n.startswith("0.")]},
    ], lr=0.02, momentum=0.9)


def data(steps: int, workers: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    gen = torch.Generator().manual_seed(7)
    return [[(torch.randn(4, 8, generator=gen), torch.randint(0, 3, (4,), generator=gen))
             for _ in range(workers)] for _ in range(steps)]


def loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(model(x), y)


def train_single(factory: Callable[[Named], torch.optim.Optimizer], steps: int,
                 clip: float | None = None) -> list[torch.Tensor]:
    model = make_model()
    named = list(model.named_parameters())
    optimizer = factory(named) if factory is not decay_by_dim_positional \
        else decay_by_dim_positional([p for _, p in named])
    for step in data(steps, 2):
        optimizer.zero_grad()
        loss(model, torch.cat([x for x, _ in step]), torch.cat([y for _, y in step])).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


async def train_ps(factory: Callable[..., torch.optim.Optimizer], steps: int,
                   transport: str, **server: Any) -> list[torch.Tensor]:
    models = [make_model(), make_model(seed=5)]
    async with servers(2, 2, transport, mode="sync", optimizer=factory, share_memory=False,
                       **server) as shards, \
            workers(models, [s.address for s in shards], transport, share_memory=False,
                    plan_options=PLAN) as ws:
        for step in data(steps, 2):
            for w, m, (x, y) in zip(ws, models, step, strict=True):
                w.zero_grad()
                loss(m, x, y).backward()
            await asyncio.gather(*(w.step() for w in ws))
        return [p.detach().clone() for p in models[0].parameters()]


def test_the_plan_splits_a_tensor_across_the_shards() -> None:
    chunks = GraphAnalyzer(make_model(), num_shards=2, **PLAN).plan().tensors()["2.weight"]
    assert {c.shard for c in chunks} == {0, 1}


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("factory", [decay_by_dim, decay_by_dim_positional, lr_by_layer],
                         ids=["decay-by-dim", "decay-by-dim-positional", "lr-by-name"])
async def test_rules_by_dim_and_name_equal_single_process(
        factory: Callable[[Named], torch.optim.Optimizer], transport: str) -> None:
    got = await train_ps(factory, 12, transport)
    want = train_single(factory, 12)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


async def test_each_shard_sees_named_shaped_parameters_in_model_order() -> None:
    seen: list[list[tuple[str, tuple[int, ...]]]] = []

    def factory(named_params: Named) -> torch.optim.Optimizer:
        seen.append([(n, tuple(p.shape)) for n, p in named_params])
        return torch.optim.SGD([p for _, p in named_params], lr=0.1)

    await train_ps(factory, 1, "tcp")
    model = dict(make_model().named_parameters())
    order = list(model)
    assert len(seen) == 2
    names = [n for shard in seen for n, _ in shard]
    assert set(names) == set(order) and len(names) == len(order) + 1  # 2.weight on both
    for shard in seen:
        assert [n for n, _ in shard] == sorted((n for n, _ in shard), key=order.index)
        for name, shape in shard:
            assert len(shape) == model[name].dim() and shape[1:] == model[name].shape[1:]
    split = [shape for shard in seen for n, shape in shard if n == "2.weight"]
    assert sum(s[0] for s in split) == 24 and all(s[0] < 24 for s in split)


async def test_an_optimizer_over_other_tensors_is_refused() -> None:
    elsewhere = make_model()  # the natural mistake: lambda _: model.configure_optimizers()
    with pytest.raises(UsageError, match="not this shard's parameters"):
        await train_ps(lambda _: torch.optim.SGD(elsewhere.parameters(), lr=0.1), 1, "tcp")


async def test_an_optimizer_that_leaves_parameters_out_is_refused() -> None:
    with pytest.raises(UsageError, match=r"leaves out .*'\d\.bias'"):
        await train_ps(lambda params: torch.optim.SGD(params[:1], lr=0.1), 1, "tcp")
