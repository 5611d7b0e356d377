"""Checkpoints: durable when the disk fills, private, kept in generations, not planted."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tensorx._ps.shard import load_checkpoint
from tensorx.errors import UsageError
from tensorx.ps import ParameterServer
from tensorx.worker import Worker

from .conftest import NOBODY, as_root
from .test_ps_train import backward, batches, make_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")


async def train(directory: Path, steps: int, **kw: object) -> ParameterServer:
    """``steps`` sync steps of one worker against a server checkpointing in ``directory``."""
    model = make_model()
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
    model = make_model()
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
