"""Tensors tensorx makes for a model live where the model does: sparse gradients of an
embedding that got none in a step, and the RNG state that planning leaves behind."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from tensorx._ps.sparse import SparseSender
from tensorx.graph_analyzer import GraphAnalyzer
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
