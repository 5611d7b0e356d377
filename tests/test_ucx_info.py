"""``tensorx info``: reports UCX, its lanes, RDMA and GPU paths; works without UCX."""

from __future__ import annotations

import argparse
import json
import sys

import pytest

from tensorx._commands import info as info_cmd


@pytest.mark.ucx
def test_collect_info_lists_ucx_transports_and_devices() -> None:
    pytest.importorskip("libucx")
    info = info_cmd.collect_info()
    ucx = info["ucx"]
    assert ucx["version"]
    assert "tcp" in ucx["transports"]
    assert "lo" in ucx["devices"]["tcp"]
    assert isinstance(ucx["rdma"], bool)
    assert isinstance(ucx["gpu"], bool)
    text = info_cmd.format_info(info)
    assert f"UCX {ucx['version']}" in text
    assert "RDMA:" in text
    assert "GPU:" in text


def test_info_says_so_without_ucx(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "libucx", None)  # import libucx -> ImportError
    info = info_cmd.collect_info()
    assert info["ucx"]["available"] is False
    assert "not installed" in info["ucx"]["why"]
    assert "UCX: not available" in info_cmd.format_info(info)


def test_info_command_prints_json(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    info_cmd.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["info", "--json"])
    assert args.func(args) == 0
    printed = json.loads(capsys.readouterr().out)
    assert set(printed) >= {"tensorx", "ucx"}
