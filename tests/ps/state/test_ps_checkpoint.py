"""Checkpoints: durable when the disk fills, private, kept in generations, not planted."""

from __future__ import annotations

import contextlib
import errno
import logging
import math
import os
import stat
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from tensorx._ps.state.shard import ShardLayout, ShardState, load_checkpoint
from tensorx.errors import UsageError
from tensorx.graph_analyzer import TransferPlan
from tensorx.ps import ParameterServer
from tensorx.worker import Worker
from tests.support.data import backward, batches
from tests.support.host import NOBODY, as_root
from tests.support.logs import only_warning
from tests.support.models import small_mlp

pytestmark = pytest.mark.usefixtures("one_torch_thread")


async def train(directory: Path, steps: int, **kw: object) -> ParameterServer:
    """``steps`` sync steps of one worker against a server checkpointing in ``directory``."""
    model = small_mlp()
    async with ParameterServer(num_workers=1, transport="tcp", checkpoint_dir=directory,
                               **kw) as ps:  # type: ignore[arg-type]
        async with Worker(model, ps.address, transport="tcp", timeout=10.0) as w:
            for (x, y), in batches(steps, 1):
                w.zero_grad()
                backward(model, x, y)
                await w.step()
    return ps


async def resume(directory: Path) -> int:
    async with ParameterServer(num_workers=1, transport="tcp",
                               checkpoint_dir=directory) as ps:
        return ps.version


def sgd(lr: float) -> Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]:
    return lambda params: torch.optim.SGD(params, lr=lr, momentum=0.9)


def adam(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=0.01)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


async def test_checkpoints_are_private_whatever_the_umask(tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        directory = tmp_path / "runs" / "ckpt"
        await train(directory, 1)
    finally:
        os.umask(old)
    assert mode(directory) == 0o700
    assert [p.name for p in directory.iterdir()] == ["ps-shard0-of1.pt"]
    assert mode(directory / "ps-shard0-of1.pt") == 0o600


@as_root
@pytest.mark.parametrize("how", ["owned by uid 65534", "writable by other users"])
async def test_a_directory_others_control_is_refused(tmp_path: Path, how: str) -> None:
    directory = tmp_path / "shared"
    directory.mkdir()
    if how.startswith("owned"):
        os.chown(directory, NOBODY, NOBODY)
    else:
        directory.chmod(0o777)
    with pytest.raises(UsageError, match=f"checkpoint directory .* is {how}"):
        await train(directory, 1)
    assert list(directory.iterdir()) == []


async def test_a_planted_link_is_not_followed(tmp_path: Path) -> None:
    """A link at the old temporary name (or at the checkpoint itself) never redirects the
    write into the file it points at."""
    directory = tmp_path / "ckpt"
    directory.mkdir(mode=0o700)
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    (directory / "ps-shard0-of1.pt.tmp").symlink_to(victim)
    await train(directory, 1)
    assert victim.read_bytes() == b"precious"
    assert (directory / "ps-shard0-of1.pt").is_file()

    (directory / "ps-shard0-of1.pt").unlink()
    (directory / "ps-shard0-of1.pt").symlink_to(victim)
    with pytest.raises(UsageError, match="not a regular file"):
        await train(directory, 1)
    assert victim.read_bytes() == b"precious"


@as_root
async def test_a_checkpoint_swapped_in_by_another_user_is_refused(tmp_path: Path) -> None:
    directory = tmp_path / "ckpt"
    await train(directory, 1)
    path = directory / "ps-shard0-of1.pt"
    saved = torch.load(path, weights_only=True)
    saved["params"] = {k: v * 1000 for k, v in saved["params"].items()}
    torch.save(saved, path)
    os.chown(path, NOBODY, NOBODY)
    with pytest.raises(UsageError, match="owned by uid 65534"):
        await resume(directory)
    os.chown(path, 0, 0)
    path.chmod(0o666)
    with pytest.raises(UsageError, match="writable by other users"):
        await resume(directory)


async def test_a_damaged_checkpoint_falls_back_to_the_one_before(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="tensorx")
    directory = tmp_path / "ckpt"
    await train(directory, 3, checkpoint_every=1)
    newest, older = directory / "ps-shard0-of1.pt", directory / "ps-shard0-of1.pt.1"
    assert sorted(p.name for p in directory.iterdir()) == [newest.name, older.name]
    assert mode(older) == 0o600
    newest.write_bytes(b"")  # empty, as after a crash on a file system without ordering
    assert await resume(directory) == 2  # the closing checkpoint (3) is gone, 2 remains
    (warning,) = [r for r in caplog.records if "is damaged" in r.getMessage()]
    assert warning.levelno == logging.WARNING and newest.name in warning.getMessage()
    assert "unreadable" in warning.getMessage() and "\n" not in warning.getMessage()

    for path in (newest, older):
        path.write_bytes(path.read_bytes()[:100] if path.stat().st_size else b"junk")
    with pytest.raises(UsageError, match="no usable checkpoint"):
        await resume(directory)


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 512 KiB tmpfs (root only; skipped where mounting is not permitted)."""
    where = tmp_path / "disk"
    where.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512k,mode=0700", "tmpfs",
                           str(where)], capture_output=True, check=False)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    yield where
    subprocess.run(["umount", "-l", str(where)], check=False)


def _fill(directory: Path) -> Path:
    filler = directory / "filler"
    with filler.open("wb", buffering=0) as file, contextlib.suppress(OSError):
        while True:
            file.write(b"\0" * 4096)
    return filler


async def test_a_full_disk_fails_the_checkpoint_not_the_training(
        small_disk: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="tensorx")
    disk = small_disk
    model = small_mlp()
    async with ParameterServer(num_workers=1, transport="tcp", checkpoint_dir=disk,
                               checkpoint_every=1) as ps:
        async with Worker(model, ps.address, transport="tcp", timeout=10.0) as w:
            data = batches(4, 1)
            for i, ((x, y),) in enumerate(data):
                if i == 2:
                    filler = _fill(disk)
                w.zero_grad()
                backward(model, x, y)
                await w.step()  # never held up by the failing checkpoint
            assert ps.version == 4 and ps.stats["checkpoint_failures"] == 2
            errors = [r for r in caplog.records if r.levelno == logging.ERROR]
            assert len(errors) == 2 and "failed, the previous one stays" in \
                errors[0].getMessage()
            assert os.strerror(errno.ENOSPC) in errors[0].getMessage()
            assert not [p for p in disk.iterdir() if p.name.endswith(".tmp")]
            saved = load_checkpoint(disk / "ps-shard0-of1.pt")
            assert saved is not None and saved["version"] == 2
            filler.unlink()
            w.zero_grad()
            backward(model, *data[0][0])
            await w.step()  # and once there is room again, checkpoints resume
    saved = load_checkpoint(disk / "ps-shard0-of1.pt")
    assert saved is not None and saved["version"] == 5


# -- resuming with another optimizer configuration ------------------------------------------
async def test_the_checkpoints_hyperparameters_win_and_a_new_value_is_named(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """As torch's ``optimizer.load_state_dict``: the checkpoint's lr is used, and the lr
    the factory (the command line) gives instead is named in one WARNING with the way to
    set it."""
    caplog.set_level(logging.INFO, logger="tensorx")
    directory = tmp_path / "ckpt"
    await train(directory, 2, optimizer=sgd(0.1))
    caplog.clear()
    async with ParameterServer(num_workers=1, transport="tcp", checkpoint_dir=directory,
                               optimizer=sgd(0.1)) as ps:
        assert ps.state is not None and ps.state.optimizer is not None
        assert ps.state.optimizer.param_groups[0]["lr"] == 0.1
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    async with ParameterServer(num_workers=1, transport="tcp", checkpoint_dir=directory,
                               optimizer=sgd(0.5)) as ps:
        assert ps.state is not None and ps.state.optimizer is not None
        assert ps.state.optimizer.param_groups[0]["lr"] == 0.1
    line = only_warning(caplog)
    assert "param_groups[0]['lr'] = 0.1" in line and "0.5" in line, line
    assert "resume_optimizer=False" in line and "RemoteOptimizer" in line, line


async def test_another_optimizer_class_is_refused_in_one_line(tmp_path: Path) -> None:
    directory = tmp_path / "ckpt"
    await train(directory, 1, optimizer=sgd(0.1))
    with pytest.raises(UsageError) as refused:
        async with ParameterServer(num_workers=1, transport="tcp", checkpoint_dir=directory,
                                   optimizer=adam):
            pass
    message = str(refused.value)
    assert "\n" not in message
    assert "SGD" in message and "Adam" in message and "resume_optimizer=False" in message


async def test_a_run_that_changed_its_own_lr_resumes_it_silently(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """An LR schedule moved the lr: the same command line resumes where it had got to,
    with no line about it."""
    def halving(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
        return torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)

    directory = tmp_path / "ckpt"
    await train(directory, 3, optimizer=sgd(0.1), lr_scheduler=halving)
    caplog.set_level(logging.INFO, logger="tensorx")
    async with ParameterServer(num_workers=1, transport="tcp", checkpoint_dir=directory,
                               optimizer=sgd(0.1), lr_scheduler=halving) as ps:
        assert ps.state is not None and ps.state.optimizer is not None
        assert ps.state.optimizer.param_groups[0]["lr"] == pytest.approx(0.1 / 8)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


async def test_resume_optimizer_false_resumes_the_parameters_alone(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="tensorx")
    directory = tmp_path / "ckpt"
    await train(directory, 2, optimizer=sgd(0.1))
    saved = load_checkpoint(directory / "ps-shard0-of1.pt")
    assert saved is not None
    async with ParameterServer(num_workers=1, transport="tcp", checkpoint_dir=directory,
                               optimizer=adam, resume_optimizer=False) as ps:
        assert ps.state is not None and ps.state.optimizer is not None
        assert ps.version == 2 and not ps.state.optimizer.state
        assert ps.state.optimizer.param_groups[0]["lr"] == 0.01
        for slot, view in zip(ps.state.layout.slots, ps.state.views, strict=True):
            assert torch.equal(view, saved["params"][slot.key])
    assert "the parameters alone" in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


async def test_a_refused_optimizer_state_replaces_nothing(tmp_path: Path) -> None:
    """Refusals come before anything is replaced: an lr the optimizer refuses, and the
    momentum buffers of a checkpoint written before tensorx recorded the optimizer's class
    (judged by its state alone)."""
    directory = tmp_path / "ckpt"
    await train(directory, 1, optimizer=sgd(0.1))
    saved = load_checkpoint(directory / "ps-shard0-of1.pt")
    assert saved is not None
    layout = ShardLayout.from_plan(TransferPlan.from_bytes(saved["plan"]), 0)
    nan_lr = {**saved, "optimizer": {**saved["optimizer"], "param_groups": [
        {**saved["optimizer"]["param_groups"][0], "lr": math.nan}]}}
    unrecorded = {k: v for k, v in saved.items() if k != "optimizer_class"}
    for make, state, refused in ((sgd(0.1), nan_lr, r"\['lr'\] = nan refused"),
                                 (adam, unrecorded, r"\['exp_avg'\] refused: missing")):
        shard = ShardState(layout, 1, make)
        try:
            with pytest.raises(UsageError, match=refused):
                shard.load_state_dict(state)
            assert shard.version == 0 and not shard.optimizer.state  # type: ignore[union-attr]
            assert not any(bool(v.any()) for v in shard.views)
        finally:
            shard.close()
