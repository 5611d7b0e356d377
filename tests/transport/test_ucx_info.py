"""``tensorx info``: reports UCX, its lanes, RDMA and GPU paths; works without UCX."""

from __future__ import annotations

import argparse
import json
import re
import sys
from typing import Any

import pytest
import torch

from tensorx._commands import gpu_info
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


# -- GPU paths --------------------------------------------------------------------------------
NO_UCX: dict[str, object] = {"available": False, "why": "UCX is not installed", "devices": {}}
UCX_GPU: dict[str, object] = {"available": True, "why": "", "build": ["--with-cuda=/cuda"],
                              "devices": {"cuda_copy": ["cuda"], "cuda_ipc": ["cuda"],
                                          "tcp": ["lo"]}}


def probe(torch: str | None = "2.11.0+cu130", cuda: str | None = "13.0",
          devices: tuple[str, ...] = ("NVIDIA H200",)) -> dict[str, object]:
    return {"torch": torch, "cuda": cuda, "devices": list(devices), "error": None}


def paths(gpu: dict[str, Any]) -> dict[str, tuple[bool, str]]:
    return {p["name"]: (p["available"], p["why"]) for p in gpu["paths"]}


@pytest.mark.skipif(torch.cuda.is_available(), reason="this host has a GPU")
def test_without_a_gpu_every_path_says_why(capsys: pytest.CaptureFixture[str]) -> None:
    info = info_cmd.collect_info()
    got = paths(info["gpu"])
    assert list(got) == list(gpu_info.PATHS)
    for name, (ok, why) in got.items():
        assert ok is False, name
        assert why, name
    torch_why = got[gpu_info.TCP_STAGING][1]
    assert "built without CUDA" in torch_why or "no CUDA device" in torch_why
    text = info_cmd.format_info(info)
    assert "GPU paths (" in text
    for name, (_, why) in got.items():
        assert re.search(rf"{re.escape(name)}\s+no\s+{re.escape(why)}", text), name
    parser = argparse.ArgumentParser()
    info_cmd.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["info", "--json"])
    assert args.func(args) == 0
    assert paths(json.loads(capsys.readouterr().out)["gpu"]) == got


@pytest.mark.parametrize(("found", "want"), [
    (probe(torch=None, cuda=None, devices=()), "torch is not installed"),
    (probe(torch="2.13.0+cpu", cuda=None, devices=()), "torch 2.13.0+cpu is built without CUDA"),
    (probe(devices=()), "no CUDA device visible to torch 2.11.0+cu130"),
])
def test_each_missing_piece_is_the_reason(found: dict[str, object], want: str,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TENSORX_CUDA_IPC", raising=False)
    got = paths(gpu_info.collect_gpu(NO_UCX, found))
    assert got[gpu_info.UCX_CUDA] == (False, "UCX is not usable: UCX is not installed")
    for name in (gpu_info.CUDA_IPC, gpu_info.TCP_STAGING, gpu_info.GPU_PS):
        assert got[name][0] is False
        assert got[name][1].startswith(want)


def test_with_a_gpu_the_paths_are_available_and_ipc_can_be_switched_off(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TENSORX_CUDA_IPC", raising=False)
    gpu = gpu_info.collect_gpu(UCX_GPU, probe())
    assert gpu["ucx_cuda_transports"] == ["cuda_copy", "cuda_ipc"]
    got = paths(gpu)
    assert got[gpu_info.UCX_CUDA] == (True, "UCX transports cuda_copy, cuda_ipc; "
                                            "not found: gdr_copy")
    assert got[gpu_info.CUDA_IPC] == (True, "torch 2.11.0+cu130 (CUDA 13.0) sees 1 device(s): "
                                            "NVIDIA H200")
    assert got[gpu_info.TCP_STAGING][0] is True
    monkeypatch.setenv("TENSORX_CUDA_IPC", "0")
    off = paths(gpu_info.collect_gpu(UCX_GPU, probe()))
    assert off[gpu_info.CUDA_IPC] == (False, "switched off (TENSORX_CUDA_IPC=0)")
    assert off[gpu_info.TCP_STAGING][0] is True


def test_ucx_without_cuda_transports_says_which_extra() -> None:
    plain = {"available": True, "why": "", "build": [], "devices": {"tcp": ["lo"]}}
    ok, why = paths(gpu_info.collect_gpu(plain, probe()))[gpu_info.UCX_CUDA]
    assert not ok and "ucx-cu12 or ucx-cu13" in why


def test_probes_never_raise(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.version, "cuda", "13.0")

    def broken() -> int:
        raise RuntimeError("CUDA driver version is insufficient")

    monkeypatch.setattr(torch.cuda, "device_count", broken)
    found = gpu_info.probe_torch()
    assert found["error"] == "CUDA failed: RuntimeError: CUDA driver version is insufficient"
    assert paths(gpu_info.collect_gpu(NO_UCX, found))[gpu_info.GPU_PS] == (
        False, found["error"])
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch -> ImportError
    found = gpu_info.probe_torch()
    assert found["torch"] is None and "torch is not importable" in found["error"]
    gpu = gpu_info.collect_gpu(NO_UCX, found)
    assert all(p["available"] is False for p in gpu["paths"])
    assert "torch not installed" in "\n".join(gpu_info.format_gpu(gpu))


def test_gpu_transports_are_ucx_cuda_ones() -> None:
    assert info_cmd.GPU_TLS == gpu_info.GPU_TLS == ("cuda_copy", "cuda_ipc", "gdr_copy")
