"""tensorx: the system under test, through its parameter-server API.

The server is a :class:`tensorx.ps.ParameterServer` (sync mode, one worker, plain
``torch.optim.SGD``, default options: for SGD, a flat update over the arena);
the client a :class:`tensorx.worker.Worker` bound to a model with the benchmark's
parameter shapes. A round is ``await worker.step()``: one-sided write of the
gradient arena into the PS slot, notify, PS applies SGD, one-sided write of the parameter
arena back into the worker's model, notify. Exactly what a PS user gets.

``--transport``: ``tcp``, ``ucx`` (the default UCX settings: peer error handling, which on
one host means UCX's tcp lanes) or ``ucx-shm`` (UCX with ``error_handling=False``: cma/posix
lanes on one host; the ``node_options`` of ``ParameterServer`` and ``Worker``) or ``auto``
(the default: on one host, host memory over the same-host CMA lane).

``--share-memory on``: the PS and worker options of that name (tensorx's default): on one
host (same host id: not across network namespaces) the worker maps the PS's arenas and a
round moves no bytes, only the two notifications. ``off`` (the benchmark's default) keeps
the copy path that every other row measures. READY says whether the worker mapped.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import time
from typing import Any

import torch

from benchmarks.baselines import common
from tensorx.ps import ParameterServer
from tensorx.worker import Worker

TIMEOUT = 300.0


def _transport(name: str) -> tuple[str, dict[str, Any] | None]:
    if name == "ucx-shm":
        return "ucx", {"error_handling": False}
    return name, None


def _optimizer(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=common.LR)  # what a user writes


# experiments (--variant): not what a user gets, each labelled as such in the tables
FLAT = {"per-tensor": False, "flat-params": True}
PIPELINE = {"early": True, "no-early": False}  # forced, where the default measures both


def serve(args: argparse.Namespace) -> None:
    asyncio.run(_serve(args))


async def _serve(args: argparse.Namespace) -> None:
    if args.variant == "one-part":  # experiment: apply and answer the update in one piece
        from tensorx._ps.update import parts

        parts.PART_BYTES = 1 << 40
    transport, ucx_options = _transport(args.transport)
    listen = f"tcp://{args.host}:0"
    ps = ParameterServer(listen, num_workers=1, mode="sync", optimizer=_optimizer,
                         transport=transport, timeout=TIMEOUT,
                         **({"flat": FLAT[args.variant]} if args.variant in FLAT else {}),
                         **({"pipeline": PIPELINE[args.variant]}
                            if args.variant in PIPELINE else {}),
                         share_memory=args.share_memory == "on",
                         node_options={"ucx_options": ucx_options or {}})
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, ps.stop)
    async with ps:
        common.announce({"host": args.host, "address": ps.address})
        await ps.serve()


def client(args: argparse.Namespace) -> None:
    asyncio.run(_client(args))


async def _client(args: argparse.Namespace) -> None:
    transport, ucx_options = _transport(args.transport)
    model = common.ShapeModel(common.MODELS[args.model]())
    worker = Worker(model, args.address, rank=0, num_workers=1, transport=transport,
                    timeout=TIMEOUT, share_memory=args.share_memory == "on",
                    node_options={"ucx_options": ucx_options or {}})
    async with worker:
        for p in model.parameters():
            assert p.grad is not None, "the plan binds every gradient into the arena"
            p.grad.fill_(common.GRAD_VALUE)
        info = worker.node.endpoints[0].info
        await _rounds(worker, common.WARMUP_ROUNDS)
        mapped = all(worker.mapped)
        common.announce({"system": f"tensorx {args.transport}", "mapped": mapped,
                         "lanes": (["shm-mapped"] if mapped else []) + info["lanes"],
                         "transport": info["transport"], "same_host": info.get("host")})
        loop = asyncio.get_running_loop()
        while True:
            line = await loop.run_in_executor(None, _readline)
            cmd = line.split()
            if not cmd or cmd[0] == "quit":
                break
            print("TIMES [" + ", ".join(map(str, await _rounds(worker, int(cmd[1])))) + "]",
                  flush=True)


def _readline() -> str:
    import sys

    return sys.stdin.readline()


async def _rounds(worker: Worker, n: int) -> list[float]:
    times = []
    for _ in range(n):
        t = time.perf_counter()
        await worker.step()
        times.append(time.perf_counter() - t)
    return times
