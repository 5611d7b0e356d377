"""``pp.split`` cuts a traced model into stage modules (pure: no processes, no sockets):
the stages chained equal the model, every crossing is planned with its shape, skip
connections cross directly, and bad cuts are clear errors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tensorx import pipelining as pp
from tensorx.errors import UsageError


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c, self.d = (nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 8),
                                          nn.Linear(8, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        g = torch.relu(self.b(h))
        return self.d(torch.relu(self.c(g)) + h)  # h skips stage 1


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4))
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x @ self.w)) @ self.w


def run_chained(pipe: pp.Pipe, x: torch.Tensor) -> torch.Tensor:
    """The stages' modules run one after the other, values routed as the plan says."""
    outs: dict[int, tuple[torch.Tensor, ...]] = {}
    routes = pipe._routes
    for s in range(pipe.num_stages):
        args: list[torch.Tensor] = [x] if s == 0 else []
        for src, positions in routes.incoming.get(s, {}).items():
            picked = routes.outgoing[src][s]
            width = max(positions) + 1
            args += [torch.empty(0)] * (width - len(args))
            for pos, i in zip(positions, picked, strict=True):
                args[pos] = outs[src][i]
        out = pipe.get_stage_module(s)(*args)
        outs[s] = tuple(out) if isinstance(out, (tuple, list)) else (out,)
    return outs[pipe.num_stages - 1][0]


@pytest.mark.parametrize("how", ["split_points", "placement"])
def test_split_stages_chained_equal_the_model_and_plan_every_crossing(how: str) -> None:
    torch.manual_seed(0)
    model, x = Net(), torch.randn(3, 4)
    if how == "split_points":
        pipe = pp.split(model, ["b", "c"], example_args=(x,))
    else:
        pipe = pp.split(model, placement={"a": 0, "b": 1, "c": 2, "d": 2}, example_args=(x,))
    assert pipe.num_stages == 3
    assert torch.allclose(run_chained(pipe, x), model(x))
    crossings = {(c.src, c.dst): c for c in pipe.crossings}
    assert set(crossings) == {(0, 1), (0, 2), (1, 2)}  # h skips stage 1: 0 -> 2 directly
    assert crossings[(0, 2)].shape == (3, 8) and crossings[(0, 2)].dtype == "float32"
    # the stages hold the model's own parameters, not copies
    own = {id(p) for p in model.parameters()}
    for s in range(3):
        assert {id(p) for p in pipe.get_stage_module(s).parameters()} <= own
    assert "0 -> 2" in pipe.describe()


def test_bad_cuts_are_clear_errors() -> None:
    model = Net()
    with pytest.raises(UsageError, match="not a module path"):
        pp.split(model, ["nope"])
    with pytest.raises(UsageError, match="in the order the model runs them"):
        pp.split(model, ["c", "b"])
    with pytest.raises(UsageError, match="not both"):
        pp.split(model, ["b"], placement={"a": 0})
    with pytest.raises(UsageError, match="from the later stage"):
        pp.split(model, placement={"a": 1, "b": 0, "c": 1, "d": 1})
    with pytest.raises(UsageError, match="would be empty"):
        pp.split(model, placement={"a": 0, "b": 0, "c": 2, "d": 2})
    with pytest.raises(UsageError, match="tied weights"):
        pp.split(Tied(), ["b"])
