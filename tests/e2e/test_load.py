"""Load: 8 worker processes x 200 steps against real PS processes on this 2-core machine.

Every worker pushes known gradients (exact in float32), so the final parameters have one
exact expected value: nothing lost, nothing applied twice. The PS processes' open file
descriptors and resident memory are sampled early and at the end and must not grow.
Run with ``make test-slow``.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import queue
import traceback
from typing import Any

import pytest

pytestmark = pytest.mark.slow

WORKERS = 8
STEPS = 200
SIZE = 4096
LR = 1.0
SCALE = 2.0 ** -10  # worker r pushes (r + 1) * SCALE: every sum below is exact in float32


def build_model() -> Any:
    import torch

    class Params(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = torch.nn.Parameter(torch.zeros(SIZE))
            self.b = torch.nn.Parameter(torch.zeros(SIZE))

    return Params()


def run_ps(out: Any, shard: int, shards: int) -> None:
    try:
        asyncio.run(_serve(out, shard, shards))
    except BaseException:
        out.put(("error", f"ps {shard}", traceback.format_exc()))


async def _serve(out: Any, shard: int, shards: int) -> None:
    import torch

    import tensorx as tx

    torch.set_num_threads(1)
    server = tx.ParameterServer("tcp://127.0.0.1:0", num_workers=WORKERS, mode="sync",
                                shard=shard, num_shards=shards, transport="tcp", timeout=120,
                                optimizer=lambda p: torch.optim.SGD(p, lr=LR))
    async with server:
        out.put(("ps", shard, server.address))
        await server.serve()


def run_worker(out: Any, release: Any, rank: int, addresses: list[str]) -> None:
    try:
        asyncio.run(_train(out, release, rank, addresses))
    except BaseException:
        out.put(("error", f"worker {rank}", traceback.format_exc()))


async def _train(out: Any, release: Any, rank: int, addresses: list[str]) -> None:
    import torch

    import tensorx as tx

    torch.set_num_threads(1)
    model = build_model()
    grad = torch.full((SIZE,), (rank + 1) * SCALE)
    async with tx.Worker(model, addresses, rank=rank, num_workers=WORKERS, transport="tcp",
                         timeout=120) as worker:
        for step in range(STEPS):
            model.zero_grad()
            ((model.a * grad).sum() + (model.b * grad).sum()).backward()
            await worker.step()
            if step in (20, STEPS - 1):
                out.put(("progress", rank, step))
        out.put(("done", rank, [float(model.a.detach().min()), float(model.a.detach().max()),
                                float(model.b.detach().min()), float(model.b.detach().max())]))
        await asyncio.to_thread(release.wait, 60)  # stay connected while the PS is measured


def usage(pid: int) -> tuple[int, int]:
    """(open file descriptors, resident bytes) of a process."""
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    with open(f"/proc/{pid}/statm") as f:
        rss_pages = int(f.read().split()[1])
    return fds, rss_pages * os.sysconf("SC_PAGE_SIZE")


class Inbox:
    """Messages from the children, kept until a caller asks for their kind."""

    def __init__(self, out: Any) -> None:
        self.out = out
        self.kept: list[tuple[Any, ...]] = []

    def expect(self, kind: str, count: int, timeout: float = 240) -> list[tuple[Any, ...]]:
        while sum(m[0] == kind for m in self.kept) < count:
            try:
                msg = self.out.get(timeout=timeout)
            except queue.Empty:
                raise AssertionError(f"waited {timeout} s for {count} {kind!r}") from None
            if msg[0] == "error":
                raise AssertionError(f"{msg[1]} failed:\n{msg[2]}")
            self.kept.append(msg)
        mine = [m for m in self.kept if m[0] == kind][:count]
        for m in mine:
            self.kept.remove(m)
        return mine


@pytest.mark.timeout(600)
@pytest.mark.parametrize("shards", [1, 2])
def test_eight_workers_two_hundred_steps_lose_nothing(shards: int) -> None:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    inbox = Inbox(out)
    servers = [ctx.Process(target=run_ps, args=(out, s, shards), daemon=True)
               for s in range(shards)]
    for proc in servers:
        proc.start()
    addresses = [a for _, _, a in sorted(inbox.expect("ps", shards, 120))]
    release = ctx.Event()
    workers = [ctx.Process(target=run_worker, args=(out, release, r, addresses), daemon=True)
               for r in range(WORKERS)]
    try:
        for proc in workers:
            proc.start()
        inbox.expect("progress", WORKERS)  # step 20: warmed up, every endpoint open
        early = [usage(p.pid) for p in servers if p.pid]  # type: ignore[misc]
        inbox.expect("progress", WORKERS)  # the last step
        done = inbox.expect("done", WORKERS)
        late = [usage(p.pid) for p in servers if p.pid]  # type: ignore[misc]
        release.set()
    finally:
        for proc in workers + servers:
            proc.kill()
            proc.join(10)
    mean_grad = sum(r + 1 for r in range(WORKERS)) * SCALE / WORKERS
    want = -LR * STEPS * mean_grad
    for _, rank, values in done:
        assert values == [want] * 4, f"worker {rank} ended with {values}, want {want}"
    for (fds0, rss0), (fds1, rss1) in zip(early, late, strict=True):
        assert fds1 == fds0, f"PS file descriptors went from {fds0} to {fds1}"
        assert rss1 - rss0 < 16 << 20, f"PS memory grew by {(rss1 - rss0) >> 20} MiB"
    print(f"\n{shards} shard(s): final parameter {want} exact on all {WORKERS} workers; "
          f"PS (fds, rss) at step 20 {early} -> after step {STEPS} {late}")
