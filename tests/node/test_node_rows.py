"""Rows of a remote tensor: ``ep.read_rows`` and ``ep.write_rows`` (the dtype and shape
travel in the descriptor), and what a mismatch says."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import tensorx as tx
from tests.support.lanes import assert_lane, lanes, node_transport


@pytest.mark.parametrize("lane", lanes())
async def test_rows_read_and_written_by_index_in_few_ops(lane: str) -> None:
    table = torch.arange(40, dtype=torch.float32).reshape(10, 4)
    async with tx.Node(transport=node_transport(lane)) as owner, \
            tx.Node(None, transport=node_transport(lane)) as client:
        owner.export(table, name="emb")
        ep = await client.connect(owner.address)
        assert_lane(ep, lane)
        desc = await ep.lookup("emb")
        rows = [7, 8, 9, 2, 3, 0]  # three runs: 7-9, 2-3, 0
        out = torch.zeros(len(rows), 4)
        await ep.read_rows(out, desc, rows)
        assert torch.equal(out, table[rows])
        assert ep.stats.snapshot()["read"]["ops"] == 3
        src = np.full((2, 4), -1, np.float32)  # numpy on this side, torch on the owner's
        await ep.write_rows(src, desc, np.array([5, 1]), notify=b"done")
        assert await owner.notifications.get() == (owner.endpoints[0], b"done")
        assert table[5].tolist() == table[1].tolist() == [-1.0] * 4
        assert table[0].tolist() == [0, 1, 2, 3]  # nothing else changed
        await ep.read_rows(torch.zeros(0, 4), desc, [])  # no rows: nothing to do


async def test_rows_of_an_nd_tensor_are_along_dim_0() -> None:
    cube = np.arange(24, dtype=np.int16).reshape(4, 3, 2)
    async with tx.Node(transport="tcp") as owner, tx.Node(None, transport="tcp") as client:
        desc = owner.export(cube)
        ep = await client.connect(owner.address)
        out = np.zeros((2, 3, 2), np.int16)
        await ep.read_rows(out, desc.to_bytes(), torch.tensor([3, 1]))
        assert np.array_equal(out, cube[[3, 1]])


@pytest.mark.parametrize(("out", "rows", "says"), [
    (np.zeros((2, 4), np.float64), [0, 1],
     "out is float64 but region 0x[0-9a-f]+ \\('t'\\) holds float32: the bytes would be "
     "reinterpreted, not converted; use a float32 tensor of shape \\(2, 4\\)"),
    (np.zeros((2, 3), np.float32), [0, 1],
     "out has shape \\(2, 3\\), but 2 row\\(s\\) of region 0x[0-9a-f]+ \\('t'\\) \\(each of "
     "shape \\(4,\\)\\) need shape \\(2, 4\\)"),
    (np.zeros((1, 4), np.float32), [6],
     "row 6 \\(rows\\[0\\]\\) is outside the 6 rows of region 0x[0-9a-f]+ \\('t'\\) "
     "\\(0 to 5\\)"),
    (np.zeros((1, 4), np.float32), [-1], "row -1 \\(rows\\[0\\]\\) is outside the 6 rows"),
    (np.zeros((1, 4), np.float32), [0.5], "rows must be a 1-D sequence of ints, not float64"),
    (np.zeros((1, 4), np.float32), [[0]], "rows must be a 1-D sequence of ints"),
])
async def test_a_mismatch_is_a_usage_error_and_moves_nothing(out: np.ndarray, rows: list[int],
                                                             says: str) -> None:
    async with tx.Node(transport="tcp") as owner, tx.Node(None, transport="tcp") as client:
        owner.export(np.zeros((6, 4), np.float32), name="t")
        ep = await client.connect(owner.address)
        desc = await ep.lookup("t")
        before = out.copy()
        with pytest.raises(tx.UsageError, match=f"^{says}"):
            await ep.read_rows(out, desc, rows)
        with pytest.raises(tx.UsageError, match=f"^{says.replace('out ', 'src ')}"):
            await ep.write_rows(out, desc, rows)
        assert np.array_equal(out, before)
        assert ep.stats.snapshot()["read"]["ops"] == ep.stats.snapshot()["write"]["ops"] == 0


async def test_raw_memory_has_no_rows_and_a_row_written_twice_is_refused() -> None:
    async with tx.Node(transport="tcp") as owner, tx.Node(None, transport="tcp") as client:
        raw = owner.export(tx.MemoryRegion.allocate(64))
        typed = owner.export(np.zeros((4, 2), np.float32))
        scalar = owner.export(np.zeros((), np.float32))
        ep = await client.connect(owner.address)
        with pytest.raises(tx.UsageError, match="was not registered from a tensor or array, "
                           "so its descriptor has no dtype or shape"):
            await ep.read_rows(np.zeros((1, 2), np.float32), raw, [0])
        with pytest.raises(tx.UsageError, match="holds a 0-d tensor: it has no rows"):
            await ep.read_rows(np.zeros(1, np.float32), scalar, [0])
        with pytest.raises(tx.UsageError, match=r"a row appears twice in rows \(1\)"):
            await ep.write_rows(np.zeros((3, 2), np.float32), typed, [1, 2, 1])
        dup = np.zeros((2, 2), np.float32)
        await ep.read_rows(dup, typed, [3, 3])  # reading a row twice is fine
        staging = tx.MemoryRegion.allocate(64)  # raw memory here: only its size counts
        await ep.read_rows(staging, typed, [0, 1, 2])
        with pytest.raises(tx.UsageError, match=r"^out has 8 B, but 2 row\(s\) of region "
                           ".* need 16 B"):
            await ep.read_rows(tx.MemoryRegion.allocate(8), typed, [0, 1])
