"""A worker's sparse staging: each shard's tables staged in one region with a header slot
each; packed (all of a shard's tables coalesced at once) in the format the per-table path
writes (and read_header / payload_views decode); grown as needed, refused past a budget."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from tensorx._ps.rows import staging as rows_staging
from tensorx._ps.rows.header import payload_views, read_header
from tensorx._ps.rows.staging import SparseStaging, StagedSparse
from tensorx.errors import RegionError, UsageError
from tensorx.graph_analyzer import GraphAnalyzer
from tests.support import models

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
          **options: int) -> tuple[SparseStaging, StagedSparse]:
    plan = GraphAnalyzer(model, **options).plan()
    staging = SparseStaging(plan)
    if packed:
        return staging, staging.stage(0, grads)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(rows_staging._Packed, "of", staticmethod(lambda *_: None))
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
    assert bytes(packed.headers(0).buffer()) == \
        bytes(table.headers(0).buffer())
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
        header = read_header(staging.headers(0), entry)
        ids, values = payload_views(staged.region, entry, header.rows, header.offset)
        want = grads[entry.name].coalesce()
        assert torch.equal(ids, want.indices()[0]) and torch.equal(values, want.values())


def test_a_table_at_its_budget_stages_and_one_past_it_changes_nothing() -> None:
    model = Tables()
    at_budget = [[1, 2, 2, 3, 4, 4, 4, 1], [5], [], [], [6, 6]]  # 4 unique rows of 4 allowed
    staging, staged = stage(model, backward(model, at_budget), sparse_max_rows=4)
    assert staged.headers["t.0.weight"].rows == 4
    headers, region = staging.headers(0), staging.region(0)
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


# -- a model's sparse gradients, as the worker stages them ---------------------------------
def test_sparse_rows_are_staged_with_a_header() -> None:
    model = models.sparse_embedding()
    plan = GraphAnalyzer(model, num_shards=2).plan()
    staging, params = SparseStaging(plan), dict(model.named_parameters())
    model(torch.tensor([[1, 5, 5], [7, 1, 999]])).sum().backward()
    entry = plan.dynamic("emb.weight")
    staged = staging.stage_params(entry.shard, params)
    header = read_header(staging.headers(entry.shard), entry)
    assert header == staged.headers["emb.weight"]
    assert (header.rows, header.version) == (4, 1)
    indices, values = payload_views(staged.region, entry, header.rows, header.offset)
    assert indices.tolist() == [1, 5, 7, 999]
    dense = model.emb.weight.grad.to_dense()  # type: ignore[union-attr]
    assert torch.equal(values, dense[indices])
    assert staging.stage_params(entry.shard, params).headers["emb.weight"].version == 2
    staging.close()
    assert staged.region.closed and staging.headers(0).closed


def test_a_shards_tables_are_packed_in_one_staging_region() -> None:
    """Each table's payload follows the previous one's in the shard's staging region, so
    the receiver reads them all at once; each is its gradient coalesced."""
    model = models.sparse_embedding()  # two tables, rows of 16 and of 8 floats
    plan = GraphAnalyzer(model).plan()
    staging = SparseStaging(plan)
    model(torch.tensor([[3, 3, 509], [7, 1, 3]])).sum().backward()
    staged = staging.stage_params(0, dict(model.named_parameters()))
    spans = []
    for entry in plan.dynamic_entries:
        header = staged.headers[entry.name]
        indices, values = payload_views(staged.region, entry, header.rows, header.offset)
        grad = model.get_parameter(entry.name).grad.coalesce()  # type: ignore[union-attr]
        assert torch.equal(indices, grad.indices()[0])
        torch.testing.assert_close(values, grad.values())
        spans.append((header.offset, header.offset + header.nbytes))
    (a0, a1), (b0, b1) = sorted(spans)
    assert a0 == 0 and a1 <= b0 < a1 + 64 and b1 <= staged.region.nbytes
    staging.close()


def test_sparse_staging_grows_then_fails_clearly_past_its_budget() -> None:
    model = models.sparse_embedding()
    staging = SparseStaging(GraphAnalyzer(model, sparse_budget_bytes=300 * (8 + 64)).plan())
    params = dict(model.named_parameters())
    model(torch.arange(270).reshape(90, 3)).sum().backward()
    staged = staging.stage_params(0, params)
    assert staged.grown and staged.headers["emb.weight"].rows == 270
    model.zero_grad(set_to_none=True)
    model(torch.arange(330).reshape(110, 3)).sum().backward()
    with pytest.raises(RegionError, match="at most 300"):
        staging.stage_params(0, params)
    staging.close()


def test_declared_max_rows_is_a_hard_limit() -> None:
    model = models.sparse_embedding()
    staging = SparseStaging(GraphAnalyzer(model, sparse_max_rows=4).plan())
    model(torch.arange(6).reshape(2, 3)).sum().backward()
    with pytest.raises(RegionError, match="sparse_max_rows"):
        staging.stage_params(0, dict(model.named_parameters()))
    staging.close()


def test_a_table_without_a_sparse_gradient_is_named() -> None:
    """No backward yet (``.grad`` None), or a dense ``.grad``: UsageError naming the table."""
    model = models.sparse_embedding()
    staging, params = SparseStaging(GraphAnalyzer(model).plan()), dict(model.named_parameters())
    with pytest.raises(UsageError, match="has no sparse gradient to stage"):
        staging.stage_params(0, params)
    model(torch.tensor([[1, 2, 3]])).sum().backward()
    params["emb.weight"].grad = torch.zeros_like(params["emb.weight"])
    with pytest.raises(UsageError, match=r"emb\.weight has no sparse gradient"):
        staging.stage_params(0, params)
    staging.close()


def test_dense_models_have_no_staging() -> None:
    model = models.mlp()
    staging = SparseStaging(GraphAnalyzer(model).plan())
    with pytest.raises(UsageError):
        staging.stage_params(0, dict(model.named_parameters()))
    with pytest.raises(UsageError):
        staging.region(0)
    staging.close()
