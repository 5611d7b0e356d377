"""Pipeline x data parallel: two replicas of a two-stage pipeline, each stage's parameters
on a parameter server of its own (sync, one worker per replica), train as one process
does on the union of the replicas' batches."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from tensorx import ParameterServer, RemoteOptimizer
from tensorx import pipelining as pp
from tests.support.clusters import on_ranks

pytestmark = pytest.mark.usefixtures("one_torch_thread")

REPLICAS, STAGES, M, STEPS = 2, 2, 2, 2


def parts() -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(8, 16), nn.Tanh()), nn.Linear(16, 3)]


def data() -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    g = torch.Generator().manual_seed(3)
    return [[(torch.randn(6, 8, generator=g), torch.randint(0, 3, (6,), generator=g))
             for _ in range(REPLICAS)] for _ in range(STEPS)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_each_stage_on_its_own_parameter_server_trains_as_one_process() -> None:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def run(coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, loop).result(60)

    servers = [ParameterServer("tcp://127.0.0.1:0", num_workers=REPLICAS, log_every=None,
                               optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
               for _ in range(STAGES)]
    for ps in servers:
        run(ps.start())
    batches = data()
    loss_fn = nn.CrossEntropyLoss()

    def replica_stage(replica: int, s: int, peers: dict[int, str]) -> Callable[[], Any]:
        module = parts()[s]  # (here: the seed is global, the threads would race for it)

        def train() -> dict[str, torch.Tensor]:
            with pp.PipelineStage(module, s, STAGES, "cpu", peers=peers) as stage, \
                    RemoteOptimizer(module, servers[s].address, rank=replica,
                                    num_workers=REPLICAS) as opt:
                sched = pp.Schedule1F1B(stage, M, loss_fn=loss_fn if s == STAGES - 1 else None)
                for step in batches:
                    x, y = step[replica]
                    opt.zero_grad()
                    if s == 0:
                        sched.step(x)
                    else:
                        sched.step(target=y)
                    opt.step()
            return {k: v.detach().clone() for k, v in module.state_dict().items()}
        return train

    try:
        jobs = []
        for replica in range(REPLICAS):
            peers = {s: f"tcp://127.0.0.1:{free_port()}" for s in range(STAGES)}
            jobs += [replica_stage(replica, s, peers) for s in range(STAGES)]
        states = on_ranks(lambda i: jobs[i](), len(jobs))
    finally:
        for ps in servers:
            run(ps.aclose())
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)
        loop.close()

    # one process: the whole model, each replica's micro-batches, gradients averaged
    model = nn.Sequential(*parts())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in batches:
        opt.zero_grad()
        for x, y in step:
            for xb, yb in zip(torch.tensor_split(x, M), torch.tensor_split(y, M), strict=True):
                (loss_fn(model(xb), yb) / (M * REPLICAS)).backward()
        opt.step()
    want = model.state_dict()
    for replica in range(REPLICAS):
        for s in range(STAGES):
            for k, v in states[replica * STAGES + s].items():
                assert torch.allclose(v, want[f"{s}.{k}"], atol=1e-6), (replica, s, k)
