"""``ParameterServer(device=...)`` and ``tensorx ps --device`` without a GPU: the default,
validation, the same-host mapping a GPU shard cannot offer, checkpoints as CPU tensors.
(The GPU side itself: tests/ps/test_gpu_ps.py.)"""

from __future__ import annotations

import argparse
import logging
from typing import Any

import pytest
import torch

from tensorx._commands import ps as ps_command
from tensorx._ps.common.device import fence, resolve
from tensorx._ps.service.samehost import Sharing
from tensorx._ps.state.shard import to_cpu
from tensorx.errors import UsageError
from tensorx.ps import ParameterServer
from tests.support.clusters import train_sync
from tests.support.training import SGD_MOMENTUM

pytestmark = pytest.mark.usefixtures("one_torch_thread")
NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")


def test_cpu_is_the_default_and_stays_cpu() -> None:
    assert ParameterServer(num_workers=1).device == "cpu"
    assert ParameterServer(num_workers=1, device="cpu").device == "cpu"
    assert ParameterServer(num_workers=1, device=torch.device("cpu")).device == "cpu"  # type: ignore[arg-type]


async def test_explicit_cpu_trains_exactly_as_the_default() -> None:
    default = await train_sync(SGD_MOMENTUM, 6, 1, "tcp")
    explicit = await train_sync(SGD_MOMENTUM, 6, 1, "tcp", device="cpu")
    for a, b in zip(default, explicit, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("bad", ["gpu", "cuda:", "cuda:-1", "cuda:x", "cpu:0", "CUDA", "",
                                 " cuda", 0, None])
def test_a_bad_device_is_a_usage_error(bad: Any) -> None:
    with pytest.raises(UsageError, match="device must be 'cpu', 'cuda' or 'cuda:N'"):
        ParameterServer(num_workers=1, device=bad)


@NO_CUDA
@pytest.mark.parametrize("device", ["cuda", "cuda:0", "cuda:3"])
def test_cuda_without_cuda_says_so(device: str) -> None:
    with pytest.raises(UsageError, match="CUDA is not available here"):
        ParameterServer(num_workers=1, device=device)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_is_resolved_and_an_index_out_of_range_refused() -> None:
    assert resolve("cuda") == f"cuda:{torch.cuda.current_device()}"
    count = torch.cuda.device_count()
    with pytest.raises(UsageError, match=f"{count} CUDA device"):
        resolve(f"cuda:{count}")


def test_a_gpu_shard_offers_no_mapping_and_says_why_once(
        caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="tensorx._ps.service.samehost"):
        sharing = Sharing(0, "sync", True, "cuda:0")
        assert not sharing.wanted
        assert not sharing.offer(None, 0, asked=True)
        assert not sharing.offer(None, 1, asked=True)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "only host memory can be mapped" in lines[0], lines
    assert Sharing(0, "sync", True, "cpu").wanted
    assert not Sharing(0, "async", True, "cpu").wanted
    assert not Sharing(0, "sync", False, "cpu").wanted


def test_fence_on_the_cpu_is_a_no_op() -> None:
    fence("cpu")


def test_checkpoint_state_is_copied_to_host() -> None:
    t = torch.ones(3)
    state = {"state": {0: {"step": torch.tensor(2.0), "exp_avg": t}},
             "param_groups": [{"lr": 0.1, "betas": (0.9, 0.99), "params": [0]}]}
    saved = to_cpu(state)
    assert saved["param_groups"] == state["param_groups"]
    assert saved["state"][0]["exp_avg"] is t  # host tensors are not copied again


# -- the command line -----------------------------------------------------------------
def test_device_flag_parses() -> None:
    parser = argparse.ArgumentParser()
    ps_command._arguments(parser)
    assert parser.parse_args(["--workers", "1"]).device == "cpu"
    assert parser.parse_args(["--workers", "1", "--device", "cuda:1"]).device == "cuda:1"


def test_device_flag_reaches_the_server(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[Any] = []

    class Recorder:
        def __init__(self, *args: Any, **kw: Any) -> None:
            seen.append(kw["device"])
            raise UsageError("recorded")

    monkeypatch.setattr("tensorx.ps.ParameterServer", Recorder)
    code = ps_command.main(["--workers", "1", "--listen", "tcp://127.0.0.1:0",
                            "--device", "cpu"])
    assert (code, seen) == (2, ["cpu"])
