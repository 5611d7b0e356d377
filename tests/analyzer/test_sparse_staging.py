"""Packed sparse staging: all of a shard's tables coalesced at once, staged in the format
the per-table path writes (and read_header / payload_views decode)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from tensorx._analyzer import sparse
from tensorx.errors import RegionError
from tensorx.graph_analyzer import GraphAnalyzer, SparseStaging, payload_views, read_header

ROWS = (50, 80, 30, 20, 64)


class Tables(nn.Module):
    def __init__(self, dim: int = 6, dtypes: tuple[torch.dtype, ...] = (torch.float32,)) -> None:
        super().__init__()
        self.t = nn.ModuleList(nn.Embedding(n, dim, sparse=True, dtype=dtypes[k % len(dtypes)])
                               for k, n in enumerate(ROWS))


def backward(model: Tables, ids: list[list[int]],
             integers: bool = False) -> dict[str, torch.Tensor]:
    """Uncoalesced sparse gradients as autograd makes them: each id's row is the upstream
    gradient of its position (small integers when ``integers``: sums exact in any order)."""
    gen = torch.Generator().manual_seed(len(ids))
    for table, batch in zip(model.t, ids, strict=True):
        if batch:
            out = table(torch.tensor(batch))
            up = torch.randn(out.shape, generator=gen, dtype=torch.float64)
            (out * (up * 8).round() if integers else out * up).sum().backward()
    return {f"t.{k}.weight": grad(t) for k, t in enumerate(model.t)}


def grad(table: nn.Embedding) -> torch.Tensor:
    if table.weight.grad is not None:
        return table.weight.grad
    rows = torch.zeros((0, table.embedding_dim), dtype=table.weight.dtype)  # an untouched table
    return rows.to_sparse(1).sparse_resize_(table.weight.shape, 1, 1)


def stage(model: Tables, grads: dict[str, torch.Tensor], packed: bool = True,
          **options: int) -> tuple[SparseStaging, sparse.StagedSparse]:
    plan = GraphAnalyzer(model, **options).plan()
    staging = SparseStaging(plan)
    if packed:
        return staging, staging.stage(0, grads)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sparse._Packed, "of", staticmethod(lambda *_: None))
        return staging, staging.stage(0, grads)


def in_order(g: torch.Tensor) -> dict[int, torch.Tensor]:
    """Each id's rows summed one by one in the order autograd made them."""
    sums: dict[int, torch.Tensor] = {}
    for i, v in zip(g._indices()[0].tolist(), g._values(), strict=True):
        sums[i] = sums[i] + v if i in sums else v.clone()
    return sums


DUPLICATES = [[3, 3, 3, 7, 49, 3, 7, 0], [79, 1, 1, 2, 1, 1, 1, 1], [], [5], [9, 9, 8, 63, 9]]


@pytest.mark.parametrize("ids", [DUPLICATES, [[]] * len(ROWS)], ids=["duplicates", "empty"])
def test_packed_staging_is_byte_for_byte_the_per_table_staging(ids: list[list[int]]) -> None:
    """Same region bytes, same header slots: ids sorted unique per table at 64-aligned
    offsets, then the summed rows (sums that are exact whatever their order)."""
    model = Tables()
    grads = backward(model, ids, integers=True)
    packed, a = stage(model, grads)
    table, b = stage(model, grads, packed=False)
    assert not a.grown and a.region.nbytes == b.region.nbytes
    assert bytes(a.region.buffer()) == bytes(b.region.buffer())
    assert np.array_equal(a.fields, b.fields) and a.headers == b.headers
    assert bytes(packed.header_regions()[(0, "headers")].buffer()) == \
        bytes(table.header_regions()[(0, "headers")].buffer())
    assert [a.headers[f"t.{k}.weight"].rows for k in range(len(ROWS))] == \
        [len(set(batch)) for batch in ids]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_duplicates_are_summed_in_autograd_order(dtype: torch.dtype) -> None:
    """Each row bit for bit the sum of its duplicates in the order autograd made them
    (coalesce() sums them in an order of its sort's; the same up to rounding)."""
    model = Tables(dim=5, dtypes=(dtype,))
    ids = [[int(i) for i in torch.randint(0, n, (3 * n,), generator=torch.Generator()
                                          .manual_seed(n))] for n in ROWS]
    grads = backward(model, ids)
    plan = GraphAnalyzer(model).plan()
    _, staged = stage(model, grads)
    for entry in plan.dynamic_entries:
        header = staged.headers[entry.name]
        got_ids, got = payload_views(staged.region, entry, header.rows, header.offset)
        want = grads[entry.name].coalesce()
        assert torch.equal(got_ids, want.indices()[0])
        sums = in_order(grads[entry.name])
        assert torch.equal(got, torch.stack([sums[i] for i in got_ids.tolist()]))
        torch.testing.assert_close(got, want.values())


def test_tables_of_mixed_dtypes_are_staged_one_by_one() -> None:
    model = Tables(dtypes=(torch.float32, torch.float64))
    grads = backward(model, DUPLICATES)
    plan = GraphAnalyzer(model).plan()
    staging, staged = stage(model, grads)
    for entry in plan.dynamic_entries:
        header = read_header(staging.header_regions()[(0, "headers")], entry)
        ids, values = payload_views(staged.region, entry, header.rows, header.offset)
        want = grads[entry.name].coalesce()
        assert torch.equal(ids, want.indices()[0]) and torch.equal(values, want.values())


def test_a_table_at_its_budget_stages_and_one_past_it_changes_nothing() -> None:
    model = Tables()
    at_budget = [[1, 2, 2, 3, 4, 4, 4, 1], [5], [], [], [6, 6]]  # 4 unique rows of 4 allowed
    staging, staged = stage(model, backward(model, at_budget), sparse_max_rows=4)
    assert staged.headers["t.0.weight"].rows == 4
    headers, region = staging.header_regions()[(0, "headers")], staging.region(0)
    before = bytes(headers.buffer()), bytes(region.buffer())
    model.zero_grad(set_to_none=True)
    past = backward(model, [[1], [2], [3], [0, 1, 2, 3, 4, 4], [7]])  # the 4th has 5 rows
    with pytest.raises(RegionError, match=r"t\.3\.weight: sparse gradient has 5 rows"):
        staging.stage(0, past)
    assert (bytes(headers.buffer()), bytes(region.buffer())) == before
    assert staging.region(0) is region
    model.zero_grad(set_to_none=True)
    again = staging.stage(0, backward(model, at_budget))
    assert [h.version for h in again.headers.values()] == [2] * len(ROWS)
