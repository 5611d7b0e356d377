"""Sparse tables on the server: its optimizer gets torch's sparse gradients (rows, not
tables), sync training equals one process on the union batch, and a refused step reaches
the workers at once as an OptimizerError naming the tensor."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from tensorx._ps.rows.header import read_header
from tensorx.errors import OptimizerError
from tests.support.clusters import servers, workers
from tests.support.lanes import assert_link, lanes, node_transport
from tests.support.models import sparse_embedding

pytestmark = pytest.mark.usefixtures("one_torch_thread")

OptFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]
SGD: OptFactory = lambda p: torch.optim.SGD(p, lr=0.1)  # noqa: E731
ADAGRAD: OptFactory = lambda p: torch.optim.Adagrad(p, lr=0.1)  # noqa: E731
SPARSE_ADAM: OptFactory = lambda p: torch.optim.SparseAdam(p, lr=0.01)  # noqa: E731
ADAM: OptFactory = lambda p: torch.optim.Adam(p, lr=0.01)  # noqa: E731
STEPS, BATCH, ROWS = 6, 16, 1000


class TwoTower(nn.Module):
    """Nothing but sparse tables: a user and an item bag, scored by their dot product."""

    def __init__(self) -> None:
        super().__init__()
        self.user = nn.EmbeddingBag(ROWS, 8, mode="sum", sparse=True)
        self.item = nn.EmbeddingBag(ROWS // 2, 8, mode="mean", sparse=True)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return (self.user(ids) * self.item(ids % (ROWS // 2))).sum(1, keepdim=True)


def two_tower() -> nn.Module:
    torch.manual_seed(0)
    return TwoTower()


def data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per step, both ranks' batches (rank r: rows r*BATCH...), Zipf-like repeated ids."""
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(STEPS):
        ids = (torch.rand(2 * BATCH, 4, generator=gen) ** 3 * ROWS).long()
        out.append((ids, (ids % 7).float().mean(1, keepdim=True) / 7))
    return out


def loss_of(model: nn.Module, ids: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(model(ids), target)


def half(t: torch.Tensor, rank: int) -> torch.Tensor:
    return t[rank * BATCH:(rank + 1) * BATCH]


def single(make: Callable[[], nn.Module], opt: OptFactory) -> list[torch.Tensor]:
    """One process training on the union of both ranks' batches."""
    model = make()
    optimizer = opt(list(model.parameters()))  # type: ignore[arg-type]
    with torch.sparse.check_sparse_tensor_invariants(enable=False):  # as the server does
        for ids, target in data():
            optimizer.zero_grad()
            loss_of(model, ids, target).backward()
            optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


@contextlib.contextmanager
def steps_seen() -> Iterator[list[list[tuple[tuple[int, ...], bool, torch.Tensor | None]]]]:
    """Every optimizer step in this process meanwhile: (shape, sparse, row ids) per
    parameter with a gradient (a global hook: the server's flat update stays on)."""
    seen: list[list[tuple[tuple[int, ...], bool, torch.Tensor | None]]] = []

    def hook(opt: torch.optim.Optimizer, *_: Any) -> None:
        seen.append([(tuple(p.shape), p.grad.is_sparse,
                      p.grad.coalesce().indices()[0].clone() if p.grad.is_sparse else None)
                     for g in opt.param_groups for p in g["params"] if p.grad is not None])

    handle = register_optimizer_step_pre_hook(hook)
    try:
        yield seen
    finally:
        handle.remove()


async def train(make: Callable[[], nn.Module], opt: OptFactory, lane: str, num_shards: int = 2,
                mode: str = "sync", share_memory: bool = False,
                mapped: list[list[bool]] | None = None, **kw: Any) -> list[nn.Module]:
    models = [make(), make()]
    transport = node_transport(lane)
    async with servers(num_shards, 2, transport, mode=mode, optimizer=opt, **kw) as shards, \
            workers(models, [ps.address for ps in shards], transport,
                    share_memory=share_memory, timeout=60) as ws:
        for ids, target in data():
            for r, (w, m) in enumerate(zip(ws, models, strict=True)):
                w.zero_grad()
                loss_of(m, half(ids, r), half(target, r)).backward()
            await asyncio.gather(*(w.step() for w in ws))
        if mapped is not None:
            mapped += [w.mapped for w in ws]
        if not share_memory:
            for w in ws:
                assert_link(w, lane)
    return models


def table_rows(seen: list[list[tuple[tuple[int, ...], bool, torch.Tensor | None]]],
               shape: tuple[int, ...]) -> list[torch.Tensor]:
    """The row ids of every sparse gradient of a table of ``shape`` the server stepped
    with; fails if it ever got a dense one of that shape."""
    grads = [(sparse, ids) for step in seen for s, sparse, ids in step if s == shape]
    assert all(sparse for sparse, _ in grads), "a table got a dense gradient"
    return [ids for _, ids in grads if ids is not None]


@pytest.mark.parametrize("lane", lanes())
@pytest.mark.parametrize(("opt", "make"), [
    pytest.param(SGD, sparse_embedding, id="sgd"),
    pytest.param(ADAGRAD, sparse_embedding, id="adagrad"),
    pytest.param(SPARSE_ADAM, two_tower, id="sparse-adam"),
])
async def test_sync_sparse_equals_single_process(opt: OptFactory, make: Callable[[], nn.Module],
                                                 lane: str) -> None:
    """2 workers, 2 shards: the server's optimizer steps each table with a sparse gradient
    holding exactly the rows the union batch touched, and the parameters equal one
    process's on that batch (rtol 1e-5, atol 1e-6, as the dense test)."""
    with steps_seen() as seen:
        models = await train(make, opt, lane)
    want = single(make, opt)
    for got, ref in zip(models, [want, want], strict=True):
        for g, w in zip(got.parameters(), ref, strict=True):
            torch.testing.assert_close(g.detach(), w, rtol=1e-5, atol=1e-6)
    first = make()
    emb = next(m for m in first.modules() if isinstance(m, nn.Embedding | nn.EmbeddingBag))
    rows = table_rows(seen, tuple(emb.weight.shape))
    assert len(rows) == STEPS  # one sparse step of this table per update
    for got_ids, (ids, _) in zip(rows, data(), strict=True):
        assert torch.equal(got_ids, torch.unique(ids % emb.num_embeddings))


@pytest.mark.parametrize(("opt", "make"), [
    pytest.param(SGD, sparse_embedding, id="sgd"),
    pytest.param(ADAGRAD, sparse_embedding, id="adagrad"),
    pytest.param(SPARSE_ADAM, two_tower, id="sparse-adam"),
])
async def test_sync_sparse_mapped_on_one_host_equals_single_process(
        opt: OptFactory, make: Callable[[], nn.Module]) -> None:
    """Same host, share_memory on (the default): the workers map the shard's arenas, tables
    included, so the server's row updates are in the workers' tables with nothing written
    back; the rows still travel to the server. Before, a plan with sparse tables was
    refused the mapping (and every step wrote every whole table back)."""
    mapped: list[list[bool]] = []
    with steps_seen() as seen:
        models = await train(make, opt, "tcp", num_shards=1, share_memory=True, mapped=mapped)
    assert mapped == [[True], [True]]
    want = single(make, opt)
    for got in models:
        for g, w in zip(got.parameters(), want, strict=True):
            torch.testing.assert_close(g.detach(), w, rtol=1e-5, atol=1e-6)
    emb = next(m for m in make().modules() if isinstance(m, nn.Embedding | nn.EmbeddingBag))
    assert len(table_rows(seen, tuple(emb.weight.shape))) == STEPS


@pytest.mark.parametrize("flat", [None, False], ids=["flat-auto", "per-tensor"])
async def test_adagrad_one_shard_both_update_paths(flat: bool | None) -> None:
    """Tables and the dense head on one shard, under the flat update (the tables left out
    of its ranges, stepped first) and per tensor: the same result as one process."""
    with steps_seen() as seen:
        models = await train(sparse_embedding, ADAGRAD, "tcp", num_shards=1, flat=flat)
    want = single(sparse_embedding, ADAGRAD)
    for g, w in zip(models[0].parameters(), want, strict=True):
        torch.testing.assert_close(g.detach(), w, rtol=1e-5, atol=1e-6)
    assert len(table_rows(seen, (ROWS, 16))) == STEPS
    assert len(table_rows(seen, (ROWS // 2, 8))) == STEPS


@pytest.mark.parametrize(("opt", "make", "names", "kind"), [
    pytest.param(ADAM, sparse_embedding, ("emb.weight",), "sparse", id="adam-given-rows"),
    pytest.param(SPARSE_ADAM, sparse_embedding, ("head.weight", "head.bias"), "dense",
                 id="sparse-adam-given-dense"),
])
async def test_optimizer_refusal_reaches_every_worker(opt: OptFactory,
                                                      make: Callable[[], nn.Module],
                                                      names: tuple[str, ...], kind: str) -> None:
    """A step the server's optimizer refuses raises OptimizerError in every worker of that
    update, naming the tensor, long before their timeout; nothing was applied."""
    models = [make(), make()]
    before = {n: p.detach().clone() for n, p in models[0].named_parameters()}
    ids, target = data()[0]
    async with servers(1, 2, "tcp", mode="sync", optimizer=opt) as (ps,), \
            workers(models, [ps.address], "tcp", timeout=60) as ws:
        for r, (w, m) in enumerate(zip(ws, models, strict=True)):
            w.zero_grad()
            loss_of(m, half(ids, r), half(target, r)).backward()
        results = await asyncio.gather(*(w.step() for w in ws), return_exceptions=True)
        assert ps.state is not None and ps.state.version == 0
        after = {n: p.detach().clone() for n, p in ps.state.named_parameters()}
    for result in results:
        assert isinstance(result, OptimizerError), result
        assert f"{kind} gradient" in str(result)
        assert all(repr(n) in str(result) for n in names), str(result)
    assert after.keys() == before.keys()
    assert all(torch.equal(after[n], before[n]) for n in before)


@pytest.mark.parametrize("mode", ["async", "bounded"])
async def test_async_sparse_training_steps_rows(mode: str) -> None:
    """Async and bounded modes take the same path: each push's rows alone, no averaging."""
    kw = {"staleness": 1} if mode == "bounded" else {}
    ids, target = data()[0]
    with steps_seen() as seen:
        models = await train(sparse_embedding, ADAGRAD, "tcp", mode=mode, **kw)
    rows = table_rows(seen, (ROWS, 16))
    assert len(rows) == 2 * STEPS  # one update per push
    assert all(len(r) <= BATCH * 4 for r in rows)
    first = float(loss_of(sparse_embedding(), ids, target).detach())
    assert float(loss_of(models[0], ids, target).detach()) < first



@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(("opt", "make"), [
    pytest.param(ADAGRAD, sparse_embedding, id="adagrad"),
    pytest.param(SPARSE_ADAM, two_tower, id="sparse-adam"),
])
async def test_sync_sparse_on_a_gpu_server(opt: OptFactory, make: Callable[[], nn.Module]) -> None:
    """The same, with the shards' arenas, rows and optimizer on a GPU (not run here: no GPU)."""
    with steps_seen() as seen:
        models = await train(make, opt, "tcp", device="cuda:0")
    want = single(make, opt)
    for g, w in zip(models[0].parameters(), want, strict=True):
        torch.testing.assert_close(g.detach(), w, rtol=1e-5, atol=1e-6)
    assert any(sparse for step in seen for _, sparse, _ in step)


class ManyTables(nn.Module):
    """Four bags of one row width (16 floats: rows of 64 bytes), as a DLRM's tables: a
    shard's tables back to back, staged packed and answered a run at a time."""

    def __init__(self) -> None:
        super().__init__()
        self.bags = nn.ModuleList(nn.EmbeddingBag(ROWS // (k + 1), 16, mode="mean", sparse=True)
                                  for k in range(4))
        self.head = nn.Linear(16, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(sum(b(ids % b.num_embeddings) for b in self.bags) / 4)  # type: ignore[no-any-return]


def many_tables() -> nn.Module:
    torch.manual_seed(0)
    return ManyTables()


@pytest.mark.parametrize("lane", lanes())
@pytest.mark.parametrize("opt", [SGD, ADAGRAD], ids=["sgd", "adagrad"])
async def test_tables_back_to_back_train_as_one_process_over_each_lane(opt: OptFactory,
                                                                        lane: str) -> None:
    """Tables of one dtype and row width lying back to back (the DLRM shape): staged packed,
    received a dtype at a time, their answers' rows gathered and scattered a run at a time,
    over the transport (share_memory=False): the parameters equal one process's."""
    models = [many_tables(), many_tables()]
    transport = node_transport(lane)
    async with servers(1, 2, transport, mode="sync", optimizer=opt) as (ps,), \
            workers(models, [ps.address], transport, share_memory=False, timeout=60) as ws:
        for ids, target in data():
            for r, (w, m) in enumerate(zip(ws, models, strict=True)):
                w.zero_grad()
                loss_of(m, half(ids, r), half(target, r)).backward()
            await asyncio.gather(*(w.step() for w in ws))
        for w in ws:
            assert_link(w, lane)
            runs = [run for spans in w._sparse.inboxes[0]._runs.values() for run in spans]
            assert any(end - first == 4 for first, end, _, _ in runs)  # one run of all four
    want = single(many_tables, opt)
    for got in models:
        for g, w in zip(got.parameters(), want, strict=True):
            torch.testing.assert_close(g.detach(), w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("share_memory", [True, False], ids=["mapped", "copied"])
async def test_the_worker_stages_its_sparse_rows_itself_until_it_closes(
        share_memory: bool) -> None:
    """The worker's sparse sender owns the staging and header regions (its binding holds
    the arenas only): the same regions step after step, whether the model is bound to the
    shard's memory or its own, closed when the worker closes."""
    model = sparse_embedding()
    async with servers(1, 1, mode="sync", optimizer=SGD) as (ps,):
        async with workers([model], [ps.address], share_memory=share_memory,
                           timeout=60) as (w,):
            assert w.mapped == [share_memory]
            assert set(w.binding.regions) == {(0, "params"), (0, "grads")}
            assert w._sparse is not None
            staging = w._sparse.staging
            headers, region = staging.headers(0), staging.region(0)
            for step in range(2):
                w.zero_grad()
                model(torch.randint(0, 500, (4, 3), generator=torch.Generator()
                                    .manual_seed(step))).sum().backward()
                await w.step()
            assert w._sparse.headers(0) is headers and staging.region(0) is region
            assert read_header(headers, w.plan.dynamic("emb.weight")).version == 2
        assert headers.closed and region.closed
