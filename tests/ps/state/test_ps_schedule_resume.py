"""An LR schedule across a checkpoint: resumed where it had got to, as torch's
``scheduler.load_state_dict``; another schedule refused, a missing one named."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tensorx._ps.state.shard import ShardLayout, ShardState, Slot, load_checkpoint
from tensorx.errors import UsageError
from tensorx.ps import ParameterServer
from tensorx.worker import Worker
from tests.support.data import backward, batches
from tests.support.logs import only_warning
from tests.support.models import small_mlp

pytestmark = pytest.mark.usefixtures("one_torch_thread")

Schedule = Callable[[torch.optim.Optimizer], torch.optim.lr_scheduler.LRScheduler]


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.5, momentum=0.5)


def step_lr(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)


def warmup(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min(1.0, (i + 1) / 4))


def layout() -> ShardLayout:
    slots = (Slot("w", 0, 6, torch.float32), Slot("b", 64, 3, torch.float32))
    return ShardLayout(0, 1, 128, slots, "fp-test")


def train(state: ShardState, steps: range) -> list[float]:
    """One update per step (the gradient ``step + 1`` everywhere); the lr after each."""
    lrs = []
    for step in steps:
        for view in state.slot_views(0):
            view.fill_(step + 1.0)
        state.apply([0])
        assert state.optimizer is not None
        lrs.append(state.optimizer.param_groups[0]["lr"])
    return lrs


def reference(schedule: Schedule, steps: int) -> tuple[list[float], torch.Tensor]:
    """The lr after each step of one uninterrupted torch run, and its final ``w``."""
    w, b = torch.nn.Parameter(torch.zeros(6)), torch.nn.Parameter(torch.zeros(3))
    opt = sgd([w, b])
    sched = schedule(opt)
    lrs = []
    for step in range(steps):
        w.grad, b.grad = torch.full((6,), step + 1.0), torch.full((3,), step + 1.0)
        opt.step()
        sched.step()
        lrs.append(opt.param_groups[0]["lr"])
    return lrs, w.detach()


def checkpoint(schedule: Schedule | None, steps: int) -> dict[str, Any]:
    state = ShardState(layout(), 1, sgd, lr_scheduler=schedule)
    try:
        train(state, range(steps))
        return state.state_dict(b"plan")
    finally:
        state.close()


def shard(schedule: Schedule | None) -> ShardState:
    return ShardState(layout(), 1, sgd, lr_scheduler=schedule)


@pytest.mark.parametrize("schedule", [step_lr, warmup], ids=["StepLR", "LambdaLR"])
def test_a_resumed_schedule_continues_as_an_uninterrupted_run(schedule: Schedule) -> None:
    want, w = reference(schedule, 6)
    saved = checkpoint(schedule, 3)
    state = shard(schedule)
    try:
        state.load_state_dict(saved)
        assert state.lr_scheduler is not None and state.lr_scheduler.last_epoch == 3
        assert train(state, range(3, 6)) == pytest.approx(want[3:])
        assert torch.allclose(state.params[0], w)
    finally:
        state.close()


def test_another_schedule_is_refused_before_anything_is_replaced() -> None:
    saved = checkpoint(step_lr, 3)
    state = shard(warmup)
    try:
        with pytest.raises(UsageError) as refused:
            state.load_state_dict(saved)
        message = str(refused.value)
        assert "\n" not in message and "StepLR" in message and "LambdaLR" in message, message
        assert "resume_optimizer=False" in message, message
        assert state.version == 0 and not state.optimizer.state  # type: ignore[union-attr]
        assert state.lr_scheduler is not None and state.lr_scheduler.last_epoch == 0
    finally:
        state.close()


def test_another_schedule_is_refused_in_a_checkpoint_that_did_not_name_it() -> None:
    """Checkpoints written before tensorx recorded the schedule's class: judged by the
    settings its state holds."""
    saved = checkpoint(step_lr, 3)
    del saved["lr_scheduler_class"]
    state = shard(warmup)
    try:
        with pytest.raises(UsageError, match="LambdaLR"):
            state.load_state_dict(saved)
    finally:
        state.close()
    state = shard(step_lr)  # the same class still resumes
    try:
        state.load_state_dict(saved)
        assert state.lr_scheduler is not None and state.lr_scheduler.last_epoch == 3
    finally:
        state.close()


def test_a_schedule_left_out_on_resume_is_named(caplog: pytest.LogCaptureFixture) -> None:
    """As in torch (an optimizer state loaded, no scheduler built): the lr stays where the
    checkpoint's schedule left it, and one WARNING says so and how to continue it."""
    caplog.set_level(logging.INFO, logger="tensorx")
    want, _ = reference(step_lr, 3)
    saved = checkpoint(step_lr, 3)
    state = shard(None)
    try:
        state.load_state_dict(saved)
        assert train(state, range(3, 5)) == [want[2], want[2]]
    finally:
        state.close()
    line = only_warning(caplog)
    assert "StepLR" in line and "lr_scheduler" in line and "--lr-scheduler" in line, line


def test_a_schedule_added_on_resume_starts_there_and_is_named(
        caplog: pytest.LogCaptureFixture) -> None:
    """A checkpoint written without a schedule: the new one starts at the resume (as a
    scheduler built after torch's ``optimizer.load_state_dict``), and one WARNING says so."""
    caplog.set_level(logging.INFO, logger="tensorx")
    saved = checkpoint(None, 3)
    state = shard(step_lr)
    try:
        state.load_state_dict(saved)
        assert state.lr_scheduler is not None and state.lr_scheduler.last_epoch == 0
        assert train(state, range(3, 5)) == pytest.approx([0.5, 0.25])
    finally:
        state.close()
    line = only_warning(caplog)
    assert "without an LR scheduler" in line and "StepLR" in line, line


def test_a_changed_schedule_setting_is_named_and_the_checkpoints_wins(
        caplog: pytest.LogCaptureFixture) -> None:
    """As torch's ``scheduler.load_state_dict``: the checkpoint's settings are used; one
    WARNING names the one the factory now gives differently."""
    caplog.set_level(logging.INFO, logger="tensorx")
    saved = checkpoint(step_lr, 3)
    state = shard(lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5))
    try:
        state.load_state_dict(saved)
        assert state.lr_scheduler is not None
        assert state.lr_scheduler.step_size == 2  # type: ignore[attr-defined]
    finally:
        state.close()
    line = only_warning(caplog)
    assert "step_size" in line and "2" in line and "5" in line, line


def test_resume_optimizer_false_starts_a_fresh_schedule(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="tensorx")
    saved = checkpoint(step_lr, 3)
    for schedule in (step_lr, warmup, None):
        state = shard(schedule)
        try:
            state.load_state_dict(saved, optimizer=False)
            assert state.version == 3
            assert state.lr_scheduler is None or state.lr_scheduler.last_epoch == 0
        finally:
            state.close()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


async def test_a_restarted_server_continues_the_schedule(tmp_path: Path) -> None:
    """Through the server and its checkpoint directory: the lr after the resume is an
    uninterrupted run's at that step."""
    def run() -> ParameterServer:
        return ParameterServer(num_workers=1, transport="tcp", checkpoint_dir=tmp_path,
                               optimizer=sgd, lr_scheduler=warmup)

    async def steps(ps: ParameterServer, n: int) -> None:
        model = small_mlp()
        async with Worker(model, ps.address, transport="tcp", timeout=10.0) as w:
            for (x, y), in batches(n, 1):
                w.zero_grad()
                backward(model, x, y)
                await w.step()

    want, _ = reference(warmup, 5)
    async with run() as ps:
        await steps(ps, 3)
    saved = load_checkpoint(tmp_path / "ps-shard0-of1.pt")
    assert saved is not None and saved["lr_scheduler_class"] == "LambdaLR"
    async with run() as ps:
        assert ps.state is not None and ps.state.optimizer is not None
        assert ps.state.optimizer.param_groups[0]["lr"] == pytest.approx(want[2])
        await steps(ps, 2)
        assert ps.state.optimizer.param_groups[0]["lr"] == pytest.approx(want[4])
