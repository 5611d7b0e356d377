"""The pure parts of the parameter server: scheduling, shard math, checkpoints, messages."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest
import torch

from tensorx._ps.service.losses import LossWatch
from tensorx._ps.service.schedule import Scheduler
from tensorx._ps.state.shard import ShardLayout, ShardState, Slot, load_checkpoint, views
from tensorx._ps.update import parts
from tensorx._ps.wire import protocol
from tensorx.errors import ProtocolError, UsageError
from tensorx.testing import wait_until


def _layout() -> ShardLayout:
    slots = (Slot("w", 0, 6, torch.float32), Slot("b", 64, 3, torch.float32))
    return ShardLayout(0, 1, 128, slots, "fp-test")


# -- scheduling -------------------------------------------------------------------------
def test_sync_applies_once_all_ranks_pushed() -> None:
    s = Scheduler("sync", 3)
    for r in range(3):
        s.join(r)
    assert s.push(2).apply == []
    assert s.push(0).apply == []
    d = s.push(1)
    assert d.apply == [0, 1, 2]
    assert d.release == [0, 1, 2]


def test_sync_waits_for_a_missing_rank() -> None:
    s = Scheduler("sync", 2)
    s.join(0)
    assert s.push(0).apply == []
    s.join(1)
    assert s.push(1).apply == [0, 1]


def test_async_applies_and_answers_each_push() -> None:
    s = Scheduler("async", 2)
    s.join(0)
    s.join(1)
    d = s.push(1)
    assert (d.apply, d.release) == ([1], [1])


def test_double_push_and_unknown_rank_are_protocol_errors() -> None:
    s = Scheduler("sync", 2)
    s.join(0)
    s.push(0)
    with pytest.raises(ProtocolError, match="twice"):
        s.push(0)
    with pytest.raises(ProtocolError, match="not joined"):
        s.push(1)


@pytest.mark.parametrize("mode", ["sync", "async", "bounded"])
def test_a_push_of_the_same_step_again_is_taken_once(mode: str) -> None:
    """A worker retrying a step that timed out pushes that step again: the scheduler sees
    it as the push it has (pending or answered), never as a second one."""
    s = Scheduler(mode, 2)
    s.join(0)
    s.join(1)
    assert not s.again(0, 7)
    s.push(0, 7)
    assert s.again(0, 7) and not s.again(0, 8) and not s.again(1, 7)
    s.push(1, 3)
    assert s.again(0, 7)  # answered: a late retry is still the same push
    s.leave(0)
    s.join(0)  # a new connection: its first push is new, whatever its step
    assert not s.again(0, 7)


def test_bad_mode_is_usage_error() -> None:
    with pytest.raises(UsageError, match="mode"):
        Scheduler("eventually", 2)


@pytest.mark.parametrize("staleness", [0, 1, 3])
def test_bounded_staleness_holds_under_random_arrivals(staleness: int) -> None:
    rng = random.Random(staleness)
    s = Scheduler("bounded", 3, staleness)
    for r in range(3):
        s.join(r)
    ready, done = {0, 1, 2}, [0, 0, 0]
    while min(done) < 30:
        rank = rng.choice(sorted(ready))
        ready.discard(rank)
        d = s.push(rank)
        assert d.apply == [rank]
        done[rank] += 1
        ready.update(d.release)
        for r in d.release:
            assert done[r] - min(done) <= staleness
        assert ready, "deadlock: nobody may proceed"
    assert s.max_gap <= staleness


def test_bounded_leave_releases_waiters() -> None:
    s = Scheduler("bounded", 2, 0)
    s.join(0)
    s.join(1)
    assert s.push(0).release == []
    assert s.leave(1).release == [0]


# -- shard math -------------------------------------------------------------------------
@pytest.mark.parametrize("make", [
    lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    lambda p: torch.optim.Adam(p, lr=0.01),
])
def test_shard_optimizer_matches_plain_torch(make: object) -> None:
    state = ShardState(_layout(), 2, make)  # type: ignore[arg-type]
    w, b = torch.nn.Parameter(torch.zeros(6)), torch.nn.Parameter(torch.zeros(3))
    ref = make([w, b])  # type: ignore[operator]
    gen = torch.Generator().manual_seed(0)
    for _ in range(5):
        grads = [[torch.randn(6, generator=gen), torch.randn(3, generator=gen)] for _ in range(2)]
        for r in range(2):
            for i, g in enumerate(grads[r]):
                state.slot_views(r)[i].copy_(g)
        state.apply([0, 1])
        w.grad, b.grad = [(grads[0][i] + grads[1][i]) / 2 for i in range(2)]
        ref.step()
    assert torch.allclose(state.params[0], w)
    assert torch.allclose(state.params[1], b)
    assert state.version == 5


def test_checkpoint_round_trip_resumes_identically(tmp_path: Path) -> None:
    def make(p: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.Adam(p, lr=0.05)

    a = ShardState(_layout(), 1, make, verify=True)
    a.slot_views(0)[0].fill_(1.0)
    a.apply([0])
    a.save(tmp_path / "ck.pt", b"plan-bytes")
    saved = load_checkpoint(tmp_path / "ck.pt")
    assert saved["plan"] == b"plan-bytes"
    b = ShardState(_layout(), 1, make, verify=True)
    b.load_state_dict(saved)
    assert b.version == 1
    assert a.checksum() == b.checksum()
    for s in (a, b):
        s.slot_views(0)[0].fill_(-2.0)
        s.apply([0])
    assert torch.equal(a.params[0], b.params[0])


def test_checkpoint_of_another_plan_is_refused(tmp_path: Path) -> None:
    a = ShardState(_layout(), 1, lambda p: torch.optim.SGD(p, lr=0.1))
    a.save(tmp_path / "ck.pt", b"x")
    other = ShardLayout(0, 1, 128, _layout().slots, "fp-other")
    b = ShardState(other, 1, lambda p: torch.optim.SGD(p, lr=0.1))
    with pytest.raises(UsageError, match="different plan"):
        b.load_state_dict(load_checkpoint(tmp_path / "ck.pt"))


def test_checksum_changes_with_every_update() -> None:
    state = ShardState(_layout(), 1, lambda p: torch.optim.SGD(p, lr=0.1), verify=True)
    seen = {state.checksum()}
    for _ in range(3):
        state.slot_views(0)[0].fill_(1.0)
        state.apply([0])
        seen.add(state.checksum())
    assert len(seen) == 4


# -- control messages -------------------------------------------------------------------
def test_messages_round_trip() -> None:
    raw = protocol.encode("push", step=3, version=7, staging={"emb.weight": b"desc"},
                          mapped=False, hyper=[{"lr": 0.5}], inbox=b"", parts=[0, 2])
    assert protocol.decode(raw) == {"t": "push", "step": 3, "version": 7,
                                    "staging": {"emb.weight": b"desc"}, "mapped": False,
                                    "hyper": [{"lr": 0.5}], "inbox": b"", "parts": [0, 2]}
    assert protocol.decode(protocol.encode("part", k=5)) == {"t": "part", "k": 5}


@pytest.mark.parametrize("payload", [
    b"\xc1", b"\x93\x01\x02\x03", protocol.encode("bye")[:-1] + b"\x81",
])
def test_garbage_is_a_protocol_error(payload: bytes) -> None:
    with pytest.raises(ProtocolError):
        protocol.decode(payload)


def test_wrong_field_type_is_a_protocol_error() -> None:
    import msgpack

    with pytest.raises(ProtocolError, match="step"):
        protocol.decode(msgpack.packb({"t": "push", "step": "3", "version": 1, "staging": {},
                                       "mapped": False}))
    with pytest.raises(ProtocolError, match="unknown"):
        protocol.decode(msgpack.packb({"t": "pickle"}))


def test_lr_scheduler_steps_with_every_update() -> None:
    def make(p: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.SGD(p, lr=0.5, momentum=0.5)

    def sched(o: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
        return torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.1)

    state = ShardState(_layout(), 1, make, lr_scheduler=sched)
    w, b = torch.nn.Parameter(torch.zeros(6)), torch.nn.Parameter(torch.zeros(3))
    opt = make([w, b])
    ref = sched(opt)
    for step in range(5):
        state.slot_views(0)[0].fill_(step + 1.0)
        state.apply([0])
        w.grad, b.grad = torch.full((6,), step + 1.0), torch.zeros(3)
        opt.step()
        ref.step()
    assert torch.allclose(state.params[0], w)
    assert state.optimizer.param_groups[0]["lr"] == pytest.approx(0.5 * 0.01)


@pytest.mark.parametrize("make", [
    lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=1e-3),
    lambda p: torch.optim.AdamW(p, lr=0.01),
], ids=["sgd-momentum-wd", "adamw"])
def test_flat_optimizer_equals_per_tensor(make: object) -> None:
    """One flat parameter over the arena (padding included) gives the same parameters as
    one parameter per tensor, averaging two slots or taking one slot as is."""
    states = [ShardState(_layout(), 2, make, flat=f) for f in (False, True)]  # type: ignore[arg-type]
    assert [s.flat for s in states] == [False, True]
    assert len(states[1].params) == 1
    gen = torch.Generator().manual_seed(1)
    for step in range(6):
        grads = [torch.randn(2, 32, generator=gen) for _ in range(2)]
        for s in states:
            for r in range(2):
                for slot, view in zip(s.layout.slots, views(s.layout, s.slot_regions[r]),
                                      strict=True):
                    view.copy_(grads[r][0 if slot.key == "w" else 1][:slot.numel])
            s.apply([0, 1] if step % 2 else [step % 4 // 2])
    for a, b in zip(states[0].views, states[1].views, strict=True):
        torch.testing.assert_close(a, b)


def _fill_slots(state: ShardState, grads: list[torch.Tensor]) -> None:
    for r, g in enumerate(grads):
        for slot, view in zip(state.layout.slots, views(state.layout, state.slot_regions[r]),
                              strict=True):
            view.copy_(g[:slot.numel] if slot.key == "w" else g[8:8 + slot.numel])


@pytest.mark.parametrize("make", [
    lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=1e-3),
    lambda p: torch.optim.Adam(p, lr=0.01),
], ids=["sgd-momentum-wd", "adam"])
def test_a_flat_update_applied_part_by_part_is_the_same_update(
        make: object, monkeypatch: pytest.MonkeyPatch) -> None:
    whole = ShardState(_layout(), 2, make, flat=True)  # type: ignore[arg-type]
    monkeypatch.setattr(parts, "PART_BYTES", 32)
    split = ShardState(_layout(), 2, make, flat=True)  # type: ignore[arg-type]
    assert (whole.num_parts, split.num_parts) == (1, 4)
    assert [split.part_bytes(k) for k in range(4)] == [(0, 32), (32, 32), (64, 32), (96, 32)]
    gen = torch.Generator().manual_seed(3)
    for step in range(5):
        grads = [torch.randn(16, generator=gen) for _ in range(2)]
        ranks = [0, 1] if step % 2 else [1]
        for s in (whole, split):
            _fill_slots(s, grads)
        whole.apply(ranks)
        for k in reversed(range(4)):  # any order: the parts are independent
            split.apply_part(ranks, k)
        split.finish_update()
    assert whole.version == split.version == 5
    for a, b in zip(whole.views, split.views, strict=True):
        torch.testing.assert_close(a, b)


def test_a_flat_checkpoint_does_not_depend_on_the_part_size(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def adam(p: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.Adam(p, lr=0.01)

    gen = torch.Generator().manual_seed(4)
    steps = [[torch.randn(16, generator=gen)] for _ in range(6)]

    def train(state: ShardState, batch: list[list[torch.Tensor]]) -> None:
        for grads in batch:
            _fill_slots(state, grads)
            state.apply([0])

    reference = ShardState(_layout(), 1, adam, flat=True)
    train(reference, steps)
    for saved_parts, loaded_parts in ((32, None), (None, 32)):
        monkeypatch.setattr(parts, "PART_BYTES", saved_parts or parts.PART_BYTES)
        first = ShardState(_layout(), 1, adam, flat=True)
        train(first, steps[:3])
        first.save(tmp_path / "ck.pt", b"x")
        monkeypatch.undo()
        monkeypatch.setattr(parts, "PART_BYTES", loaded_parts or parts.PART_BYTES)
        second = ShardState(_layout(), 1, adam, flat=True)
        assert first.num_parts != second.num_parts
        second.load_state_dict(load_checkpoint(tmp_path / "ck.pt"))
        train(second, steps[3:])
        monkeypatch.undo()
        for a, b in zip(reference.views, second.views, strict=True):
            torch.testing.assert_close(a, b)


def test_flat_checkpoint_needs_a_flat_server(tmp_path: Path) -> None:
    def sgd(p: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.SGD(p, lr=0.1)

    ShardState(_layout(), 1, sgd, flat=True).save(tmp_path / "ck.pt", b"x")
    with pytest.raises(UsageError, match="flat=True"):
        ShardState(_layout(), 1, sgd).load_state_dict(load_checkpoint(tmp_path / "ck.pt"))
    ShardState(_layout(), 1, sgd, flat=True).load_state_dict(load_checkpoint(tmp_path / "ck.pt"))


def test_an_empty_shard_counts_versions() -> None:
    state = ShardState(ShardLayout(1, 2, 0, (), "fp"), 1,
                       lambda p: torch.optim.SGD(p, lr=0.1), flat=True)
    state.apply([0])
    assert state.version == 1


# -- lost workers (sync barrier policy) --------------------------------------------------
def test_continue_completes_the_barrier_without_an_excused_rank() -> None:
    s = Scheduler("sync", 3)
    for r in range(3):
        s.join(r)
    assert s.push(0).apply == []
    s.leave(2)
    assert s.push(1).apply == []  # still waits for rank 2: not excused yet
    assert s.waiting_for() == [2]
    d = s.excuse(2)
    assert (d.apply, d.release) == ([0, 1], [0, 1])
    s.push(0)
    assert s.push(1).apply == [0, 1]  # later barriers go on without it
    s.join(2)  # rejoined: counted at once
    s.push(0)
    assert s.push(1).apply == []
    assert s.push(2).apply == [0, 1, 2]


def test_a_rank_that_pushed_then_left_is_dropped_from_the_barrier() -> None:
    s = Scheduler("sync", 2)
    s.join(0)
    s.join(1)
    s.push(1)
    s.leave(1)  # its pushed gradient must never be applied
    assert s.excuse(1).apply == []  # nothing pending: no barrier to complete
    assert s.push(0).apply == [0]


def test_a_rank_that_rejoined_during_a_barrier_is_waited_for() -> None:
    s = Scheduler("sync", 3)
    for r in range(3):
        s.join(r)
    s.leave(2)
    s.excuse(2)
    s.push(0)
    s.join(2)  # came back while the barrier waits for rank 1
    assert s.waiting_for() == [1, 2]
    assert s.push(1).apply == []
    assert s.push(2).apply == [0, 1, 2]


def test_everybody_lost_then_one_rejoins() -> None:
    s = Scheduler("sync", 2)
    for r in range(2):
        s.join(r)
        s.leave(r)
        assert s.excuse(r).apply == []  # an empty barrier never completes
    assert s.excuse(0).apply == []
    s.join(1)
    assert s.push(1).apply == [1]
    s.join(0)
    assert s.excuse(0).apply == []  # excusing a connected rank does nothing
    s.push(1)
    assert s.push(0).apply == [0, 1]


async def test_loss_timer_fires_once_and_rejoining_cancels_it() -> None:
    fired: list[int] = []
    s = Scheduler("sync", 2)
    watch = LossWatch(0, "continue", 0.05, fired.append)
    for r in range(2):
        s.join(r)
    s.push(0)
    s.leave(1)
    watch.gone(1)
    watch.gone(1)  # the same absence: one timer
    await wait_until(lambda: fired, what="the loss timer")
    assert fired == [1]
    assert watch.declare(1, s, [0]).apply == [0]
    assert watch.declare(1, s, [0]).apply == []  # handled: a second event is stale
    s.leave(0)
    watch.gone(0)
    assert watch.back(0) is not None  # back before its timeout: no event
    await asyncio.sleep(0.2)  # past the 0.05 s timer: the behaviour is that nothing fires
    assert fired == [1]
    with pytest.raises(UsageError):
        LossWatch(0, "panic", 1.0, fired.append)


def test_a_connected_rank_that_missed_a_barrier_is_late_until_it_joins_again() -> None:
    s = Scheduler("sync", 3)
    for r in range(3):
        s.join(r)
    s.push(0, 0)
    s.push(1, 0)
    assert s.barrier == 0 and s.waiting_for() == [2]
    d = s.miss([2])  # connected, and it has not pushed: the barrier goes on without it
    assert (d.apply, d.release, s.barrier) == ([0, 1], [0, 1], 1)
    assert s.late(2) and not s.late(0)
    s.push(0, 1)
    assert s.push(1, 1).apply == [0, 1]  # later barriers too
    s.leave(2)
    assert not s.late(2)  # gone: a disconnected lost rank, as after its timer
    s.join(2)  # rejoined: counted again
    assert not s.late(2)
    s.push(0, 2)
    s.push(1, 2)
    assert s.push(2, 2).apply == [0, 1, 2]


async def test_a_barriers_clock_finds_the_connected_ranks_that_missed_it() -> None:
    overdue: list[int] = []
    s = Scheduler("sync", 3)
    watch = LossWatch(0, "continue", 0.1, lambda rank: None, overdue.append)
    for r in range(3):
        s.join(r)
        watch.back(r)
    s.push(0, 0)
    watch.opened(s.barrier)
    await asyncio.sleep(0.05)
    s.leave(1)  # disconnected: its own timer decides about it, not the barrier's clock
    s.join(2)
    watch.back(2)  # joined again after the barrier opened: its 0.1 s run from then
    await wait_until(lambda: overdue, what="the barrier's clock")
    assert overdue == [0]
    assert watch.overdue(0, s, [0, 2]).apply == []  # rank 2 still has time
    await wait_until(lambda: len(overdue) == 2, what="the clock, again for rank 2")
    d = watch.overdue(0, s, [0, 2])
    assert not s.late(1) and s.late(2) and watch.declared == 1
    assert d.apply == []  # it still waits for rank 1, disconnected: its own timer's job
    assert s.excuse(1).apply == [0] and s.barrier == 1  # rank 1's timer ran out
    assert watch.overdue(0, s, [0, 2]).apply == []  # a stale clock changes nothing
    watch.close()
    for policy, timeout in (("wait", 0.01), ("continue", None)):  # no clock at all
        fired: list[int] = []
        idle = LossWatch(0, policy, timeout, fired.append, fired.append)
        idle.opened(0)
        await asyncio.sleep(0.05)
        assert fired == []
