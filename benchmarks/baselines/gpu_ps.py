"""The PS round of ``benchmarks/gpu.py``: model and server on the GPU, sync mode, plain SGD,
``--workers`` workers (``--rank`` each), driven over :mod:`benchmarks.baselines.common`'s line
protocol by :class:`benchmarks.baselines.pair.Pair`.

* ``gpu-tensorx``: ``tx.ParameterServer(..., device=--device)`` with the defaults (transport,
  ``flat``, ``share_memory``: what a user gets; ``--variant flat`` sets ``flat=True``,
  ``--variant per-tensor`` ``flat=False``) and one
  :class:`tensorx.Worker` per worker process bound to a model on ``--device``. A round is
  ``await worker.step()`` then a device synchronize.
* ``gpu-tensorpipe``: ``torch.distributed.rpc`` with TensorPipe and ``device_maps`` (worker
  ``cuda:i`` -> PS ``cuda:i`` and back), the PyTorch batch-update parameter-server pattern:
  each worker calls ``rpc_sync("ps", update_and_fetch, (grads,))`` with its CUDA gradients,
  the PS sums them on its GPU, applies SGD to the average once every worker has pushed
  (``torch._foreach_add_``) and answers every worker with the parameters, which the worker
  keeps as its parameters (no further copy). A round ends with a device synchronize too.

With ``--device cpu`` both run on host memory (the self-test: no device maps, figures
meaningless). Every server also ends when its stdin closes (the driver gone), so no process
outlives a driver that died.

``$TX_BENCH_PROFILE=DIR`` (tensorx only): each process profiles itself with cProfile (the
server all its life, a worker its measured rounds) and writes the top functions, by own
time and by cumulative time, to ``DIR/<role>-<rank>.txt`` when it ends.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import os
import pstats
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed.rpc as rpc

from benchmarks.baselines import common

TIMEOUT = 120.0


def _sync(device: str) -> Callable[[], None]:
    if device.startswith("cuda"):
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def _stdin_watchdog(on_eof: Callable[[], None]) -> None:
    """Call ``on_eof`` once stdin closes (the driver exited or was killed)."""
    def watch() -> None:
        while sys.stdin.readline():
            pass
        on_eof()

    threading.Thread(target=watch, daemon=True, name="stdin-watchdog").start()


def _sgd(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=common.LR)  # plain SGD, torch's own defaults


# -- tensorx -----------------------------------------------------------------------------------
class _Profile:
    """cProfile of this process's tensorx work, written out at exit (``$TX_BENCH_PROFILE``:
    see the module docstring); does nothing where that is unset."""

    def __init__(self, role: str) -> None:
        self.where = os.environ.get("TX_BENCH_PROFILE")
        self.role = role
        self.prof: cProfile.Profile | None = cProfile.Profile() if self.where else None

    def __enter__(self) -> None:
        if self.prof is not None:
            self.prof.enable()

    def __exit__(self, *exc: object) -> None:
        if self.prof is not None:
            self.prof.disable()

    def write(self) -> None:
        if self.prof is None or self.where is None:
            return
        out = io.StringIO()
        stats = pstats.Stats(self.prof, stream=out)
        for key in ("tottime", "cumulative"):
            stats.sort_stats(key).print_stats(40)
        path = Path(self.where) / f"{self.role}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(out.getvalue())


def tensorx_serve(args: argparse.Namespace) -> None:
    profile = _Profile(f"server-{args.workers}w")
    with profile:
        asyncio.run(_tensorx_serve(args))
    profile.write()


async def _tensorx_serve(args: argparse.Namespace) -> None:
    from tensorx import ParameterServer

    options: dict[str, object] = {"flat": {"flat": True, "per-tensor": False}[args.variant]} \
        if args.variant else {}
    if args.device != "cpu":
        options["device"] = args.device
    try:
        ps = ParameterServer(f"tcp://{args.host}:0", num_workers=args.workers, mode="sync",
                             optimizer=_sgd, **options)
    except TypeError as exc:
        raise RuntimeError(f"this tensorx's ParameterServer does not take {options}: "
                           f"{exc}") from exc
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, ps.stop)
    _stdin_watchdog(lambda: loop.call_soon_threadsafe(ps.stop))
    async with ps:
        common.announce({"host": args.host, "address": ps.address})
        await ps.serve()


def tensorx_client(args: argparse.Namespace) -> None:
    profile = _Profile(f"worker-{args.workers}w-rank{args.rank}")
    asyncio.run(_tensorx_client(args, profile))
    profile.write()


async def _tensorx_client(args: argparse.Namespace, profile: _Profile) -> None:
    import time

    from tensorx import Worker

    sync = _sync(args.device)
    model = common.ShapeModel(common.MODELS[args.model]()).to(args.device)
    async with Worker(model, args.address, rank=args.rank, num_workers=args.workers) as worker:
        for p in model.parameters():
            if p.grad is None:
                p.grad = torch.full_like(p, common.GRAD_VALUE)
            else:
                p.grad.fill_(common.GRAD_VALUE)
        ep = worker.node.endpoints[0]

        async def rounds(n: int) -> list[float]:
            times = []
            for _ in range(n):
                t = time.perf_counter()
                await worker.step()
                sync()
                times.append(time.perf_counter() - t)
            return times

        async def measured(n: int) -> list[float]:
            with profile:
                return await rounds(n)

        await rounds(common.WARMUP_ROUNDS)
        info = ep.info
        common.announce({"system": "tensorx", "transport": info.get("transport"),
                         "lanes": info.get("lanes", []), "gpu": info.get("gpu"),
                         "mapped": all(worker.mapped)})
        loop = asyncio.get_running_loop()
        while True:
            cmd = (await loop.run_in_executor(None, sys.stdin.readline)).split()
            if not cmd or cmd[0] == "quit":
                break
            print("TIMES [" + ", ".join(map(str, await measured(int(cmd[1])))) + "]",
                  flush=True)


# -- torch.distributed.rpc (TensorPipe) ----------------------------------------------------------
class _BatchUpdatePS:
    def __init__(self, shapes: list[common.Shape], workers: int, device: str) -> None:
        self.params = [p.to(device) for p in common.make_params(shapes)]
        self.acc = [torch.zeros_like(p) for p in self.params]
        self.workers = workers
        self.lock = threading.Lock()
        self.pending = 0
        self.future: torch.futures.Future[list[torch.Tensor]] = torch.futures.Future()


_PS: _BatchUpdatePS | None = None


@rpc.functions.async_execution  # type: ignore[misc]
def update_and_fetch(grads: list[torch.Tensor]) -> torch.futures.Future[list[torch.Tensor]]:
    """Runs on the PS: add this worker's gradients; the last one in applies SGD to the
    average and answers everybody with the parameters."""
    ps = _PS
    assert ps is not None
    with ps.lock, torch.no_grad():
        if ps.workers == 1:
            torch._foreach_add_(ps.params, grads, alpha=-common.LR)
        else:
            torch._foreach_add_(ps.acc, grads)
        ps.pending += 1
        future = ps.future
        if ps.pending == ps.workers:
            if ps.workers > 1:
                torch._foreach_add_(ps.params, ps.acc, alpha=-common.LR / ps.workers)
                torch._foreach_zero_(ps.acc)
            ps.pending = 0
            ps.future = torch.futures.Future()
            future.set_result(ps.params)
    return future


def _init_rpc(rank: int, args: argparse.Namespace, port: int) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = args.host, str(port)
    opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://{args.host}:{port}",
                                           rpc_timeout=TIMEOUT)
    if args.device.startswith("cuda"):
        index = torch.device(args.device).index or 0
        peers = [f"worker{r + 1}" for r in range(args.workers)] if rank == 0 else ["ps"]
        for peer in peers:
            opts.set_device_map(peer, {index: index})
    name = "ps" if rank == 0 else f"worker{rank}"
    rpc.init_rpc(name, rank=rank, world_size=args.workers + 1, rpc_backend_options=opts)


def rpc_serve(args: argparse.Namespace) -> None:
    global _PS
    _PS = _BatchUpdatePS(common.MODELS[args.model](), args.workers, args.device)
    port = common.free_port(args.host)
    _stdin_watchdog(lambda: os._exit(3))
    common.announce({"host": args.host, "port": port})
    _init_rpc(0, args, port)
    rpc.shutdown()  # graceful: returns once every worker has shut down too


def rpc_client(args: argparse.Namespace) -> None:
    _init_rpc(args.rank + 1, args, args.port)
    sync = _sync(args.device)
    shapes = common.MODELS[args.model]()
    grads = [g.to(args.device) for g in common.make_grads(shapes)]
    state = {"params": [p.to(args.device) for p in common.make_params(shapes)]}

    def one_round() -> None:
        state["params"] = rpc.rpc_sync("ps", update_and_fetch, args=(grads,))
        sync()

    common.client_loop(lambda n: common.timed_rounds(one_round, n),
                       {"system": "tensorpipe", "lanes": [], "transport": "tensorpipe"})
    rpc.shutdown()
