"""A sync PS loses a worker to SIGKILL in the middle of a push (issue 7, first scenario).

Two worker processes push known gradients (exact in float32: rank r pushes (r + 1) * SCALE
into every element, and SGD with lr=1 subtracts their mean), so every parameter value the
test sees has one exact expected value. The victim writes a poisoned gradient into its slot
on the shard (half of it over the wire, or all of it straight into the mapped slot) and is
killed before its push notification: the poison must never be applied. A fresh process with
the same rank then re-handshakes and must get a fresh slot (the dead one's descriptor is
refused). The shard runs in this test's event loop, so its state can be checked directly.

The last tests keep a rank connected but hung (a worker in this loop that stops stepping:
its node goes on answering, it just never pushes): under "continue" the barrier goes on
without it after worker_loss_timeout, and a step that timed out meanwhile is retried as
the same step, under either policy.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import os
import signal
import time
import traceback
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from tensorx import _shm
from tensorx.errors import RegionError, TimeoutError
from tensorx.memregion import RegionDescriptor, host_id
from tensorx.ps import ParameterServer
from tensorx.testing import wait_until
from tensorx.worker import Worker

SIZE = 1024
SCALE = 2.0 ** -4
BOTH = (1 + 2) * SCALE / 2   # one update with both ranks' gradients
ALONE = 1 * SCALE            # one update with rank 0's gradient only
POISON = 1000.0
LOSS_TIMEOUT = 1.0


class Params(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.zeros(SIZE))


def values(t: torch.Tensor) -> list[float]:
    return sorted(set(t.detach().reshape(-1).tolist()))


# -- the worker processes ------------------------------------------------------------------
def _worker_main(rank: int, share: bool, conn: Connection) -> None:
    torch.set_num_threads(1)
    try:
        asyncio.run(_worker(rank, share, conn))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        raise


async def _worker(rank: int, share: bool, conn: Connection) -> None:
    _, address, stale = await asyncio.to_thread(conn.recv)  # ("start", ...): imports are done
    model = Params()
    async with Worker(model, address, rank=rank, num_workers=2, transport="tcp", timeout=30,
                      share_memory=share) as w:
        report: dict[str, Any] = {"slot": w._links.shards[0].slot.to_bytes(), "mapped": w.mapped,
                                  "values": values(model.a),
                                  "slot_file": w._region(0, "grads").shared_name}
        if stale:
            report["stale"] = await _write_to(w, RegionDescriptor.from_bytes(stale))
        conn.send(("ready", report))
        while (cmd := await asyncio.to_thread(conn.recv))[0] != "close":
            if cmd[0] == "step":
                w.zero_grad()
                (model.a * ((rank + 1) * SCALE)).sum().backward()
                await w.step()
                conn.send(("stepped", (values(model.a), time.monotonic(), w.stats["rejoins"])))
            elif cmd[0] == "poison":
                await _poison(w, model)
                conn.send(("blocked", None))
                await asyncio.sleep(3600)  # killed here, before any push notification
    conn.send(("closed", None))


async def _poison(w: Worker, model: Params) -> None:
    """Mid-push: a gradient (all POISON) lands in the shard's slot, no notification follows.
    Mapped, the model's gradient *is* the slot; else half of it travels as a one-sided write."""
    w.zero_grad()
    (model.a * POISON).sum().backward()
    if not w.mapped[0]:
        grads = w._region(0, "grads")
        await w._eps[0].write(grads, w._links.shards[0].slot, nbytes=grads.nbytes // 2)


async def _write_to(w: Worker, desc: RegionDescriptor) -> str:
    try:
        await w._eps[0].write(w._region(0, "grads"), desc, nbytes=64)
    except RegionError as exc:
        return f"refused: {exc}"
    return "accepted"


class Child:
    """One worker process and its pipe; it connects on :meth:`start`."""

    def __init__(self, ctx: Any, rank: int, share: bool) -> None:
        self.rank = rank
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, args=(rank, share, child), daemon=True)
        self.proc.start()

    def send(self, *cmd: Any) -> None:
        self.conn.send(cmd)

    async def expect(self, kind: str, timeout: float = 60.0) -> Any:
        if not await asyncio.to_thread(self.conn.poll, timeout):
            raise AssertionError(f"worker rank {self.rank} sent no {kind!r} in {timeout} s")
        got, value = self.conn.recv()
        if got == "error":
            raise AssertionError(f"worker rank {self.rank} failed:\n{value}")
        assert got == kind, (got, value)
        return value

    async def step(self) -> tuple[list[float], float, int]:
        self.send("step")
        result: tuple[list[float], float, int] = await self.expect("stepped")
        return result

    def kill(self) -> float:
        """SIGKILL; returns the wall-clock time of the kill (for log timestamps)."""
        assert self.proc.pid is not None
        wall = time.time()
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(10)
        return wall

    def stop(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(10)


def shard_values(ps: ParameterServer) -> list[float]:
    assert ps.state is not None
    return values(ps.state.views[0])


def sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=1.0)


async def start_pair(ps: ParameterServer, children: list[Child]) -> list[dict[str, Any]]:
    for c in children:
        c.send("start", ps.address, b"")
    return [await c.expect("ready") for c in children]


async def step_both(a: Child, b: Child) -> list[float]:
    (va, _, _), (vb, _, _) = await asyncio.gather(a.step(), b.step())
    assert va == vb
    return va


async def finish(ps: ParameterServer, want: float, version: int, children: tuple[Child, Child],
                 steps: int) -> None:
    """``steps`` more steps together, then the shard holds exactly ``want`` at ``version``;
    the children leave cleanly."""
    for _ in range(steps):
        want -= BOTH
        assert await step_both(*children) == [want]
    assert shard_values(ps) == [want] and ps.version == version
    for c in children:
        c.send("close")
        await c.expect("closed")


def loss_records(caplog: pytest.LogCaptureFixture, text: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if text in r.getMessage()]


async def step(w: Worker, m: Params, rank: int) -> None:
    """One step of an in-loop worker: rank ``rank``'s known gradient, pushed and pulled."""
    w.zero_grad()
    (m.a * ((rank + 1) * SCALE)).sum().backward()
    await w.step()


async def step_together(ws: list[Worker], models: list[Params]) -> list[float]:
    await asyncio.gather(*(step(w, m, r) for r, (w, m) in enumerate(zip(ws, models,
                                                                         strict=True))))
    assert values(models[0].a) == values(models[1].a)
    return values(models[0].a)


# -- the tests -----------------------------------------------------------------------------
async def test_continue_goes_on_without_a_worker_killed_mid_push(
        caplog: pytest.LogCaptureFixture) -> None:
    """on_worker_loss="continue", copy path: the victim's half-written poison is never
    applied; after the timeout the survivor's steps go on alone; a restarted rank 1 gets a
    fresh slot, the dead one's descriptor is refused, and both go on together."""
    caplog.set_level(logging.INFO, logger="tensorx")
    ctx = mp.get_context("spawn")
    survivor, victim, successor = Child(ctx, 0, False), Child(ctx, 1, False), Child(ctx, 1, False)
    try:
        async with ParameterServer(num_workers=2, mode="sync", optimizer=sgd, transport="tcp",
                                   share_memory=False, on_worker_loss="continue",
                                   worker_loss_timeout=LOSS_TIMEOUT) as ps:
            (_, old) = await start_pair(ps, [survivor, victim])
            want = 0.0
            for _ in range(2):
                want -= BOTH
                assert await step_both(survivor, victim) == [want]
            survivor.send("step")  # pushes and waits at the barrier
            victim.send("poison")
            await victim.expect("blocked")
            t_kill, wall_kill = time.monotonic(), victim.kill()

            values_, t_done, rejoins = await survivor.expect("stepped")
            want -= ALONE
            assert values_ == [want] and shard_values(ps) == [want] and ps.version == 3
            waited = t_done - t_kill
            assert waited >= LOSS_TIMEOUT, waited  # never before its timeout (a lower bound)
            (gone,) = loss_records(caplog, "worker rank 1 disconnected")
            (lost,) = loss_records(caplog, "sync barriers go on without it")
            assert lost.levelno == logging.WARNING and "rank 1" in lost.getMessage()
            for _ in range(2):  # alone now: no timer for it any more (one loss, one line)
                values_, t_done, rejoins = await survivor.step()
                want -= ALONE
                assert values_ == [want]
            assert rejoins == 0 and ps.stats["worker_losses"] == 1
            assert len(loss_records(caplog, "sync barriers go on without it")) == 1

            successor.send("start", ps.address, old["slot"])
            new = await successor.expect("ready")
            assert new["slot"] != old["slot"]
            assert new["stale"].startswith("refused: ") and "not exported" in new["stale"]
            assert new["values"] == [want]  # the shard's parameters, not its own zeros
            await finish(ps, want, 7, (survivor, successor), steps=2)
    finally:
        for c in (survivor, victim, successor):
            c.stop()
    print(f"\ncontinue: PS saw the SIGKILL after {(gone.created - wall_kill) * 1e3:.1f} ms; "
          f"the survivor's step completed {waited:.2f} s after the kill "
          f"(worker_loss_timeout={LOSS_TIMEOUT} s)")


@pytest.mark.skipif(not host_id(), reason="no usable /dev/shm")
async def test_wait_holds_the_barrier_until_a_restarted_worker_rejoins(
        caplog: pytest.LogCaptureFixture) -> None:
    """on_worker_loss="wait", mapped path (the poison is written straight into the shard's
    slot): nothing is applied until a fresh process with the dead rank re-handshakes into a
    fresh /dev/shm slot and pushes; then the held-up survivor and it go on together."""
    caplog.set_level(logging.INFO, logger="tensorx")
    ctx = mp.get_context("spawn")
    survivor, victim, successor = Child(ctx, 0, True), Child(ctx, 1, True), Child(ctx, 1, True)
    try:
        async with ParameterServer(num_workers=2, mode="sync", optimizer=sgd, transport="tcp",
                                   on_worker_loss="wait",
                                   worker_loss_timeout=LOSS_TIMEOUT) as ps:
            (_, old) = await start_pair(ps, [survivor, victim])
            assert old["mapped"] == [True] and old["slot_file"] is not None
            want = 0.0
            for _ in range(2):
                want -= BOTH
                assert await step_both(survivor, victim) == [want]
            survivor.send("step")
            victim.send("poison")
            await victim.expect("blocked")
            assert ps.state is not None
            assert values(ps.state.slot_region(1).view(torch.float32)) == [POISON]
            t_kill, wall_kill = time.monotonic(), victim.kill()

            await wait_until(lambda: loss_records(caplog, "keeps waiting for it to rejoin"),
                             30, what="the loss timer")
            assert not survivor.conn.poll()  # still held at the barrier
            assert shard_values(ps) == [want] and ps.version == 2
            (gone,) = loss_records(caplog, "worker rank 1 disconnected")
            (lost,) = loss_records(caplog, "keeps waiting for it to rejoin")
            assert lost.levelno == logging.WARNING and "rank 1" in lost.getMessage()
            assert lost.created - gone.created >= LOSS_TIMEOUT
            fresh = ps.state.slot_region(1)
            assert fresh.shared_name != old["slot_file"]
            assert not (Path(_shm.SHM_DIR) / old["slot_file"]).exists()
            assert values(fresh.view(torch.float32)) == [0.0]  # the poison went with the slot

            t_restart = time.monotonic()
            successor.send("start", ps.address, old["slot"])
            new = await successor.expect("ready")
            rejoin_s = time.monotonic() - t_restart
            assert new["mapped"] == [True] and new["slot_file"] == fresh.shared_name
            assert new["slot"] != old["slot"]
            assert new["stale"].startswith("refused: ")
            assert ps.version == 2  # joining alone applies nothing
            successor.send("step")
            (v1, _, rejoins), (v2, _, _) = await asyncio.gather(
                survivor.expect("stepped"), successor.expect("stepped"))
            want -= BOTH
            assert v1 == v2 == [want] and rejoins == 0  # the survivor's link held throughout
            await finish(ps, want, 4, (survivor, successor), steps=1)
    finally:
        for c in (survivor, victim, successor):
            c.stop()
    assert len(loss_records(caplog, "keeps waiting")) == 1  # once per absence
    print(f"\nwait: PS saw the SIGKILL after {(gone.created - wall_kill) * 1e3:.1f} ms; "
          f"warned after {lost.created - wall_kill:.2f} s; a pre-started process with rank 1 "
          f"re-handshook in {rejoin_s:.2f} s; survivor held {time.monotonic() - t_kill:.1f} s "
          "in all")


async def test_a_resumed_server_goes_on_without_a_rank_that_never_returns(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Restarted from its checkpoint, the shard expects every rank back; under "continue"
    the one rank that comes back trains alone once the others' timeout has run out."""
    caplog.set_level(logging.INFO, logger="tensorx")
    models = [Params(), Params()]
    async with ParameterServer(num_workers=2, optimizer=sgd, transport="tcp",
                               checkpoint_dir=tmp_path) as ps:
        ws = [Worker(m, ps.address, rank=r, num_workers=2, transport="tcp")
              for r, m in enumerate(models)]
        await asyncio.gather(*(w.start() for w in ws))
        await asyncio.gather(*(step(w, m, r)
                               for r, (w, m) in enumerate(zip(ws, models, strict=True))))
        await asyncio.gather(*(w.aclose() for w in ws))
    started = time.monotonic()  # the timeouts run from the restart
    async with ParameterServer(num_workers=2, optimizer=sgd, transport="tcp",
                               checkpoint_dir=tmp_path, on_worker_loss="continue",
                               worker_loss_timeout=LOSS_TIMEOUT / 2) as ps:
        assert ps.version == 1
        async with Worker(models[0], ps.address, rank=0, num_workers=2, transport="tcp") as w:
            await step(w, models[0], 0)
            # it went through once rank 1 was declared lost, never before its timeout
            assert loss_records(caplog, "sync barriers go on without it")
            assert time.monotonic() - started >= LOSS_TIMEOUT / 2
            await step(w, models[0], 0)
        assert values(models[0].a) == [-BOTH - 2 * ALONE] and ps.version == 3
    (lost,) = loss_records(caplog, "sync barriers go on without it")
    assert "rank 1" in lost.getMessage() and lost.levelno == logging.WARNING


async def test_a_worker_killed_just_before_the_answer_leaves_the_others_served(
        caplog: pytest.LogCaptureFixture) -> None:
    """Both ranks pushed; rank 1 is killed as the shard starts answering, before its loop
    has read that end: the survivor still gets the update's parameters, then goes on alone
    ("continue"); the death is a WARNING naming the rank, never an ERROR or traceback."""
    caplog.set_level(logging.INFO)
    ctx = mp.get_context("spawn")
    survivor, victim = Child(ctx, 0, False), Child(ctx, 1, False)
    try:
        async with ParameterServer(num_workers=2, mode="sync", optimizer=sgd, transport="tcp",
                                   share_memory=False, on_worker_loss="continue",
                                   worker_loss_timeout=LOSS_TIMEOUT) as ps:
            await start_pair(ps, [survivor, victim])
            answer = ps.updates._send_params

            async def killing_first(peer: Any, sent: Any = None) -> None:
                if victim.proc.is_alive():
                    victim.kill()  # blocking: gone before the shard's loop runs again
                await answer(peer, sent)

            ps.updates._send_params = killing_first  # type: ignore[method-assign]
            survivor.send("step")
            victim.send("step")
            values_, _, rejoins = await survivor.expect("stepped")
            assert values_ == [-BOTH] and rejoins == 0 and not victim.proc.is_alive()
            values_, _, _ = await survivor.step()  # alone, once rank 1 is declared lost
            assert values_ == [-BOTH - ALONE] and ps.version == 2
            survivor.send("close")
            await survivor.expect("closed")
    finally:
        for c in (survivor, victim):
            c.stop()
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []
    assert any("rank 1" in r.getMessage() for r in caplog.records
               if r.levelno == logging.WARNING)


# -- a rank that hangs with its connection open; a step retried after its timeout -----------
def hung_pair(ps: ParameterServer, models: list[Params], reconnect: float | None = None,
              **options: Any) -> list[Worker]:
    """Rank 0 and rank 1 in this loop, over the defaults or ``options`` (rank 1 with
    ``reconnect``). A rank "hangs" by not stepping: its node goes on answering (its
    connection stays open), it just never pushes."""
    return [Worker(m, ps.address, rank=r, num_workers=2, timeout=5.0,
                   reconnect=reconnect if r == 1 else None, **options)
            for r, m in enumerate(models)]


async def test_continue_goes_on_without_a_connected_rank_that_never_pushes(
        caplog: pytest.LogCaptureFixture) -> None:
    """on_worker_loss="continue": rank 1 hangs with its connection open. The barrier goes on
    without it worker_loss_timeout after rank 0's push (one WARNING naming rank 1), the next
    ones at once; when rank 1 comes back to life its late push (computed on parameters an
    update has replaced) is refused, saying why, and with reconnect it rejoins and trains
    with rank 0 again."""
    caplog.set_level(logging.INFO, logger="tensorx")
    models = [Params(), Params()]
    async with ParameterServer(num_workers=2, optimizer=sgd, on_worker_loss="continue",
                               worker_loss_timeout=LOSS_TIMEOUT) as ps:
        ws = hung_pair(ps, models, reconnect=10.0)
        async with ws[0], ws[1]:
            want = -BOTH
            assert await step_together(ws, models) == [want]
            t0 = time.monotonic()
            await step(ws[0], models[0], 0)  # before: TimeoutError after 5 s
            waited = time.monotonic() - t0
            want -= ALONE
            assert values(models[0].a) == [want] and waited >= LOSS_TIMEOUT, waited
            t0 = time.monotonic()
            await step(ws[0], models[0], 0)  # rank 1 is lost: nobody waits for it now
            want -= ALONE
            assert values(models[0].a) == [want] and time.monotonic() - t0 < LOSS_TIMEOUT
            (lost,) = loss_records(caplog, "has not pushed")
            assert lost.levelno == logging.WARNING and "rank 1" in lost.getMessage()
            assert ps.stats["worker_losses"] == 1

            await step(ws[1], models[1], 1)  # back to life: late, refused, rejoins
            assert ws[1].stats["rejoins"] == 1 and values(models[1].a) == [want]
            (refused,) = loss_records(caplog, "rejoining")
            assert "rank 1's push of step 1 came after" in refused.getMessage(), refused
            want -= BOTH
            assert await step_together(ws, models) == [want]
            assert ps.version == 4 and shard_values(ps) == [want]
    assert len(loss_records(caplog, "has not pushed")) == 1
    print(f"\ncontinue, hung rank: rank 0's step went on {waited:.2f} s after its push "
          f"(worker_loss_timeout={LOSS_TIMEOUT} s)")


def push_times_out_once(ep: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """``ep``'s next write raises TimeoutError after it has gone out, notification and all
    (a push whose write timed out although the shard got it)."""
    real = ep.write_many

    async def write_many(*args: Any, **kw: Any) -> None:
        monkeypatch.setattr(ep, "write_many", real)
        await real(*args, **kw)
        raise TimeoutError("the push timed out (after its notification had left)")

    monkeypatch.setattr(ep, "write_many", write_many)


@pytest.mark.parametrize("share_memory", [True, False], ids=["default", "copies"])
@pytest.mark.parametrize("timed_out", ["pull", "push"])
async def test_a_step_retried_after_it_timed_out_gets_the_answer_to_that_step(
        timed_out: str, share_memory: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Default policy ("wait"): rank 1 hangs with its connection open, so rank 0's step
    times out (waiting for its answer, or in its push after the push had reached the
    shard). Rank 0 retries the same step as it is while rank 1 comes back to life and
    pushes: the barrier completes once, with both gradients, the retry gets its answer,
    and the next step finds no answer left over (before: "rank 0 pushed twice"). Over the
    defaults (same host: the arenas mapped) and with every push and pull copied over the
    same-host lane (``share_memory=False``)."""
    models = [Params(), Params()]
    async with ParameterServer(num_workers=2, optimizer=sgd, share_memory=share_memory) as ps:
        ws = hung_pair(ps, models, share_memory=share_memory)
        async with ws[0], ws[1]:
            assert await step_together(ws, models) == [-BOTH]
            if timed_out == "push":
                push_times_out_once(ws[0]._eps[0], monkeypatch)
            ws[0].timeout = 0.5  # shorter than the hang
            with pytest.raises(TimeoutError):
                await step(ws[0], models[0], 0)
            ws[0].timeout = 5.0
            await asyncio.gather(ws[0].step(), step(ws[1], models[1], 1))
            assert values(models[0].a) == values(models[1].a) == [-2 * BOTH]
            assert ps.version == 2
            assert await step_together(ws, models) == [-3 * BOTH]


async def test_continue_a_retried_step_survives_the_hung_rank_being_killed(
        caplog: pytest.LogCaptureFixture) -> None:
    """on_worker_loss="continue", rank 0's timeout shorter than worker_loss_timeout: its step
    times out while rank 1 hangs; rank 1 is then killed and rank 0 retries: the retry is
    taken as the same step and gets the update made without rank 1 (before: ProtocolError
    "rank 0 pushed twice")."""
    caplog.set_level(logging.INFO, logger="tensorx")
    models = [Params(), Params()]
    async with ParameterServer(num_workers=2, optimizer=sgd, on_worker_loss="continue",
                               worker_loss_timeout=LOSS_TIMEOUT) as ps:
        ws = hung_pair(ps, models)
        async with ws[0], ws[1]:
            assert await step_together(ws, models) == [-BOTH]
            ws[0].timeout = 0.5  # shorter than the hang
            with pytest.raises(TimeoutError):
                await step(ws[0], models[0], 0)
            ws[1].node.abort()  # killed: its connection ends without a goodbye
            ws[0].timeout = 5.0
            await ws[0].step()
            assert values(models[0].a) == [-BOTH - ALONE] and ps.version == 2
            await step(ws[0], models[0], 0)
            assert values(models[0].a) == [-BOTH - 2 * ALONE] and ps.version == 3
    assert len(loss_records(caplog, "go on without it")) == 1
