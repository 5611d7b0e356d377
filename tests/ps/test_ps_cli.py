"""``tensorx ps`` as a service: addresses on stdout, SIGTERM checkpoints, restart resumes."""

from __future__ import annotations

import argparse
import signal
from pathlib import Path

import pytest
import torch
from torch import nn

from tensorx._commands.ps import _arguments, parse_lr_scheduler, parse_optimizer, shard_listen
from tensorx.errors import UsageError
from tensorx.worker import Worker
from tests.support.clusters import PsProcess
from tests.support.data import backward, batches
from tests.support.models import small_mlp
from tests.support.training import reference


async def _train(address: str, model: nn.Module, rounds: list[list[tuple[torch.Tensor, ...]]]
                 ) -> None:
    async with Worker(model, address, transport="tcp") as w:
        for step in rounds:
            w.zero_grad()
            backward(model, *step[0])
            await w.step()


async def test_sigterm_checkpoints_and_a_restart_resumes(tmp_path: Path) -> None:
    args = ["--listen", "tcp://127.0.0.1:0", "--workers", "1", "--transport", "tcp",
            "--optimizer", "adam:lr=0.01", "--checkpoint-dir", str(tmp_path)]
    data = batches(6, 1)
    model = small_mlp()
    for rounds in (data[:3], data[3:]):
        ps = PsProcess(*args)
        try:
            (address,) = ps.addresses(1)
            await _train(address, model, rounds)
        finally:
            log = ps.stop()
        assert ps.proc.returncode == 0, log
        assert "checkpointed shard 0 at version" in log
        model = small_mlp(seed=7)  # the restarted server, not this init, decides
    assert "resumed from" in log
    want = reference(data)
    assert (tmp_path / "ps-shard0-of1.pt").exists()
    saved = torch.load(tmp_path / "ps-shard0-of1.pt", weights_only=True)
    assert saved["version"] == 6
    for name, p in want.named_parameters():
        torch.testing.assert_close(saved["params"][name], p.detach().reshape(-1),
                                   rtol=1e-5, atol=1e-6)


def test_two_shards_in_one_process_stop_cleanly() -> None:
    ps = PsProcess("--listen", "tcp://127.0.0.1:0", "--workers", "2", "--shards", "2",
                   "--transport", "tcp")
    try:
        addresses = ps.addresses(2)
        assert len(set(addresses)) == 2
    finally:
        log = ps.stop(signal.SIGINT)
    assert ps.proc.returncode == 0, log


def test_optimizer_spec() -> None:
    make = parse_optimizer("sgd:lr=0.05,momentum=0.9,nesterov=True")
    opt = make([nn.Parameter(torch.zeros(2))])
    assert isinstance(opt, torch.optim.SGD)
    assert opt.defaults["momentum"] == 0.9
    assert isinstance(parse_optimizer("AdamW:lr=1e-3,betas=(0.9,0.99)")(
        [nn.Parameter(torch.zeros(1))]), torch.optim.AdamW)
    for bad in ("nope:lr=1", "sgd:lr=__import__('os')", "sgd:0.1", "sgd:lr=-1"):
        with pytest.raises((UsageError, ValueError)):
            parse_optimizer(bad)


def test_shard_ports_follow_the_first() -> None:
    assert shard_listen("tcp://0.0.0.0:7000", 2) == "tcp://0.0.0.0:7002"
    assert shard_listen("tcp://127.0.0.1:0", 1) == "tcp://127.0.0.1:0"


def test_lr_scheduler_spec() -> None:
    assert parse_lr_scheduler(None) is None
    make = parse_lr_scheduler("StepLR:step_size=3,gamma=0.5")
    assert make is not None
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
    assert isinstance(make(opt), torch.optim.lr_scheduler.StepLR)
    with pytest.raises(UsageError, match="unknown lr scheduler"):
        parse_lr_scheduler("warp:speed=9")


def test_worker_loss_flags() -> None:
    parser = argparse.ArgumentParser()
    _arguments(parser)
    args = parser.parse_args(["--workers", "2"])
    assert (args.on_worker_loss, args.worker_loss_timeout) == ("wait", 30.0)
    args = parser.parse_args(["--workers", "2", "--on-worker-loss", "continue",
                              "--worker-loss-timeout", "1.5"])
    assert (args.on_worker_loss, args.worker_loss_timeout) == ("continue", 1.5)
    args = parser.parse_args(["--workers", "2", "--worker-loss-timeout", "none"])
    assert args.worker_loss_timeout is None
    for bad in (["--on-worker-loss", "panic"], ["--worker-loss-timeout", "-1"],
                ["--worker-loss-timeout", "soon"]):
        with pytest.raises(SystemExit):
            parser.parse_args(["--workers", "2", *bad])


def test_send_timeout_and_nonfinite_flags() -> None:
    parser = argparse.ArgumentParser()
    _arguments(parser)
    args = parser.parse_args(["--workers", "2"])
    assert (args.send_timeout, args.on_nonfinite) == (10.0, "skip")
    args = parser.parse_args(["--workers", "2", "--send-timeout", "2.5",
                              "--on-nonfinite", "refuse"])
    assert (args.send_timeout, args.on_nonfinite) == (2.5, "refuse")
    assert parser.parse_args(["--workers", "2", "--send-timeout", "none"]).send_timeout is None
    for bad in (["--send-timeout", "-1"], ["--on-nonfinite", "ignore"]):
        with pytest.raises(SystemExit):
            parser.parse_args(["--workers", "2", *bad])
