"""Boundary edges of fx-traced models split over devices, and the ``tensorx plan`` command."""

from __future__ import annotations

import argparse

import pytest
import torch
from torch import fx, nn

from tensorx._commands import plan as plan_command
from tensorx.errors import UsageError
from tensorx.graph_analyzer import HEADER_BYTES, BoundaryAnalyzer
from tensorx.memregion import MemoryRegion
from tests.support import models

PLACEMENT = {"stage0": "gpu0", "stage1": "gpu1"}


def test_two_stage_split_has_the_activation_and_skip_edges() -> None:
    analyzer = BoundaryAnalyzer(models.two_stage(), PLACEMENT,
                                sample_inputs=(torch.randn(4, 16),))
    plan = analyzer.plan()
    edges = {(e.tensor, e.src, e.dst): e for e in plan.edges}
    # the activation, and the skip slice h[:, :8], taken on gpu0 where h lives (smaller)
    assert set(edges) == {("stage0_1", "gpu0", "gpu1"), ("getitem", "gpu0", "gpu1")}
    act, skip = edges[("stage0_1", "gpu0", "gpu1")], edges[("getitem", "gpu0", "gpu1")]
    assert (act.shape, act.dtype, act.nbytes, act.kind) == ((4, 32), "float32", 512, "static")
    assert (skip.shape, skip.nbytes, skip.offset) == ((4, 8), 128, 512)
    assert plan.arena_bytes("gpu1") == 640 and plan.arena_bytes("gpu0") == 0
    with MemoryRegion.allocate(plan.arena_bytes("gpu1")) as region:
        views = plan.receive_views("gpu1", region)
        assert views["stage0_1"].shape == (4, 32) and views["getitem"].shape == (4, 8)
        assert views["getitem"].data_ptr() == region.address + 512
    with MemoryRegion.allocate(64) as small, pytest.raises(UsageError):
        plan.receive_views("gpu1", small)


class ThreeWay(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(8, 8)
        self.mid = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
        self.dec = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.enc(x)
        m = self.mid(h)
        return self.dec(m + h)  # type: ignore[no-any-return]


def test_edges_cross_each_boundary_and_receive_slots_are_aligned() -> None:
    placement = {"enc": "p0", "mid": "p1", "dec": "p2"}
    plan = BoundaryAnalyzer(ThreeWay(), placement, sample_inputs=(torch.randn(3, 8),)).plan()
    pairs = sorted((e.tensor, e.src, e.dst) for e in plan.edges)
    # m + h runs where its first input is (p1), so h goes to p1 once and the sum to p2
    assert pairs == [("add", "p1", "p2"), ("enc", "p0", "p1")]
    sizes = {e.tensor: e.nbytes for e in plan.edges}
    assert sizes == {"add": 96, "enc": 96}
    assert all(e.offset % 64 == 0 for e in plan.edges)
    text = plan.describe()
    assert text.splitlines()[0].split() == ["tensor", "from", "to", "bytes", "kind", "shape",
                                            "offset"]
    assert "receive arena p2" in text


def test_without_sample_inputs_edges_are_dynamic_with_a_header() -> None:
    plan = BoundaryAnalyzer(models.two_stage(), PLACEMENT, dynamic_max_bytes=1000).plan()
    first, second = plan.edges
    assert first.kind == "dynamic" and first.shape is None and first.nbytes == 1000
    assert first.payload_offset == first.offset + HEADER_BYTES
    assert second.offset == 1088  # header + 1000 B, aligned up to 64
    assert plan.arena_bytes("gpu1") == 2176
    with MemoryRegion.allocate(plan.arena_bytes("gpu1")) as region:
        payload = plan.receive_views("gpu1", region)[second.tensor]
        assert payload.dtype == torch.uint8 and payload.numel() == 1000
        assert payload.data_ptr() == region.address + second.offset + HEADER_BYTES


def test_functions_are_placed_with_the_module_they_run_in() -> None:
    analyzer = BoundaryAnalyzer(models.two_stage(), {"": "host", "stage1": "gpu1"},
                                sample_inputs=(torch.randn(2, 16),))
    places = analyzer.node_places()
    assert places["stage0_1"] == "host" and places["stage1_2"] == "gpu1"
    assert places["x"] == "host"
    assert {(e.src, e.dst) for e in analyzer.edges()} == {("host", "gpu1"), ("gpu1", "host")}


def test_transformer_stack_split_by_layer() -> None:
    stack = nn.Sequential(*models.transformer(layers=3).layers)  # traced through the layers
    plan = BoundaryAnalyzer(fx.symbolic_trace(stack), {"0": "a", "1": "a", "2": "b"},
                            sample_inputs=(torch.randn(2, 5, 32),)).plan()
    assert [(e.src, e.dst, e.shape, e.kind) for e in plan.edges] == [
        ("a", "b", (2, 5, 32), "static")]


def test_blocks_can_be_kept_whole_as_leaves() -> None:
    model = nn.Sequential(models.transformer(layers=2), nn.Linear(32, 4))
    plan = BoundaryAnalyzer(model, {"0": "a", "1": "b"}, sample_inputs=(torch.randn(2, 5, 32),),
                            leaf_modules=(nn.TransformerEncoder,)).plan()
    assert [(e.tensor, e.src, e.dst, e.nbytes) for e in plan.edges] == [("_0", "a", "b", 1280)]
    assert not BoundaryAnalyzer(model, {"0.layers.0": "a", "0.layers.1": "b"},
                                leaf_modules=(nn.TransformerEncoder,)).edges()


def test_fingerprint_is_deterministic() -> None:
    def make() -> str:
        torch.manual_seed(0)
        return BoundaryAnalyzer(models.two_stage(), PLACEMENT,
                                sample_inputs=(torch.randn(4, 16),)).plan().fingerprint
    assert make() == make()


def test_bad_arguments_are_usage_errors() -> None:
    with pytest.raises(UsageError):
        BoundaryAnalyzer(models.two_stage(), {})
    with pytest.raises(UsageError):
        BoundaryAnalyzer(models.two_stage(), PLACEMENT, dynamic_max_bytes=-1)


# -- the CLI -------------------------------------------------------------------------------
def run_cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="tensorx")
    plan_command.add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    status: int = args.func(args)
    return status


def test_cli_prints_the_resnet50_plan(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli(["plan", "tests.support.models:resnet50", "--shards", "2", "--summary"]) == 0
    out = capsys.readouterr().out
    assert "170 entries, 161 tensors, 25557032 elements, 2 shard(s)" in out
    assert "shard 0: 29 entries, dense 51113920 B, params arena 51113920 B" in out
    assert "shard 1: 141 entries, dense 51114240 B, params arena 51114240 B" in out
    assert "imbalance 0.00% (dense bytes" in out


def test_cli_table_and_options(capsys: pytest.CaptureFixture[str]) -> None:
    assert plan_command.main(["tests.support.models:cnn", "--include-buffers", "--max-rows",
                              "3"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].split()[:2] == ["shard", "offset"]
    assert "more entries" in out


@pytest.mark.parametrize("target", ["nope", "no_such_module:f", "tests.support.models:missing"])
def test_cli_bad_targets_exit_2(target: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert plan_command.main([target]) == 2
    assert "tensorx plan: error:" in capsys.readouterr().err


def test_cli_bad_options_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert plan_command.main(["tests.support.models:mlp", "--alignment", "3"]) == 2
    assert "alignment" in capsys.readouterr().err
