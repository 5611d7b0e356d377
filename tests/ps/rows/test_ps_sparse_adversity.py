"""What a worker's sparse push can make a shard do (issue 17's row path, adversarially): a
forged header, a staging region smaller than its headers say, row ids out of range, out of
order or repeated, a NaN row, a staging announcement naming no table, a gradient unlike its
table. Each is refused with a tensorx error naming the table before a byte is read or
written, or summed as torch sums it; nothing of a refused push is kept, and the other
rank's update goes on."""

from __future__ import annotations

import asyncio
import copy
import logging
import math
from typing import Any

import pytest
import torch
from torch import nn

import tensorx as tx
from tensorx._ps.rows.header import payload_views
from tensorx._ps.rows.sparse import SparseReceiver
from tensorx._ps.rows.staging import SparseStaging
from tensorx._ps.state.shard import ShardLayout, ShardState
from tensorx.errors import ProtocolError, RegionError, UsageError
from tensorx.graph_analyzer import GraphAnalyzer
from tensorx.memregion import MemoryRegion
from tests.support.clusters import servers, workers
from tests.support.models import sparse_embedding
from tests.support.sparse_rows import Copying, setup

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def poison_ids(worker: Any) -> None:
    """``worker`` stages a row id past its table from now on."""
    staging = worker._sparse.staging  # the worker's sparse sender owns it
    stage = staging.stage

    def bad_stage(shard: int, grads: Any) -> Any:
        staged = stage(shard, grads)
        at = staged.headers["bag.weight"].offset // 8
        staging.region(shard).view(torch.int64)[at] = 500  # bag has 500 rows
        return staged

    staging.stage = bad_stage


@pytest.mark.parametrize(("attack", "error", "text"), [
    pytest.param("id", RegionError, "rank 1: bag.weight row index out of range", id="id"),
    pytest.param("nan", UsageError, "rank 1's gradient of step 0 holds NaN or Inf", id="nan"),
])
async def test_a_refused_sparse_push_fails_its_worker_only(
        attack: str, error: type[Exception], text: str,
        caplog: pytest.LogCaptureFixture) -> None:
    """Sync, two ranks: rank 1 stages a row id past its table, or a NaN row. Its step
    raises a tensorx error saying so (long before its timeout), the shard logs it once,
    keeps none of its rows, and makes rank 0's update alone (the barrier goes on without
    rank 1: on_worker_loss, on_nonfinite)."""
    models = [sparse_embedding(), sparse_embedding()]
    alone = copy.deepcopy(models[0])  # rank 0's step in one process, for comparison
    gen = torch.Generator().manual_seed(3)
    batches = [torch.randint(0, 1000, (8, 4), generator=gen) for _ in range(2)]
    caplog.set_level(logging.WARNING, logger="tensorx")
    async with servers(1, 2, mode="sync", optimizer=lambda p: torch.optim.SGD(p, lr=0.5),
                       on_worker_loss="continue", worker_loss_timeout=1.0,
                       on_nonfinite="refuse") as (ps,), \
            workers(models, [ps.address], share_memory=False, timeout=60) as ws:
        for w, m, ids in zip(ws, models, batches, strict=True):
            w.zero_grad()
            m(ids).square().mean().backward()
        if attack == "id":
            poison_ids(ws[1])
        else:
            models[1].bag.weight.grad._values()[0, 0] = math.nan
        ok, refused = await asyncio.gather(*(w.step() for w in ws), return_exceptions=True)
        assert ok is None, ok
        assert ps.version == 1
        assert ps.state is not None and ps.state.rows.packed(1) == [None, None]
    assert isinstance(refused, error) and text in str(refused), refused
    lines = [r.getMessage() for r in caplog.records if text in r.getMessage()]
    assert len(lines) == 1 and "refused" in lines[0], lines
    sgd = torch.optim.SGD(alone.parameters(), lr=0.5)
    alone(batches[0]).square().mean().backward()
    sgd.step()
    for (name, want), got in zip(alone.named_parameters(), models[0].parameters(), strict=True):
        torch.testing.assert_close(got, want, msg=name)


def forge(receiver: SparseReceiver, plan: Any, name: str, **fields: int) -> None:
    """Overwrite fields of ``name``'s header slot in rank 0's headers on the shard."""
    slots = receiver.headers[0].view("<u8")
    at = plan.dynamic(name).header_offset // 8
    order = ("rows", "nbytes", "version", "capacity", "offset")
    for field, value in fields.items():
        slots[at + order.index(field)] = value % (1 << 64)


@pytest.mark.parametrize(("fields", "match"), [
    pytest.param({"rows": -1}, r"c\.weight: header", id="negative-rows"),
    pytest.param({"nbytes": -64}, r"c\.weight: header", id="negative-nbytes"),
    pytest.param({"offset": -64}, r"c\.weight: header", id="negative-offset"),
    pytest.param({"rows": 1 << 61, "nbytes": (1 << 61) * 20}, r"c\.weight: header",
                 id="rows-whose-bytes-wrap"),
    pytest.param({"offset": (1 << 62) - 64}, "span", id="offset-at-the-int64-edge"),
])
async def test_a_forged_header_is_refused_before_anything_is_read(fields: dict[str, int],
                                                                  match: str) -> None:
    """Counts and offsets that are negative as int64, or whose payload's end wraps, are
    refused (RegionError naming the table, or the span) with nothing read."""
    plan, staging, receiver, staged = setup(5)
    try:
        forge(receiver, plan, "c.weight", **fields)
        receiver.announce(0, dict.fromkeys(staged, staging.region(0).descriptor().to_bytes()))
        ep = Copying([staging.region(0)])
        with pytest.raises(RegionError, match=match):
            await receiver.receive(ep, 0, None)
        assert ep.reads == 0
    finally:
        receiver.close()
        staging.close()


class Counting:
    """A real endpoint, counting the reads it is asked for."""

    def __init__(self, ep: Any) -> None:
        self.ep, self.reads = ep, 0

    async def read(self, *args: Any, **kw: Any) -> None:
        self.reads += 1
        await self.ep.read(*args, **kw)


async def test_a_staging_region_smaller_than_its_headers_say_is_refused_naming_the_table(
        ) -> None:
    """The worker exports a staging region that ends inside its last table's payload (the
    headers are right): RegionError naming that table, before anything is read."""
    plan, staging, receiver, staged = setup(6)
    headers = staging.stage(0, staged).headers
    receiver.headers[0].buffer()[:] = staging.headers(0).buffer()
    last = max(headers, key=lambda n: headers[n].offset)
    end = headers[last].offset + headers[last].nbytes
    short = MemoryRegion.allocate(end - 64)
    short.buffer()[:] = staging.region(0).buffer()[:short.nbytes]
    try:
        async with tx.Node(transport="tcp") as worker, \
                tx.Node(listen=None, transport="tcp") as shard:
            desc = worker.export(short, access="r").to_bytes()
            receiver.announce(0, dict.fromkeys(staged, desc))
            ep = Counting(await shard.connect(worker.address))
            with pytest.raises(RegionError, match=rf"rank 0: {last}\b.*staging region"):
                await receiver.receive(ep, 0, 10)
            assert ep.reads == 0
    finally:
        short.close()
        receiver.close()
        staging.close()


async def test_a_push_of_no_rows_reads_nothing() -> None:
    """Every header says 0 rows and no staging was ever announced: no rows, no read."""
    plan, staging, receiver, staged = setup(7)
    try:
        for name in staged:
            forge(receiver, plan, name, rows=0, nbytes=0, offset=0)
        ep = Copying([])
        got = await receiver.receive(ep, 0, None)
        assert len(got) == 0 and got.num_rows == 0 and ep.reads == 0
    finally:
        receiver.close()
        staging.close()


@pytest.mark.parametrize("ranks", [[0], [0, 1]])
async def test_row_ids_out_of_order_and_repeated_are_summed_as_torch_sums_them(
        ranks: list[int]) -> None:
    """A worker that stages its rows uncoalesced (ids descending, each twice): the update
    is torch's SGD step on that uncoalesced gradient (and, with two ranks, the mean with a
    well-behaved rank's rows), for float32 and float64 tables of several row widths."""
    plan, staging, receiver, staged = setup(8)
    layout = ShardLayout.from_plan(plan, 0)
    state = ShardState(layout, len(ranks), lambda p: torch.optim.SGD(p, lr=1.0))
    want = {n: p.detach().clone() for n, p in state.named_parameters()}
    try:
        headers = staging.stage(0, staged).headers
        given = {}
        for name, h in headers.items():  # ids descending, every other one the one before
            ids, values = payload_views(staging.region(0), plan.dynamic(name), h.rows,
                                        h.offset)
            ids.copy_(ids.flip(0))
            ids[1::2] = ids[0::2][:ids[1::2].numel()]
            given[name] = (ids.clone(), values.clone())
        receiver.headers[0].buffer()[:] = staging.headers(0).buffer()
        receiver.announce(0, dict.fromkeys(staged, staging.region(0).descriptor().to_bytes()))
        state.put_rows(0, await receiver.receive(Copying([staging.region(0)]), 0, None))
        if len(ranks) == 2:
            state.put_rows(1, {n: (g.coalesce().indices()[0], g.coalesce().values())
                               for n, g in staged.items()})
        state.apply(ranks)
        for name, (ids, values) in given.items():
            grad = torch.sparse_coo_tensor(ids[None], values, want[name].shape)
            if len(ranks) == 2:
                grad = (grad + staged[name]) / 2
            want[name].sub_(grad.to_dense())
            torch.testing.assert_close(dict(state.named_parameters())[name], want[name],
                                       msg=name)
    finally:
        state.close()
        receiver.close()
        staging.close()


def test_an_update_leaves_the_rows_handed_to_it_as_they_were() -> None:
    """Two ranks, one of which pushed no rows of a table: the mean is the other rank's
    rows halved, in a tensor of the update's own (the rows a rank pushed stayed as they
    were: they were halved in place, and a second update of them was a quarter)."""
    plan = GraphAnalyzer(sparse_embedding()).plan()
    state = ShardState(ShardLayout.from_plan(plan, 0), 2, lambda p: torch.optim.SGD(p, lr=1.0))
    try:
        ids, values = torch.tensor([3, 5, 9]), torch.ones(3, 16)
        state.put_rows(0, {"emb.weight": (ids, values)})
        state.put_rows(1, {})
        table = dict(state.named_parameters())["emb.weight"]
        steps = []
        for _ in range(2):
            before = table[ids].clone()
            state.apply([0, 1])
            steps.append(before - table[ids])
        assert torch.equal(values, torch.ones(3, 16))
        assert torch.equal(steps[0], torch.full((3, 16), 0.5)) and torch.equal(*steps)
    finally:
        state.close()


async def test_a_staging_announcement_naming_no_table_is_refused_whole() -> None:
    """A push names a table that does not exist (a long name of control characters)
    beside a real one: ProtocolError whose text is printable and short (it is logged and
    sent back), and the receiver keeps the staging it had (the real table's new
    descriptor, of a region of garbage, is not taken)."""
    plan, staging, receiver, staged = setup(9)
    garbage = MemoryRegion.allocate(staging.region(0).nbytes)
    try:
        garbage.buffer()[:] = b"\xff" * garbage.nbytes  # ids -1: refused if read
        receiver.announce(0, dict.fromkeys(staged, staging.region(0).descriptor().to_bytes()))
        evil = "\x1b[2J\n" + "\u202e" * 10_000
        with pytest.raises(ProtocolError, match="unknown tensor") as refused:
            receiver.announce(0, {"a.weight": garbage.descriptor().to_bytes(), evil: b""})
        text = str(refused.value)
        assert len(text) < 500 and text.isprintable() and text.isascii(), text[:100]
        got = await receiver.receive(Copying([staging.region(0), garbage]), 0, None)
        assert torch.equal(got["a.weight"][0], staged["a.weight"].coalesce().indices()[0])
    finally:
        garbage.close()
        receiver.close()
        staging.close()


@pytest.mark.parametrize("width", [16, 3], ids=["packed", "per-table"])
@pytest.mark.parametrize("wrong", ["dtype", "row-shape"])
def test_staging_a_gradient_unlike_its_table_is_refused_naming_it(wrong: str,
                                                                  width: int) -> None:
    """A gradient of another dtype or row shape than its plan entry's would be staged
    past its payload, over the next table's: UsageError naming it, nothing written (tables
    alike are staged packed, others one by one)."""
    tables = nn.ModuleDict({"a": nn.Embedding(300, 16, sparse=True),
                            "c": nn.Embedding(100, width, sparse=True)})
    staging = SparseStaging(GraphAnalyzer(tables).plan())
    try:
        given = {}
        for name, (n, dim) in {"a.weight": (300, 16), "c.weight": (100, width)}.items():
            values = torch.ones(4, dim)
            if name == "c.weight":
                values = values.double() if wrong == "dtype" else values.repeat(1, 2)
            given[name] = torch.sparse_coo_tensor(torch.tensor([[1, 2, 3, 1]]), values,
                                                  (n, *values.shape[1:]), check_invariants=True)
        before = bytes(staging.region(0).buffer())
        with pytest.raises(UsageError, match=r"c\.weight"):
            staging.stage(0, given)
        assert bytes(staging.region(0).buffer()) == before
    finally:
        staging.close()
