"""The seeded batches the parameter-server tests train :func:`tests.support.models.small_mlp`
on, and its loss step."""

from __future__ import annotations

import torch
from torch import nn


def batches(steps: int, workers: int, size: int = 4) -> list[list[tuple[torch.Tensor, ...]]]:
    gen = torch.Generator().manual_seed(123)
    return [[(torch.randn(size, 8, generator=gen), torch.randint(0, 3, (size,), generator=gen))
             for _ in range(workers)] for _ in range(steps)]


def backward(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    nn.functional.cross_entropy(model(x), y).backward()
