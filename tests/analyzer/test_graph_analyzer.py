"""GraphAnalyzer planning on real models: layout, order, sharding, identity, wire form."""

from __future__ import annotations

import dataclasses
import itertools
import subprocess
import sys

import msgpack
import pytest
import torch
from torch import nn

from tensorx import graph_analyzer
from tensorx.errors import PlanMismatchError, ProtocolError, UsageError
from tensorx.graph_analyzer import GraphAnalyzer, PlanEntry, TransferPlan
from tests.support import models


def plan_of(model: nn.Module, **kw: object) -> TransferPlan:
    return GraphAnalyzer(model, **kw).plan()  # type: ignore[arg-type]


@pytest.mark.parametrize("factory", [models.mlp, models.cnn, models.transformer,
                                     models.sparse_embedding, models.two_stage])
@pytest.mark.parametrize("shards", [1, 2, 3])
def test_real_models_plan_soundly(factory: object, shards: int) -> None:
    model = factory()  # type: ignore[operator]
    plan = plan_of(model, num_shards=shards, chunk_bytes=4096)
    assert plan.problems() == []
    named = dict(model.named_parameters())
    assert set(plan.tensors()) == set(named)
    for name, chunks in plan.tensors().items():
        assert sum(c.numel for c in chunks) == named[name].numel()
        assert chunks[0].shape == tuple(named[name].shape)
    assert sum(plan.arena_bytes(s) for s in range(shards)) == plan.total_bytes


def test_entry_fields_match_the_contract() -> None:
    plan = plan_of(models.mlp())
    e = next(e for e in plan.entries if e.name == "0.weight")
    assert e == PlanEntry("0.weight", 0, 0, 64 * 128, (128, 64), "float32", 64 * 128 * 4,
                          "static", 0, "params", e.offset, "param", 0)
    assert e.whole and e.key == "0.weight"
    with pytest.raises(AttributeError):
        e.offset = 0  # type: ignore[misc]


def test_entries_follow_gradient_ready_order() -> None:
    plan = plan_of(models.mlp())
    names = [e.name for e in plan.shard_entries(0)]
    assert names == ["4.bias", "4.weight", "2.bias", "2.weight", "0.bias", "0.weight"]


class Reordered(nn.Module):
    """Registers ``late`` first but calls it last: only tracing can know."""

    def __init__(self) -> None:
        super().__init__()
        self.late = nn.Linear(8, 2)
        self.early = nn.Linear(4, 8)
        self.bn = nn.BatchNorm1d(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.late(torch.relu(self.bn(self.early(x))))  # type: ignore[no-any-return]


def test_sample_inputs_trace_the_real_order_without_side_effects() -> None:
    model = Reordered()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(5, 4)
    rng = torch.random.get_rng_state()
    plan = plan_of(model, sample_inputs=(x,))
    names = [e.name for e in plan.shard_entries(0)]
    assert names[:2] == ["late.bias", "late.weight"]
    assert names[-2:] == ["early.bias", "early.weight"]
    assert plan.options.order == "traced"
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert torch.equal(rng, torch.random.get_rng_state())
    assert plan.fingerprint != plan_of(Reordered()).fingerprint


def test_large_tensors_are_chunked_and_chunks_are_contiguous() -> None:
    model = nn.Linear(1000, 1000)  # 4 MB weight
    plan = plan_of(model, num_shards=2, chunk_bytes=1 << 20)
    chunks = plan.tensors()["weight"]
    # whole rows (4000 B) in aligned pairs: 262 rows per chunk; the shard cut falls at the
    # pair of rows nearest half the dense bytes (bias 4032 B + 500 rows | 500 rows)
    assert [c.numel for c in chunks] == [262000, 238000, 24000, 262000, 214000]
    assert [c.shard for c in chunks] == [0, 0, 1, 1, 1]
    assert [plan.dense_bytes(s) for s in range(2)] == [4032 + 2_000_000, 2_000_000]
    for a, b in itertools.pairwise(chunks):
        assert (b.shard == a.shard and b.offset == a.end) or (
            b.shard == a.shard + 1 and b.offset == 0 and a.end == plan.arena_bytes(a.shard))
    assert not chunks[1].whole and chunks[1].key == ("weight", 1)


def test_resnet50_two_shards_are_balanced() -> None:
    model = models.resnet50()
    assert len(list(model.parameters())) == 161
    assert sum(p.numel() for p in model.parameters()) == 25_557_032
    plan = plan_of(model, num_shards=2)
    assert plan.problems() == []
    assert plan.imbalance < 0.05
    assert len(plan.entries) > 161  # the largest tensors are split at 4 MiB
    assert max(e.nbytes for e in plan.entries) <= 4 << 20


def test_meta_device_models_plan_without_memory() -> None:
    with torch.device("meta"):
        model = models.resnet50()
    plan = plan_of(model, num_shards=2)
    assert plan.fingerprint == plan_of(models.resnet50(), num_shards=2).fingerprint


def test_offsets_are_aligned_to_the_requested_alignment() -> None:
    plan = plan_of(models.cnn(), num_shards=2, alignment=256, chunk_bytes=1024)
    assert all(e.offset % 256 == 0 for e in plan.entries)
    assert all(plan.arena_bytes(s) % 256 == 0 for s in range(2))


def test_more_shards_than_tensors_leaves_empty_arenas() -> None:
    plan = plan_of(nn.Linear(2, 2), num_shards=4)
    assert plan.problems() == []
    assert sorted(plan.arena_bytes(s) for s in range(4))[:2] == [0, 0]


def test_buffers_are_planned_on_request() -> None:
    cnn = models.cnn()
    assert not any(e.role == "buffer" for e in plan_of(cnn).entries)
    plan = plan_of(cnn, include_buffers=True)
    buffers = {e.name: e for e in plan.entries if e.role == "buffer"}
    assert set(buffers) == {n for n, _ in cnn.named_buffers()}
    assert buffers["1.num_batches_tracked"].dtype == "int64"
    assert plan.problems() == []


def test_frozen_parameters_do_not_cross() -> None:
    model = models.mlp()
    model[0].weight.requires_grad_(False)
    assert "0.weight" not in plan_of(model).tensors()


def test_shared_parameters_are_planned_once() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    model[1].weight = model[0].weight
    assert sorted(plan_of(model).tensors()) == ["0.bias", "0.weight", "1.bias"]


def test_sparse_gradients_are_dynamic_with_header_slots() -> None:
    plan = plan_of(models.sparse_embedding(), num_shards=1, sparse_max_rows=64)
    kinds = {e.name: e.kind for e in plan.entries}
    assert kinds == {"emb.weight": "dynamic", "bag.weight": "dynamic",
                     "head.weight": "static", "head.bias": "static"}
    dyn = {d.name: d for d in plan.dynamic_entries}
    assert dyn["emb.weight"].capacity_rows == 64 and not dyn["emb.weight"].growable
    assert dyn["emb.weight"].row_shape == (16,)
    assert sorted(d.header_offset for d in dyn.values()) == [0, 64]
    assert plan.header_bytes(0) == 128


def test_sparse_staging_grows_within_a_budget() -> None:
    plan = plan_of(models.sparse_embedding(), sparse_budget_bytes=600 * (8 + 64))
    emb = plan.dynamic("emb.weight")
    assert emb.growable and emb.capacity_rows == 256 and emb.budget_rows == 600
    assert plan.dynamic("bag.weight").budget_rows == 500  # the table is smaller than the budget


@pytest.mark.parametrize("kw", [
    {"num_shards": 0}, {"num_shards": 1.5}, {"num_shards": 1 << 17},
    {"alignment": 32}, {"alignment": 96},
    {"chunk_bytes": 100}, {"chunk_bytes": 0}, {"sparse_max_rows": 0},
])
def test_bad_options_are_usage_errors(kw: dict[str, object]) -> None:
    with pytest.raises(UsageError):
        GraphAnalyzer(models.mlp(), **kw)  # type: ignore[arg-type]


def test_not_a_module_is_a_usage_error() -> None:
    with pytest.raises(UsageError, match=r"torch\.nn\.Module"):
        GraphAnalyzer(object())  # type: ignore[arg-type]


def test_shard_out_of_range() -> None:
    plan = plan_of(models.mlp(), num_shards=2)
    with pytest.raises(UsageError):
        plan.arena_bytes(2)
    with pytest.raises(UsageError):
        plan.shard_entries(-1)


# -- identity ------------------------------------------------------------------------------
def test_fingerprint_is_stable_and_sensitive() -> None:
    a = plan_of(models.transformer(), num_shards=2)
    assert a.fingerprint == plan_of(models.transformer(seed=7), num_shards=2).fingerprint
    assert a.fingerprint != plan_of(models.transformer(), num_shards=3).fingerprint
    assert a.fingerprint != plan_of(models.transformer(layers=3), num_shards=2).fingerprint
    assert a.fingerprint != plan_of(models.transformer(), num_shards=2,
                                    chunk_bytes=1 << 20).fingerprint


def test_fingerprint_is_the_same_in_another_process() -> None:
    code = ("from tests.support import models; from tensorx.graph_analyzer import GraphAnalyzer;"
            "print(GraphAnalyzer(models.cnn(), num_shards=2).plan().fingerprint)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=60)
    assert out.stdout.strip() == plan_of(models.cnn(), num_shards=2).fingerprint


def test_bytes_round_trip_without_the_model() -> None:
    plan = plan_of(models.sparse_embedding(), num_shards=2, include_buffers=True)
    again = TransferPlan.from_bytes(plan.to_bytes())
    assert again.entries == plan.entries
    assert again.dynamic_entries == plan.dynamic_entries
    assert again.fingerprint == plan.fingerprint
    assert [again.arena_bytes(s) for s in range(2)] == [plan.arena_bytes(s) for s in range(2)]
    assert b"pickle" not in plan.to_bytes()


def test_corrupt_or_forged_bytes_are_protocol_errors() -> None:
    data = plan_of(models.mlp()).to_bytes()
    fields = msgpack.unpackb(data)
    fields[2][0][10] += 64  # move an entry: the fingerprint no longer matches
    for bad in (b"", b"\x93junk", msgpack.packb([1, 2, 3]), msgpack.packb(fields),
                data[:-5]):
        with pytest.raises(ProtocolError):
            TransferPlan.from_bytes(bad)
    fields = msgpack.unpackb(data)
    fields[2][1][10] = fields[2][0][10]  # overlap, with a matching fingerprint
    forged = TransferPlan.from_bytes  # the fingerprint check must not be the only defence
    plan = TransferPlan([PlanEntry(*r[:4], tuple(r[4]), *r[5:]) for r in fields[2]],
                        plan_of(models.mlp()).options)
    with pytest.raises(ProtocolError, match="overlaps"):
        forged(plan.to_bytes())
    huge = [dataclasses.replace(e, offset=e.offset + (1 << 50)) if e.name == "0.weight" else e
            for e in plan_of(models.mlp()).entries]
    with pytest.raises(ProtocolError, match="more than any arena"):
        forged(TransferPlan(huge, plan.options).to_bytes())


def test_check_same_names_the_first_differing_tensor() -> None:
    ours = plan_of(models.mlp())
    other = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(),
                          nn.Linear(64, 11))
    theirs = plan_of(other)
    ours.check_same(plan_of(models.mlp()))
    ours.check_same(plan_of(models.mlp()).to_bytes())
    ours.check_same(ours.fingerprint)
    ours.check_same((ours.fingerprint, b"not even decoded"))
    # the first tensor in model order, and the one field that differs (it named 4.bias,
    # laid out first, followed by all fourteen fields of both entries)
    says = (r"^tensor '4\.weight' differs in shape: \(10, 64\) in ours vs \(11, 64\) in "
            r"theirs\. Every process must plan the same model \(the same tensors, shapes and "
            r"dtypes\) with the same plan options and number of shards; compare "
            r"plan\.describe\(\) on both sides$")
    with pytest.raises(PlanMismatchError, match=says):
        ours.check_same((theirs.fingerprint, theirs.to_bytes()))
    with pytest.raises(PlanMismatchError, match=says):
        ours.check_same(theirs)
    with pytest.raises(PlanMismatchError, match=says.replace("ours", "mine")):
        ours.check_same(theirs.to_bytes(), ours="mine")
    with pytest.raises(PlanMismatchError, match=r"fingerprint .* exchange to_bytes"):
        ours.check_same(theirs.fingerprint)
    with pytest.raises(PlanMismatchError, match=r"^the plan option num_shards differs: 1 in "
                       r"ours vs 2 in theirs\. Every process"):
        ours.check_same(plan_of(models.mlp(), num_shards=2))


def test_describe_is_a_readable_table() -> None:
    plan = plan_of(models.sparse_embedding(), num_shards=2)
    text = plan.describe()
    header = text.splitlines()[0].split()
    assert header == ["shard", "offset", "nbytes", "kind", "dtype", "shape", "tensor"]
    assert "emb.weight" in text and "dynamic" in text and "imbalance" in text
    assert plan.fingerprint in text
    short = plan.describe(max_rows=1)
    assert "more entries" in short
    assert "4 entries" in repr(plan) or "entries" in repr(plan)


def test_views_give_the_ps_one_tensor_per_entry() -> None:
    from tensorx.memregion import MemoryRegion

    plan = plan_of(nn.Linear(1000, 300), num_shards=2, chunk_bytes=1 << 18)
    for shard in range(2):
        with MemoryRegion.allocate(plan.arena_bytes(shard)) as region:
            views = TransferPlan.views(plan.shard_entries(shard), region)
            for entry in plan.shard_entries(shard):
                v = views[entry.key]
                assert v.numel() == entry.numel and v.dtype == torch.float32
                assert v.data_ptr() == region.address + entry.offset



@pytest.mark.parametrize("name", ["SparseHeader", "SparseStaging", "StagedSparse",
                                  "payload_views", "read_header"])
def test_the_sparse_paths_runtime_is_no_longer_served_here(name: str) -> None:
    """The worker stages sparse rows itself: the pieces of it this module once served
    say so, by name, where code still asks for them."""
    with pytest.raises(ImportError, match=rf"graph_analyzer\.{name} is gone: .*internal "
                       r"runtime piece of the parameter server's sparse path.*no longer "
                       r"public.*tensorx\.Worker stages sparse gradients itself"):
        getattr(graph_analyzer, name)
    with pytest.raises(AttributeError, match="has no attribute 'nothing'"):
        graph_analyzer.nothing  # type: ignore[attr-defined]  # noqa: B018


def test_an_old_import_of_the_sparse_staging_says_why_it_fails() -> None:
    with pytest.raises(ImportError, match=r"SparseStaging is gone.*plan\.bind"):
        from tensorx.graph_analyzer import SparseStaging  # type: ignore[attr-defined]  # noqa: F401
