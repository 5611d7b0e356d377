"""What a shard takes for its optimizer: every torch optimizer's own state and values pass
(no false refusal of a real checkpoint), and each kind of bad one is named. Pure: no server
(the attacks over real servers and workers are in tests/ps/worker/test_remote_optimizer.py)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from tensorx._ps.update.optim_check import check_hyper, check_state
from tensorx.errors import UsageError

Make = Callable[[list[nn.Parameter]], torch.optim.Optimizer]
OPTIMIZERS: dict[str, Make] = {
    "SGD": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True),
    "Adam-amsgrad": lambda p: torch.optim.Adam(p, lr=0.01, amsgrad=True),
    "AdamW": lambda p: torch.optim.AdamW(p, lr=0.01),
    "Adagrad": lambda p: torch.optim.Adagrad(p, lr=0.1),
    "RMSprop": lambda p: torch.optim.RMSprop(p, lr=0.01, momentum=0.5, centered=True),
    "Adadelta": lambda p: torch.optim.Adadelta(p),
    "Adamax": lambda p: torch.optim.Adamax(p),
    "NAdam": lambda p: torch.optim.NAdam(p),
    "RAdam": lambda p: torch.optim.RAdam(p),
    "ASGD": lambda p: torch.optim.ASGD(p),
    "Rprop": lambda p: torch.optim.Rprop(p),
    "Adafactor": lambda p: torch.optim.Adafactor(p),
}


def stepped(make: Make, sparse: bool = False) -> tuple[torch.optim.Optimizer, dict[int, str]]:
    """An optimizer over a matrix, a vector and a scalar, after two steps."""
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(shape)) for shape in ((6, 4), (4,), ())]
    opt = make(params)
    for _ in range(2):
        for p in params:
            g = torch.randn_like(p)
            p.grad = g.to_sparse() if sparse and p.dim() else g
        opt.step()
    return opt, {id(p): name for p, name in zip(params, ("w", "b", "s"), strict=True)}


def by_label(opt: torch.optim.Optimizer, label_of: dict[int, str]) -> dict[str, dict[str, Any]]:
    return {label_of[id(p)]: dict(s) for p, s in opt.state.items()}


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_every_torch_optimizers_own_state_and_values_pass(name: str) -> None:
    opt, label_of = stepped(OPTIMIZERS[name])
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    check_hyper(opt, groups)
    check_state(opt, label_of, groups, by_label(opt, label_of))
    flat = {label: {k: v.reshape(-1) if v.shape == (6, 4) else v for k, v in entry.items()}
            for label, entry in by_label(opt, label_of).items()}
    check_state(opt, label_of, groups, flat)  # a split tensor's chunk arrives flat


def test_sparse_adam_state_passes() -> None:
    def make(params: list[nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.SparseAdam(params[:2])

    opt, label_of = stepped(make, sparse=True)
    check_state(opt, label_of, [{}], by_label(opt, label_of))


def test_each_kind_of_bad_state_is_named() -> None:
    opt, label_of = stepped(OPTIMIZERS["Adafactor"])
    good = by_label(opt, label_of)
    assert good["w"]["row_var"].shape != good["w"]["col_var"].shape  # factored
    bad: list[tuple[str, str, Any]] = [
        ("w", "row_var", torch.zeros(6, 4)),             # not factored as Adafactor keeps it
        ("w", "col_var", -good["w"]["col_var"] - 1),     # a variance below zero
        ("b", "variance", torch.full((4,), math.inf)),
        ("s", "step", torch.tensor(1.5)),
        ("b", "step", -1),                               # a number, as an old step was
    ]
    groups = [{}]
    for label, key, value in bad:
        state = {k: dict(v) for k, v in good.items()}
        state[label][key] = value
        with pytest.raises(UsageError, match=rf"'{label}'\['{key}'\]"):
            check_state(opt, label_of, groups, state)
    check_state(opt, label_of, groups, {**good, "b": {**good["b"], "step": 2}})


def test_a_custom_optimizer_is_judged_by_its_own_constructor() -> None:
    class Clipped(torch.optim.SGD):
        def __init__(self, params: Any, lr: float = 0.1, clip: float = 1.0) -> None:
            if not clip > 0:
                raise ValueError(f"Invalid clip: {clip}")
            super().__init__(params, lr=lr)
            for g in self.param_groups:
                g["clip"] = clip

    opt = Clipped([nn.Parameter(torch.zeros(3))])
    check_hyper(opt, [{"clip": 2.0, "lr": 0.5}])
    with pytest.raises(UsageError, match=r"\['clip'\] = -1.0 .*Invalid clip: -1.0"):
        check_hyper(opt, [{"clip": -1.0}])
    needs = torch.optim.SGD([nn.Parameter(torch.zeros(3))], lr=0.1)
    needs.param_groups[0]["lr"] = -5.0  # set past the constructor: nothing to judge by
    check_hyper(needs, [{"lr": -1.0}])
