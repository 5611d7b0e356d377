"""Property tests: plans never overlap, are aligned, cover every byte once, are deterministic."""

from __future__ import annotations

import math

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from tensorx.graph_analyzer import GraphAnalyzer, TransferPlan

DTYPES = [torch.float32, torch.float16, torch.float64, torch.bfloat16]

shapes = st.lists(st.integers(0, 48), min_size=0, max_size=3).map(tuple)
specs = st.lists(st.tuples(shapes, st.sampled_from(DTYPES)), min_size=1, max_size=10)
options = st.fixed_dictionaries({
    "num_shards": st.integers(1, 5),
    "alignment": st.sampled_from([64, 128, 512]),
    "chunk_units": st.integers(1, 64),
    "sparse_rows": st.sampled_from([0, 3, 40]),
})
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def build(spec: list[tuple[tuple[int, ...], torch.dtype]], sparse_rows: int) -> nn.Module:
    model = nn.Module()
    for i, (shape, dtype) in enumerate(spec):
        model.register_parameter(f"t{i}", nn.Parameter(torch.randn(shape).to(dtype)))
    if sparse_rows:
        model.add_module("emb", nn.Embedding(sparse_rows, 4, sparse=True))
    return model


def plan_for(spec: list[tuple[tuple[int, ...], torch.dtype]],
             opts: dict[str, int]) -> tuple[nn.Module, TransferPlan]:
    model = build(spec, opts["sparse_rows"])
    plan = GraphAnalyzer(model, num_shards=opts["num_shards"], alignment=opts["alignment"],
                         chunk_bytes=opts["alignment"] * opts["chunk_units"]).plan()
    return model, plan


@SETTINGS
@given(spec=specs, opts=options)
def test_entries_are_aligned_and_never_overlap(spec: list[tuple[tuple[int, ...], torch.dtype]],
                                               opts: dict[str, int]) -> None:
    _, plan = plan_for(spec, opts)
    assert plan.problems() == []
    for shard in range(plan.num_shards):
        used = bytearray(plan.arena_bytes(shard))
        for e in plan.shard_entries(shard):
            assert e.offset % opts["alignment"] == 0
            assert e.end <= len(used)
            assert not any(used[e.offset:e.end])
            used[e.offset:e.end] = b"\1" * e.nbytes


@SETTINGS
@given(spec=specs, opts=options)
def test_every_byte_of_every_parameter_is_covered_once(
        spec: list[tuple[tuple[int, ...], torch.dtype]], opts: dict[str, int]) -> None:
    model, plan = plan_for(spec, opts)
    for name, p in model.named_parameters():
        count = [0] * p.numel()
        chunks = plan.tensors()[name]
        for c in chunks:
            assert c.nbytes == c.numel * p.element_size()
            row = max(1, math.prod(p.shape[1:]))
            group = math.lcm(row * p.element_size(), opts["alignment"])  # fewest aligned rows
            # longer than chunk_bytes only if not even one group fits (then cut between shards)
            assert c.nbytes <= plan.options.chunk_bytes or c.whole or (
                group > plan.options.chunk_bytes)
            assert c.whole or (c.start % row == 0 and c.numel % row == 0)  # whole rows
            for i in range(c.start, c.start + c.numel):
                count[i] += 1
        assert count == [1] * p.numel()
    assert len(plan.tensors()) == len(list(model.parameters()))


@SETTINGS
@given(spec=specs, opts=options)
def test_plans_are_deterministic_and_round_trip(
        spec: list[tuple[tuple[int, ...], torch.dtype]], opts: dict[str, int]) -> None:
    _, a = plan_for(spec, opts)
    _, b = plan_for(spec, opts)  # a fresh model with other random values
    assert a.entries == b.entries and a.fingerprint == b.fingerprint
    again = TransferPlan.from_bytes(a.to_bytes())
    assert again.entries == a.entries and again.fingerprint == a.fingerprint
    a.check_same(again)


@settings(max_examples=25, deadline=None)
@given(spec=specs, opts=options)
def test_binding_keeps_values_and_places_them_in_the_arenas(
        spec: list[tuple[tuple[int, ...], torch.dtype]], opts: dict[str, int]) -> None:
    model, plan = plan_for(spec, opts)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    binding = plan.bind(model)
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name])
        for c in plan.tensors()[name]:
            view = binding.entry_view(c, "params")
            assert torch.equal(view, before[name].flatten()[c.start:c.start + c.numel])
            if p.numel() and c.numel:
                assert p.flatten()[c.start].data_ptr() == view.data_ptr()
    binding.unbind()
