"""A shard's sparse tables without the network: rows handed over whole, per-row optimizer
state through checkpoints and the state a RemoteOptimizer gathers."""

from __future__ import annotations

import dataclasses
import io
from collections.abc import Callable
from typing import Any

import pytest
import torch

from tensorx._ps.rows.header import read_header, read_headers
from tensorx._ps.rows.sparse import SparseReceiver
from tensorx._ps.rows.staging import SparseStaging
from tensorx._ps.state.shard import ShardLayout, ShardState
from tensorx._ps.update.optim_check import check_state
from tensorx._ps.wire import optim_state
from tensorx.errors import BrokenError, RegionError
from tensorx.graph_analyzer import GraphAnalyzer
from tensorx.memregion import MemoryRegion, RegionDescriptor
from tests.support.models import sparse_embedding

TABLES = {"emb.weight": (1000, 16), "bag.weight": (500, 8)}


class RowWiseAdagrad(torch.optim.Optimizer):
    """DLRM's row-wise Adagrad: one accumulator per row (the mean square of the row's
    gradient), sparse gradients only for tables, plain SGD for the rest."""

    def __init__(self, params: Any, lr: float = 0.1, eps: float = 1e-8) -> None:
        super().__init__(params, {"lr": lr, "eps": eps})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if not p.grad.is_sparse:
                    p.add_(p.grad, alpha=-group["lr"])
                    continue
                g = p.grad.coalesce()
                rows, values = g.indices()[0], g.values()
                state = self.state[p]
                if not state:
                    state["sum"] = torch.zeros(p.shape[0], dtype=p.dtype)
                state["sum"].index_add_(0, rows, values.pow(2).mean(1))
                scale = group["lr"] / (state["sum"][rows].sqrt() + group["eps"])
                p.index_add_(0, rows, -values * scale[:, None])


def plan_and_layout() -> tuple[Any, ShardLayout]:
    plan = GraphAnalyzer(sparse_embedding()).plan()
    return plan, ShardLayout.from_plan(plan, 0)


def rows_of(seed: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Coalesced rows for both tables, as a worker stages them."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, (n, dim) in TABLES.items():
        ids = torch.randint(0, n, (40,), generator=gen).unique()
        out[name] = (ids, torch.randn(len(ids), dim, generator=gen))
    return out


def state_of(factory: Callable[..., torch.optim.Optimizer], flat: bool | None = None,
             workers: int = 2) -> ShardState:
    _, layout = plan_and_layout()
    state = ShardState(layout, workers, factory, flat=flat)
    state.load_params({k: v.detach() for k, v in sparse_embedding().state_dict().items()})
    return state


def train(state: ShardState, seeds: list[int]) -> None:
    for seed in seeds:
        state.put_rows(0, rows_of(seed))
        state.put_rows(1, rows_of(seed + 100))
        state.apply([0, 1])


def params(state: ShardState) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in state.named_parameters()}


@pytest.mark.parametrize(("factory", "flat"), [
    pytest.param(lambda p: torch.optim.Adagrad(p, lr=0.1), None, id="adagrad-flat"),
    pytest.param(lambda p: torch.optim.Adagrad(p, lr=0.1), False, id="adagrad-per-tensor"),
    pytest.param(lambda p: RowWiseAdagrad(p), None, id="row-wise"),
])
def test_per_row_state_survives_a_checkpoint(factory: Callable[..., torch.optim.Optimizer],
                                             flat: bool | None) -> None:
    """Two updates, a checkpoint into a fresh shard, a third update on both: the same
    parameters; the row-wise state keeps its per-row shape."""
    a = state_of(factory, flat)
    train(a, [1, 2])
    file = io.BytesIO()
    torch.save(a.state_dict(b"plan"), file)  # as a checkpoint does
    file.seek(0)
    b = state_of(factory, flat)
    b.load_state_dict(torch.load(file, weights_only=True))
    train(a, [3])
    train(b, [3])
    for name, value in params(a).items():
        assert torch.equal(value, params(b)[name]), name
    table = dict(b.named_parameters())["emb.weight"]
    want = (1000,) if isinstance(b.optimizer, RowWiseAdagrad) else (1000, 16)
    assert tuple(b.optimizer.state[table]["sum"].shape) == want  # type: ignore[union-attr]


def test_a_row_wise_state_passes_the_state_checks() -> None:
    """Its dense steps keep nothing: what it keeps for a table is learnt from a step over
    rows, as a table's gradient arrives (its own state is not refused)."""
    state = state_of(lambda p: RowWiseAdagrad(p))
    train(state, [1])
    opt, label_of = state.optimizer, state.param_labels()
    assert opt is not None and label_of is not None
    check_state(opt, label_of, [{}], optim_state.state_of(opt, label_of))


def test_tables_get_the_mean_of_the_ranks_rows() -> None:
    """SGD on a table moves exactly the rows pushed, by lr times the ranks' mean; the
    flat update (SGD is elementwise) leaves the tables out of its ranges."""
    state = state_of(lambda p: torch.optim.SGD(p, lr=0.5))
    assert "2 sparse table(s) per tensor" in state.update
    before = params(state)
    train(state, [7])
    after = params(state)
    for name, (n, _) in TABLES.items():
        want = before[name].clone()
        for rows in (rows_of(7), rows_of(107)):
            ids, values = rows[name]
            want.index_add_(0, ids, values, alpha=-0.5 / 2)
        torch.testing.assert_close(after[name], want, rtol=0, atol=1e-6)
        touched = torch.cat([rows_of(7)[name][0], rows_of(107)[name][0]]).unique()
        untouched = torch.ones(n, dtype=torch.bool)
        untouched[touched] = False
        assert torch.equal(after[name][untouched], before[name][untouched])


@pytest.mark.parametrize("ranks", [[0], [0, 1]])
def test_a_tables_gradient_is_the_coalesced_mean_of_the_rows(ranks: list[int]) -> None:
    """Rows as a worker stages them (sorted, unique), or not (a rank's ids out of order and
    repeated): the gradient is what torch's coalesce() gives of them all, over the ranks;
    changing it in place (clipping) leaves the rows a rank pushed as they were."""
    state = state_of(lambda p: torch.optim.SGD(p, lr=0.5))
    n, dim = TABLES["emb.weight"]
    pushed = [(torch.tensor([9, 3, 9, 0]), torch.randn(4, dim)), rows_of(5)["emb.weight"]]
    for r in ranks:
        state.put_rows(r, {"emb.weight": pushed[r]})
    i = state.rows.index("emb.weight")
    grad = state.rows.grad(ranks, i)
    assert grad is not None and grad.is_coalesced()
    ids = torch.cat([pushed[r][0] for r in ranks])
    values = torch.cat([pushed[r][1] for r in ranks])
    with torch.sparse.check_sparse_tensor_invariants(enable=False):
        want = torch.sparse_coo_tensor(ids[None], values / len(ranks), (n, dim)).coalesce()
    assert torch.equal(grad.indices(), want.indices())
    torch.testing.assert_close(grad.values(), want.values())
    kept = [pushed[r][1].clone() for r in ranks]
    grad.values().mul_(0.0)
    assert all(torch.equal(pushed[r][1], k) for r, k in zip(ranks, kept, strict=True))
    sorted_once = state.rows.grad([1], i) if 1 in ranks else None
    assert sorted_once is None or torch.equal(sorted_once.indices()[0], pushed[1][0])


def test_optimizer_state_packs_for_a_remote_optimizer() -> None:
    """What RemoteOptimizer.state_dict() gathers from a shard: per-row state included."""
    state = state_of(lambda p: RowWiseAdagrad(p))
    train(state, [1])
    assert state.optimizer is not None
    gathered = optim_state.state_of(state.optimizer, state.param_labels())
    assert tuple(gathered["emb.weight"]["sum"].shape) == (1000,)
    packed = optim_state.Packed(gathered)
    assert packed.tensors["emb.weight"]["sum"][:2] == ["float32", [1000]]


class BreakingEndpoint:
    """Reads from the staging regions it knows; the ``fail_at``-th read breaks after half
    of its bytes landed."""

    def __init__(self, regions: list[MemoryRegion], fail_at: int | None = None) -> None:
        self.regions = {r.region_id: r for r in regions}
        self.fail_at = fail_at
        self.reads = 0

    async def read(self, local: MemoryRegion, desc: RegionDescriptor, offset: int = 0,
                   remote_offset: int = 0, nbytes: int = 0,
                   timeout: float | None = None) -> None:
        self.reads += 1
        n = nbytes // 2 if self.reads == self.fail_at else nbytes
        src = self.regions[desc.region_id].buffer()
        local.buffer()[offset:offset + n] = src[remote_offset:remote_offset + n]
        if self.reads == self.fail_at:
            raise BrokenError("the worker died mid-push")


async def test_a_push_that_breaks_half_way_hands_over_no_rows() -> None:
    """Half of the rows arrived, then the read broke: the shard's next update uses none of
    that push (its rows reach the optimizer only once all of them came)."""
    plan, layout = plan_and_layout()
    staging = SparseStaging(plan)
    receiver = SparseReceiver(plan, 0, 1)
    state = ShardState(layout, 1, lambda p: torch.optim.SGD(p, lr=1.0))
    try:
        async def push(seed: int, fail_at: int | None) -> dict[str, Any]:
            grads = {name: torch.sparse_coo_tensor(ids[None], values, TABLES[name],
                                                   check_invariants=True)
                     for name, (ids, values) in rows_of(seed).items()}
            staging.stage(0, grads)
            receiver.headers[0].buffer()[:] = staging.headers(0).buffer()
            desc = staging.region(0).descriptor().to_bytes()
            receiver.announce(0, dict.fromkeys(TABLES, desc))
            ep = BreakingEndpoint([staging.region(0)], fail_at)
            got = await receiver.receive(ep, 0, None)
            assert ep.reads == 1  # every table of the shard in one read
            return got

        state.put_rows(0, await push(1, None))
        with pytest.raises(BrokenError):
            state.put_rows(0, await push(2, fail_at=1))
        before = params(state)
        state.apply([0])
        for name in TABLES:
            ids, values = rows_of(1)[name]
            want = before[name].clone().index_add_(0, ids, -values)
            assert torch.equal(params(state)[name], want), name
    finally:
        state.close()
        receiver.close()
        staging.close()


async def test_staged_rows_spread_past_what_the_tables_take_are_refused_unread() -> None:
    """A header that puts a table's rows far from the others' (a read, and a buffer, of
    that span) is refused before anything is allocated or read."""
    plan, _ = plan_and_layout()
    staging = SparseStaging(plan)
    receiver = SparseReceiver(plan, 0, 1)
    try:
        grads = {name: torch.sparse_coo_tensor(ids[None], values, TABLES[name],
                                               check_invariants=True)
                 for name, (ids, values) in rows_of(1).items()}
        staged = staging.stage(0, grads)
        receiver.headers[0].buffer()[:] = staging.headers(0).buffer()
        entry = plan.dynamic("bag.weight")
        far = dataclasses.replace(staged.headers[entry.name], offset=1 << 40)
        slot = entry.header_offset
        receiver.headers[0].buffer()[slot:slot + len(far.pack())] = far.pack()
        receiver.announce(0, dict.fromkeys(TABLES, staging.region(0).descriptor().to_bytes()))
        ep = BreakingEndpoint([staging.region(0)])
        with pytest.raises(RegionError, match="span"):
            await receiver.receive(ep, 0, None)
        assert ep.reads == 0
    finally:
        receiver.close()
        staging.close()


@pytest.mark.parametrize("field", ["rows", "nbytes", "offset"])
def test_a_header_that_does_not_fit_its_table_is_refused_naming_it(field: str) -> None:
    """All the header slots are decoded at once, each checked as read_header checks one: a
    slot whose rows pass the budget, whose bytes do not match its rows, or whose payload is
    not aligned raises RegionError naming its table; good slots decode to read_header's."""
    plan, _ = plan_and_layout()
    staging = SparseStaging(plan)
    try:
        grads = {name: torch.sparse_coo_tensor(ids[None], values, TABLES[name],
                                               check_invariants=True)
                 for name, (ids, values) in rows_of(1).items()}
        staged = staging.stage(0, grads)
        headers = staging.headers(0)
        entries = list(plan.dynamic_entries)
        assert read_headers(headers, entries) == [read_header(headers, e) for e in entries]
        entry = plan.dynamic("bag.weight")
        good = staged.headers[entry.name]
        bad = {"rows": entry.budget_rows + 1, "nbytes": good.nbytes + 8,
               "offset": good.offset + 8}[field]
        slot = entry.header_offset
        headers.buffer()[slot:slot + 40] = dataclasses.replace(good, **{field: bad}).pack()[:40]
        with pytest.raises(RegionError, match=r"bag\.weight: header"):
            read_headers(headers, entries)
    finally:
        staging.close()


@pytest.mark.parametrize("flat", [None, False], ids=["flat-auto", "per-tensor"])
def test_a_table_no_rank_touched_is_not_stepped(flat: bool | None) -> None:
    """No rows of a table in an update: no gradient for it, so the optimizer skips it as
    torch skips a None grad (Adagrad's step count for it does not move)."""
    state = state_of(lambda p: torch.optim.Adagrad(p, lr=0.1), flat)
    state.put_rows(0, {"emb.weight": rows_of(3)["emb.weight"]})
    state.put_rows(1, {})
    state.apply([0, 1])
    assert state.optimizer is not None
    tables = dict(state.named_parameters())
    steps = {n: float(state.optimizer.state_dict()["state"][i]["step"])
             for i, (n, _) in enumerate(state.named_parameters())}
    assert steps["emb.weight"] == 1.0
    assert steps["bag.weight"] == 0.0
    assert tables["bag.weight"].grad is None


def test_grad_hook_and_clipping_see_sparse_rows() -> None:
    """After gather (grad_hook=, clip_grad_norm=): a table's gradient is sparse, coalesced,
    counts in the global norm by its rows, and a scaling reaches the optimizer."""
    state = state_of(lambda p: torch.optim.SGD(p, lr=1.0))
    state.put_rows(0, rows_of(5))
    state.put_rows(1, {})
    before = params(state)
    state.gather([0, 1])
    named = dict(state.named_grads())
    assert named["emb.weight"].is_sparse and named["emb.weight"].is_coalesced()
    want = sum(float((v / 2).double().pow(2).sum()) for _, v in rows_of(5).values())
    assert state.grad_sumsq() == pytest.approx(want, rel=1e-6)
    state.scale_grads(0.5)
    assert named["emb.weight"].is_coalesced()
    state.apply([0, 1])
    ids, values = rows_of(5)["emb.weight"]
    want_emb = before["emb.weight"].clone().index_add_(0, ids, values, alpha=-0.25)
    torch.testing.assert_close(params(state)["emb.weight"], want_emb, rtol=0, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_a_rows_values_add_up_in_rank_order_from_zero(dtype: torch.dtype) -> None:
    """Each row id's rows are added one after the other, from zero, in the order of the
    ranks and, within a rank, in the order pushed (big - big + 1 + 0.5 is 1.5, and
    1 + 0.5 - big + big is 0: the small ones are lost next to big); a row of -0.0 alone sums
    to +0.0. The same bits whichever sum runs (float32/64 rows in host memory: a numpy sort
    and an ``embedding_bag``; other dtypes: ``index_add_``)."""
    from tensorx._ps.rows.tables import sum_rows

    big = 2.0 ** 60
    row = torch.ones(2, 3, dtype=dtype)
    parts = [(torch.tensor([4, 1]), torch.stack([row * big, row * -0.0])),
             (torch.tensor([4, 2]), torch.stack([row * -big, row * 3])),
             (torch.tensor([1, 4, 4]), torch.stack([row * -0.0, row, row * 0.5]))]
    sums = []
    for order in (parts, parts[::-1]):
        ids, values = sum_rows(order)
        assert ids.tolist() == [1, 2, 4]
        want = torch.zeros(3, 2, 3, dtype=dtype)
        for part_ids, part_values in order:  # the definition: rank by rank, from zero
            want.index_add_(0, torch.searchsorted(ids, part_ids), part_values)
        assert torch.equal(values.view(torch.uint8), want.view(torch.uint8))
        assert values[0].eq(0).all() and not values[0].signbit().any()
        sums.append(values[2])
    assert torch.equal(sums[0], row * 1.5) and torch.equal(sums[1], row * 0)
