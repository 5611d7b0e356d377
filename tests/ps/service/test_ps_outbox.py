"""Async and bounded answers in flight keep the arena they read (issue 16, item 4).

:meth:`ShardState.move_params` and :class:`tensorx._ps.service.outbox.Outbox` without processes:
an update that is due while an answer still reads the arena goes to a copy, the answer's
arena stays exactly as it was, and the training is the same as if nothing had moved. The
end-to-end case (a SIGSTOPped worker over tcp and ucx) is in ``test_ps_slow_peer.py``.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

from tensorx._ps.service.outbox import Outbox
from tensorx._ps.state.shard import ShardLayout, ShardState, views
from tensorx.graph_analyzer import GraphAnalyzer
from tests.support import models


def _layout() -> ShardLayout:
    return ShardLayout.from_plan(GraphAnalyzer(models.transformer(), num_shards=1).plan(), 0)


def _grads(state: ShardState, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for view in views(state.layout, state.slot_regions[0]):
        view.copy_(torch.randn(view.shape, generator=gen))


OPTIMIZERS: dict[str, Any] = {
    "sgd-momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    "adam": lambda p: torch.optim.Adam(p, lr=1e-2),
}


@pytest.mark.parametrize("flat", [None, False])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_moving_the_parameters_changes_nothing_but_where_they_are(
        name: str, flat: bool | None) -> None:
    moved, ref = (ShardState(_layout(), 1, OPTIMIZERS[name], flat=flat) for _ in range(2))
    assert (moved.fast is not None) == (flat is None)
    olds = []
    for step in range(6):
        for s in (moved, ref):
            _grads(s, step)
        if step % 2:
            before = [v.clone() for v in moved.views]
            olds.append((moved.move_params(moved.new_arena()), before))
        moved.apply([0])
        ref.apply([0])
        # the arena left behind holds the version it had, untouched by the update
        old, snapshot = olds[-1] if olds else (None, None)
        if old is not None and snapshot is not None and step % 2:
            for v, b in zip(views(moved.layout, old), snapshot, strict=True):
                assert torch.equal(v, b)
    for x, y in zip(moved.views, ref.views, strict=True):
        assert torch.equal(x, y)  # momentum, Adam's moments and steps carried over
    for p in moved.params:  # the optimizer's parameters view the newest arena
        base = moved.params_region.address
        assert base <= p.data_ptr() < base + moved.params_region.nbytes
    for old, _ in olds:
        old.close()
    moved.close()
    ref.close()


async def test_an_update_waits_for_no_answer_and_old_arenas_become_spares() -> None:
    state = ShardState(_layout(), 2, OPTIMIZERS["sgd-momentum"])
    outbox = Outbox(0, limit=1)
    first = state.params_region
    release = asyncio.Event()
    seen: list[bytes] = []

    async def slow_answer() -> None:  # a stopped worker: reads the arena once let go
        await release.wait()
        seen.append(bytes(first.view(torch.uint8, (64,), 0).numpy()))

    before = bytes(first.view(torch.uint8, (64,), 0).numpy())
    outbox.send(1, first, slow_answer)
    assert outbox.pending(1) and outbox.busy(first)
    _grads(state, 0)
    await outbox.make_room(state)  # returns at once: the update goes elsewhere
    state.apply([0])
    assert state.params_region is not first and outbox.moves == 1
    second = state.params_region
    assert bytes(second.view(torch.uint8, (64,), 0).numpy()) != before  # updated there

    # limit=1 old arena held: the next update with an answer in flight on the new arena
    # has to wait for the oldest answer, then reuses its arena as the spare
    async def quick() -> None:
        await asyncio.sleep(0)  # an answer that takes one loop turn

    outbox.send(0, second, quick)
    outbox.send(1, second, quick)  # after rank 1's slow answer: in order
    assert outbox.busy(second)
    waiting = asyncio.ensure_future(outbox.make_room(state))
    # past the time make_room gives an answer before it copies (a copy of this small
    # arena's time): that wait is the behaviour under test
    await asyncio.sleep(0.05)
    assert not waiting.done()  # held by the stopped worker's answer
    release.set()
    await asyncio.wait_for(waiting, 10)
    assert seen == [before]  # the slow answer read the version it was given
    assert state.params_region is first  # the old arena, free again, is the spare
    await outbox.drain()
    await outbox.aclose(state.params_region)
    assert second.closed and not first.closed
    state.close()
