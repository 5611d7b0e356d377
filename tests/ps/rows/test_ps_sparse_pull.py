"""The pull of a sparse model moves rows (issue 17, item 1): a worker that holds a recent
version is written the dense bytes and only the table rows that changed since, straight into
its arena, over the transport (``share_memory=False``). Every answer is checked whole on the
worker (``verify=True``: a checksum of the shard's arena), so a stale row fails the step."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from tensorx._ps.rows.changed import runs
from tensorx._ps.service import answer
from tensorx._ps.update import parts
from tensorx.ps import ParameterServer
from tests.support.clusters import servers, workers
from tests.support.lanes import assert_link, lanes, node_transport

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ROWS, DIM, BATCH, STEPS = 20_000, 16, 16, 6
SGD = lambda p: torch.optim.SGD(p, lr=0.1)  # noqa: E731
MOMENTUM = lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)  # noqa: E731
ADAGRAD = lambda p: torch.optim.Adagrad(p, lr=0.1)  # noqa: E731


class Tables(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(ROWS, DIM, sparse=True)
        self.head = nn.Linear(DIM, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(ids).mean(1))  # type: ignore[no-any-return]


def make() -> nn.Module:
    torch.manual_seed(0)
    return Tables()


def data(batch: int = BATCH) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per step, both ranks' batches; ids skewed to the low rows, as recommendation traffic."""
    gen = torch.Generator().manual_seed(3)
    out = []
    for _ in range(STEPS):
        ids = (torch.rand(2 * batch, 4, generator=gen) ** 4 * ROWS).long()
        out.append((ids, torch.rand(2 * batch, 1, generator=gen)))
    return out


def most_rows_changed(batch: int = BATCH) -> int:
    """The most rows one update changes (both ranks' ids)."""
    return max(int(ids.unique().numel()) for ids, _ in data(batch))


def loss(model: nn.Module, ids: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(model(ids), target)


def single(opt: Callable[..., torch.optim.Optimizer], batch: int = BATCH
           ) -> list[torch.Tensor]:
    model = make()
    optimizer = opt(list(model.parameters()))
    with torch.sparse.check_sparse_tensor_invariants(enable=False):
        for ids, target in data(batch):
            optimizer.zero_grad()
            loss(model, ids, target).backward()
            optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


def written(ps: ParameterServer) -> int:
    return sum(ep.stats.nbytes["write"] for ep in ps.node.endpoints)


async def train(opt: Callable[..., torch.optim.Optimizer], lane: str, batch: int = BATCH,
                skip: int = 1) -> tuple[list[nn.Module], float, int]:
    """Sync, 2 workers, one shard; the bytes the shard wrote per answer after the first
    ``skip`` steps, and its arena's size."""
    models = [make(), make()]
    transport = node_transport(lane)
    async with servers(1, 2, transport, mode="sync", optimizer=opt) as (ps,), \
            workers(models, [ps.address], transport, share_memory=False, verify=True,
                    timeout=60) as ws:
        before = 0
        for n, (ids, target) in enumerate(data(batch)):
            for r, (w, m) in enumerate(zip(ws, models, strict=True)):
                w.zero_grad()
                loss(m, ids[r * batch:(r + 1) * batch],
                     target[r * batch:(r + 1) * batch]).backward()
            await asyncio.gather(*(w.step() for w in ws))
            if n == skip - 1:
                before = written(ps)
        for w in ws:
            assert_link(w, lane)
        assert ps.state is not None
        per_answer = (written(ps) - before) / (2 * (STEPS - skip))
        return models, per_answer, ps.state.layout.nbytes


def check_equals_one_process(models: list[nn.Module], opt: Any, batch: int = BATCH) -> None:
    want = single(opt, batch)
    for m in models:
        for g, w in zip(m.parameters(), want, strict=True):
            torch.testing.assert_close(g.detach(), w, rtol=1e-5, atol=1e-6)


def packed_bound(rows: int, arena: int) -> int:
    """An answer's bytes when the changed rows travel packed: the dense bytes (the arena
    less its table), and per row its values and its id, plus a header's worth."""
    table = ROWS * DIM * 4
    return (arena - table) + rows * (DIM * 4 + 8) + 1024


@pytest.mark.parametrize("lane", lanes())
@pytest.mark.parametrize("in_parts", [False, True], ids=["at-once", "in-parts"])
async def test_changed_rows_travel_packed_into_the_workers_inbox(
        lane: str, in_parts: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the default options an answer writes the changed rows and their ids, packed,
    not runs over the rows between them (which the skewed ids make most of the table);
    also when the update is applied in parts, the tables' rows ahead of the dense part."""
    if in_parts:
        monkeypatch.setattr(parts, "PART_BYTES", 16)  # the head's 68 B: more than a part
    models, per_answer, arena = await train(SGD, lane)
    check_equals_one_process(models, SGD)
    assert per_answer <= packed_bound(most_rows_changed(), arena), (per_answer, arena)


async def test_an_inbox_too_small_grows_and_then_takes_the_rows() -> None:
    """More rows than the worker's first inbox holds: that answer goes in runs and asks for
    a larger inbox, the next push lends one, and later answers are packed again."""
    batch = 160  # 2 x 640 ids per update: more distinct rows than a first inbox holds
    assert most_rows_changed(batch) > 256  # the plan's first staging capacity
    models, per_answer, arena = await train(SGD, "tcp", batch, skip=2)
    check_equals_one_process(models, SGD, batch)
    assert per_answer <= packed_bound(most_rows_changed(batch), arena), (per_answer, arena)


@pytest.mark.parametrize("lane", lanes())
@pytest.mark.parametrize("opt", [SGD, ADAGRAD], ids=["sgd", "adagrad"])
async def test_a_step_writes_the_changed_rows_and_equals_one_process(
        opt: Any, lane: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(answer, "GAP_BYTES", 0)  # runs of changed rows only (no filler)
    models, per_answer, arena = await train(opt, lane)
    want = single(opt)
    for m in models:
        for g, w in zip(m.parameters(), want, strict=True):
            torch.testing.assert_close(g.detach(), w, rtol=1e-5, atol=1e-6)
    # the table is 1.28 MB; a step touches at most 2 x 64 rows (mostly low ones)
    assert per_answer < arena / 4, (per_answer, arena)


async def test_an_optimizer_that_changes_other_rows_gets_whole_tables() -> None:
    """SGD with momentum keeps moving rows a step did not touch: the answers stay whole."""
    models, per_answer, arena = await train(MOMENTUM, "tcp")
    want = single(MOMENTUM)
    for m in models:
        for g, w in zip(m.parameters(), want, strict=True):
            torch.testing.assert_close(g.detach(), w, rtol=1e-5, atol=1e-6)
    assert per_answer >= arena


@pytest.mark.parametrize("mode", ["async", "bounded"])
async def test_workers_several_versions_behind_get_every_row_since(mode: str) -> None:
    """Async: a worker's answer covers the rows every update since its version changed
    (other workers' included); each one passes the whole-arena checksum."""
    models = [make(), make(), make()]
    async with servers(1, 3, "tcp", mode=mode, staleness=4, optimizer=SGD) as (ps,), \
            workers(models, [ps.address], "tcp", share_memory=False, verify=True,
                    timeout=60) as ws:
        async def run(r: int) -> None:
            for ids, target in data():
                ws[r].zero_grad()
                loss(models[r], ids[r::3], target[r::3]).backward()
                await ws[r].step()
                await asyncio.sleep(0.001 * r)  # uneven paces: versions in between

        await asyncio.gather(*(run(r) for r in range(3)))
        assert ps.stats["max_version_lag"] >= 1


def test_runs_cover_the_ids_and_bridge_only_small_gaps() -> None:
    ids = torch.tensor([0, 1, 2, 5, 6, 40, 1000])
    assert runs(ids, row_bytes=64, gap_bytes=0) == [(0, 3), (5, 2), (40, 1), (1000, 1)]
    assert runs(ids, row_bytes=64, gap_bytes=64 * 3) == [(0, 7), (40, 1), (1000, 1)]
    assert runs(ids, row_bytes=64, gap_bytes=64 * 1000) == [(0, 1001)]
    assert runs(torch.tensor([], dtype=torch.int64), 64, 4096) == []
