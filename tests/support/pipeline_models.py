"""Models and data for the pipeline tests: each factory is seeded, so the stage processes
and the single-process reference build the same weights and batches."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["VOCAB", "Skip", "batches", "loss_fn", "parts", "stage_options", "whole"]

VOCAB = 11


class Skip(nn.Module):
    """A skip connection from the first stage's output to the last stage's add."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 16)
        self.c = nn.Linear(16, 16)
        self.d = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        g = torch.tanh(self.b(h))
        return self.d(torch.tanh(self.c(g)) + h)


class Embed(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, d)
        self.block = _block(d)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.block(self.emb(ids))


class Head(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.block = _block(d)
        self.out = nn.Linear(d, VOCAB)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.out(self.block(h))


def _block(d: int) -> nn.Module:
    return nn.TransformerEncoderLayer(d, nhead=2, dim_feedforward=32, dropout=0.0,
                                      batch_first=True)


def parts(name: str, stages: int) -> list[nn.Module]:
    """The model ``name`` as ``stages`` modules run one after the other."""
    torch.manual_seed(0)
    if name == "cnn":
        head = [nn.Conv2d(1, 6, 3, padding=1), nn.ReLU()]
        body = [nn.Sequential(nn.Conv2d(6, 6, 3, padding=1), nn.BatchNorm2d(6), nn.ReLU())
                for _ in range(stages - 2)]
        tail = [nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(24, 10)]
        return [nn.Sequential(*head), *body, nn.Sequential(*tail)]
    if name == "transformer":
        return [Embed(16), *(_block(16) for _ in range(stages - 2)), Head(16)]
    if name == "mlp":
        return [nn.Sequential(nn.Linear(8 if i == 0 else 16, 16), nn.Tanh()) if i < stages - 1
                else nn.Linear(16, 3) for i in range(stages)]
    raise ValueError(name)


def whole(name: str, stages: int) -> nn.Module:
    if name == "skip":
        torch.manual_seed(0)
        return Skip()
    return nn.Sequential(*parts(name, stages))


SPLIT_POINTS = {"skip": ["b", "c"]}


def batches(name: str, steps: int, m: int) -> list[tuple[Any, Any]]:
    """(input, target) per step: a batch (split by the schedule) or, for the transformer,
    a list of ``m`` micro-batches whose sequence lengths differ."""
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        if name == "cnn":
            n = 2 * m + 1 if m > 1 else 3  # an uneven last micro-batch
            out.append((torch.randn(n, 1, 6, 6, generator=g), torch.randint(0, 10, (n,),
                                                                            generator=g)))
        elif name == "transformer":
            lens = [int(v) for v in torch.randint(3, 9, (m,), generator=g)]
            xs = [torch.randint(0, VOCAB, (2, L), generator=g) for L in lens]
            ys = [torch.randint(0, VOCAB, (2, L), generator=g) for L in lens]
            out.append((xs, ys))
        else:
            n = 3 * m + 1 if m > 1 else 3
            out.append((torch.randn(n, 8, generator=g), torch.randint(0, 3, (n,), generator=g)))
    return out


def loss_fn(name: str) -> Any:
    if name == "transformer":
        return lambda out, y: F.cross_entropy(out.reshape(-1, VOCAB), y.reshape(-1))
    return nn.CrossEntropyLoss()


def stage_options(name: str, stage: int) -> dict[str, Any]:
    """The transformer's stages take a sequence length that varies per micro-batch."""
    if name == "transformer" and stage > 0:
        return {"dynamic": (1,), "max_shapes": [(2, 8, 16)]}
    return {}


def reference(name: str, stages: int, m: int, steps: int) -> tuple[list[list[float]],
                                                                  dict[str, torch.Tensor]]:
    """One process training the whole model on the same micro-batches, the loss averaged
    over them: (losses per step, final state)."""
    model = whole(name, stages)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    fn = loss_fn(name)
    losses = []
    for x, y in batches(name, steps, m):
        opt.zero_grad()
        xs = x if isinstance(x, list) else list(torch.tensor_split(x, m))
        ys = y if isinstance(y, list) else list(torch.tensor_split(y, m))
        step = []
        for xb, yb in zip(xs, ys, strict=True):
            loss = fn(model(xb), yb)
            (loss / m).backward()
            step.append(loss.item())
        opt.step()
        losses.append(step)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}
