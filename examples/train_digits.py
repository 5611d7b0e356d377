"""Train an MLP on scikit-learn's digits with one parameter server and two workers.

Three processes on this machine: a ``ParameterServer`` (sync mode) and two ``Worker``s, each
training on its half of every global batch. Gradients travel as one-sided writes into the
server's registered slots; fresh parameters as one-sided writes into the workers' models.

    python examples/train_digits.py                 # or: make demo
    python examples/train_digits.py --transport tcp --mode async --epochs 30

Across machines, start every process under torchrun: rank 0 serves, the others train, and
they meet through torchrun's TCPStore (the server publishes its address there)::

    torchrun --nnodes 1 --nproc-per-node 3 examples/train_digits.py --launcher torchrun
    TENSORX_TOKEN=secret torchrun --nnodes 2 ... --launcher torchrun      # across machines
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import multiprocessing as mp
import os
import queue
import signal
import sys
import time
import traceback
from typing import Any

import torch
from torch import nn

import tensorx as tx

WORKERS = 2
SEED = 0


def build_model() -> nn.Module:
    torch.manual_seed(SEED)
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))


def load_digits() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Digits ship inside scikit-learn: no download. Standardised, stratified 80/20 split."""
    from sklearn.datasets import load_digits as sk_digits
    from sklearn.model_selection import train_test_split

    x, y = sk_digits(return_X_y=True)
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=0.2, stratify=y,
                                              random_state=SEED)
    mean, std = x_tr.mean(0), x_tr.std(0) + 1e-6
    as_x = lambda a: torch.tensor((a - mean) / std, dtype=torch.float32)  # noqa: E731
    return as_x(x_tr), torch.tensor(y_tr), as_x(x_te), torch.tensor(y_te)


def make_optimizer(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


# -- the parameter server process ------------------------------------------------------------
def run_ps(results: Any, args: argparse.Namespace) -> None:
    _child(results, "ps", _serve(results, args))


async def _serve(results: Any, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)  # three processes share this machine's cores
    ps = tx.ParameterServer("tcp://127.0.0.1:0", num_workers=args.workers, mode=args.mode,
                            staleness=args.staleness, optimizer=make_optimizer,
                            transport=args.transport, share_memory=args.share_memory)
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, ps.stop)
    async with ps:
        results.put(("address", ps.address))
        await ps.serve()
    results.put(("ps", ps.stats))


# -- the worker processes ----------------------------------------------------------------------
def run_worker(results: Any, rank: int, address: str, args: argparse.Namespace) -> None:
    async def train() -> None:
        results.put(("done", await _train(rank, address, args)))

    _child(results, f"worker {rank}", train())


async def _train(rank: int, address: str, args: argparse.Namespace) -> dict[str, Any]:
    from tqdm import tqdm

    torch.set_num_threads(1)
    x_tr, y_tr, x_te, y_te = load_digits()
    model = build_model()
    steps_per_epoch = len(x_tr) // (args.batch_size * args.workers)
    total = steps_per_epoch * args.epochs
    gen = torch.Generator().manual_seed(SEED)  # every worker draws the same permutations
    async with tx.Worker(model, address, rank=rank, num_workers=args.workers,
                         transport=args.transport, share_memory=args.share_memory) as worker:
        info = worker.node.endpoints[0].info
        transport = info["transport"]
        # why TCP where it is: "tcp (ucx: UCX here has no RDMA device)" on a host without RDMA
        path = (info["why"] if transport == "tcp" else transport) + (
            ", arenas mapped (same host: steps move no bytes)" if all(worker.mapped) else "")
        bar = tqdm(total=total, desc=f"digits ({transport}, {args.mode})", unit="step",
                   disable=rank != 0 or args.quiet, file=sys.stdout)
        t0 = time.perf_counter()
        for _ in range(args.epochs):
            perm = torch.randperm(len(x_tr), generator=gen)
            for step in range(steps_per_epoch):
                start = (step * args.workers + rank) * args.batch_size
                idx = perm[start:start + args.batch_size]
                worker.zero_grad()
                loss = nn.functional.cross_entropy(model(x_tr[idx]), y_tr[idx])
                loss.backward()
                await worker.step()
                bar.update()
            bar.set_postfix(loss=f"{loss.item():.3f}")
        seconds = time.perf_counter() - t0
        bar.close()
        with torch.no_grad():
            accuracy = (model(x_te).argmax(1) == y_te).float().mean().item()
    return {"rank": rank, "accuracy": accuracy, "steps": total, "seconds": seconds,
            "transport": path}


def _child(results: Any, name: str, coro: Any) -> None:
    logging.basicConfig(level=logging.WARNING, format=f"[{name}] %(levelname)s %(message)s")
    try:
        asyncio.run(coro)
    except BaseException:
        results.put(("error", f"{name} failed:\n{traceback.format_exc()}"))
        raise


# -- under torchrun: rank 0 serves, ranks 1.. train; they meet in torchrun's store -------------
def torchrun_main(args: argparse.Namespace) -> None:
    from tensorx.ps import launcher_store
    from tensorx.worker import ps_addresses

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    args.workers = world - 1
    store = launcher_store()
    done_keys = [f"digits/done/{r}" for r in range(args.workers)]
    if rank == 0:
        asyncio.run(_serve_until_done(store, done_keys, args))
        return
    result = asyncio.run(_train(rank - 1, ps_addresses(1, store=store)[0], args))
    store.set(done_keys[rank - 1], "1")
    if rank == 1:
        print(f"{result['seconds'] / result['steps'] * 1e3:.2f} ms/step over "
              f"{result['transport']}")
        print(f"accuracy {result['accuracy']:.4f}")


async def _serve_until_done(store: Any, done_keys: list[str], args: argparse.Namespace) -> None:
    # one machine: stay on loopback; several: listen everywhere (needs $TENSORX_TOKEN)
    local = os.environ["MASTER_ADDR"] in ("127.0.0.1", "localhost", "::1")
    async with tx.ParameterServer(f"tcp://{'127.0.0.1' if local else '0.0.0.0'}:0",
                                  num_workers=args.workers, mode=args.mode,
                                  staleness=args.staleness, optimizer=make_optimizer,
                                  transport=args.transport) as ps:
        ps.publish(store)
        await asyncio.get_running_loop().run_in_executor(None, store.wait, done_keys)


# -- the launcher ----------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> float:
    args = parse_args(argv)
    if args.launcher == "torchrun":
        torchrun_main(args)
        return 0.0
    t0 = time.perf_counter()
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    ps = ctx.Process(target=run_ps, args=(results, args), name="ps")
    ps.start()
    procs: list[Any] = []
    try:
        address = _expect(results, "address", 60)
        procs = [ctx.Process(target=run_worker, args=(results, r, address, args),
                             name=f"worker-{r}") for r in range(args.workers)]
        for p in procs:
            p.start()
        done = [_expect(results, "done", args.timeout) for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=30)
        ps.terminate()  # SIGTERM: the server stops cleanly
        ps.join(timeout=30)
        for p in [*procs, ps]:
            if p.is_alive():
                p.kill()
    wall = time.perf_counter() - t0
    first = min(done, key=lambda d: d["rank"])
    per_step = first["seconds"] / first["steps"]
    print(f"transport {first['transport']}  mode {args.mode}  workers {args.workers}  "
          f"steps {first['steps']}  {per_step * 1e3:.2f} ms/step  wall {wall:.1f} s")
    print(f"accuracy {first['accuracy']:.4f}")
    return float(first["accuracy"])


def _expect(results: Any, kind: str, timeout: float) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        try:
            got, value = results.get(timeout=max(0.1, deadline - time.monotonic()))
        except queue.Empty:
            raise SystemExit(f"timed out after {timeout:.0f} s waiting for {kind}") from None
        if got == "error":
            raise SystemExit(value)
        if got == kind:
            return value
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out after {timeout:.0f} s waiting for {kind}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=WORKERS)
    p.add_argument("--epochs", type=int, default=15)
    p.add_argument("--batch-size", type=int, default=32, help="per worker")
    p.add_argument("--mode", choices=("sync", "async", "bounded"), default="sync")
    p.add_argument("--staleness", type=int, default=1, help="bounded mode only")
    p.add_argument("--transport", choices=("auto", "tcp", "ucx"), default="auto")
    p.add_argument("--no-share-memory", dest="share_memory", action="store_false",
                   help="same host: copy through the transport instead of mapping the "
                        "server's arenas")
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--launcher", choices=("local", "torchrun"), default="local",
                   help="local: spawn 1 PS + N workers here; torchrun: one role per rank")
    return p.parse_args(argv)


if __name__ == "__main__":
    main()
