"""An embedding service, on tensorx and on ``torch.distributed.rpc``, measured in one run.

The service owns an embedding table built from real data that ships with scikit-learn (the
1,797 handwritten digits: each row is one image's 64 pixels, standardised and scaled to unit
length, as float32) and lets clients in other processes read and update rows. Written twice:

* **tensorx**: the service exports the table under a name; a client looks it up and moves
  rows with one-sided ``ep.read_rows`` / ``ep.write_rows`` (no service code runs for them);
  a notification asks the service to re-normalise the rows a client wrote (docs/services.md
  builds the same service step by step);
* **torch.distributed.rpc** (TensorPipe): the service holds the same table and answers
  ``read_row(i)`` / ``write_row(i, row)`` calls.

A load generator in a client process drives each with closed loops (1 and ``--concurrency``
operations in flight, one row of 64 floats each) and prints rows/s and p50/p99 latency per
op, then the same-run ratios:

    python examples/embedding_service.py                 # 20000 ops per row of the table
    python examples/embedding_service.py --ops 300       # a quick look
    python examples/embedding_service.py --tcp           # also tensorx's TCP lane (the
                                                         # path between hosts without RDMA)
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import multiprocessing as mp
import os
import socket
import sys
import threading
import time
import warnings
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

import tensorx as tx

DIM = 64
WARMUP = 100  # ops before each measured loop
TIMEOUT = 300.0  # seconds a child may take to answer


def build_table() -> np.ndarray:
    """The digits as an embedding table: (1797, 64) float32, unit rows."""
    from sklearn.datasets import load_digits

    x = load_digits().data.astype(np.float32)
    x = (x - x.mean(0)) / (x.std(0) + 1e-6)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def summary(latencies: list[float], wall: float) -> dict[str, float]:
    lat = np.asarray(latencies)
    return {"rows_s": len(lat) / wall, "p50_us": float(np.percentile(lat, 50)) * 1e6,
            "p99_us": float(np.percentile(lat, 99)) * 1e6}


def row_sequence(n: int, rows: int) -> list[int]:
    """The rows the load generator touches, the same for both services."""
    return np.random.default_rng(1).integers(0, rows, n).tolist()


# -- tensorx ---------------------------------------------------------------------------
async def tx_serve(transport: str, ready: Any, stop: Any) -> None:
    table = build_table()

    async def session(ep: tx.Endpoint) -> None:  # one task per client
        async for message in ep.messages:  # "rows 3 4": the client wrote those rows
            rows = [int(r) for r in message.split()[1:] if 0 <= int(r) < len(table)]
            table[rows] /= np.linalg.norm(table[rows], axis=1, keepdims=True)
            await ep.notify(b"normalized")

    async with tx.Node("tcp://127.0.0.1:0", transport=transport, handler=session) as node:
        node.export(table, name="table")
        ready.put(node.address)
        await asyncio.to_thread(stop.wait)


async def closed_loop(call: Callable[[int, int], Awaitable[None]], in_flight: int,
                      total: int) -> dict[str, float]:
    """``total`` calls, ``in_flight`` at a time (``call(worker, op)``), each timed."""
    latencies: list[float] = []
    issued = 0

    async def worker(k: int) -> None:
        nonlocal issued
        while issued < total:
            issued += 1
            started = time.perf_counter()
            await call(k, issued)
            latencies.append(time.perf_counter() - started)

    started = time.perf_counter()
    await asyncio.gather(*(worker(k) for k in range(in_flight)))
    return summary(latencies, time.perf_counter() - started)


async def tx_load(address: str, transport: str, ops: int, conc: int) -> dict[str, Any]:
    async with tx.Node(None, transport=transport) as node:
        ep = await node.connect(address)
        replies = ep.messages  # the service's notifications: claimed before any can come
        table = await ep.lookup("table")
        seq = row_sequence(ops + WARMUP, table.shape[0])
        # one registered row buffer per op in flight, registered once (as a service's
        # client would): a plain array would be registered again on every call
        bufs = [tx.MemoryRegion.register(np.zeros((1, DIM), np.float32))
                for _ in range(conc)]
        rows = build_table()
        src = [tx.MemoryRegion.register(rows[i:i + 1].copy()) for i in range(conc)]

        async def read(k: int, i: int) -> None:
            await ep.read_rows(bufs[k], table, [seq[i % len(seq)]])

        async def write(k: int, i: int) -> None:
            await ep.write_rows(src[k], table, [seq[i % len(seq)]])

        results: dict[str, Any] = {"lanes": ",".join(ep.info["lanes"])}
        for name, call in (("read", read), ("write", write)):
            for c in (1, conc):
                await closed_loop(call, c, WARMUP)
                results[f"{name} {c}"] = await closed_loop(call, c, ops)
        await ep.write_rows(src[0], table, [0], notify=b"rows 0")  # and the service's own
        assert await replies.get(timeout=30) == b"normalized"
        return results


def quiet(name: str) -> None:
    """A child's log: WARNING and up, each line naming the process."""
    logging.basicConfig(level=logging.WARNING, format=f"[{name}] %(levelname)s %(message)s")


def tx_service_main(transport: str, ready: Any, stop: Any) -> None:
    quiet("tensorx service")
    asyncio.run(tx_serve(transport, ready, stop))


def tx_client_main(address: str, transport: str, ops: int, conc: int, out: Any) -> None:
    quiet("tensorx client")
    out.put(asyncio.run(tx_load(address, transport, ops, conc)))


# -- torch.distributed.rpc -------------------------------------------------------------
_TABLE: Any = None  # the rpc service's table (a torch tensor)


def rpc_read(i: int) -> Any:
    return _TABLE[i].clone()  # a view would send the whole table's storage


def rpc_write(i: int, row: Any) -> None:
    _TABLE[i].copy_(row)


def rpc_init(name: str, rank: int, port: int) -> Any:
    import torch
    from torch.distributed import rpc

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    warnings.filterwarnings("ignore", message="You are using a Backend")  # torch's own
    options = rpc.TensorPipeRpcBackendOptions(num_worker_threads=16, rpc_timeout=60)
    rpc.init_rpc(name, rank=rank, world_size=2, rpc_backend_options=options)
    return rpc


def rpc_service_main(port: int) -> None:
    import torch

    global _TABLE
    _TABLE = torch.from_numpy(build_table())
    rpc = rpc_init("service", 0, port)
    rpc.shutdown()  # serves until the client is done too


def rpc_closed_loop(call: Callable[[int], Any], in_flight: int,
                    total: int) -> dict[str, float]:
    """:func:`closed_loop` with rpc futures: each completion issues the next call."""
    latencies: list[float] = []
    lock, done, errors = threading.Lock(), threading.Event(), []
    issued = 0

    def issue() -> None:
        nonlocal issued
        with lock:
            if issued >= total:
                return
            issued += 1
            i = issued
        started = time.perf_counter()
        call(i).add_done_callback(lambda fut: finish(fut, started))

    def finish(fut: Any, started: float) -> None:
        try:
            fut.value()
        except Exception as exc:  # reported by the caller, never a hang
            errors.append(exc)
            done.set()
            return
        with lock:
            latencies.append(time.perf_counter() - started)
            last = len(latencies) == total
        if last:
            done.set()
        else:
            issue()

    started = time.perf_counter()
    for _ in range(in_flight):
        issue()
    if not done.wait(TIMEOUT) or errors:
        raise RuntimeError(f"rpc load failed: {errors or 'timed out'}")
    return summary(latencies, time.perf_counter() - started)


def rpc_client_main(port: int, ops: int, conc: int, out: Any) -> None:
    import torch

    rpc = rpc_init("client", 1, port)
    try:
        rows = build_table()
        seq = row_sequence(ops + WARMUP, len(rows))
        src = torch.from_numpy(rows[:1].copy())[0]

        def read(i: int) -> Any:
            return rpc.rpc_async("service", rpc_read, args=(seq[i % len(seq)],))

        def write(i: int) -> Any:
            return rpc.rpc_async("service", rpc_write, args=(seq[i % len(seq)], src))

        results: dict[str, Any] = {"lanes": "tensorpipe"}
        for name, call in (("read", read), ("write", write)):
            for c in (1, conc):
                rpc_closed_loop(call, c, WARMUP)
                results[f"{name} {c}"] = rpc_closed_loop(call, c, ops)
        out.put(results)
    finally:
        rpc.shutdown()


# -- the run ---------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def receive(queue: Any, *procs: Any) -> Any:
    """The next thing a child puts on ``queue``; RuntimeError once one of ``procs`` died."""
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:
        try:
            return queue.get(timeout=0.5)
        except Exception:  # queue.Empty
            dead = [p for p in procs if not p.is_alive() and p.exitcode]
            if dead:
                raise RuntimeError(f"{dead[0].name} exited {dead[0].exitcode}") from None
    raise RuntimeError(f"no answer from {[p.name for p in procs]} within {TIMEOUT} s")


def start(ctx: Any, name: str, target: Callable[..., None], *args: Any) -> Any:
    proc = ctx.Process(target=target, args=args, name=name)
    proc.start()
    return proc


def stop(proc: Any, timeout: float = 60) -> None:
    proc.join(timeout)
    if proc.is_alive():
        proc.kill()
        proc.join()


def run_tensorx(ctx: Any, transport: str, ops: int, conc: int) -> dict[str, Any]:
    ready, done, out = ctx.Queue(), ctx.Event(), ctx.Queue()
    service = start(ctx, "tensorx service", tx_service_main, transport, ready, done)
    try:
        address = receive(ready, service)
        client = start(ctx, "tensorx client", tx_client_main, address, transport, ops, conc,
                       out)
        try:
            return receive(out, client, service)  # type: ignore[no-any-return]
        finally:
            stop(client)
    finally:
        done.set()
        stop(service)


def run_rpc(ctx: Any, service: Any, port: int, ops: int, conc: int) -> dict[str, Any]:
    """The load against the rpc ``service`` (started first: it waits for this client in
    init_rpc, idle, while tensorx is measured)."""
    out = ctx.Queue()
    client = start(ctx, "rpc client", rpc_client_main, port, ops, conc, out)
    try:
        return receive(out, client, service)  # type: ignore[no-any-return]
    finally:
        stop(client)


def report(runs: dict[str, dict[str, Any]], ops: int, conc: int) -> None:
    print(f"embedding service: 1797 rows x {DIM} float32 (scikit-learn digits), one host; "
          f"{ops} ops per line, one row each")
    print(f"{'system':<16} {'lanes':<16} {'op':<6} {'in flight':>9} {'rows/s':>9} "
          f"{'p50 us':>8} {'p99 us':>8}")
    for system, res in runs.items():
        for key in ("read 1", f"read {conc}", "write 1", f"write {conc}"):
            op, c = key.split()
            r = res[key]
            print(f"{system:<16} {res['lanes']:<16} {op:<6} {c:>9} {r['rows_s']:>9.0f} "
                  f"{r['p50_us']:>8.1f} {r['p99_us']:>8.1f}")
    ours, rpc = runs["tensorx"], runs["torch rpc"]
    p50 = ours["read 1"]["p50_us"] / rpc["read 1"]["p50_us"]
    rate = ours[f"read {conc}"]["rows_s"] / rpc[f"read {conc}"]["rows_s"]
    print(f"tensorx / torch rpc, this run: p50 read of one row {p50:.2f}x (target <= 0.5x); "
          f"rows/s at {conc} concurrent reads {rate:.1f}x (target >= 3x)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ops", type=int, default=20000, help="timed ops per line")
    p.add_argument("--concurrency", type=int, default=64, help="ops in flight, the second loop")
    p.add_argument("--tcp", action="store_true", help="also tensorx with transport='tcp'")
    args = p.parse_args()
    ctx = mp.get_context("spawn")
    port = free_port()
    rpc_service = start(ctx, "rpc service", rpc_service_main, port)
    try:
        runs = {"tensorx": run_tensorx(ctx, "auto", args.ops, args.concurrency)}
        if args.tcp:
            runs["tensorx (tcp)"] = run_tensorx(ctx, "tcp", args.ops, args.concurrency)
        runs["torch rpc"] = run_rpc(ctx, rpc_service, port, args.ops, args.concurrency)
    finally:
        stop(rpc_service)
    report(runs, args.ops, args.concurrency)


if __name__ == "__main__":
    sys.exit(main())
