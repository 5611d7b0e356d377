"""The `tensorx` command as a user runs it (a real subprocess through the entry point)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def tensorx(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tensorx.cli", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, check=False)


def test_plan_prints_the_resnet50_summary() -> None:
    out = tensorx("plan", "tests.support.models:resnet50", "--shards", "2", "--summary")
    assert out.returncode == 0, out.stderr
    assert "161 tensors, 25557032 elements, 2 shard(s)" in out.stdout
    assert "imbalance" in out.stdout


@pytest.mark.parametrize("command", ["info", "plan", "ps"])
def test_every_command_has_help(command: str) -> None:
    out = tensorx(command, "--help")
    assert out.returncode == 0, out.stderr
    assert "usage: tensorx" in out.stdout


def test_bad_invocation_is_a_clear_error_not_a_traceback() -> None:
    out = tensorx("plan", "no.such.module:factory")
    assert out.returncode != 0
    assert "Traceback" not in out.stderr


async def test_info_shows_what_a_running_node_exports() -> None:
    import asyncio

    import tensorx as tx

    async with tx.Node(transport="tcp", token="tok") as node:
        desc = node.export(tx.MemoryRegion.allocate(12345), access="r")
        out = await asyncio.to_thread(tensorx, "info", "--node", node.address, "--token", "tok")
        assert out.returncode == 0, out.stdout + out.stderr
        assert f"{desc.region_id:#x}" in out.stdout
        assert "12,345 B" in out.stdout
        wrong = await asyncio.to_thread(tensorx, "info", "--node", node.address,
                                        "--token", "bad")
        assert wrong.returncode == 1
        assert "token" in wrong.stdout
