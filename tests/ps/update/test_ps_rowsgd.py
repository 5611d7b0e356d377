"""Plain SGD on sparse tables in a few ops for all of them (tensorx._ps.update.rowsgd): the
same bits as torch's own sparse SGD step, update after update, and torch's step wherever it
may not."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from tensorx._ps.rows.tables import row_groups
from tensorx._ps.state.shard import ShardLayout, ShardState
from tensorx._ps.update import rowkernel, rowsgd
from tensorx.graph_analyzer import GraphAnalyzer
from tests.support.host import kernel_or_skip


class Mixed(nn.Module):
    """Tables of three row shapes and two dtypes around a dense layer."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Embedding(1000, 16, sparse=True)
        self.head = nn.Linear(16, 1)
        self.b = nn.EmbeddingBag(500, 8, mode="sum", sparse=True)
        self.c = nn.Embedding(300, 5, sparse=True).double()
        self.d = nn.Embedding(700, 16, sparse=True)


def two_groups(named_params: list[tuple[str, nn.Parameter]]) -> torch.optim.Optimizer:
    fast = [p for n, p in named_params if n in ("a.weight", "d.weight")]
    rest = [p for n, p in named_params if n not in ("a.weight", "d.weight")]
    return torch.optim.SGD([{"params": fast, "lr": 0.3}, {"params": rest}], lr=0.05)


def state_of(factory: Callable[..., torch.optim.Optimizer], flat: bool | None,
             schedule: bool = True) -> ShardState:
    model = Mixed()
    layout = ShardLayout.from_plan(GraphAnalyzer(model).plan(), 0)
    state = ShardState(layout, 3, factory, flat=flat,
                       lr_scheduler=(lambda o: torch.optim.lr_scheduler.StepLR(o, 1, 0.7))
                       if schedule else None)
    state.load_params({k: v.detach() for k, v in model.state_dict().items()})
    return state


def push(state: ShardState, rank: int, seed: int) -> None:
    """Sorted unique rows of every table, as a worker stages them (some tables left out)."""
    gen = torch.Generator().manual_seed(seed)
    rows = {}
    for name, p in state.named_parameters():
        if name in ("head.weight", "head.bias") or (seed + len(name)) % 5 == 0:
            continue
        ids = torch.randint(0, p.shape[0], (60,), generator=gen).unique()
        rows[name] = (ids, torch.randn(len(ids), *p.shape[1:], generator=gen).to(p.dtype))
    state.put_rows(rank, rows)


def train(state: ShardState, ranks: list[int]) -> list[torch.Tensor]:
    for seed in range(4):
        for r in ranks:
            push(state, r, 10 * seed + r)
        state.slot_views(ranks[0])[1].fill_(0.25)  # some dense gradient too
        state.apply(ranks)
    return [p.detach().clone() for _, p in state.named_parameters()]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


@pytest.mark.parametrize("flat", [None, False], ids=["flat-auto", "per-tensor"])
@pytest.mark.parametrize("ranks", [[0], [0, 1], [0, 1, 2]])
@pytest.mark.parametrize("by", ["kernel", "torch-ops"])
def test_plain_sgd_on_rows_gives_torchs_bits(flat: bool | None, ranks: list[int], by: str,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Two param groups, an LR schedule, tables of two dtypes and three row shapes, one to
    three ranks (a mean over three is no power of two): the few-ops step, by the C kernel
    or by torch ops, leaves every parameter bit for bit as torch's step does, and the
    changed rows an answer sends are the same."""
    steps = []
    original = rowsgd.RowSGD.step

    def counted(self: rowsgd.RowSGD, *a: Any) -> dict[int, torch.Tensor]:
        steps.append(1)
        return original(self, *a)

    monkeypatch.setattr(rowsgd.RowSGD, "step", counted)
    kernel_calls = []
    if by == "kernel":
        kernel = kernel_or_skip()
        original_sgd = rowkernel.RowKernel.sgd

        def sgd(self: rowkernel.RowKernel, *a: Any) -> torch.Tensor | None:
            got = original_sgd(self, *a)
            kernel_calls.append(got is not None)
            return got

        monkeypatch.setattr(rowkernel.RowKernel, "sgd", sgd)
        assert kernel is not None
    else:
        monkeypatch.setattr(rowkernel, "load", lambda: None)
    ours_state = state_of(two_groups, flat)
    ours = train(ours_state, ranks)
    assert len(steps) == 4
    if by == "kernel":  # every group of every step (3 groups, one lr each)
        assert kernel_calls and all(kernel_calls)
    monkeypatch.setattr(rowsgd.RowSGD, "usable", lambda self: False)
    theirs_state = state_of(two_groups, flat)
    theirs = train(theirs_state, ranks)
    assert len(steps) == 4  # torch's step this time
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(bits(a), bits(b))
    assert not torch.equal(ours[0], state_of(two_groups, flat).params[0].detach())
    ours_rows = ours_state.changed.since(0, ours_state.version)
    theirs_rows = theirs_state.changed.since(0, theirs_state.version)
    assert ours_rows is not None and theirs_rows is not None
    assert ours_rows.keys() == theirs_rows.keys()
    assert all(torch.equal(ours_rows[i], theirs_rows[i]) for i in ours_rows)


@pytest.mark.parametrize(("factory", "why"), [
    (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), "momentum"),
    (lambda p: torch.optim.SGD(p, lr=0.1, maximize=True), "maximize"),
    (lambda p: torch.optim.SGD(p, lr=torch.tensor(0.1)), "tensor lr"),
    (lambda p: torch.optim.Adagrad(p, lr=0.1), "not plain SGD"),
])
def test_other_optimizers_step_through_torch(factory: Any, why: str) -> None:
    state = state_of(factory, None, schedule=False)
    tables = [state.params[i] for i in state.rows]
    reason = rowsgd.why_not(state.optimizer, tables)
    assert reason is not None and why in reason
    before = [p.detach().clone() for p in state.params]
    train(state, [0, 1])
    assert any(not torch.equal(a, b) for a, b in zip(before, state.params, strict=True))


def test_a_step_hook_makes_torch_step() -> None:
    state = state_of(two_groups, None, schedule=False)
    assert state.optimizer is not None and state._row_sgd is not None
    assert state._row_sgd.usable()
    seen = []
    state.optimizer.register_step_post_hook(lambda *_: seen.append(1))
    assert not state._row_sgd.usable()
    train(state, [0])
    assert seen  # the hook ran: torch's own step did


def test_row_groups_pack_and_split_by_table() -> None:
    model = Mixed()
    layout = ShardLayout.from_plan(GraphAnalyzer(model).plan(), 0)
    specs = {i: s for i, s in enumerate(layout.param_specs()) if s.sparse}
    groups = row_groups(specs)
    assert sorted(len(g.starts) for g in groups) == [1, 1, 2]  # a and d share rows of 16
    (pair,) = [g for g in groups if len(g.starts) == 2]
    rows = {i: (torch.tensor([0, 5, specs[i].shape[0] - 1]), torch.randn(3, 16))
            for i in pair.starts}
    packed = pair.pack(rows)
    assert packed is not None
    keys, values = packed
    assert bool((keys[1:] > keys[:-1]).all()) and values.shape == (6, 16)
    split = pair.split(keys)
    assert all(torch.equal(split[i], rows[i][0]) for i in pair.starts)
