"""What a shard checks for NaN and Inf is what it applies.

A rank's gradient slot is memory the rank can write one-sided at any moment (over the same-host
lane, or a mapping, while the shard reads it). Here rank 1 pushes a finite gradient, and once
the shard has checked it, the moment the shard starts applying, rank 1 writes NaN over its
whole slot (as the shard starts on the last part when it applies part by part). The shard
must apply what it checked: the parameters are those of the run
without that write, finite, on every link, with the update applied part by part as the
gradients land (pipelined) or after the barrier.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import torch
from torch import nn

from tensorx._ps.service import round as rounds
from tensorx._ps.service.nonfinite import Verdict, checked
from tensorx._ps.state.shard import ShardLayout, ShardState
from tensorx._ps.update import fold, foldkernel, parts
from tensorx.graph_analyzer import GraphAnalyzer
from tensorx.memregion import MemoryRegion
from tensorx.ps import ParameterServer
from tensorx.worker import Worker
from tests.support.data import backward, batches
from tests.support.host import fold_kernel_or_skip
from tests.support.lanes import assert_link, link_options, links
from tests.support.models import small_mlp
from tests.support.training import SGD_MOMENTUM, train_single

pytestmark = pytest.mark.usefixtures("one_torch_thread")

STEPS = 3
ATTACKED = 1  # the step (0-based) whose slot rank 1 overwrites once it has been checked


@pytest.fixture
def tiny_parts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Parts of 64 bytes, each applied as soon as it can be (see test_ps_pipelined)."""
    monkeypatch.setattr(parts, "PART_BYTES", 64)
    monkeypatch.setattr(rounds, "EARLY_BYTES", 0)


# how the shard applies: part by part as the gradients land (a sync round in parts, each
# applied early or once all have landed), or one push at a time (async: rank 0 steps, then
# rank 1, so that the order is the same in every run)
VARIANTS = {"pipelined-early": {"mode": "sync", "pipeline": True},
            "pipelined-settled": {"mode": "sync", "pipeline": False},
            "async": {"mode": "async"}}


@contextlib.asynccontextmanager
async def cluster(link: str, variant: str, models: list[nn.Module]
                  ) -> AsyncIterator[tuple[ParameterServer, list[Worker]]]:
    options = link_options(link)
    async with ParameterServer("tcp://127.0.0.1:0", num_workers=2, optimizer=SGD_MOMENTUM,
                               log_every=None, **VARIANTS[variant], **options) as ps:
        ws = [Worker(m, ps.address, rank=r, num_workers=2, overlap=False, timeout=30,
                     **options) for r, m in enumerate(models)]
        try:
            await asyncio.gather(*(w.start() for w in ws))
            yield ps, ws
        finally:
            await asyncio.gather(*(w.aclose() for w in ws), return_exceptions=True)


def nan_over_slot(worker: Worker, loop: asyncio.AbstractEventLoop) -> Callable[[], None]:
    """``worker`` (rank 1) writing NaN over its whole gradient slot on shard 0, as it may at
    any moment: through the mapping when it mapped the slot, else one-sided over its
    endpoint (from the shard's apply thread: it waits until the write has landed)."""
    slot = worker._links.shards[0].slot
    assert slot is not None
    nan = torch.full((slot.nbytes // 4,), float("nan"))

    def write() -> None:
        if worker.mapped[0]:  # its gradients are the slot: write them
            for p in worker.model.parameters():
                assert p.grad is not None
                p.grad.fill_(float("nan"))
            return
        assert threading.current_thread() is not threading.main_thread(), \
            "a copying peer's write can only land while the loop runs"
        region = MemoryRegion.register(nan)

        async def one_sided() -> None:
            try:
                await worker._eps[0].write(region, slot)
            finally:
                region.close()

        asyncio.run_coroutine_threadsafe(one_sided(), loop).result(timeout=20)

    return write


def attack_when_applying(monkeypatch: pytest.MonkeyPatch, armed: list[Callable[[], None]]
                         ) -> None:
    """Run ``armed``'s write (once) as the shard starts applying an update, or its last
    part: every part of the gradient has been checked by then."""
    apply, apply_part = ShardState.apply, ShardState.apply_part

    def patched_apply(self: ShardState, ranks: Any) -> None:
        if armed:
            armed.pop()()
        apply(self, ranks)

    def patched_part(self: ShardState, ranks: list[int], k: int) -> None:
        if armed and k == self.num_parts - 1:
            armed.pop()()
        apply_part(self, ranks, k)

    monkeypatch.setattr(ShardState, "apply", patched_apply)
    monkeypatch.setattr(ShardState, "apply_part", patched_part)


async def train(link: str, variant: str, monkeypatch: pytest.MonkeyPatch | None
                ) -> list[torch.Tensor]:
    """Rank 0's parameters after :data:`STEPS` steps; with ``monkeypatch``, rank 1 writes
    NaN over its slot at step :data:`ATTACKED` once the shard has checked it."""
    models = [small_mlp(), small_mlp(seed=99)]
    armed: list[Callable[[], None]] = []
    if monkeypatch is not None:
        attack_when_applying(monkeypatch, armed)
    async with cluster(link, variant, models) as (ps, ws):
        assert ps.rounds.active() is variant.startswith("pipelined")
        write = nan_over_slot(ws[1], asyncio.get_running_loop())
        for i, step in enumerate(batches(STEPS, 2)):
            for w, m, (x, y) in zip(ws, models, step, strict=True):
                w.zero_grad()
                backward(m, x, y)
            attacked = i == ATTACKED and monkeypatch is not None
            if variant == "async":  # rank 1's push is applied on its own
                await ws[0].step()
                armed += [write] if attacked else []
                await ws[1].step()
            else:
                armed += [write] if attacked else []
                await asyncio.gather(*(w.step() for w in ws))
            if attacked:
                assert not armed, "the shard applied no update"
                slot = ps.state.slot_region(1).view(torch.float32)  # type: ignore[union-attr]
                assert bool(torch.isnan(slot).any()), "the write did not land"
        for w in ws:
            assert_link(w, link)
        assert ps.stats["nonfinite"] == 0  # what was applied was finite: nothing to report
        return [p.detach().clone() for p in models[0].parameters()]


@pytest.mark.parametrize("link", links())
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.usefixtures("tiny_parts")
async def test_nan_written_into_a_checked_slot_never_reaches_the_parameters(
        link: str, variant: str, monkeypatch: pytest.MonkeyPatch) -> None:
    got = await train(link, variant, monkeypatch)
    want = train_single(SGD_MOMENTUM, STEPS) if variant != "async" else \
        await train(link, variant, None)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


# -- the check, without I/O ----------------------------------------------------------------
@pytest.fixture(params=["kernel", "kernel-streamed", "torch"])
def fold_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """How the shard folds and checks: the C fold kernel (its accumulator written through
    the caches, or past them as a fold larger than the cache is), or torch ops in pieces."""
    if request.param.startswith("kernel"):
        fold_kernel_or_skip()
        if request.param == "kernel-streamed":
            monkeypatch.setattr(foldkernel, "STREAM_BYTES", 0)  # every fold is "large"
        return "kernel"
    monkeypatch.setattr(foldkernel, "_loaded", [None])
    return str(request.param)


@pytest.fixture
def state(fold_path: str) -> Any:
    model = small_mlp()
    sgd = lambda p: torch.optim.SGD(p, lr=0.1)  # noqa: E731
    shard = ShardState(ShardLayout.from_plan(GraphAnalyzer(model).plan(), 0), 2, sgd)
    yield shard
    shard.close()


def fill(state: ShardState, rank: int, value: float) -> torch.Tensor:
    slot = state.slot_region(rank).view(torch.float32)
    slot.fill_(value)
    return slot


def test_the_fold_is_checked_and_a_rank_named_by_its_own_copy(state: Any) -> None:
    fill(state, 0, 1.0)
    fill(state, 1, 3.0)
    assert checked(state, [0, 1]) == Verdict([], True)
    params = state.params_region.view(torch.float32).clone()
    fill(state, 1, float("nan"))  # after the check: the update steps with the fold
    state.apply([0, 1])
    assert torch.allclose(state.params_region.view(torch.float32), params - 0.1 * 2.0)
    fill(state, 1, float("inf"))
    assert checked(state, [0, 1]) == Verdict([1], False)
    assert checked(state, [0]) == Verdict([], True)  # the others, folded again


@pytest.mark.parametrize("where", ["first", "last"])
@pytest.mark.parametrize("ranks", [[0], [0, 1]])
def test_the_fold_is_checked_piece_by_piece_and_a_nan_in_its_last_piece_is_found(
        state: Any, monkeypatch: pytest.MonkeyPatch, where: str, ranks: list[int]) -> None:
    """The check is taken as the fold is made (by the kernel value by value; by torch ops
    in pieces, here of 16 bytes where a real one is 4 MiB); NaN in the first or the last
    piece of the last tensor is found, names its rank, and nothing of the step is
    applied."""
    monkeypatch.setattr(fold, "CHECK_PIECE", 16)
    for rank in ranks:
        fill(state, rank, 1.0)
    slot = state.slot_region(ranks[-1]).view(torch.float32)
    assert slot.numel() > 4 * 4  # several pieces
    params = state.params_region.view(torch.float32).clone()
    slot[0 if where == "first" else -1] = float("nan")
    assert checked(state, ranks) == Verdict([ranks[-1]], False)
    assert torch.equal(state.params_region.view(torch.float32), params)  # nothing applied
    slot[0 if where == "first" else -1] = 1.0
    assert checked(state, ranks) == Verdict([], True)
    state.apply(ranks)
    assert torch.allclose(state.params_region.view(torch.float32), params - 0.1 * 1.0)


def test_a_mean_that_overflows_is_not_applied_though_no_rank_is_to_blame(state: Any) -> None:
    for rank in (0, 1):
        fill(state, rank, 0.0)[0] = 3e38  # each sums to a finite value, their mean does not
    assert checked(state, [0, 1]) == Verdict([], False)


@pytest.mark.parametrize("put_back", [False, True])
def test_a_slot_changed_while_it_is_folded_is_judged_by_a_private_copy(
        state: Any, monkeypatch: pytest.MonkeyPatch, put_back: bool, fold_path: str) -> None:
    """Rank 1 writes NaN into its slot while the shard folds it: the fold is not finite,
    so each slot is copied and checked on its own. A NaN still there names rank 1; one put
    back by then leaves copies that are finite, and their mean is what is applied."""
    fill(state, 0, 1.0)
    slot = fill(state, 1, 3.0)

    def racing(real: Callable[..., Any]) -> Callable[..., Any]:
        def folding(acc: torch.Tensor, slots: Any, **kw: Any) -> Any:
            slot.fill_(float("nan"))
            got = real(acc, slots, **kw)
            if put_back:
                slot.fill_(3.0)
            return got
        return folding

    if fold_path == "kernel":
        kernel = foldkernel.load(fold._mean_into)
        assert kernel is not None
        monkeypatch.setattr(kernel, "fold", racing(kernel.fold))
    else:
        monkeypatch.setattr(fold, "_mean_into", racing(fold._mean_into))
    verdict = checked(state, [0, 1])
    assert verdict == (Verdict([], True) if put_back else Verdict([1], False))
    if put_back:
        params = state.params_region.view(torch.float32).clone()
        state.apply([0, 1])
        assert torch.allclose(state.params_region.view(torch.float32), params - 0.1 * 2.0)
