"""The UCX limit: run ``ucx_perftest`` (server + client, loopback) on given lanes.

tensorx's UCX transport is judged against UCX's own benchmark on the same ``UCX_TLS`` in
the same run. ``limits(size)`` covers the two configurations tensorx uses on one host:

* ``tcp`` with peer-failure endpoints (``-e``): tensorx's default, ``error_handling=True``;
* ``posix,cma`` without error handling: ``UcxFactory(error_handling=False, tls="posix,cma")``.

    python benchmarks/ucx_perftest.py --size 64M             # the limits only
    python benchmarks/ucx_perftest.py --size 64M --compare   # tensorx vs perftest table
"""

from __future__ import annotations

import argparse
import csv
import io
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Mapping
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

__all__ = ["CONFIGS", "compare", "limits", "perftest_binary", "perftest_gbps", "tensorx_gbps",
           "tensorx_settings"]

# (UCX_TLS, peer-failure endpoints) pairs: the lanes tensorx uses in each mode.
CONFIGS: tuple[tuple[str, bool], ...] = (("tcp", True), ("posix,cma", False))
TESTS = ("ucp_put_bw", "ucp_get")


def perftest_binary() -> tuple[Path, Path]:
    """(ucx_perftest, libucx lib dir) from the ``libucx`` wheel; FileNotFoundError if absent."""
    try:
        import libucx
    except ImportError as exc:
        raise FileNotFoundError("libucx is not installed") from exc
    root = Path(libucx.__file__).parent
    binary = root / "bin" / "ucx_perftest"
    if not binary.is_file():
        raise FileNotFoundError(f"no ucx_perftest in {root / 'bin'}")
    return binary, root / "lib"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def perftest_gbps(tls: str, test: str, size: int, *, error_handling: bool = False,
                  iters: int = 20, warmup: int = 3, timeout: float = 120.0,
                  settings: Mapping[str, str] | None = None) -> float:
    """Overall bandwidth in GB/s (1e9 B/s) of one ``ucx_perftest`` run on ``UCX_TLS=tls``.

    Runs the server and the client as two processes on 127.0.0.1. ``error_handling``
    passes ``-e`` (peer-failure endpoints), as tensorx's default transport uses.
    ``settings`` are UCX settings (names without ``UCX_``) for both processes.
    """
    binary, libdir = perftest_binary()
    env = dict(os.environ, **{f"UCX_{k}": v for k, v in (settings or {}).items()})
    env.update(UCX_TLS=tls, UCX_WARN_UNUSED_ENV_VARS="n",
               LD_LIBRARY_PATH=f"{libdir}:{os.environ.get('LD_LIBRARY_PATH', '')}")
    port = _free_port()
    args = ["-p", str(port)]
    # No probe of the port: perftest's server serves the first connection it accepts, so
    # the client itself retries while the server is not listening yet.
    server = subprocess.Popen([str(binary), *args], env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        cmd = [str(binary), "127.0.0.1", *args, "-t", test, "-s", str(size), "-n", str(iters),
               "-w", str(warmup), "-v", *(["-e"] if error_handling else [])]
        out = _run_client(cmd, env, timeout)
        server.wait(timeout=10)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    return _parse(out)


def _run_client(cmd: list[str], env: dict[str, str], timeout: float) -> str:
    for attempt in range(20):  # the server may need a moment to listen
        res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout,
                             check=False)
        if res.returncode == 0:
            return res.stdout
        if "onnection refused" not in res.stderr + res.stdout or attempt == 19:
            raise RuntimeError(f"ucx_perftest failed ({res.returncode}): "
                               f"{(res.stderr or res.stdout).strip()[-500:]}")
        time.sleep(0.1)
    raise AssertionError("unreachable")


def _parse(out: str) -> float:
    rows = [r for r in csv.reader(io.StringIO(out)) if r and r[0].strip().isdigit()]
    header = next(r for r in csv.reader(io.StringIO(out)) if r and r[0] == "iterations")
    overall_mb = float(rows[-1][header.index("overall_bw")])
    return overall_mb * (1 << 20) / 1e9  # perftest's MB is MiB


def tensorx_settings() -> dict[str, str]:
    """The UCX settings tensorx's UCX transport applies by default (same lanes, same knobs)."""
    from tensorx.transport.ucx import DEFAULT_OPTIONS

    return {k: v for k, v in DEFAULT_OPTIONS.items() if k != "WARN_UNUSED_ENV_VARS"}


def limits(size: int, *, iters: int = 20, same_settings: bool = True) -> dict[str, float]:
    """GB/s of ``ucp_put_bw`` and ``ucp_get`` for every config in :data:`CONFIGS`.

    Keys read ``"<tls>[ -e] <test>"``; a config that cannot run here is left out. With
    ``same_settings`` perftest runs with the UCX settings tensorx applies (tcp segment
    sizes), otherwise with UCX's defaults.
    """
    settings = tensorx_settings() if same_settings else {}
    out: dict[str, float] = {}
    try:
        perftest_binary()
    except FileNotFoundError:
        return out
    for tls, eh in CONFIGS:
        for test in TESTS:
            key = f"{tls}{' -e' if eh else ''} {test}"
            try:
                out[key] = perftest_gbps(tls, test, size, error_handling=eh, iters=iters,
                                         settings=settings)
            except (RuntimeError, subprocess.TimeoutExpired, StopIteration,
                    IndexError, ValueError) as exc:
                print(f"ucx_perftest {key}: {exc}")
    return out


# -- tensorx (Node + Endpoint, as a user calls it) on the same lanes -------------------------
def _options(tls: str, error_handling: bool, spin: float | None) -> dict[str, Any]:
    return {"tls": tls, "error_handling": error_handling, "progress_spin_us": spin}


def _owner(conn: Connection, tls: str, error_handling: bool, size: int,
           spin: float | None) -> None:
    import asyncio

    import tensorx as tx

    async def serve() -> None:
        async with tx.Node("tcp://127.0.0.1:0", transport="ucx",
                           ucx_options=_options(tls, error_handling, spin)) as node:
            desc = node.export(tx.MemoryRegion.allocate(size), access="rw")
            conn.send((node.address, desc.to_bytes()))
            await asyncio.get_running_loop().run_in_executor(None, conn.recv)  # only UCX works

    asyncio.run(serve())


def tensorx_gbps(tls: str, size: int, *, error_handling: bool, iters: int = 20,
                 timeout: float = 300.0, spin: float | None = 50.0) -> dict[str, Any]:
    """GB/s of ``Endpoint.write``/``read`` of ``size`` bytes between two fresh processes
    (UCX is configured once per process) over ``UCX_TLS=tls``, plus the median 8-byte write
    (put + flush) round trip in microseconds and the lanes used. ``spin``: the UCX
    progress driver's spin window (``UcxFactory(progress_spin_us=...)``; None: ucxx's)."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    owner_conn, owner_child = ctx.Pipe()
    owner = ctx.Process(target=_owner, args=(owner_child, tls, error_handling, size, spin),
                        daemon=True)
    owner.start()
    client = ctx.Process(target=_client, args=(child, owner_conn, tls, size, error_handling,
                                               iters, spin), daemon=True)
    client.start()
    try:
        deadline = time.monotonic() + timeout
        while not conn.poll(0.2):
            if not client.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the tensorx measurement failed or did not finish")
        result: dict[str, Any] = conn.recv()
        return result
    finally:
        owner_conn.send("stop")
        for proc in (client, owner):
            proc.join(10)
            if proc.is_alive():
                proc.kill()


def _client(conn: Connection, owner: Connection, tls: str, size: int, error_handling: bool,
            iters: int, spin: float | None) -> None:
    import asyncio

    if not owner.poll(60):
        raise RuntimeError("tensorx owner process did not start")
    address, desc = owner.recv()
    conn.send(asyncio.run(_measure(address, desc, tls, size, error_handling, iters, spin)))


WINDOW = 16  # ops in one write_many: a window in flight, as perftest keeps one


def iters_for(size: int, iters: int) -> int:
    """At least ``iters``, and enough ops of ``size`` bytes to move 256 MiB (at most
    20,000): ten 64 KiB ops are over in a millisecond, too short to time."""
    return max(iters, min(20_000, (256 << 20) // max(size, 1)))


async def _measure(address: str, desc: bytes, tls: str, size: int, error_handling: bool,
                   iters: int, spin: float | None) -> dict[str, Any]:
    import tensorx as tx

    async with tx.Node(None, transport="ucx",
                       ucx_options=_options(tls, error_handling, spin)) as node:
        ep = await node.connect(address)
        remote = tx.RegionDescriptor.from_bytes(desc)
        local = tx.MemoryRegion.allocate(size)
        out: dict[str, Any] = {}
        n = iters_for(size, iters)

        async def many() -> None:
            await ep.write_many([(local, remote)] * WINDOW, timeout=60)

        for name, fn, per in (("put", lambda: ep.write(local, remote, timeout=60), 1),
                              ("get", lambda: ep.read(local, remote, timeout=60), 1),
                              ("put window", many, WINDOW)):
            for _ in range(max(1, n // (10 * per))):
                await fn()  # warm-up
            t0 = time.perf_counter()
            for _ in range(max(1, n // per)):
                await fn()
            out[name] = size * per * max(1, n // per) / (time.perf_counter() - t0) / 1e9
        times = []
        for _ in range(2000):
            t0 = time.perf_counter()
            await ep.write(local, remote, nbytes=8, timeout=10)
            times.append(time.perf_counter() - t0)
        out["put8_us"] = sorted(times)[len(times) // 2] * 1e6
        out["raw put8_us"], out["raw put"] = _raw_floor(ep, local, remote, size, n)
        out["lanes"] = ep.info["lanes"]
        return out


def _raw_floor(ep: Any, local: Any, remote: Any, size: int, n: int) -> tuple[float, float]:
    """The floor with no tensorx in it: the same put + flush issued by direct calls into
    the UCP binding on the same endpoint, progressing until done (no event loop, no checks,
    no lane). Median 8-byte round trip in microseconds, and GB/s of ``size``-byte puts."""
    lane = next(x for x in ep._lane.lanes if x.name == "ucx")  # noqa: SLF001 (the floor reaches under the API on purpose)
    rt, lib = lane._rt, lane._lib  # noqa: SLF001 (same)
    uep, rkey = lane._ep, lane._rkey(remote)  # noqa: SLF001 (same)
    raddr, memh = int(remote.keys["ucx"]["addr"]), rt.memh(local)

    def put(nbytes: int) -> None:
        w = rt.new_wait()
        lib.tx_put(uep, local.address, nbytes, raddr, rkey, memh, w)
        lib.tx_flush(uep, w)
        lib.tx_wait_release(w)
        while w.pending:
            lib.tx_progress(rt.worker, 64, w)

    times = []
    for _ in range(2000):
        t0 = time.perf_counter()
        put(8)
        times.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    for _ in range(n):
        put(size)
    gbps = size * n / (time.perf_counter() - t0) / 1e9
    return sorted(times)[len(times) // 2] * 1e6, gbps


def compare(size: int, *, rounds: int = 3, iters: int = 20, spins: tuple[float | None, ...]
            = (50.0,), configs: tuple[tuple[str, bool], ...] = CONFIGS,
            defaults: bool = True) -> list[dict[str, Any]]:
    """Interleaved rounds of ucx_perftest (tensorx's UCX settings, and UCX's defaults) and
    tensorx (one sample per progress ``spins`` setting) on each config; medians."""
    rows, same, n = [], tensorx_settings(), iters_for(size, iters)
    for tls, eh in configs:
        samples: dict[str, list[float]] = {}
        lanes: Any = None
        for _ in range(rounds):
            for test, key in (("ucp_put_bw", "put"), ("ucp_get", "get")):
                samples.setdefault(f"perftest {key}", []).append(
                    perftest_gbps(tls, test, size, error_handling=eh, iters=n, warmup=n // 10,
                                  settings=same))
                if defaults:
                    samples.setdefault(f"perftest-default {key}", []).append(
                        perftest_gbps(tls, test, size, error_handling=eh, iters=n,
                                      warmup=n // 10))
            for spin in spins:
                res = tensorx_gbps(tls, size, error_handling=eh, iters=iters, spin=spin)
                lanes = res.pop("lanes")
                for key, value in res.items():
                    samples.setdefault(f"tensorx {key}{_spin_label(spin)}", []).append(value)
        med = {k: statistics.median(v) for k, v in samples.items()}
        rows.append({"tls": tls, "error_handling": eh, "lanes": lanes, **med})
    return rows


def _spin_label(spin: float | None) -> str:
    return "" if spin == 50.0 else " (ucxx progress)" if spin is None else f" (spin {spin:g})"


def _spin(text: str) -> float | None:
    return None if text == "ucxx" else float(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", default="64M")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--compare", action="store_true",
                        help="also measure tensorx (Node + Endpoint), interleaved; a table")
    parser.add_argument("--spins", default="50",
                        help="tensorx progress settings to compare: microseconds, or 'ucxx' "
                             "(ucxx's progress thread), comma-separated")
    args = parser.parse_args()
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    s = args.size.upper()
    size = int(s[:-1]) * units[s[-1]] if s[-1] in units else int(s)
    if not args.compare:
        for key, value in limits(size, iters=args.iters).items():
            print(f"{key:28s} {value:6.2f} GB/s")
        return
    spins = tuple(_spin(x) for x in args.spins.split(","))
    print(report(compare(size, rounds=args.rounds, iters=args.iters, spins=spins), spins))


def report(rows: list[dict[str, Any]], spins: tuple[float | None, ...] = (50.0,)) -> str:
    """The markdown table of :func:`compare`'s rows: tensorx against perftest on the same
    lanes, and against the floor with no tensorx in it (the same UCP calls from Python)."""
    lines = ["| UCX_TLS | error handling | lanes | tensorx | put: tensorx / perftest | "
             f"put, {WINDOW} per write_many / perftest | get: tensorx / perftest | "
             "put: floor (UCP from Python) | perftest, UCX defaults: put / get | "
             "8 B put+flush: tensorx / floor |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        for spin in spins:
            tag = _spin_label(spin)
            put, get, win = r[f"tensorx put{tag}"], r[f"tensorx get{tag}"], \
                r[f"tensorx put window{tag}"]
            floor, rt8 = r[f"tensorx raw put{tag}"], r[f"tensorx put8_us{tag}"]
            raw8 = r[f"tensorx raw put8_us{tag}"]
            defaults = (f"{r['perftest-default put']:.2f} / {r['perftest-default get']:.2f} "
                        "GB/s" if "perftest-default put" in r else "-")
            lines.append(
                f"| {r['tls']} | {r['error_handling']} | {', '.join(r['lanes'])} | "
                f"{tag.strip(' ()') or 'default'} | "
                f"{put:.2f} / {r['perftest put']:.2f} GB/s ({put / r['perftest put']:.0%}) | "
                f"{win:.2f} / {r['perftest put']:.2f} GB/s ({win / r['perftest put']:.0%}) | "
                f"{get:.2f} / {r['perftest get']:.2f} GB/s ({get / r['perftest get']:.0%}) | "
                f"{floor:.2f} GB/s (tensorx {floor / put:.2f}x its time) | {defaults} | "
                f"{rt8:.1f} / {raw8:.1f} us ({rt8 / raw8:.2f}x) |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
