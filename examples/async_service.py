"""A long-running parameter server (async mode) that workers join and leave as they please.

This process runs the server as an asyncio service; worker processes are started at
staggered times, train for a while on their own slice of the digits data, and leave. A
worker that joins late starts from the server's current parameters, not from scratch. At
the end one more worker joins only to read the parameters and measure test accuracy.

    python examples/async_service.py [--transport tcp] [--checkpoint-dir ckpt/]

For a real deployment run the server with ``tensorx ps --mode async ...`` instead.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import multiprocessing as mp
import sys
import time
from typing import Any

import torch
from torch import nn

import tensorx as tx

SLOTS = 3  # ranks 0..2: a leaving worker frees its rank for the next one


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))


def digits() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x_tr, x_te, y_tr, y_te = train_test_split(x / 16.0, y, test_size=0.2, random_state=0,
                                              stratify=y)
    f = lambda a: torch.tensor(a, dtype=torch.float32)  # noqa: E731
    return f(x_tr), torch.tensor(y_tr), f(x_te), torch.tensor(y_te)


def worker_main(address: str, rank: int, steps: int, transport: str, results: Any) -> None:
    torch.set_num_threads(1)
    results.put((rank, asyncio.run(_work(address, rank, steps, transport))))


async def _work(address: str, rank: int, steps: int, transport: str) -> float:
    x_tr, y_tr, x_te, y_te = digits()
    x_tr, y_tr = x_tr[rank::SLOTS], y_tr[rank::SLOTS]  # this worker's own slice
    model = build_model()
    gen = torch.Generator().manual_seed(rank)
    async with tx.Worker(model, address, rank=rank, num_workers=SLOTS,
                         transport=transport) as worker:
        for _ in range(steps):
            idx = torch.randint(0, len(x_tr), (32,), generator=gen)
            worker.zero_grad()
            nn.functional.cross_entropy(model(x_tr[idx]), y_tr[idx]).backward()
            await worker.step()
        with torch.no_grad():
            return float((model(x_te).argmax(1) == y_te).float().mean())


async def main(args: argparse.Namespace) -> float:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    loop = asyncio.get_running_loop()
    server = tx.ParameterServer("tcp://127.0.0.1:0", num_workers=SLOTS, mode="async",
                                optimizer=lambda p: torch.optim.Adam(p, lr=2e-3),
                                checkpoint_dir=args.checkpoint_dir, transport=args.transport)
    async with server:
        print(f"service up at {server.address} (async mode, {SLOTS} slots)")
        # (rank, join once the server reached this version, steps): 1 and 2 join mid-run
        plan = [(0, 0, args.steps), (1, args.steps // 4, args.steps),
                (2, args.steps // 2, args.steps // 2)]
        t0 = time.perf_counter()

        async def visit(rank: int, after: int, steps: int) -> None:
            while server.version < after:  # noqa: ASYNC110 - a demo polls a public counter
                await asyncio.sleep(0.05)
            proc = ctx.Process(target=worker_main, daemon=True,
                               args=(server.address, rank, steps, args.transport, results))
            print(f"[{time.perf_counter() - t0:5.1f} s] worker {rank} joins for {steps} steps "
                  f"(server at version {server.version})")
            proc.start()
            await loop.run_in_executor(None, proc.join, 120)
            print(f"[{time.perf_counter() - t0:5.1f} s] worker {rank} left "
                  f"(server at version {server.version})")

        await asyncio.gather(*(visit(*v) for v in plan))
        await visit(0, 0, 0)  # a late visitor: reads the current parameters and evaluates
        accuracies = dict(results.get(timeout=10) for _ in range(len(plan) + 1))
    print(f"server applied {server.stats['updates']} updates; "
          f"max version lag {server.stats['max_version_lag']}")
    print(f"accuracy {list(accuracies.values())[-1]:.4f}")
    return float(list(accuracies.values())[-1])


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--transport", choices=("auto", "tcp", "ucx"), default="auto")
    p.add_argument("--checkpoint-dir", default=None)
    logging.basicConfig(stream=sys.stderr, format="%(name)s %(levelname)s %(message)s")
    logging.getLogger("tensorx.ps").setLevel(logging.INFO)
    asyncio.run(main(p.parse_args()))
