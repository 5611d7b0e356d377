"""Every bad argument or file given to ``tensorx ps``: one line naming it and why, exit 2."""

from __future__ import annotations

import logging
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tensorx._commands.ps import main
from tensorx._ps.state.shard import ShardLayout, ShardState, checkpoint_path
from tensorx.graph_analyzer import GraphAnalyzer

BASE = ["--workers", "1", "--listen", "tcp://127.0.0.1:0", "--transport", "tcp"]


@pytest.mark.parametrize(("args", "named"), [
    (["--listen", "tcp://127.0.0.1:99999"], "99999"),
    (["--listen", "abc"], "'abc'"),
    (["--listen", "tcp://127.0.0.1:abc"], "'tcp://127.0.0.1:abc'"),
    (["--optimizer", "sgd:lr=-1"], "'sgd:lr=-1'"),
    (["--optimizer", "sgd:foo=1"], "'foo'"),
    (["--optimizer", "nope"], "unknown optimizer 'nope'"),
    (["--lr-scheduler", "steplr:foo=1"], "'steplr:foo=1'"),
    (["--shards", "0"], "--shards"),
    (["--shard", "1"], "--shard 1 outside 0..0"),
    (["--log-every", "-1"], "--log-every"),
    (["--checkpoint-every", "0"], "--checkpoint-every"),
    (["--checkpoint-keep", "0"], "--checkpoint-keep"),
    (["--metrics-port", "70000"], "--metrics-port"),
    (["--workers", "0"], "--workers"),
    (["--log-level", "LOUD"], "--log-level"),
    (["--device", "tpu"], "--device: device must be 'cpu', 'cuda' or 'cuda:N', got 'tpu'"),
    (["--loop", "trio"], "--loop"),
], ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_a_bad_argument_is_one_line(args: list[str], named: str,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        sys.exit(main([*BASE, *args]))
    assert exited.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tensorx ps: error: "), lines
    assert named in lines[0]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tensorx", "ps", *args], text=True,
                          capture_output=True, timeout=60, check=False)


def test_python_m_tensorx_runs_the_cli() -> None:
    done = _run("--help")
    assert done.returncode == 0 and "--exit-when-done" in done.stdout
    assert "--no-share-memory" in done.stdout and "--no-resume-optimizer" in done.stdout
    done = _run(*BASE, "--listen", "tcp://127.0.0.1:99999")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines() == [
        "tensorx ps: error: argument --listen: bad address 'tcp://127.0.0.1:99999': "
        "Port out of range 0-65535"]


@pytest.mark.parametrize("content", [b"", b"PK\x03\x04 not really a zip"], ids=["empty", "junk"])
def test_a_corrupt_checkpoint_is_one_line(tmp_path: Path, content: bytes) -> None:
    (tmp_path / "ps-shard0-of1.pt").write_bytes(content)
    done = _run(*BASE, "--checkpoint-dir", str(tmp_path))
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("tensorx ps: error: no usable checkpoint in"), last
    assert "ps-shard0-of1.pt: unreadable" in last


@pytest.fixture
def sgd_checkpoint(tmp_path: Path) -> Iterator[Path]:
    """A directory with the checkpoint of one step of SGD with momentum (its state holds
    momentum buffers); the ``tensorx`` log level, which ``main`` sets, put back after."""
    plan = GraphAnalyzer(torch.nn.Linear(4, 2)).plan()
    state = ShardState(ShardLayout.from_plan(plan, 0), 1,
                       lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9))
    try:
        state.apply([0])
        state.save(checkpoint_path(tmp_path, 0, 1), plan.to_bytes())
    finally:
        state.close()
    level = logging.getLogger("tensorx").level
    yield tmp_path
    logging.getLogger("tensorx").setLevel(level)


def test_another_optimizer_than_the_checkpoints_is_one_line(
        sgd_checkpoint: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        sys.exit(main([*BASE, "--optimizer", "adam:lr=0.01",
                       "--checkpoint-dir", str(sgd_checkpoint)]))
    assert exited.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tensorx ps: error: "), lines
    assert "SGD" in lines[0] and "Adam" in lines[0] and "--no-resume-optimizer" in lines[0]


def test_launcher_helpers_are_public() -> None:
    import tensorx as tx
    from tensorx._ps.common.rendezvous import connect_store
    from tensorx.worker import ps_addresses

    assert tx.launcher_store is connect_store and tx.ps_addresses is ps_addresses
    assert {"launcher_store", "ps_addresses"} <= set(tx.__all__)
