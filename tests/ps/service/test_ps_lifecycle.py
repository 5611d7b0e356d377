"""A run's life: workers started before the server, runs that end, departures named."""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from tensorx.errors import BrokenError, TimeoutError, UsageError
from tensorx.ps import ParameterServer
from tensorx.testing import wait_until
from tensorx.worker import Worker
from tests.support.clusters import PsProcess
from tests.support.data import backward, batches
from tests.support.lanes import assert_link, link_options, links, transports
from tests.support.models import small_mlp
from tests.support.training import SGD_MOMENTUM

TRANSPORTS = transports()


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


async def logged(caplog: pytest.LogCaptureFixture, text: str, within: float = 30.0) -> None:
    """Wait (bounded) until a log record containing ``text`` was emitted."""
    await wait_until(lambda: any(text in r.getMessage() for r in caplog.records), within,
                     what=f"a log line with {text!r}")


async def train(worker: Worker, model: torch.nn.Module,
                data: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    for x, y in data:
        worker.zero_grad()
        backward(model, x, y)
        await worker.step()


def uneven_reference(short: int, data: list[list[tuple[torch.Tensor, ...]]]
                     ) -> list[torch.Tensor]:
    """One process: both ranks' batches while both train, then rank 1's alone."""
    model = small_mlp()
    opt = SGD_MOMENTUM(list(model.parameters()))  # type: ignore[arg-type]
    for i, step in enumerate(data):
        opt.zero_grad()
        used = step if i < short else step[1:]
        backward(model, torch.cat([x for x, _ in used]), torch.cat([y for _, y in used]))
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_worker_started_before_the_server_waits_for_it(
        transport: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="tensorx")
    port = free_port()
    model = small_mlp()
    worker = Worker(model, f"tcp://127.0.0.1:{port}", transport=transport, timeout=60.0)
    attempts = 0
    connect_all = worker._connect_all

    async def counted(*args: Any) -> Any:
        nonlocal attempts
        attempts += 1
        return await connect_all(*args)

    worker._connect_all = counted  # type: ignore[method-assign]
    joining = asyncio.ensure_future(worker.start())
    await logged(caplog, "waiting for the ps shard")
    await wait_until(lambda: attempts >= 3, what="a few refused attempts")
    assert not joining.done()
    async with ParameterServer(f"tcp://127.0.0.1:{port}", num_workers=1,
                               transport=transport) as ps:
        await joining
        try:
            ((x, y),) = batches(1, 1)[0]
            worker.zero_grad()
            backward(model, x, y)
            await worker.step()
            assert ps.version == 1
        finally:
            await worker.aclose()
    waits = [r for r in caplog.records if "waiting for the ps shard" in r.getMessage()]
    assert len(waits) == 1 and waits[0].levelno == logging.INFO  # one line, not one per try


async def test_the_first_join_gives_up_after_the_timeout() -> None:
    port = free_port()
    worker = Worker(small_mlp(), f"tcp://127.0.0.1:{port}", transport="tcp", timeout=0.5)
    with pytest.raises(BrokenError, match=r"no ps shard .* answered within 0.5 s") as info:
        await worker.start()
    # why, even when the budget ran out during the last attempt (it said "timed out")
    assert str(info.value).endswith(
        f"attempts): connection refused: nothing listens at 127.0.0.1:{port} (not started "
        "yet, stopped, or another port?)"), info.value


@pytest.mark.parametrize("link", links())
async def test_sync_goes_on_without_a_rank_that_finished(
        link: str, caplog: pytest.LogCaptureFixture) -> None:
    """Uneven step counts: rank 0 has 2 batches, rank 1 has 5. Rank 0 says goodbye; rank 1
    is not held at the barrier (no timeout) and its last rounds are its gradient alone."""
    caplog.set_level(logging.INFO, logger="tensorx")
    data = batches(5, 2)
    models = [small_mlp(), small_mlp(seed=5)]
    async with ParameterServer(num_workers=2, optimizer=SGD_MOMENTUM,
                               **link_options(link)) as ps:
        ws = [Worker(m, ps.address, rank=r, num_workers=2, timeout=20.0, **link_options(link))
              for r, m in enumerate(models)]
        await asyncio.gather(*(w.start() for w in ws))

        async def rank0() -> None:
            await train(ws[0], models[0], [s[0] for s in data[:2]])
            assert_link(ws[0], link)
            await ws[0].aclose()

        async def rank1() -> None:
            try:
                await train(ws[1], models[1], [s[1] for s in data])
                assert_link(ws[1], link)
            finally:
                await ws[1].aclose()

        await asyncio.gather(rank0(), rank1())
        assert ps.version == 5
    for got, want in zip(models[1].parameters(), uneven_reference(2, data), strict=True):
        torch.testing.assert_close(got.detach(), want, rtol=1e-5, atol=1e-6)
    (left,) = [r for r in caplog.records if "rank 0 finished" in r.getMessage()]
    assert left.levelno == logging.INFO and "no longer wait for it" in left.getMessage()


async def test_a_worker_held_by_a_departed_rank_is_told_which_and_why(
        caplog: pytest.LogCaptureFixture) -> None:
    """Rank 1 vanishes without a goodbye (its node closes, as in a crash): rank 0's step
    waits per on_worker_loss='wait', and its TimeoutError names rank 1 and the policy."""
    caplog.set_level(logging.INFO, logger="tensorx")
    models = [small_mlp(), small_mlp()]
    async with ParameterServer(num_workers=2, transport="tcp", worker_loss_timeout=60) as ps:
        ws = [Worker(m, ps.address, rank=r, num_workers=2, transport="tcp", timeout=3.0)
              for r, m in enumerate(models)]
        await asyncio.gather(*(w.start() for w in ws))
        try:
            await ws[1].node.aclose()  # gone without saying goodbye
            await logged(caplog, "worker rank 1 disconnected")
            with pytest.raises(TimeoutError, match=r"sent no 'params' within 3.0 s: the sync "
                               r"barrier waits for rank 1, which disconnected \d+ s ago \(it "
                               r"waits for it to rejoin: on_worker_loss='wait', "
                               r"worker_loss_timeout=60 s\)$"):
                await train(ws[0], models[0], [batches(1, 1)[0][0]])
        finally:
            await asyncio.gather(*(w.aclose() for w in ws))
    assert any("holds our step" in r.getMessage() for r in caplog.records)


async def test_a_worker_held_by_a_rank_that_never_joined_is_told_so() -> None:
    """No loss timer applies to a rank that never joined: the message says it never did
    and what to do (it said "rank 1 has not joined yet; it waits for them to rejoin" and
    quoted the loss timer)."""
    model = small_mlp()
    async with ParameterServer(num_workers=2, transport="tcp", worker_loss_timeout=60) as ps:
        address = ps.address
        async with Worker(model, address, rank=0, num_workers=2, transport="tcp",
                          timeout=1.0) as worker:
            with pytest.raises(TimeoutError) as info:
                await train(worker, model, [batches(1, 1)[0][0]])
    assert str(info.value) == (
        f"ps shard 0 ({address}) sent no 'params' within 1.0 s: the sync barrier waits "
        "for rank 1, which never joined (start it with rank=1, or check that it reaches "
        "this shard)")


async def test_serve_until_workers_done_checkpoints_and_returns(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="tensorx")
    data = batches(3, 2)
    models = [small_mlp(), small_mlp()]
    ps = await ParameterServer(num_workers=2, transport="tcp", checkpoint_dir=tmp_path).start()
    serving = asyncio.ensure_future(ps.serve(until="workers_done"))
    ws = [Worker(m, ps.address, rank=r, num_workers=2, transport="tcp")
          for r, m in enumerate(models)]
    await asyncio.gather(*(w.start() for w in ws))
    await asyncio.gather(*(train(w, m, [s[r] for s in data])
                           for r, (w, m) in enumerate(zip(ws, models, strict=True))))
    await ws[0].aclose()
    await logged(caplog, "worker rank 0 finished")
    assert not serving.done()  # rank 1 has not said goodbye yet
    await ws[1].aclose()
    await asyncio.wait_for(serving, 30)
    saved = torch.load(tmp_path / "ps-shard0-of1.pt", weights_only=True)
    assert saved["version"] == 3


async def test_cli_exit_when_done_exits_0_with_a_checkpoint(tmp_path: Path) -> None:
    ps = PsProcess("--listen", "tcp://127.0.0.1:0", "--workers", "1", "--transport", "tcp",
                   "--checkpoint-dir", str(tmp_path), "--exit-when-done")
    try:
        (address,) = ps.addresses(1)
        model = small_mlp()
        async with Worker(model, address, transport="tcp") as w:
            await train(w, model, [s[0] for s in batches(2, 1)])
        returncode = await asyncio.to_thread(ps.proc.wait, 30)
    finally:
        log = ps.stop()
    assert returncode == 0, log
    assert "every worker said goodbye" in log
    saved = torch.load(tmp_path / "ps-shard0-of1.pt", weights_only=True)
    assert saved["version"] == 2


async def test_a_setting_is_read_as_given_and_assigning_one_is_refused() -> None:
    """The server's parts are built with its settings: a later assignment would not reach
    them, so it is refused with a UsageError naming the constructor argument."""
    async with ParameterServer(num_workers=2, mode="bounded", staleness=1, timeout=12.5,
                               transport="tcp") as ps:
        assert (ps.mode, ps.num_workers, ps.timeout, ps.shard, ps.num_shards) == \
            ("bounded", 2, 12.5, 0, 1)
        for name, value in (("timeout", 5.0), ("mode", "sync"), ("num_workers", 3)):
            with pytest.raises(UsageError, match=f"pass {name}= to ParameterServer"):
                setattr(ps, name, value)
        assert ps.timeout == 12.5 and ps.mode == "bounded"
