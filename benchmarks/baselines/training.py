"""PS training processes for ``benchmarks/train_throughput.py``: one PS, two workers, sync.

The model is communication-heavy on purpose: a wide MLP (784 -> 4096 -> 4096 -> 10, 20M
parameters, 80 MB) on small batches of synthetic data, so a step moves far more bytes than
it computes. Two systems:

* ``tensorx``: :class:`tensorx.ps.ParameterServer` (sync, SGD, default options) and, per
  worker, the blocking :class:`tensorx.RemoteOptimizer` in an ordinary PyTorch loop
  (``--overlap`` on or off: gradient buckets written during backward, or all at ``step``;
  auto, the default: measured;
  ``--share-memory on``: the workers map the PS's arenas, nothing is copied at all).
* ``rpc``: the PyTorch tutorial's batch-update parameter server on ``torch.distributed.rpc``
  (TensorPipe): each worker calls ``rpc_sync(update_and_fetch, grads)``; the PS sums, applies
  SGD to the average once every worker has pushed, and answers both with the parameters.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import threading
from collections.abc import Callable

import torch
import torch.distributed.rpc as rpc
from torch import nn

from benchmarks.baselines import common
from benchmarks.baselines.rpc import init_ps_group

WORKERS = 2
BATCH = 16
LR = 0.01
TIMEOUT = 300.0


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(784, 4096), nn.ReLU(), nn.Linear(4096, 4096), nn.ReLU(),
                         nn.Linear(4096, 10))


def batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(rank + 1)
    return torch.randn(BATCH, 784, generator=gen), torch.randint(0, 10, (BATCH,), generator=gen)


def backward(model: nn.Module, rank: int) -> Callable[[], None]:
    x, y = batch(rank)
    return lambda: nn.functional.cross_entropy(model(x), y).backward()


def _sgd(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR, foreach=True)  # as the RPC PS: foreach ops


# -- tensorx -----------------------------------------------------------------------------------
def tensorx_serve(args: argparse.Namespace) -> None:
    from tensorx.ps import ParameterServer

    async def serve() -> None:
        ps = ParameterServer(f"tcp://{args.host}:0", num_workers=WORKERS, mode="sync",
                             optimizer=_sgd, transport=args.transport, timeout=TIMEOUT,
                             share_memory=args.share_memory == "on")
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, ps.stop)
        async with ps:
            common.announce({"host": args.host, "address": ps.address})
            await ps.serve()

    asyncio.run(serve())


def tensorx_client(args: argparse.Namespace) -> None:
    from tensorx import RemoteOptimizer

    model = build_model()
    with RemoteOptimizer(model, args.address, rank=args.rank, num_workers=WORKERS,
                         transport=args.transport, timeout=TIMEOUT,
                         overlap={"on": True, "off": False}.get(args.overlap),
                         share_memory=args.share_memory == "on") as opt:
        run_backward = backward(model, args.rank)

        def step() -> None:
            opt.zero_grad()
            run_backward()
            opt.step()

        lanes = opt.worker.node.endpoints[0].info["lanes"]
        common.client_loop(lambda n: common.timed_rounds(step, n),
                           {"lanes": lanes, "mapped": all(opt.worker.mapped)})


# -- torch.distributed.rpc ---------------------------------------------------------------------
class _BatchUpdatePS:
    """The tutorial's BatchUpdateParameterServer, on a module (plain SGD on the average)."""

    def __init__(self) -> None:
        self.params = [p.detach() for p in build_model().parameters()]
        self.acc = [torch.zeros_like(p) for p in self.params]
        self.lock = threading.Lock()
        self.pending = 0
        self.future: torch.futures.Future[list[torch.Tensor]] = torch.futures.Future()


_PS: _BatchUpdatePS | None = None


@rpc.functions.async_execution  # type: ignore[misc]
def update_and_fetch(grads: list[torch.Tensor]) -> torch.futures.Future[list[torch.Tensor]]:
    ps = _PS
    assert ps is not None
    with ps.lock:
        torch._foreach_add_(ps.acc, grads)
        ps.pending += 1
        future = ps.future
        if ps.pending == WORKERS:
            torch._foreach_add_(ps.params, ps.acc, alpha=-LR / WORKERS)
            torch._foreach_zero_(ps.acc)
            ps.pending = 0
            ps.future = torch.futures.Future()
            future.set_result(ps.params)
    return future


def _init_rpc(rank: int, host: str, port: int) -> None:
    init_ps_group(rank, host, port, WORKERS, TIMEOUT)


def rpc_serve(args: argparse.Namespace) -> None:
    global _PS
    _PS = _BatchUpdatePS()
    port = common.free_port(args.host)
    common.announce({"host": args.host, "port": port})
    _init_rpc(0, args.host, port)
    rpc.shutdown()


def rpc_client(args: argparse.Namespace) -> None:
    _init_rpc(args.rank + 1, args.host, args.port)
    model = build_model()
    params = list(model.parameters())
    run_backward = backward(model, args.rank)

    def step() -> None:
        for p in params:
            p.grad = None
        run_backward()
        fresh = rpc.rpc_sync("ps", update_and_fetch, args=([p.grad for p in params],))
        with torch.no_grad():
            torch._foreach_copy_(params, fresh)

    common.client_loop(lambda n: common.timed_rounds(step, n), {"lanes": []})
    rpc.shutdown()
