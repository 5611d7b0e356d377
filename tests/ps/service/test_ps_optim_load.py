"""A load of optimizer state when a shard has no optimizer.

A shard the plan leaves no parameters (more shards than the model has entries) builds no
optimizer (see ShardState). It has no state to load, as a torch optimizer over no
parameters has none: a load that carries no state for it (what RemoteOptimizer sends) is
loaded into the other shards and the workers train on, exactly as a single process that
loaded the same checkpoint; a load that carries state for it is refused with an error that
names the entry, and nothing is loaded anywhere.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from tensorx._ps.update.optim import plan_params
from tensorx.errors import ProtocolError
from tensorx.remote_optimizer import RemoteOptimizer
from tests.support.clusters import on_ranks, servers, serving_in_thread, workers
from tests.support.data import backward, batches
from tests.support.lanes import assert_link, link_options, links

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NUM_SHARDS = 2  # one tensor, two shards: shard EMPTY is left no parameters
EMPTY = 0


class OneRow(nn.Module):
    """One weight of one row (a plan cuts tensors at whole rows: this one stays whole), so
    one shard holds it and the other nothing; three logits for the tests' batches."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(1, 8) / 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x @ self.weight.t()
        return torch.cat([h, -h, h * h], dim=1)


def linear(seed: int = 0) -> OneRow:
    torch.manual_seed(seed)
    return OneRow()


def adam(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=0.05)


def train(opt: torch.optim.Optimizer, model: nn.Module, data: list[Any], rank: int) -> None:
    """``data``'s steps for ``rank``; rank -1: the union batch, in one process."""
    for step in data:
        x, y = step[rank] if rank >= 0 else (torch.cat([b[0] for b in step]),
                                             torch.cat([b[1] for b in step]))
        opt.zero_grad()
        backward(model, x, y)
        opt.step()


@pytest.mark.parametrize("link", links())
def test_a_load_skips_a_shard_without_optimizer(link: str) -> None:
    """Two ranks save after 3 steps; fresh servers, fresh models: both load the model and
    the optimizer state and train 3 more steps. Equal to one process that never stopped;
    the empty shard neither refuses the load nor drops the workers. Over the defaults and
    over each lane with share_memory=False."""
    data = batches(6, 2)
    models = [linear(), linear()]
    with serving_in_thread(NUM_SHARDS, 2, optimizer=adam, flat=False,
                           **link_options(link)) as ps:
        def first(rank: int) -> dict[str, Any]:
            with RemoteOptimizer(models[rank], ps, rank, 2, timeout=20,
                                 **link_options(link)) as opt:
                assert {e.shard for e in plan_params(opt.worker.plan)} == {1 - EMPTY}
                assert opt.worker.optim[EMPTY]["groups"] == []  # no optimizer there
                train(opt, models[rank], data[:3], rank)
                assert_link(opt.worker, link, every=False)  # (the empty shard: no bytes)
                return opt.state_dict()

        saved = on_ranks(first)[0]
    assert saved["state"]  # Adam's state, all on the shard that has the weight
    model_state = models[0].state_dict()

    resumed = [linear(seed=5), linear(seed=6)]
    with serving_in_thread(NUM_SHARDS, 2, optimizer=adam, flat=False,
                           **link_options(link)) as ps:
        def second(rank: int) -> None:
            resumed[rank].load_state_dict(model_state)
            with RemoteOptimizer(resumed[rank], ps, rank, 2, timeout=20,
                                 **link_options(link)) as opt:
                opt.load_state_dict(saved)
                loaded = opt.state_dict()
                for i, entry in saved["state"].items():
                    for key, value in entry.items():
                        torch.testing.assert_close(loaded["state"][i][key], value)
                train(opt, resumed[rank], data[3:], rank)
                assert opt.worker.stats["rejoins"] == 0

        on_ranks(second)

    single = linear()
    local = adam(list(single.parameters()))  # type: ignore[arg-type]
    train(local, single, data, -1)
    for model in resumed:
        torch.testing.assert_close(model.weight.detach(), single.weight.detach(),
                                   rtol=1e-5, atol=1e-6)


async def test_state_for_a_shard_without_optimizer_is_refused() -> None:
    """A peer that sends the empty shard state for an entry: refused (ProtocolError naming
    the entry, as for any entry a shard does not hold); the other shard loads nothing."""
    model = linear()
    async with servers(NUM_SHARDS, 1, optimizer=adam, flat=False, log_every=None) as shards, \
            workers([model], [ps.address for ps in shards], timeout=20) as (w,):
        for (x, y), in batches(2, 1):
            w.zero_grad()
            backward(model, x, y)
            await w.step()
        fetched = await w.fetch_optimizer_state()
        states = [dict(state) for _, state in fetched]
        assert states[EMPTY] == {} and set(states[1 - EMPTY]) == {"weight"}
        hps = w.optim[1 - EMPTY]["groups"][0]["hp"]
        stray = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else v
                 for k, v in states[1 - EMPTY]["weight"].items()}
        states[EMPTY] = {"weight": stray}
        with pytest.raises(ProtocolError, match="'weight'"):
            await w.load_optimizer_state([hps], states)
        held = shards[1 - EMPTY].state
        assert held is not None and held.optimizer is not None
        kept = next(iter(held.optimizer.state.values()))
        assert float(kept["step"]) == 2.0 and kept["exp_avg"].abs().sum() > 0
