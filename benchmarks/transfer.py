"""One-sided write/read bandwidth and small-op latency, against the raw-socket limit.

Everything is measured in one run on this machine, between two processes on loopback:
tensorx over each available transport and over ``auto`` (the default: on one host, host
memory moves over the same-host CMA lane), blocking raw sockets doing the same transfers
(``benchmarks/rawsock.py``), the same exchange between two asyncio loops (for small ops,
the floor of any asyncio transport, tensorx over TCP included) and a single-threaded ``memcpy`` of
the same sizes (the bound of a one-copy lane). For UCX it also runs ``ucx_perftest`` on
the same lanes, when that helper is present. Prints a markdown table; writes a PNG chart
with ``--plot``.

    python benchmarks/transfer.py                 # tcp, auto (+ ucx when installed)
    python benchmarks/transfer.py --sizes 64M --repeat 9
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import tensorx as tx
from benchmarks._charts import save
from benchmarks.rawsock import AsyncioClient, RawClient
from tensorx import _eventloop
from tensorx.testing import OwnerProcess

UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
ALL_CPUS = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()
DEFAULT_SIZES = "4K,64K,1M,16M,64M,256M"


def parse_size(text: str) -> int:
    text = text.strip().upper()
    return int(text[:-1]) * UNITS[text[-1]] if text[-1] in UNITS else int(text)


def human(n: int) -> str:
    for unit in ("G", "M", "K"):
        if n >= UNITS[unit] and n % UNITS[unit] == 0:
            return f"{n // UNITS[unit]} {unit}iB"
    return f"{n} B"


def repeats_for(n: int, repeat: int) -> int:
    return repeat if n >= 16 << 20 else max(repeat, 200 if n <= 64 << 10 else 30)


def median_time(fn: Callable[[], float], n: int) -> float:
    fn()  # warm-up
    return statistics.median(fn() for _ in range(n))


async def amedian_time(fn: Callable[[], Awaitable[None]], n: int) -> float:
    await fn()
    times = []
    for _ in range(n):
        t = time.perf_counter()
        await fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


async def bench_tensorx(transport: str, sizes: list[int], repeat: int,
                        loop: str = "asyncio") -> dict[str, object]:
    """{(op, size): seconds} plus the endpoint info, for one transport; both processes
    run on ``loop``."""
    results: dict[str, object] = {}
    async with OwnerProcess(transport, env={_eventloop.ENV: loop}) as owner, \
            tx.Node(listen=None, transport=transport) as node:
        pin(owner.pid)
        ep = await node.connect(owner.address)
        results["info"] = ep.info
        desc = await owner.export(max(sizes))
        local = tx.MemoryRegion.register(np.ones(max(sizes), np.uint8))
        for n in sizes:
            reps = repeats_for(n, repeat)
            results[f"write {n}"] = await amedian_time(
                lambda n=n: ep.write(local, desc, nbytes=n), reps)
            results[f"read {n}"] = await amedian_time(
                lambda n=n: ep.read(local, desc, nbytes=n), reps)
        small = tx.MemoryRegion.allocate(8)
        results["latency"] = await amedian_time(lambda: ep.write(small, desc, nbytes=8), 500)
    return results


def bench_raw(sizes: list[int], repeat: int) -> dict[str, object]:
    client = RawClient(max(sizes))
    pin(client.proc.pid)
    try:
        results: dict[str, object] = {}
        for n in sizes:
            reps = repeats_for(n, repeat)
            results[f"write {n}"] = median_time(lambda n=n: client.write(n), reps)
            results[f"read {n}"] = median_time(lambda n=n: client.read(n), reps)
        results["latency"] = median_time(lambda: client.write(8), 500)
        return results
    finally:
        client.close()


async def bench_asyncio(sizes: list[int], repeat: int) -> dict[str, object]:
    """The raw socket's exchange between two asyncio loops (``rawsock.AsyncioClient``):
    for small ops, the floor of any asyncio transport, tensorx over TCP included (large
    transfers it takes in as many readiness callbacks as the kernel makes pieces)."""
    client = AsyncioClient(max(sizes))
    pin(client.proc.pid)
    client.attach()
    try:
        results: dict[str, object] = {}
        for n in sizes:
            reps = repeats_for(n, repeat)
            results[f"write {n}"] = await _amedian(lambda n=n: client.awrite(n), reps)
            results[f"read {n}"] = await _amedian(lambda n=n: client.aread(n), reps)
        results["latency"] = await _amedian(lambda: client.awrite(8), 500)
        return results
    finally:
        client.detach()
        client.close()


async def _amedian(fn: Callable[[], Awaitable[float]], n: int) -> float:
    await fn()  # warm-up
    return statistics.median([await fn() for _ in range(n)])


def bench_memcpy(sizes: list[int], repeat: int) -> dict[str, object]:
    """One single-threaded copy of each size between two buffers of this process."""
    src = np.ones(max(sizes), np.uint8)
    dst = np.zeros(max(sizes), np.uint8)
    results: dict[str, object] = {}
    for n in sizes:
        reps = repeats_for(n, repeat)
        results[f"write {n}"] = median_time(lambda n=n: _copy(dst[:n], src[:n]), reps)
        results[f"read {n}"] = median_time(lambda n=n: _copy(src[:n], dst[:n]), reps)
    results["latency"] = median_time(lambda: _copy(dst[:8], src[:8]), 500)
    return results


def _copy(dst: np.ndarray, src: np.ndarray) -> float:
    started = time.perf_counter()
    np.copyto(dst, src)
    return time.perf_counter() - started


def ucx_perftest_report(size: int, rounds: int) -> str:
    """tensorx (Endpoint) against ucx_perftest on the same lanes, both UCX configurations
    tensorx uses, interleaved (``benchmarks/ucx_perftest.py``); empty without the binary."""
    from benchmarks import ucx_perftest

    try:
        ucx_perftest.perftest_binary()
    except FileNotFoundError as exc:
        return f"(no ucx_perftest: {exc})"
    if hasattr(os, "sched_setaffinity"):  # undo pin(): the processes spawned inherit it
        os.sched_setaffinity(0, ALL_CPUS)
    return ucx_perftest.report(ucx_perftest.compare(size, rounds=rounds, iters=10))


# Where client and server run, every system alike. Unpinned, the scheduler sometimes stacks
# both on one core and the figures go bimodal. "one-core" is what the published figures
# measured (before 2026-11-25 the first round's raw socket alone ran on two cores: pin()
# narrowed this process to one CPU, which every later server inherited); on this VM a
# wake-up across cores costs tens of microseconds, which two cores add to every system.
PLACEMENTS = ("one-core", "two-cores")
placement = PLACEMENTS[0]


def pin(server_pid: int | None) -> None:
    """Client on the first CPU we started with, server on the same one or the next
    (:data:`placement`)."""
    if server_pid is None or len(ALL_CPUS) < 2:
        return
    cpus = sorted(ALL_CPUS)
    os.sched_setaffinity(0, {cpus[0]})
    os.sched_setaffinity(server_pid, {cpus[0] if placement == "one-core" else cpus[1]})


def merge(rounds: list[dict[str, object]]) -> dict[str, object]:
    """Median over interleaved rounds of every timing; the rest from the first round."""
    out = dict(rounds[0])
    for key, value in rounds[0].items():
        if isinstance(value, float):
            out[key] = statistics.median(float(r[key]) for r in rounds)  # type: ignore[arg-type]
    return out


def gbps(n: int, seconds: object) -> float:
    return n / float(seconds) / 1e9 if seconds else float("nan")  # type: ignore[arg-type]


def table(sizes: list[int], systems: dict[str, dict[str, object]]) -> str:
    raw = systems["raw socket"]
    lines = ["| size | system | write GB/s | read GB/s | write vs raw | read vs raw |",
             "|---|---|---|---|---|---|"]
    for n in sizes:
        for name, res in systems.items():
            w, r = gbps(n, res[f"write {n}"]), gbps(n, res[f"read {n}"])
            rw, rr = w / gbps(n, raw[f"write {n}"]), r / gbps(n, raw[f"read {n}"])
            lines.append(f"| {human(n)} | {name} | {w:.2f} | {r:.2f} | {rw:.0%} | {rr:.0%} |")
    if "memcpy" in systems:
        lines += ["", "| size | system | write vs memcpy | read vs memcpy |", "|---|---|---|---|"]
        mem = systems["memcpy"]
        for n in sizes:
            for name, res in systems.items():
                if name != "memcpy":
                    lines.append(f"| {human(n)} | {name} | "
                                 f"{float(mem[f'write {n}']) / float(res[f'write {n}']):.0%} | "  # type: ignore[arg-type]
                                 f"{float(mem[f'read {n}']) / float(res[f'read {n}']):.0%} |")  # type: ignore[arg-type]
    lines.append("")
    lines.append("| system | 8 B write, round trip (us) |")
    lines.append("|---|---|")
    for name, res in systems.items():
        lines.append(f"| {name} | {float(res['latency']) * 1e6:.1f} |")  # type: ignore[arg-type]
    return "\n".join(lines)


def plot(sizes: list[int], systems: dict[str, dict[str, object]], path: str) -> None:
    """GB/s per system against size, write and read; a system missing a size is left out."""
    systems = {name: res for name, res in systems.items()
               if all(f"{op} {n}" in res for op in ("write", "read") for n in sizes)}
    if not sizes or not systems:
        print(f"transfer: no rows, no chart written to {path}")
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, op in zip(axes, ("write", "read"), strict=True):
        for name, res in systems.items():
            ax.plot(sizes, [gbps(n, res[f"{op} {n}"]) for n in sizes], marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_title(f"one-sided {op}, loopback")
        ax.set_xlabel("bytes")
    axes[0].set_ylabel("GB/s")
    axes[0].legend()
    print(save(fig, path, dpi=120))  # (its folder made: make bench runs this first)


def available_transports() -> list[str]:
    import importlib.util

    return ["tcp", "ucx", "auto"] if importlib.util.find_spec("ucxx") else ["tcp", "auto"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default=DEFAULT_SIZES, help="comma list, e.g. 4K,64M")
    parser.add_argument("--repeat", type=int, default=7, help="timed repeats for large sizes")
    parser.add_argument("--transports", default=",".join(available_transports()))
    parser.add_argument("--plot", default="", help="write a PNG chart here")
    parser.add_argument("--loop", default="asyncio",
                        help="event loops to run tensorx on, comma list of asyncio (the "
                             "library's default) and uvloop; each is a row of its own")
    parser.add_argument("--rounds", type=int, default=3,
                        help="interleaved rounds over all systems (medians are reported)")
    parser.add_argument("--placement", choices=PLACEMENTS, default=PLACEMENTS[0],
                        help="client and server of every system both on one core (as the "
                             "published figures), or on two")
    args = parser.parse_args()
    global placement
    placement = args.placement
    print(f"placement: {placement} (client and server of every system alike)", flush=True)
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    runs: dict[str, list[dict[str, object]]] = {}
    for r in range(args.rounds):
        print(f"round {r + 1}/{args.rounds}: raw sockets", flush=True)
        runs.setdefault("raw socket", []).append(bench_raw(sizes, args.repeat))
        runs.setdefault("asyncio socket", []).append(asyncio.run(bench_asyncio(sizes, args.repeat)))
        runs.setdefault("memcpy", []).append(bench_memcpy(sizes, args.repeat))
        for transport in args.transports.split(","):
            for loop in args.loop.split(","):
                label = _label(transport) + ("" if loop == "asyncio" else f", {loop}")
                print(f"round {r + 1}/{args.rounds}: tensorx over {label}", flush=True)
                res = _eventloop.run(bench_tensorx(transport, sizes, args.repeat, loop), loop)
                if r == 0:
                    info = res["info"]
                    print(f"  endpoint: {info['transport']} lanes={info['lanes']} "
                          f"host={info.get('host')}", flush=True)
                runs.setdefault(f"tensorx {label}", []).append(res)
    systems = {name: merge(rounds) for name, rounds in runs.items()}
    print()
    print(table(sizes, systems))
    if "ucx" in args.transports:
        # a small op (per-op cost) and a large one (bandwidth), where they were asked for
        for size in [s for s in (64 << 10, 64 << 20) if s in sizes] or [max(sizes)]:
            print(f"\ntensorx vs ucx_perftest on the same lanes, {human(size)}, "
                  f"{args.rounds} interleaved rounds (medians):", flush=True)
            print(ucx_perftest_report(size, args.rounds))
    if args.plot:
        plot(sizes, systems, args.plot)


def _label(transport: str) -> str:
    return "auto (same-host lane)" if transport == "auto" else transport


if __name__ == "__main__":
    main()
