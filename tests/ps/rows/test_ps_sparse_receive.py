"""A shard's receipt of a push's sparse rows: the rows gathered out of the bytes read are the
rows the worker staged, table by table, whatever their dtypes, row sizes and staging regions;
an id outside its table is refused naming it; and the rows handed over whole pack as a
per-table dict of the same rows packs."""

from __future__ import annotations

import pytest
import torch

from tensorx._ps.rows.tables import PushedRows, SparseRows, put_rows, take_rows
from tensorx._ps.state.shard import ShardLayout
from tensorx.errors import RegionError
from tensorx.memregion import MemoryRegion
from tests.support.sparse_rows import Copying, setup


async def test_the_rows_received_are_the_rows_staged() -> None:
    _, staging, receiver, staged = setup(1, skip="b")
    try:
        desc = staging.region(0).descriptor().to_bytes()
        receiver.announce(0, dict.fromkeys(staged, desc))
        ep = Copying([staging.region(0)])
        got = await receiver.receive(ep, 0, None)
        assert ep.reads == 1
        assert sorted(got) == ["a.weight", "c.weight", "d.weight"]  # b sent no rows
        for name, grad in staged.items():
            if name == "b.weight":
                continue
            want = grad.coalesce()
            ids, values = got[name]
            assert torch.equal(ids, want.indices()[0]), name
            assert values.dtype == want.dtype and torch.equal(values, want.values()), name
        assert got.num_rows == sum(int(got[n][0].numel()) for n in got)
    finally:
        receiver.close()
        staging.close()


async def test_tables_staged_in_two_regions_are_read_from_each() -> None:
    """A worker may name a staging region per table: each region's span is read once, and
    each table's rows come from its own region (a copy of the staging here, with the other
    copy's bytes spoiled where this one's tables are not)."""
    _, staging, receiver, staged = setup(2)
    headers = staging.stage(0, staged).headers
    first, second = (MemoryRegion.allocate(staging.region(0).nbytes) for _ in range(2))
    try:
        owner = {n: (first, second)[i % 2] for i, n in enumerate(staged)}
        for copy in (first, second):
            copy.buffer()[:] = staging.region(0).buffer()
            for name, h in headers.items():
                if owner[name] is not copy:  # ids -1 and NaN rows: refused if read
                    copy.buffer()[h.offset:h.offset + h.nbytes] = b"\xff" * h.nbytes
        announce = {n: owner[n].descriptor().to_bytes() for n in staged}
        receiver.announce(0, announce)
        ep = Copying([first, second])
        got = await receiver.receive(ep, 0, None)
        assert ep.reads == 2
        for name, grad in staged.items():
            want = grad.coalesce()
            assert torch.equal(got[name][0], want.indices()[0]), name
            assert torch.equal(got[name][1], want.values()), name
    finally:
        receiver.close()
        staging.close()
        first.close()
        second.close()


@pytest.mark.parametrize("bad", [-1, 100])
async def test_an_id_outside_its_table_is_refused_naming_it(bad: int) -> None:
    plan, staging, receiver, staged = setup(3)
    try:
        header = staging.stage(0, staged).headers["c.weight"]
        at = header.offset // 8 + header.rows - 1  # c's last id
        staging.region(0).view(torch.int64)[at] = bad  # c has 100 rows
        receiver.headers[0].buffer()[:] = staging.headers(0).buffer()
        receiver.announce(0, dict.fromkeys(staged, staging.region(0).descriptor().to_bytes()))
        with pytest.raises(RegionError, match=r"rank 0: c\.weight row index out of range"):
            await receiver.receive(Copying([staging.region(0)]), 0, None)
    finally:
        receiver.close()
        staging.close()


async def test_pushed_rows_pack_as_the_same_rows_by_table_do() -> None:
    plan, staging, receiver, staged = setup(4)
    try:
        receiver.announce(0, dict.fromkeys(staged, staging.region(0).descriptor().to_bytes()))
        got = await receiver.receive(Copying([staging.region(0)]), 0, None)
        assert isinstance(got, PushedRows)
        specs = ShardLayout.from_plan(plan, 0).param_specs()
        whole, by_table = SparseRows(specs), SparseRows(specs)
        whole.put(0, got)
        by_table.put(0, {n: (ids.clone(), values.clone()) for n, (ids, values) in got.items()})
        for ours, theirs in zip(whole.packed(0), by_table.packed(0), strict=True):
            assert ours is not None and theirs is not None
            assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])
        for i in whole:
            ours, theirs = whole.grad([0], i), by_table.grad([0], i)
            assert ours is not None and theirs is not None
            assert torch.equal(ours.indices(), theirs.indices())
            assert torch.equal(ours.values(), theirs.values())
    finally:
        receiver.close()
        staging.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int64])
def test_rows_taken_and_put_are_index_select_and_index_copy(dtype: torch.dtype) -> None:
    """The row copies of an update and of answers (numpy's where it has the dtype, torch's
    elsewhere) give what index_select / index_copy_ give, into ``out`` too, and on a
    strided view of a table."""
    gen = torch.Generator().manual_seed(5)
    base = (torch.randn(64, 12, generator=gen) * 100).to(dtype)
    ids = torch.randperm(64, generator=gen)[:20]
    for step in (1, 2):
        table = base[:, ::step]
        got = take_rows(table, ids)
        assert torch.equal(got, table.index_select(0, ids)) and got.dtype == dtype
        out = torch.empty_like(got)
        assert take_rows(table, ids, out=out) is out and torch.equal(out, got)
        rows = (torch.randn(got.shape, generator=gen) * 100).to(dtype)
        ours, theirs = base.clone(), base.clone()
        put_rows(ours[:, ::step], ids, rows)
        theirs[:, ::step].index_copy_(0, ids, rows)
        assert torch.equal(ours, theirs)
