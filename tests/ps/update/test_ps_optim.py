"""The server's optimizer sees the model's parameters: named, shaped, in model order.

Real servers and workers over real endpoints (share_memory=False, so the bytes cross the
transport), against single-process training on the union of the workers' batches.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from tensorx._ps.service.norm_exchange import NormExchange
from tensorx._ps.state.shard import ShardLayout, ShardState, load_checkpoint
from tensorx._ps.update import parts
from tensorx._ps.wire import protocol
from tensorx.errors import BrokenError, TensorxError, UsageError
from tensorx.errors import TimeoutError as TxTimeoutError
from tensorx.graph_analyzer import GraphAnalyzer
from tensorx.node import Node
from tensorx.ps import ParameterServer
from tests.support.clusters import PsProcess, servers, workers
from tests.support.lanes import assert_link, lanes, node_transport

Named = list[tuple[str, nn.Parameter]]
# chunks of 4 rows of 64 B: the plan splits 1.weight (24 rows) across the two shards
PLAN = {"chunk_bytes": 256}


pytestmark = pytest.mark.usefixtures("one_torch_thread")


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
                   lane: str, **server: Any) -> list[torch.Tensor]:
    models = [make_model(), make_model(seed=5)]
    transport = node_transport(lane)
    async with servers(2, 2, transport, mode="sync", optimizer=factory, share_memory=False,
                       **server) as shards, \
            workers(models, [s.address for s in shards], transport, share_memory=False,
                    plan_options=PLAN) as ws:
        for step in data(steps, 2):
            for w, m, (x, y) in zip(ws, models, step, strict=True):
                w.zero_grad()
                loss(m, x, y).backward()
            await asyncio.gather(*(w.step() for w in ws))
        for w in ws:
            assert_link(w, lane)
        return [p.detach().clone() for p in models[0].parameters()]


def test_the_plan_splits_a_tensor_across_the_shards() -> None:
    chunks = GraphAnalyzer(make_model(), num_shards=2, **PLAN).plan().tensors()["2.weight"]
    assert {c.shard for c in chunks} == {0, 1}


@pytest.mark.parametrize("lane", lanes())
@pytest.mark.parametrize("factory", [decay_by_dim, decay_by_dim_positional, lr_by_layer],
                         ids=["decay-by-dim", "decay-by-dim-positional", "lr-by-name"])
async def test_rules_by_dim_and_name_equal_single_process(
        factory: Callable[[Named], torch.optim.Optimizer], lane: str) -> None:
    got = await train_ps(factory, 12, lane)
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


# -- server-side gradient processing ------------------------------------------------------
def sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.5, momentum=0.5)


def sgd_named(named: Named) -> torch.optim.Optimizer:
    return sgd([p for _, p in named])


async def train_clipped(lane: str, norms: list[float], **server: Any
                        ) -> list[torch.Tensor]:
    models = [make_model(), make_model(seed=5)]
    transport = node_transport(lane)
    async with servers(2, 2, transport, mode="sync", optimizer=sgd, share_memory=False,
                       clip_grad_norm=0.05, **server) as shards, \
            workers(models, [s.address for s in shards], transport, share_memory=False,
                    plan_options=PLAN) as ws:
        for step in data(10, 2):
            for w, m, (x, y) in zip(ws, models, step, strict=True):
                w.zero_grad()
                loss(m, x, y).backward()
            await asyncio.gather(*(w.step() for w in ws))
            assert shards[0].stats["grad_norm"] == shards[1].stats["grad_norm"]
            norms.append(shards[0].stats["grad_norm"])
        for w in ws:
            assert_link(w, lane)
        return [p.detach().clone() for p in models[0].parameters()]


@pytest.mark.parametrize("lane", lanes())
async def test_clip_grad_norm_over_two_shards_equals_single_process(lane: str) -> None:
    norms: list[float] = []
    got = await train_clipped(lane, norms)
    want = train_single(sgd_named, 10, clip=0.05)
    assert min(norms) > 0.05  # every step was clipped
    for g, w in zip(got, want, strict=True):
        assert torch.allclose(g, w, rtol=1e-6, atol=1e-6), (g - w).abs().max()


async def test_clip_grad_norm_with_a_flat_server_applied_part_by_part(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(parts, "PART_BYTES", 512)  # several parts per shard
    norms: list[float] = []
    got = await train_clipped("tcp", norms, flat=True)
    want = train_single(sgd_named, 10, clip=0.05)
    assert min(norms) > 0.05
    for g, w in zip(got, want, strict=True):
        assert torch.allclose(g, w, rtol=1e-6, atol=1e-6), (g - w).abs().max()


async def test_grad_hook_sees_the_averaged_gradient_by_name() -> None:
    seen: list[list[str]] = []

    def halve_weights(named_grads: list[tuple[str, torch.Tensor]]) -> None:
        seen.append([n for n, _ in named_grads])
        for name, grad in named_grads:
            if name.endswith("weight"):
                grad.mul_(0.5)

    got = await train_ps(sgd, 6, "tcp", grad_hook=halve_weights)
    model = make_model()
    optimizer = sgd(list(model.parameters()))
    for step in data(6, 2):
        optimizer.zero_grad()
        loss(model, torch.cat([x for x, _ in step]), torch.cat([y for _, y in step])).backward()
        for name, p in model.named_parameters():
            if name.endswith("weight"):
                p.grad.mul_(0.5)  # type: ignore[union-attr]
        optimizer.step()
    for g, w in zip(got, model.parameters(), strict=True):
        torch.testing.assert_close(g, w.detach(), rtol=1e-5, atol=1e-6)
    order = [n for n, _ in make_model().named_parameters()]
    assert len(seen) == 12  # 6 updates on each of the 2 shards
    assert all(names == sorted(names, key=order.index) for names in seen)


def test_clip_grad_norm_is_for_sync_mode() -> None:
    for mode in ("async", "bounded"):
        with pytest.raises(UsageError, match="clip it on the worker"):
            ParameterServer(num_workers=1, mode=mode, clip_grad_norm=1.0)
    with pytest.raises(UsageError, match="positive number"):
        ParameterServer(num_workers=1, clip_grad_norm=0.0)


async def test_the_cli_clips_over_two_shards_in_one_process() -> None:
    ps = PsProcess("--listen", "tcp://127.0.0.1:0", "--workers", "2", "--shards", "2",
                   "--transport", "tcp", "--optimizer", "sgd:lr=0.5,momentum=0.5",
                   "--clip-grad-norm", "0.05", "--log-level", "WARNING")
    try:
        models = [make_model(), make_model(seed=5)]
        async with workers(models, ps.addresses(2), "tcp", share_memory=False,
                           plan_options=PLAN) as ws:
            for step in data(5, 2):
                for w, m, (x, y) in zip(ws, models, step, strict=True):
                    w.zero_grad()
                    loss(m, x, y).backward()
                await asyncio.gather(*(w.step() for w in ws))
    finally:
        log = ps.stop()
    assert ps.proc.returncode == 0, log
    want = train_single(sgd_named, 5, clip=0.05)
    for g, w in zip(models[0].parameters(), want, strict=True):
        assert torch.allclose(g.detach(), w, rtol=1e-6, atol=1e-6), (g - w).abs().max()


async def test_the_norm_exchange_names_a_silent_or_gone_shard() -> None:
    async with Node("tcp://127.0.0.1:0", transport="tcp") as a, \
            Node("tcp://127.0.0.1:0", transport="tcp") as b:
        ex = [NormExchange(node, k, 2, timeout=1.0) for k, node in enumerate((a, b))]
        pumps = [asyncio.ensure_future(_pump(node, x)) for node, x in zip((a, b), ex,
                                                                           strict=True)]
        try:
            for x in ex:
                x.learn([a.address, b.address])
            totals = await asyncio.gather(ex[0].total(1, [0, 1], 2.0),
                                          ex[1].total(1, [0, 1], 0.25))
            assert totals == [2.25, 2.25]
            with pytest.raises(TxTimeoutError, match=r"no gradient norm for version 2 from "
                                                     r"shard\(s\) \[1\]"):
                await ex[0].total(2, [0, 1], 1.0)
            await ex[1].aclose()
            await b.aclose()
            with pytest.raises(BrokenError, match="shard 1"):
                await ex[0].total(3, [0, 1], 1.0)
        finally:
            for pump in pumps:
                pump.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)
            await ex[0].aclose()


async def _pump(node: Node, exchange: NormExchange) -> None:
    """What the server's notification and disconnect pumps do for a peer shard."""
    async def said() -> None:
        while True:
            ep, payload = await node.notifications.get()
            exchange.receive(ep, protocol.decode(payload))

    async def gone() -> None:
        while True:
            exchange.lost(await node.disconnected.get())

    await asyncio.gather(said(), gone())


async def test_a_failing_hook_fails_the_update_to_the_workers() -> None:
    def broken(named_grads: list[tuple[str, torch.Tensor]]) -> None:
        raise ValueError("boom in the hook")

    model = make_model()
    async with servers(1, 1, "tcp", grad_hook=broken) as shards, \
            workers([model], [shards[0].address], "tcp") as ws:
        loss(model, *data(1, 1)[0][0]).backward()
        with pytest.raises(TensorxError, match="boom in the hook"):
            await ws[0].step()
        assert shards[0].version == 0


# -- checkpoints ----------------------------------------------------------------------------
def test_a_checkpoint_of_named_groups_resumes_identically(tmp_path: Path) -> None:
    """Optimizer state over the named, shaped parameters (two groups, a split tensor)
    survives a checkpoint: the resumed shard takes the same steps."""
    plan = GraphAnalyzer(make_model(), num_shards=2, **PLAN).plan()
    layout = ShardLayout.from_plan(plan, 0)
    assert not all(spec.whole for spec in layout.params)  # part of 2.weight is here
    gen = torch.Generator().manual_seed(2)
    grads = [torch.randn(layout.nbytes // 4, generator=gen) for _ in range(6)]

    def step(state: ShardState, g: torch.Tensor) -> None:
        state.slot_regions[0].view(torch.float32, (g.numel(),)).copy_(g)
        state.apply([0])

    a = ShardState(layout, 1, decay_by_dim)
    for g in grads[:3]:
        step(a, g)
    a.save(tmp_path / "ck.pt", b"plan")
    b = ShardState(layout, 1, decay_by_dim)
    b.load_state_dict(load_checkpoint(tmp_path / "ck.pt"))
    assert b.version == 3
    for g in grads[3:]:
        step(a, g)
        step(b, g)
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(p, q), name


def test_an_old_format_checkpoint_is_refused_clearly(tmp_path: Path) -> None:
    torch.save({"format": 1, "fingerprint": "txp1-old", "plan": b"old", "version": 3},
               tmp_path / "old.pt")
    with pytest.raises(UsageError, match="older tensorx"):
        load_checkpoint(tmp_path / "old.pt")
