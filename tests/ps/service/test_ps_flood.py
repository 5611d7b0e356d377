"""A parameter server under a flood of notifications from one authenticated peer: what the
flood can make it hold is bounded, and an honest worker still trains meanwhile."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import tracemalloc

import pytest
import torch
from torch import nn

import tensorx as tx
from tensorx.ps import ParameterServer
from tensorx.worker import Worker

MiB = 1 << 20


class Params(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.zeros(1024))


def sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=1.0)


@pytest.mark.parametrize("share_memory", [True, False])
async def test_one_peers_notification_flood_is_bounded_and_a_worker_trains(
        share_memory: bool) -> None:
    """A token holder sends 1 MiB notifications as fast as it can (each one a refused
    message): the server copied them into its own queue without limit, and the worker's
    push waited behind the backlog until its step timed out. Now a peer with more than 64
    messages waiting is dropped, the server grows by a bounded amount, and the worker's
    steps go on."""
    async with ParameterServer(num_workers=1, optimizer=sgd, transport="tcp",
                               share_memory=share_memory) as ps:
        model = Params()
        async with Worker(model, ps.address, rank=0, num_workers=1, transport="tcp",
                          timeout=30) as worker, \
                tx.Node(listen=None, transport="tcp") as flooder:

            async def step() -> None:
                worker.zero_grad()
                model.a.sum().backward()
                await worker.step()

            await step()
            ep = await flooder.connect(ps.address)
            sent = 0

            async def flood() -> None:
                nonlocal sent
                payload = b"\xc1" * MiB  # not a control message: refused, one by one
                with contextlib.suppress(tx.TensorxError):  # until the server drops it
                    while True:
                        await ep.notify(payload, timeout=None)
                        sent += 1

            async def drain() -> None:  # the flooder reads the refusals it is sent
                while True:
                    await flooder.notifications.get()

            tracemalloc.start(1)
            base = tracemalloc.get_traced_memory()[0]
            tasks = [asyncio.create_task(flood()), asyncio.create_task(drain())]
            most = 0
            try:
                for _ in range(20):
                    await asyncio.wait_for(step(), 60)
                    gc.collect()
                    most = max(most, tracemalloc.get_traced_memory()[0] - base)
                await asyncio.wait_for(tasks[0], 60)  # the server dropped the flooder
            finally:
                tracemalloc.stop()
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
            assert ep.closed
            assert most < 150 * MiB, f"{sent} flooded notifications grew the server by " \
                                     f"{most / MiB:.0f} MiB"
        assert model.a.detach().tolist() == [-21.0] * 1024
