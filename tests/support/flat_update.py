"""Elementwise torch optimizers in two parameter groups, stepped on the arena of a shard of
a small transformer with seeded gradients: the flat update's tests (CPU and GPU) compare
its states with the per-tensor step's."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from tensorx._ps.state.shard import ShardLayout, ShardState, views
from tensorx.graph_analyzer import GraphAnalyzer
from tests.support import models

Named = list[tuple[str, torch.nn.Parameter]]
Factory = Callable[..., torch.optim.Optimizer]


def layout() -> ShardLayout:
    """Shard 0 of 1 of a small transformer."""
    return ShardLayout.from_plan(GraphAnalyzer(models.transformer(), num_shards=1).plan(), 0)


def two_groups(cls: type[torch.optim.Optimizer], **kw: Any) -> Factory:
    """Weights at ``lr``, the rest (biases, norms) at a tenth of it, no weight decay:
    groups interleaved in the arena."""
    lr = kw.pop("lr")

    def make(named_params: Named) -> torch.optim.Optimizer:
        w = [p for n, p in named_params if n.endswith("weight") and p.dim() > 1]
        rest = [p for n, p in named_params if not (n.endswith("weight") and p.dim() > 1)]
        return cls([{"params": w}, {"params": rest, "lr": lr / 10, "weight_decay": 0.0}],
                   lr=lr, **kw)
    return make


ELEMENTWISE: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "sgd": (torch.optim.SGD, {"lr": 0.1}),
    "sgd-nesterov-wd": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True,
                                          "weight_decay": 1e-2}),
    "sgd-dampening-maximize": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9,
                                                 "dampening": 0.5, "maximize": True}),
    "adam": (torch.optim.Adam, {"lr": 1e-2}),
    "adam-amsgrad": (torch.optim.Adam, {"lr": 1e-2, "amsgrad": True, "weight_decay": 1e-2}),
    "adamw": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
    "rmsprop-centered": (torch.optim.RMSprop, {"lr": 1e-2, "momentum": 0.5,
                                               "centered": True}),
    "adagrad": (torch.optim.Adagrad, {"lr": 0.1, "lr_decay": 0.01,
                                      "initial_accumulator_value": 0.1}),
    "adamax": (torch.optim.Adamax, {"lr": 1e-2}),
    "nadam": (torch.optim.NAdam, {"lr": 1e-2, "decoupled_weight_decay": True,
                                  "weight_decay": 1e-2}),
    "radam": (torch.optim.RAdam, {"lr": 1e-2}),
    "adadelta": (torch.optim.Adadelta, {"lr": 1.0}),
    "asgd": (torch.optim.ASGD, {"lr": 1e-2, "t0": 2}),
    "rprop": (torch.optim.Rprop, {"lr": 1e-2}),
    "adam-foreach-false": (torch.optim.Adam, {"lr": 1e-2, "foreach": False}),
}


def grads(state: ShardState, seed: int, workers: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for r in range(workers):
        for view in views(state.layout, state.slot_regions[r]):
            view.copy_(torch.randn(view.shape, generator=gen))


def train(state: ShardState, steps: range, workers: int = 2,
           by_parts: bool = False) -> None:
    for step in steps:
        grads(state, step, workers)
        ranks = [0] if workers == 1 else [0, 1] if step % 2 else [step % 4 // 2]
        if by_parts:
            for k in reversed(range(state.num_parts)):  # any order: independent ranges
                state.apply_part(ranks, k)
            state.finish_update()
        else:
            state.apply(ranks)


def same(a: ShardState, b: ShardState, exact: bool) -> None:
    """The same parameters and optimizer state (bit for bit where ``exact``)."""
    for x, y in zip(a.views, b.views, strict=True):
        if exact:
            assert torch.equal(x, y)
        else:
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)
    assert a.optimizer is not None and b.optimizer is not None
    sa, sb = a.optimizer.state_dict(), b.optimizer.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    assert sa["state"].keys() == sb["state"].keys()
    for i, entry in sa["state"].items():
        assert entry.keys() == sb["state"][i].keys()
        for key, value in entry.items():
            other = sb["state"][i][key]
            assert value.shape == other.shape, (i, key)
            torch.testing.assert_close(value, other, rtol=1e-5, atol=1e-6)
