"""Optimizers the parameter-server tests use, and single-process training to compare a
distributed run with."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from tests.support.data import backward, batches
from tests.support.models import small_mlp

OptFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]
SGD_MOMENTUM: OptFactory = lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9)  # noqa: E731
ADAM: OptFactory = lambda p: torch.optim.Adam(p, lr=0.01)  # noqa: E731


def reference(steps: Sequence[list[tuple[torch.Tensor, ...]]],
              opt: OptFactory = ADAM) -> nn.Module:
    """Single-process training on rank 0's batch of each step: what a resumed run must equal."""
    want = small_mlp()
    optimizer = opt(list(want.parameters()))  # type: ignore[arg-type]
    for step in steps:
        optimizer.zero_grad()
        backward(want, *step[0])
        optimizer.step()
    return want


def train_single(opt: OptFactory, steps: int) -> list[torch.Tensor]:
    model = small_mlp()
    optimizer = opt(list(model.parameters()))  # type: ignore[arg-type]
    for step in batches(steps, 2):
        optimizer.zero_grad()
        backward(model, torch.cat([x for x, _ in step]), torch.cat([y for _, y in step]))
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]
