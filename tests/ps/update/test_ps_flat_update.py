"""The flat update (``flat=None``, the default): chosen for elementwise optimizers, the same
parameters and per-parameter optimizer state as stepping each tensor (``flat=False``)."""

from __future__ import annotations

import copy
import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from tensorx._ps.state.shard import ShardState, load_checkpoint, views
from tensorx._ps.update import parts
from tests.support.flat_update import ELEMENTWISE, layout, same, train, two_groups


@pytest.mark.parametrize("name", list(ELEMENTWISE))
def test_the_flat_update_equals_per_tensor(name: str) -> None:
    cls, kw = ELEMENTWISE[name]
    make = two_groups(cls, **kw)
    auto, ref = (ShardState(layout(), 2, make, flat=f) for f in (None, False))
    assert auto.fast is not None and ref.fast is None
    assert auto.num_parts == 1 < len(auto.fast.ranges) or auto.num_parts > 1  # 2 groups
    assert {r.group for r in auto.fast.ranges} == {0, 1}
    train(auto, range(6))
    train(ref, range(6))
    same(auto, ref, exact=cls is torch.optim.SGD)


@pytest.mark.parametrize("name", ["sgd-nesterov-wd", "adamw"])
def test_applied_range_by_range_it_is_the_same_update(
        name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(parts, "PART_BYTES", 4096)
    cls, kw = ELEMENTWISE[name]
    auto, ref = (ShardState(layout(), 2, two_groups(cls, **kw), flat=f) for f in (None, False))
    assert auto.fast is not None and auto.num_parts > 4
    assert all(auto.part_bytes(k) == (r.start, r.nbytes) for k, r in enumerate(auto.fast.ranges))
    assert all(r.nbytes <= 4096 for r in auto.fast.ranges)  # larger tensors are cut
    assert any(n < auto.params[i].numel() for r in auto.fast.ranges for i, _, _, n in r.members)
    train(auto, range(5), by_parts=True)
    train(ref, range(5))
    same(auto, ref, exact=False)


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
    state = ShardState(layout(), 2, lambda p: NormScaled(p, lr=0.1))
    assert state.fast is None and state.num_parts == 1
    assert state.update == "per-tensor (NormScaled is not known to be elementwise)"
    before = [v.clone() for v in state.views]
    train(state, range(1), workers=1)
    grads = views(state.layout, state.slot_regions[0])
    for old, new, g in zip(before, state.views, grads, strict=True):
        torch.testing.assert_close(new, old - 0.1 * g / (g.norm() + 1e-6))


def test_a_subclass_of_an_elementwise_optimizer_steps_per_tensor() -> None:
    class MySGD(torch.optim.SGD):
        pass

    assert ShardState(layout(), 1, lambda p: MySGD(p, lr=0.1)).fast is None


def test_one_log_line_says_which_update_and_why(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="tensorx._ps.state.shard"):
        ShardState(layout(), 1, two_groups(torch.optim.SGD, lr=0.1))
        ShardState(layout(), 1, lambda p: NormScaled(p, lr=0.1))
        ShardState(layout(), 1, lambda p: torch.optim.SGD(p, lr=0.1), flat=False)
    lines = [r.getMessage() for r in caplog.records if "update:" in r.getMessage()]
    assert len(lines) == 3
    assert lines[0].startswith("ps shard 0 update: flat over ")
    assert "(SGD, elementwise, 2 group(s), fused)" in lines[0]
    assert lines[1] == "ps shard 0 update: per-tensor (NormScaled is not known to be elementwise)"
    assert lines[2] == "ps shard 0 update: per-tensor (flat=False)"


def test_flat_overrides_still_work() -> None:
    def sgd(p: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.SGD(p, lr=0.1, momentum=0.9)

    old_flat = ShardState(layout(), 2, sgd, flat=True)
    assert old_flat.flat and old_flat.fast is None and old_flat.names == ["flat.0"]
    per_tensor, auto = ShardState(layout(), 2, sgd, flat=False), ShardState(layout(), 2, sgd)
    assert not per_tensor.flat and per_tensor.fast is None and auto.fast is not None
    for s in (old_flat, per_tensor, auto):
        train(s, range(4))
    same(auto, per_tensor, exact=True)
    for x, y in zip(old_flat.views, per_tensor.views, strict=True):
        torch.testing.assert_close(x, y)


def test_schedules_and_changed_hyperparameters_apply_to_their_ranges() -> None:
    make = two_groups(torch.optim.Adam, lr=1e-2)

    def sched(opt: torch.optim.Optimizer) -> Any:
        return torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)

    auto, ref = (ShardState(layout(), 2, make, sched, flat=f) for f in (None, False))
    for s in (auto, ref):
        train(s, range(3))
        assert s.optimizer is not None
        s.optimizer.param_groups[1]["lr"] = 0.5  # as RemoteOptimizer sets it
        s.optimizer.param_groups[0]["betas"] = (0.8, 0.99)
        train(s, range(3, 6))
    same(auto, ref, exact=False)


@pytest.mark.parametrize("name", ["adam-amsgrad", "sgd-nesterov-wd", "adagrad", "nadam"])
@pytest.mark.parametrize(("first", "second"), [(None, None), (None, False), (False, None)])
def test_checkpoints_round_trip(name: str, first: bool | None, second: bool | None,
                                tmp_path: Path) -> None:
    """A checkpoint is per parameter whichever update wrote it; resumed by either, training
    goes on as if uninterrupted."""
    cls, kw = ELEMENTWISE[name]
    make = two_groups(cls, **kw)
    ref = ShardState(layout(), 2, make, flat=False)
    train(ref, range(6))
    a = ShardState(layout(), 2, make, flat=first)
    train(a, range(3))
    a.save(tmp_path / "ck.pt", b"plan")
    saved = load_checkpoint(tmp_path / "ck.pt")
    assert saved is not None and saved["param_names"] == ref.names
    b = ShardState(layout(), 2, make, flat=second)
    b.load_state_dict(saved)
    assert (b.fast is not None) == (second is None)
    train(b, range(3, 6))
    same(b, ref, exact=False)


def test_a_loaded_state_the_flat_update_cannot_hold_turns_it_off(
        caplog: pytest.LogCaptureFixture) -> None:
    make = two_groups(torch.optim.Adam, lr=1e-2)
    ref = ShardState(layout(), 1, make, flat=False)
    train(ref, range(2), workers=1)
    assert ref.optimizer is not None
    saved = ref.optimizer.state_dict()
    for i in list(saved["state"])[::2]:  # some parameters stepped more often
        saved["state"][i]["step"] = torch.tensor(7.0)
    auto = ShardState(layout(), 1, make)
    train(auto, range(2), workers=1)
    assert auto.optimizer is not None
    with caplog.at_level(logging.WARNING, logger="tensorx._ps.update.flat"):
        auto.optimizer.load_state_dict(copy.deepcopy(saved))
    assert auto.fast is None and "per-tensor from now on" in caplog.text
    ref.optimizer.load_state_dict(saved)
    train(auto, range(2, 4), workers=1)
    train(ref, range(2, 4), workers=1)
    same(auto, ref, exact=False)  # the first two steps: fused kernel, not bitwise


def test_without_sparse_tables_the_flat_update_is_all_that_runs() -> None:
    """The flat update steps the arena's ranges itself; with no sparse table to step
    beside it, the optimizer's own per-tensor step (a pass over every parameter, most of a
    round for 2000 small tensors) must not run at all."""
    state = ShardState(layout(), 1, lambda p: torch.optim.SGD(p, lr=0.1))
    assert state.fast is not None and not state.rows
    calls: list[int] = []
    assert state.optimizer is not None
    state.optimizer.step = lambda *_, **__: calls.append(1)  # type: ignore[method-assign]
    train(state, range(2), workers=1)
    train(state, range(2, 4), workers=1, by_parts=True)
    assert calls == []


@pytest.mark.parametrize("name", ["adam-amsgrad", "sgd-nesterov-wd", "rmsprop-centered"])
def test_tensors_cut_between_ranges_keep_their_state_through_a_checkpoint(
        name: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A tensor larger than a range is cut into several (parts of a pipelined round): its
    optimizer state, seen per parameter by state_dict() and checkpoints, is put together
    from the pieces and split again on load."""
    monkeypatch.setattr(parts, "PART_BYTES", 1024)
    cls, kw = ELEMENTWISE[name]
    make = two_groups(cls, **kw)
    ref = ShardState(layout(), 2, make, flat=False)
    train(ref, range(6))
    a = ShardState(layout(), 2, make)
    assert a.fast is not None
    assert any(n < a.params[i].numel() for r in a.fast.ranges for i, _, _, n in r.members)
    train(a, range(3), by_parts=True)
    a.save(tmp_path / "ck.pt", b"plan")
    for flat in (None, False):  # resumed with the cut ranges, or per tensor
        b = ShardState(layout(), 2, make, flat=flat)
        saved = load_checkpoint(tmp_path / "ck.pt")
        assert saved is not None
        b.load_state_dict(saved)
        train(b, range(3, 6), by_parts=flat is None)
        same(b, ref, exact=False)
