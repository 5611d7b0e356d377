"""The flat update (``flat=None``, the default): chosen for elementwise optimizers, the same
parameters and per-parameter optimizer state as stepping each tensor (``flat=False``)."""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tensorx._ps import parts
from tensorx._ps.shard import ShardLayout, ShardState, load_checkpoint, views
from tensorx.graph_analyzer import GraphAnalyzer
from tests import models

Named = list[tuple[str, torch.nn.Parameter]]
Factory = Callable[..., torch.optim.Optimizer]


def _layout() -> ShardLayout:
    return ShardLayout.from_plan(GraphAnalyzer(models.transformer(), num_shards=1).plan(), 0)


def _two_groups(cls: type[torch.optim.Optimizer], **kw: Any) -> Factory:
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


def _grads(state: ShardState, seed: int, workers: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for r in range(workers):
        for view in views(state.layout, state.slot_regions[r]):
            view.copy_(torch.randn(view.shape, generator=gen))


def _train(state: ShardState, steps: range, workers: int = 2,
           by_parts: bool = False) -> None:
    for step in steps:
        _grads(state, step, workers)
        ranks = [0] if workers == 1 else [0, 1] if step % 2 else [step % 4 // 2]
        if by_parts:
            for k in reversed(range(state.num_parts)):  # any order: independent ranges
                state.apply_part(ranks, k)
            state.finish_update()
        else:
            state.apply(ranks)


def _same(a: ShardState, b: ShardState, exact: bool) -> None:
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


@pytest.mark.parametrize("name", list(ELEMENTWISE))
def test_the_flat_update_equals_per_tensor(name: str) -> None:
    cls, kw = ELEMENTWISE[name]
    make = _two_groups(cls, **kw)
    auto, ref = (ShardState(_layout(), 2, make, flat=f) for f in (None, False))
    assert auto.fast is not None and ref.fast is None
    assert auto.num_parts == 1 < len(auto.fast.ranges) or auto.num_parts > 1  # 2 groups
    assert {r.group for r in auto.fast.ranges} == {0, 1}
    _train(auto, range(6))
    _train(ref, range(6))
    _same(auto, ref, exact=cls is torch.optim.SGD)


@pytest.mark.parametrize("name", ["sgd-nesterov-wd", "adamw"])
def test_applied_range_by_range_it_is_the_same_update(
        name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(parts, "PART_BYTES", 4096)
    cls, kw = ELEMENTWISE[name]
    auto, ref = (ShardState(_layout(), 2, _two_groups(cls, **kw), flat=f) for f in (None, False))
    assert auto.fast is not None and auto.num_parts > 4
    assert all(auto.part_bytes(k) == (r.start, r.nbytes) for k, r in enumerate(auto.fast.ranges))
    assert all(r.nbytes <= 4096 for r in auto.fast.ranges)  # larger tensors are cut
    assert any(n < auto.params[i].numel() for r in auto.fast.ranges for i, _, _, n in r.members)
    _train(auto, range(5), by_parts=True)
    _train(ref, range(5))
    _same(auto, ref, exact=False)


class NormScaled(torch.optim.Optimizer):
    """Steps each tensor by its gradient over the gradient's norm: not elementwise."""

    def __init__(self, params: Any, lr: float) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad / (p.grad.norm() + 1e-6), alpha=-group["lr"])


def test_an_optimizer_that_looks_at_whole_tensors_steps_per_tensor() -> None:
    state = ShardState(_layout(), 2, lambda p: NormScaled(p, lr=0.1))
    assert state.fast is None and state.num_parts == 1
    assert state.update == "per-tensor (NormScaled is not known to be elementwise)"
    before = [v.clone() for v in state.views]
    _train(state, range(1), workers=1)
    grads = views(state.layout, state.slot_regions[0])
    for old, new, g in zip(before, state.views, grads, strict=True):
        torch.testing.assert_close(new, old - 0.1 * g / (g.norm() + 1e-6))


def test_a_subclass_of_an_elementwise_optimizer_steps_per_tensor() -> None:
    class MySGD(torch.optim.SGD):
        pass

    assert ShardState(_layout(), 1, lambda p: MySGD(p, lr=0.1)).fast is None


def test_one_log_line_says_which_update_and_why(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="tensorx._ps.shard"):
        ShardState(_layout(), 1, _two_groups(torch.optim.SGD, lr=0.1))
        ShardState(_layout(), 1, lambda p: NormScaled(p, lr=0.1))
        ShardState(_layout(), 1, lambda p: torch.optim.SGD(p, lr=0.1), flat=False)
    lines = [r.getMessage() for r in caplog.records if "update:" in r.getMessage()]
    assert len(lines) == 3
    assert lines[0].startswith("ps shard 0 update: flat over ")
    assert "(SGD, elementwise, 2 group(s), fused)" in lines[0]
    assert lines[1] == "ps shard 0 update: per-tensor (NormScaled is not known to be elementwise)"
    assert lines[2] == "ps shard 0 update: per-tensor (flat=False)"


def test_flat_overrides_still_work() -> None:
    def sgd(p: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.SGD(p, lr=0.1, momentum=0.9)

    old_flat = ShardState(_layout(), 2, sgd, flat=True)
    assert old_flat.flat and old_flat.fast is None and old_flat.names == ["flat.0"]
    per_tensor, auto = ShardState(_layout(), 2, sgd, flat=False), ShardState(_layout(), 2, sgd)
    assert not per_tensor.flat and per_tensor.fast is None and auto.fast is not None
    for s in (old_flat, per_tensor, auto):
        _train(s, range(4))
    _same(auto, per_tensor, exact=True)
    for x, y in zip(old_flat.views, per_tensor.views, strict=True):
        torch.testing.assert_close(x, y)


def test_schedules_and_changed_hyperparameters_apply_to_their_ranges() -> None:
    make = _two_groups(torch.optim.Adam, lr=1e-2)

    def sched(opt: torch.optim.Optimizer) -> Any:
        return torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)

    auto, ref = (ShardState(_layout(), 2, make, sched, flat=f) for f in (None, False))
    for s in (auto, ref):
        _train(s, range(3))
        assert s.optimizer is not None
        s.optimizer.param_groups[1]["lr"] = 0.5  # as RemoteOptimizer sets it
        s.optimizer.param_groups[0]["betas"] = (0.8, 0.99)
        _train(s, range(3, 6))
    _same(auto, ref, exact=False)


@pytest.mark.parametrize("name", ["adam-amsgrad", "sgd-nesterov-wd", "adagrad", "nadam"])
@pytest.mark.parametrize(("first", "second"), [(None, None), (None, False), (False, None)])
def test_checkpoints_round_trip(name: str, first: bool | None, second: bool | None,
                                tmp_path: Path) -> None:
    """A checkpoint is per parameter whichever update wrote it; resumed by either, training
    goes on as if uninterrupted."""
    cls, kw = ELEMENTWISE[name]
    make = _two_groups(cls, **kw)
    ref = ShardState(_layout(), 2, make, flat=False)
    _train(ref, range(6))
    a = ShardState(_layout(), 2, make, flat=first)
    _train(a, range(3))
    a.save(tmp_path / "ck.pt", b"plan")
    saved = load_checkpoint(tmp_path / "ck.pt")
    assert saved is not None and saved["param_names"] == ref.names
    b = ShardState(_layout(), 2, make, flat=second)
    b.load_state_dict(saved)
    assert (b.fast is not None) == (second is None)
    _train(b, range(3, 6))
    _same(b, ref, exact=False)


def test_a_loaded_state_the_flat_update_cannot_hold_turns_it_off(
        caplog: pytest.LogCaptureFixture) -> None:
    make = _two_groups(torch.optim.Adam, lr=1e-2)
    ref = ShardState(_layout(), 1, make, flat=False)
    _train(ref, range(2), workers=1)
    assert ref.optimizer is not None
    saved = ref.optimizer.state_dict()
    for i in list(saved["state"])[::2]:  # some parameters stepped more often
        saved["state"][i]["step"] = torch.tensor(7.0)
    auto = ShardState(_layout(), 1, make)
    _train(auto, range(2), workers=1)
    assert auto.optimizer is not None
    with caplog.at_level(logging.WARNING, logger="tensorx._ps.flat"):
        auto.optimizer.load_state_dict(copy.deepcopy(saved))
    assert auto.fast is None and "per-tensor from now on" in caplog.text
    ref.optimizer.load_state_dict(saved)
    _train(auto, range(2, 4), workers=1)
    _train(ref, range(2, 4), workers=1)
    _same(auto, ref, exact=False)  # the first two steps: fused kernel, not bitwise


def test_without_sparse_tables_the_flat_update_is_all_that_runs() -> None:
    """The flat update steps the arena's ranges itself; with no sparse table to step
    beside it, the optimizer's own per-tensor step (a pass over every parameter, most of a
    round for 2000 small tensors) must not run at all."""
    state = ShardState(_layout(), 1, lambda p: torch.optim.SGD(p, lr=0.1))
    assert state.fast is not None and not state.rows
    calls: list[int] = []
    assert state.optimizer is not None
    state.optimizer.step = lambda *_, **__: calls.append(1)  # type: ignore[method-assign]
    _train(state, range(2), workers=1)
    _train(state, range(2, 4), workers=1, by_parts=True)
    assert calls == []


@pytest.mark.parametrize("name", ["adam-amsgrad", "sgd-nesterov-wd", "rmsprop-centered"])
def test_tensors_cut_between_ranges_keep_their_state_through_a_checkpoint(
        name: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A tensor larger than a range is cut into several (parts of a pipelined round): its
    optimizer state, seen per parameter by state_dict() and checkpoints, is put together
    from the pieces and split again on load."""
    monkeypatch.setattr(parts, "PART_BYTES", 1024)
    cls, kw = ELEMENTWISE[name]
    make = _two_groups(cls, **kw)
    ref = ShardState(_layout(), 2, make, flat=False)
    _train(ref, range(6))
    a = ShardState(_layout(), 2, make)
    assert a.fast is not None
    assert any(n < a.params[i].numel() for r in a.fast.ranges for i, _, _, n in r.members)
    _train(a, range(3), by_parts=True)
    a.save(tmp_path / "ck.pt", b"plan")
    for flat in (None, False):  # resumed with the cut ranges, or per tensor
        b = ShardState(_layout(), 2, make, flat=flat)
        saved = load_checkpoint(tmp_path / "ck.pt")
        assert saved is not None
        b.load_state_dict(saved)
        _train(b, range(3, 6), by_parts=flat is None)
        _same(b, ref, exact=False)
