"""Tensors tensorx makes for a model live where the model does: sparse gradients of an
embedding that got none in a step, and the RNG state that planning leaves behind."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from tensorx._analyzer.sample import cuda_devices
from tensorx._ps.rows.sparse import SparseSender
from tensorx.graph_analyzer import BoundaryAnalyzer, GraphAnalyzer
from tensorx.memregion import MemoryRegion

CUDA = pytest.param("cuda", marks=[
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")])
DEVICES = ["cpu", CUDA]


class Unused(nn.Module):
    """A sparse embedding that this step's forward never touches."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 4, sparse=True)
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x)  # type: ignore[no-any-return]


class Exports:
    """What SparseSender needs of a node: export a region, get its descriptor."""

    def export(self, region: MemoryRegion, access: str) -> Any:
        return region.descriptor()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_an_embedding_without_gradient_gets_an_empty_one_on_its_device(
        device: str, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    model = Unused().to(device=device, dtype=dtype)
    plan = GraphAnalyzer(model).plan()
    (entry,) = plan.dynamic_entries
    with plan.bind(model, densify_sparse=False) as binding:
        sender = SparseSender(binding, model, Exports())
        model(torch.randn(3, 4, device=device, dtype=dtype)).sum().backward()
        assert model.emb.weight.grad is None  # this step never touched the table
        announce = sender.stage(entry.shard)
        grad = model.emb.weight.grad
        assert grad is not None and grad.is_sparse
        assert grad.device == model.emb.weight.device
        assert grad.dtype == model.emb.weight.dtype
        assert grad.shape == model.emb.weight.shape and grad._nnz() == 0
        assert set(announce) == {entry.name}
        # the optimizer can take it as it is (torch checks device and dtype)
        torch.optim.SGD(model.parameters(), lr=0.1).step()


@pytest.mark.parametrize("device", DEVICES)
def test_a_dense_gradient_of_a_sparse_table_goes_as_its_nonzero_rows(device: str) -> None:
    model = Unused().to(device)
    plan = GraphAnalyzer(model).plan()
    (entry,) = plan.dynamic_entries
    dense = torch.zeros_like(model.emb.weight)
    dense[[3, 17]] = torch.tensor([1.0, 0.0, -2.0, 0.5], device=device)
    with plan.bind(model, densify_sparse=False) as binding:
        model.emb.weight.grad = dense
        SparseSender(binding, model, Exports()).stage(entry.shard)
        grad = model.emb.weight.grad
        assert grad.is_sparse and grad.device == model.emb.weight.device
        assert grad.coalesce().indices().tolist() == [[3, 17]]
        torch.testing.assert_close(grad.to_dense(), dense)


class Noisy(nn.Module):
    """Dropout in two stages (a sample run draws random numbers) and batch-norm statistics."""

    def __init__(self) -> None:
        super().__init__()
        self.stage0 = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.5), nn.BatchNorm1d(16))
        self.stage1 = nn.Sequential(nn.Dropout(0.5), nn.Linear(16, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.stage1(self.stage0(x))  # type: ignore[no-any-return]


def rng_states(device: str) -> list[torch.Tensor]:
    states = [torch.random.get_rng_state()]
    if device == "cuda":
        states.append(torch.cuda.get_rng_state())
    return states


@pytest.mark.parametrize("device", DEVICES)
def test_planning_with_sample_inputs_leaves_every_rng_as_it_was(device: str) -> None:
    torch.manual_seed(0)
    model = Noisy().to(device)
    x = torch.randn(6, 8, device=device)
    before = rng_states(device)
    model(x)  # the model does draw: without the fork, planning would move the state
    assert not all(torch.equal(a, b) for a, b in zip(before, rng_states(device), strict=True))
    torch.manual_seed(0)
    x = torch.randn(6, 8, device=device)
    before, stats = rng_states(device), model.stage0[2].running_mean.clone()
    GraphAnalyzer(model, sample_inputs=(x,)).plan()
    BoundaryAnalyzer(model, {"stage0": "a", "stage1": "b"}, sample_inputs=(x,)).plan()
    after = rng_states(device)
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    assert torch.equal(stats, model.stage0[2].running_mean)


def test_a_cpu_model_forks_no_cuda_generator() -> None:
    assert cuda_devices(Noisy(), (torch.randn(2, 8), {"k": [torch.zeros(1)]})) == (
        [torch.cuda.current_device()] if torch.cuda.is_initialized() else [])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_devices_are_those_of_the_model_and_inputs() -> None:
    last = torch.cuda.device_count() - 1
    model = Noisy().to(f"cuda:{last}")
    assert last in cuda_devices(model, ())
    assert cuda_devices(Noisy(), ({"x": [torch.zeros(1, device="cuda:0")]},))[0] == 0


class Sometimes(nn.Module):
    """A sparse embedding that only some steps use."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(64, 4, sparse=True)
        self.head = nn.Linear(4, 1)

    def forward(self, ids: torch.Tensor, use: bool) -> torch.Tensor:
        x = self.emb(ids).mean(1) if use else torch.ones(len(ids), 4, device=ids.device)
        return self.head(x)  # type: ignore[no-any-return]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("flat", [None, False], ids=["default", "per-tensor"])
async def test_a_cuda_embedding_left_out_of_steps_trains_with_verify(flat: bool | None) -> None:
    """A CUDA model whose embedding gets no gradient in every other step, pulls verified
    against the checksum a GPU shard computed: equals torch.optim on one process. (Over the
    CUDA IPC lane: a CPU shard needs the TCP lane to stage GPU memory.)"""
    from tensorx.ps import ParameterServer
    from tensorx.worker import Worker

    gen = torch.Generator().manual_seed(1)
    steps = [(torch.randint(0, 64, (4, 3), generator=gen).cuda(), i % 2 == 0) for i in range(6)]
    sgd = lambda p: torch.optim.SGD(p, lr=0.1)  # noqa: E731
    model, want = Sometimes().cuda(), Sometimes().cuda()
    opts: dict[str, Any] = {"transport": "tcp", "node_options": {"cuda_ipc": True}}
    async with ParameterServer("tcp://127.0.0.1:0", num_workers=1, optimizer=sgd,
                               device="cuda:0", flat=flat, **opts) as ps, \
            Worker(model, ps.address, verify=True, timeout=30, **opts) as worker:
        for ids, use in steps:
            worker.zero_grad()
            model(ids, use).sum().backward()
            await worker.step()
    local = sgd(list(want.parameters()))
    for ids, use in steps:
        local.zero_grad()
        want(ids, use).sum().backward()
        local.step()
    for got, ref in zip(model.parameters(), want.parameters(), strict=True):
        torch.testing.assert_close(got.detach(), ref.detach(), rtol=1e-5, atol=1e-6)
