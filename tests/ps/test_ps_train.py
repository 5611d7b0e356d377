"""Parameter server and workers end to end, in one event loop over real endpoints."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest
import torch
from torch import nn

from tensorx.errors import AuthError, PlanMismatchError
from tensorx.ps import ParameterServer
from tensorx.worker import Worker
from tests.support.clusters import servers, train_sync, workers
from tests.support.data import backward, batches
from tests.support.lanes import assert_link, lanes, link_options, links, transports
from tests.support.logs import retried
from tests.support.models import small_mlp, sparse_embedding
from tests.support.training import ADAM, SGD_MOMENTUM, OptFactory, reference, train_single

TRANSPORTS = transports()


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize("link", links())
@pytest.mark.parametrize(("opt", "num_shards"), [
    pytest.param(SGD_MOMENTUM, 1, id="sgd-momentum-1"),
    pytest.param(ADAM, 2, id="adam-2"),
])
async def test_sync_equals_single_process(opt: OptFactory, num_shards: int, link: str) -> None:
    """The defaults, and over each lane with every push and pull crossing it."""
    got = await train_sync(opt, 24, num_shards, link)
    want = train_single(opt, 24)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


async def test_two_shards_equal_one_shard() -> None:
    one = await train_sync(ADAM, 20, 1)
    two = await train_sync(ADAM, 20, 2)
    for a, b in zip(one, two, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


async def test_flat_server_equals_single_process() -> None:
    got = await train_sync(SGD_MOMENTUM, 20, 2, flat=True)
    for g, w in zip(got, train_single(SGD_MOMENTUM, 20), strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("lane", lanes())
async def test_updates_sent_part_by_part_equal_single_process(
        lane: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A flat shard in several parts (tiny parts here) applies and writes back the update
    part by part to workers that copy: still exactly single-process training."""
    from tensorx._ps.update import parts

    monkeypatch.setattr(parts, "PART_BYTES", 256)
    data = batches(12, 2)
    models = [small_mlp(), small_mlp(seed=99)]
    options = link_options(lane)
    async with servers(1, 2, mode="sync", optimizer=SGD_MOMENTUM, flat=True,
                       **options) as (ps,), \
            workers(models, [ps.address], verify=True, **options) as ws:
        assert ps.state is not None and ps.state.num_parts > 2
        for step in data:
            for w, m, (x, y) in zip(ws, models, step, strict=True):
                w.zero_grad()
                backward(m, x, y)
            await asyncio.gather(*(w.step() for w in ws))
        for w in ws:
            assert_link(w, lane)
    for g, want in zip(models[1].parameters(), train_single(SGD_MOMENTUM, 12), strict=True):
        torch.testing.assert_close(g.detach(), want, rtol=1e-5, atol=1e-6)


def digits() -> tuple[torch.Tensor, ...]:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x_tr, x_te, y_tr, y_te = train_test_split(x / 16.0, y, test_size=0.2, random_state=0,
                                              stratify=y)
    f = lambda a: torch.tensor(a, dtype=torch.float32)  # noqa: E731
    return f(x_tr), torch.tensor(y_tr), f(x_te), torch.tensor(y_te)


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("mode", ["async", "bounded"])
async def test_async_modes_converge_on_digits(mode: str, transport: str) -> None:
    """Two workers on halves of digits; rank 0 is slowed down now and then, so gradients
    really are stale. Both modes still reach good accuracy; bounded keeps its bound."""
    x_tr, y_tr, x_te, y_te = digits()
    torch.manual_seed(0)
    models = [nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10)) for _ in range(2)]

    async def run(w: Worker, m: nn.Module, rank: int) -> None:
        gen = torch.Generator().manual_seed(rank)
        xs, ys = x_tr[rank::2], y_tr[rank::2]
        for i in range(100):
            idx = torch.randint(0, len(xs), (32,), generator=gen)
            w.zero_grad()
            nn.functional.cross_entropy(m(xs[idx]), ys[idx]).backward()
            await w.step()
            if rank == 0 and i % 4 == 0:
                await asyncio.sleep(0.002)  # the slow worker: the behaviour under test

    adam: OptFactory = lambda p: torch.optim.Adam(p, lr=5e-3)  # noqa: E731
    async with servers(1, 2, transport, mode=mode, staleness=2, optimizer=adam) as (ps,):
        async with workers(models, [ps.address], transport, verify=True) as ws:
            await asyncio.gather(*(run(w, m, r) for r, (w, m) in
                                   enumerate(zip(ws, models, strict=True))))
            with torch.no_grad():
                accuracy = float((models[1](x_te).argmax(1) == y_te).float().mean())
    assert ps.stats["updates"] == 200
    assert accuracy >= 0.9, accuracy
    if mode == "bounded":
        assert ps.stats["max_gap"] <= 2


async def test_bounded_staleness_is_held_by_the_server() -> None:
    async with ParameterServer(num_workers=2, mode="bounded", staleness=2,
                               transport="tcp") as ps:
        models = [small_mlp(), small_mlp()]
        async with workers(models, [ps.address]) as ws:
            async def run(w: Worker, delay: float) -> None:
                for _ in range(20):
                    w.zero_grad()
                    await w.step()
                    await asyncio.sleep(delay)  # one worker slower: the behaviour under test

            await asyncio.gather(run(ws[0], 0.0), run(ws[1], 0.01))
        assert 1 <= ps.stats["max_gap"] <= 2  # the fast worker ran ahead, and no further
        assert ps.stats["updates"] == 40


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_plan_mismatch_names_the_tensor(transport: str) -> None:
    async with ParameterServer(num_workers=2, transport=transport) as ps:
        w0 = Worker(small_mlp(), ps.address, rank=0, num_workers=2, transport=transport)
        w1 = Worker(small_mlp(hidden=17), ps.address, rank=1, num_workers=2,
                    transport=transport)
        async with w0:
            with pytest.raises(PlanMismatchError) as info:
                await w1.start()
    # the first tensor in model order and its one differing field, then what to do
    assert str(info.value) == (
        "ps shard 0: tensor '0.weight' differs in shape: (16, 8) in this shard's plan (the "
        "first worker's) vs (17, 8) in the joining worker's. Every process must plan the same "
        "model (the same tensors, shapes and dtypes) with the same plan options and number of "
        "shards; compare plan.describe() on both sides")


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_wrong_token_is_an_auth_error(transport: str) -> None:
    async with ParameterServer(num_workers=1, token="right", transport=transport) as ps:
        w = Worker(small_mlp(), ps.address, token="wrong", transport=transport, timeout=5)
        with pytest.raises(AuthError):
            await w.start()


async def test_checkpoint_and_resume(tmp_path: Path) -> None:
    data = batches(6, 1)

    async def train(model: nn.Module, rounds: list[list[tuple[torch.Tensor, ...]]]) -> int:
        async with ParameterServer(num_workers=1, checkpoint_dir=tmp_path, optimizer=ADAM,
                                   transport="tcp") as ps, \
                workers([model], [ps.address]) as (w,):
            for step in rounds:
                w.zero_grad()
                backward(model, *step[0])
                await w.step()
            return ps.version

    model = small_mlp()
    assert await train(model, data[:3]) == 3
    fresh = small_mlp(seed=5)  # resuming: the checkpoint, not rank 0, seeds the server
    assert await train(fresh, data[3:]) == 6
    want = reference(data)
    for g, w in zip(fresh.parameters(), want.parameters(), strict=True):
        torch.testing.assert_close(g.detach(), w.detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("lane", lanes())
async def test_pulls_never_see_a_half_applied_update(lane: str) -> None:
    """Async mode, many fast steps on a 1 MiB model: every pull is checked against the
    checksum the server stamped on the update it belongs to."""
    torch.manual_seed(0)
    models = [nn.Sequential(nn.Linear(512, 512)) for _ in range(3)]
    options = link_options(lane)
    async with servers(1, 3, mode="async", **options) as (ps,), \
            workers(models, [ps.address], verify=True, **options) as ws:
        async def run(w: Worker, m: nn.Module) -> None:
            for _ in range(40):
                w.zero_grad()
                m(torch.randn(2, 512)).sum().backward()
                await w.step()

        await asyncio.gather(*(run(w, m) for w, m in zip(ws, models, strict=True)))
        for w in ws:
            assert_link(w, lane)
    assert ps.stats["updates"] == 120


@pytest.mark.parametrize("link", links())
async def test_sparse_embedding_model_trains(link: str) -> None:
    """Embedding and EmbeddingBag with sparse gradients, 2 shards: the loss falls, and
    the result equals one process training on both halves of the batch."""
    models = [sparse_embedding(), sparse_embedding()]
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 1000, (64, 4), generator=gen)
    target = (ids % 7).float().mean(1, keepdim=True) / 7
    sgd: OptFactory = lambda p: torch.optim.SGD(p, lr=0.1)  # noqa: E731

    def loss_of(m: nn.Module, rank: int | None = None) -> torch.Tensor:
        part = slice(None) if rank is None else slice(rank * 32, rank * 32 + 32)
        return nn.functional.mse_loss(m(ids[part]), target[part])

    options = link_options(link)
    async with servers(2, 2, mode="sync", optimizer=sgd, **options) as shards, \
            workers(models, [ps.address for ps in shards], **options) as ws:
        first = float(loss_of(models[0]).detach())
        for _ in range(25):
            for r, (w, m) in enumerate(zip(ws, models, strict=True)):
                w.zero_grad()
                loss_of(m, r).backward()
            await asyncio.gather(*(w.step() for w in ws))
        last = float(loss_of(models[0]).detach())
        # the dynamic path carried the rows (2 workers x 25 steps x <= 32*4 ids x 2 tables)
        rows = sum(ps.stats["sparse_rows"] for ps in shards)
        assert 0 < rows <= 2 * 25 * 32 * 4 * 2
        for w in ws:
            assert_link(w, link)
    assert last < 0.2 * first
    ref = sparse_embedding()
    opt = sgd(list(ref.parameters()))  # type: ignore[arg-type]
    for _ in range(25):
        opt.zero_grad()
        loss_of(ref).backward()
        opt.step()
    for g, w in zip(models[0].parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(g.detach(), w.detach(), rtol=1e-4, atol=1e-5)


async def test_worker_rejoins_a_restarted_server(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The server stops (checkpointing) and comes back on the same address; a worker with
    ``reconnect`` drops the step in flight, rejoins and carries on from the checkpoint."""
    caplog.set_level(logging.INFO, logger="tensorx.worker")
    data = batches(7, 1)
    model = small_mlp()

    def server(listen: str) -> ParameterServer:
        return ParameterServer(listen, num_workers=1, optimizer=ADAM, checkpoint_dir=tmp_path,
                               transport="tcp")

    first = await server("tcp://127.0.0.1:0").start()
    address = first.address
    async with Worker(model, address, transport="tcp", reconnect=20) as w:
        async def step(i: int) -> None:
            w.zero_grad()
            backward(model, *data[i][0])
            await w.step()

        for i in range(3):
            await step(i)
        await first.aclose()

        async def restart() -> ParameterServer:
            await retried(caplog)  # the worker retries meanwhile
            return await server(address).start()

        coming_back = asyncio.create_task(restart())
        await step(3)  # meets the dead connection: dropped, rejoins once the server is back
        async with await coming_back as second:
            for i in range(4, 7):
                await step(i)
            assert second.version == 6  # resumed at 3 from the checkpoint, then 3 more
        assert w.stats["rejoins"] == 1
    want = reference([data[i] for i in (0, 1, 2, 4, 5, 6)])
    for g, ref in zip(model.parameters(), want.parameters(), strict=True):
        torch.testing.assert_close(g.detach(), ref.detach(), rtol=1e-5, atol=1e-6)


async def test_garbage_from_one_peer_does_not_stop_the_server() -> None:
    import msgpack

    from tensorx.node import Node

    garbage = [b"", b"\xc1", msgpack.packb([1, 2]), msgpack.packb({"t": "push", "step": 0,
                                                                     "version": 0, "staging": {}}),
               msgpack.packb({"t": "hello", "proto": 1}), msgpack.packb({"t": "exec"})]
    async with ParameterServer(num_workers=1, transport="tcp") as ps:
        async with Node(None, transport="tcp") as rogue:
            ep = await rogue.connect(ps.address)
            for payload in garbage:
                await ep.notify(payload)
            _, reply = await asyncio.wait_for(rogue.notifications.get(), 10)
            assert msgpack.unpackb(reply)["t"] == "error"
        model = small_mlp()
        async with workers([model], [ps.address]) as (w,):
            for step in batches(3, 1):
                w.zero_grad()
                backward(model, *step[0])
                await w.step()
        assert ps.version == 3
