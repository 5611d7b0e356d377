"""Binding: parameters and gradients live in registered arenas, and training is unchanged."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import nn

from tensorx.errors import PlanMismatchError, UsageError
from tensorx.graph_analyzer import Binding, GraphAnalyzer, TransferPlan
from tensorx.memregion import MemoryRegion
from tests.support import models


def inside(t: torch.Tensor, region: MemoryRegion) -> bool:
    start = t.data_ptr()
    end = start + t.numel() * t.element_size()
    return region.address <= start and end <= region.address + region.nbytes


def assert_in_arenas(binding: Binding, model: nn.Module, grads: bool = True) -> None:
    plan = binding.plan
    for name, p in model.named_parameters():
        chunks = plan.tensors()[name]
        first, last = chunks[0], chunks[-1]
        assert p.data_ptr() == binding.regions[(first.shard, "params")].address + first.offset
        assert inside(p.data[..., -1:].flatten()[-1:], binding.regions[(last.shard, "params")])
        if grads and first.kind == "static":
            assert p.grad is not None
            assert p.grad.data_ptr() == binding.regions[(first.shard, "grads")].address \
                + first.offset


def batch(model_name: str, step: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(step)
    if model_name == "mlp":
        return (torch.randn(8, 64, generator=g),)
    if model_name == "cnn":
        return (torch.randn(4, 3, 8, 8, generator=g),)
    if model_name == "transformer":
        return (torch.randn(4, 5, 32, generator=g),)
    return (torch.randint(0, 1000, (4, 3), generator=g),)


FACTORIES: dict[str, Callable[[], nn.Module]] = {
    "mlp": models.mlp, "cnn": models.cnn, "transformer": models.transformer,
    "sparse": models.sparse_embedding,
}


def train(model: nn.Module, name: str, steps: int, binding: Binding | None,
          make_opt: Callable[[list[nn.Parameter]], torch.optim.Optimizer]) -> None:
    opt = make_opt(list(model.parameters()))
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = model(*batch(name, step)).float().pow(2).mean()
        loss.backward()
        if binding is not None:
            assert binding.ensure_bound() == [
                n for n, c in binding.plan.tensors().items() if c[0].kind == "dynamic"]
            assert_in_arenas(binding, model)
        opt.step()


@pytest.mark.parametrize("name", ["mlp", "cnn", "transformer", "sparse"])
@pytest.mark.parametrize("shards", [1, 2])
def test_binding_does_not_change_training(name: str, shards: int) -> None:
    plain, bound = FACTORIES[name](), FACTORIES[name]()
    plan = GraphAnalyzer(bound, num_shards=shards, chunk_bytes=1024,
                         include_buffers=name == "cnn").plan()
    binding = plan.bind(bound)
    def sgd(ps: list[nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.SGD(ps, lr=0.05, momentum=0.0 if name == "sparse" else 0.9)
    train(plain, name, 4, None, sgd)
    train(bound, name, 4, binding, sgd)
    for (n, a), b in zip(plain.state_dict().items(), bound.state_dict().values(), strict=True):
        assert torch.equal(a, b), n
    assert_in_arenas(binding, bound)


def test_adam_with_foreach_updates_in_place() -> None:
    plain, bound = models.mlp(), models.mlp()
    binding = GraphAnalyzer(bound, num_shards=2).plan().bind(bound)
    def adam(ps: list[nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.Adam(ps, lr=1e-2, foreach=True)
    train(plain, "mlp", 3, None, adam)
    train(bound, "mlp", 3, binding, adam)
    for a, b in zip(plain.parameters(), bound.parameters(), strict=True):
        assert torch.equal(a, b)


def test_gradients_land_in_the_grads_arena_without_copies() -> None:
    model = models.mlp()
    binding = GraphAnalyzer(model, num_shards=2).plan().bind(model)
    grads = {n: p.grad for n, p in model.named_parameters()}
    model(*batch("mlp", 0)).sum().backward()
    for n, p in model.named_parameters():
        assert p.grad is grads[n]
        chunks = binding.plan.tensors()[n]  # a tensor may be cut between the two shards
        arena = torch.cat([binding.entry_view(c, "grads") for c in chunks])
        assert torch.equal(arena, p.grad.flatten())  # the bytes are in the arena
    model.zero_grad(set_to_none=True)
    assert all(p.grad is None for p in model.parameters())
    model(*batch("mlp", 1)).sum().backward()
    assert binding.ensure_bound() == []  # nothing needed a copy: autograd wrote in place
    assert_in_arenas(binding, model)


def test_gradients_accumulate_in_place_across_backwards() -> None:
    model = models.mlp()
    binding = GraphAnalyzer(model).plan().bind(model)
    x = batch("mlp", 0)[0]
    model(x).sum().backward()
    once = model[0].weight.grad.clone()  # type: ignore[union-attr]
    model(x).sum().backward()
    assert torch.allclose(model[0].weight.grad, 2 * once)  # type: ignore[arg-type]
    assert_in_arenas(binding, model)


def test_pulled_parameters_land_in_the_module() -> None:
    model = models.mlp()
    plan = GraphAnalyzer(model, num_shards=2).plan()
    binding = plan.bind(model)
    for shard in range(2):
        views = TransferPlan.views(plan.shard_entries(shard), binding.regions[(shard, "params")])
        for v in views.values():
            v.fill_(0.5)  # what a one-sided write from the PS does to the arena
    assert all(bool((p == 0.5).all()) for p in model.parameters())
    assert torch.allclose(model(torch.ones(1, 64)), model(torch.ones(1, 64)))


def test_a_tensor_split_across_shards_is_one_view() -> None:
    model = nn.Linear(1000, 1000)
    plan = GraphAnalyzer(model, num_shards=2, chunk_bytes=1 << 20).plan()
    shards = {c.shard for c in plan.tensors()["weight"]}
    assert shards == {0, 1}
    before = model.weight.detach().clone()
    binding = plan.bind(model)
    assert torch.equal(model.weight, before)
    assert_in_arenas(binding, model)
    last = plan.tensors()["weight"][-1]
    assert torch.equal(binding.entry_view(last, "params"),
                       before.flatten()[last.start:last.start + last.numel])


def test_non_adjacent_regions_refuse_split_tensors() -> None:
    model = nn.Linear(1000, 1000)
    plan = GraphAnalyzer(model, num_shards=2, chunk_bytes=1 << 20).plan()
    regions = {(s, a): MemoryRegion.allocate(plan.arena_bytes(s))
               for s in range(2) for a in ("params", "grads")}
    with pytest.raises(UsageError, match="not adjacent"):
        plan.bind(model, regions=regions)


def test_user_regions_from_allocate_regions_are_used() -> None:
    model = models.cnn()
    plan = GraphAnalyzer(model, num_shards=3, chunk_bytes=1024).plan()
    regions = plan.allocate_regions()
    binding = plan.bind(model, regions=regions)
    assert all(binding.regions[k] is r for k, r in regions.items())
    assert_in_arenas(binding, model)
    binding.unbind()
    assert not regions[(0, "params")].closed  # the caller's regions stay the caller's


def test_regions_too_small_or_missing_are_usage_errors() -> None:
    model = models.mlp()
    plan = GraphAnalyzer(model).plan()
    with pytest.raises(UsageError, match="lacks"):
        plan.bind(model, regions={})
    small = {(0, a): MemoryRegion.allocate(64) for a in ("params", "grads")}
    with pytest.raises(UsageError, match="needs"):
        plan.bind(model, regions=small)


def test_binding_another_model_names_the_tensor() -> None:
    plan = GraphAnalyzer(models.mlp()).plan()
    with pytest.raises(PlanMismatchError, match="not in the model"):
        plan.bind(nn.Linear(2, 2))
    other = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(),
                          nn.Linear(64, 11))
    ptrs = [p.data_ptr() for p in other.parameters()]
    with pytest.raises(PlanMismatchError, match=(
            r"^tensor '4\.(weight|bias)' differs in shape: \(11(, 64)?,?\) in the model vs "
            r"\(10(, 64)?,?\) in the plan: bind the model the plan was made from, or plan "
            r"this one \(GraphAnalyzer\(model\)\)$")):
        plan.bind(other)
    assert [p.data_ptr() for p in other.parameters()] == ptrs  # nothing was half-bound
    assert all(p.grad is None for p in other.parameters())


def test_ensure_bound_repairs_replaced_tensors_and_zeroes_missing_grads() -> None:
    model = models.mlp()
    binding = GraphAnalyzer(model).plan().bind(model)
    model[0].weight.grad = torch.ones_like(model[0].weight)
    model[2].bias.data = torch.full_like(model[2].bias, 3.0)
    model[4].weight.grad = None
    view = binding.tensor_view("4.weight", "grads")
    view.fill_(7.0)  # stale bytes from last step must not be pushed
    assert sorted(binding.ensure_bound()) == ["0.weight", "2.bias"]
    assert_in_arenas(binding, model)
    assert bool((binding.tensor_view("0.weight", "grads") == 1).all())
    assert bool((binding.tensor_view("2.bias", "params") == 3).all())
    assert bool((view == 0).all())


def test_ensure_bound_fast_path_still_sees_every_replacement() -> None:
    """After a settled pass, a later replacement of .data or .grad (or .grad = None)
    is still found and repaired, every time."""
    model = models.mlp()
    binding = GraphAnalyzer(model).plan().bind(model)
    assert binding.ensure_bound() == []
    assert binding.ensure_bound() == []  # the cached check
    model[2].weight.grad = torch.full_like(model[2].weight, 2.0)
    assert binding.ensure_bound() == ["2.weight"]
    assert bool((binding.tensor_view("2.weight", "grads") == 2).all())
    model[0].bias.data = torch.full_like(model[0].bias, 5.0)
    assert binding.ensure_bound() == ["0.bias"]
    assert bool((binding.tensor_view("0.bias", "params") == 5).all())
    view = binding.tensor_view("4.bias", "grads")
    view.fill_(9.0)
    model[4].bias.grad = None
    assert binding.ensure_bound() == []
    assert bool((view == 0).all()) and model[4].bias.grad is not None
    assert_in_arenas(binding, model)


def test_unbind_restores_private_storage_and_is_idempotent() -> None:
    model = models.mlp()
    values = [p.detach().clone() for p in model.parameters()]
    binding = GraphAnalyzer(model).plan().bind(model)
    region = binding.regions[(0, "params")]
    binding.unbind()
    binding.unbind()
    assert region.closed
    for p, v in zip(model.parameters(), values, strict=True):
        assert torch.equal(p, v)
        assert not inside(p, region)
    model(*batch("mlp", 0)).sum().backward()  # still trains, with autograd's own grads
    assert all(p.grad is not None for p in model.parameters())


def test_buffers_are_bound_and_updated_in_place() -> None:
    model = models.cnn()
    plan = GraphAnalyzer(model, include_buffers=True).plan()
    with plan.bind(model) as binding:
        model(*batch("cnn", 0))
        mean = binding.tensor_view("1.running_mean", "params")
        assert torch.equal(mean, model[1].running_mean)
        assert mean.data_ptr() == model[1].running_mean.data_ptr()
        assert int(binding.tensor_view("1.num_batches_tracked", "params")) == 1


@pytest.mark.parametrize("make", [models.mlp, models.sparse_embedding],
                         ids=["dense", "sparse"])
def test_a_binding_holds_the_arenas_only(make: Callable[[], nn.Module]) -> None:
    """Sparse rows are staged by the worker, not the binding: a binding of a model with
    sparse tables, as of a dense one, holds its shards' params and grads regions only."""
    model = make()
    binding = GraphAnalyzer(model, num_shards=2).plan().bind(model)
    assert set(binding.regions) == {(s, a) for s in range(2) for a in ("params", "grads")}
    assert not hasattr(binding, "stage_sparse")
    binding.unbind()


def test_deepcopy_of_a_plan_binds_a_second_model() -> None:
    a, b = models.mlp(), models.mlp()
    plan = GraphAnalyzer(a).plan()
    ba, bb = plan.bind(a), copy.deepcopy(plan).bind(b)
    assert ba.regions[(0, "params")].address != bb.regions[(0, "params")].address


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_binding_on_cuda_keeps_training_identical_and_in_place() -> None:
    plain, bound = models.cnn().cuda(), models.cnn().cuda()
    plan = GraphAnalyzer(bound, num_shards=2, chunk_bytes=1024).plan()
    binding = plan.bind(bound)
    assert all(r.is_cuda for r in binding.regions.values())
    for model in (plain, bound):
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        for step in range(3):
            opt.zero_grad(set_to_none=True)
            model(batch("cnn", step)[0].cuda()).pow(2).mean().backward()
            opt.step()
    assert binding.ensure_bound() == []
    assert_in_arenas(binding, bound)
    for a, b in zip(plain.parameters(), bound.parameters(), strict=True):
        assert torch.allclose(a, b, atol=1e-5)  # cuDNN backward may reorder sums


def test_a_tensor_split_around_an_empty_shard_is_still_one_view() -> None:
    """The planner leaves a shard empty between two pieces of one tensor when two cuts fall
    at the same row (two rows of 256 B on four shards: cuts 0, 0, 256, 256); the shards'
    regions are still adjacent in memory, so binding must accept it (found by hypothesis)."""
    model = nn.Module()
    model.register_parameter("t0", nn.Parameter(torch.randn(2, 64)))
    plan = GraphAnalyzer(model, num_shards=4, alignment=64, chunk_bytes=64 * 31).plan()
    shards = [c.shard for c in plan.tensors()["t0"]]
    assert [plan.arena_bytes(s) for s in range(4)] == [0, 256, 0, 256] and shards == [1, 3]
    before = model.t0.detach().clone()
    binding = plan.bind(model)
    assert torch.equal(model.t0, before)
    assert model.t0.data_ptr() == binding.entry_view(plan.tensors()["t0"][0], "params").data_ptr()
    binding.unbind()
