"""How long a worker takes to join a parameter server, from a freshly started process.

One ``tensorx ps --workers 2`` (defaults: ``transport="auto"``) runs for the whole
measurement; each join is a new Python process that imports tensorx and torch, builds a
small model and times ``Worker.start()`` (connect, handshake, welcome, first pull: what a
rank that joins or rejoins waits for), then leaves. Ranks alternate 0, 1, so at times no
worker is connected. Prints each join and the median (the machine is shared: one join is
noise, the median of ten is the figure).

    python benchmarks/join.py
    python benchmarks/join.py --joins 20 --transport tcp
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

_JOIN = """
import asyncio, json, sys, time
import torch
import tensorx as tx

async def main():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    worker = tx.Worker(model, sys.argv[1], rank=int(sys.argv[2]), num_workers=2,
                       transport=sys.argv[3], timeout=30)
    t0 = time.perf_counter()
    await worker.start()
    took = time.perf_counter() - t0
    info = [ep.info.get("transport") for ep in worker.node.endpoints]
    from tensorx.transport import _ucp
    ucx = _ucp._loaded is not None
    await worker.aclose()
    print(json.dumps({"join_s": took, "lanes": info, "ucx_loaded": ucx}), flush=True)

asyncio.run(main())
"""


def start_ps(transport: str) -> tuple[subprocess.Popen[str], str]:
    """``tensorx ps --workers 2`` on a free loopback port; its process and address."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "tensorx", "ps", "--workers", "2", "--listen",
         "tcp://127.0.0.1:0", "--transport", transport],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.stdout is not None
    deadline = time.monotonic() + 60
    for line in proc.stdout:
        found = re.search(r" listening on ((?:tcp|ucx)://[^\s:]+:\d+)", line)
        if found:
            return proc, found.group(1)
        if time.monotonic() > deadline:
            break
    proc.kill()
    raise RuntimeError("tensorx ps did not say where it listens")


def join(address: str, rank: int, transport: str) -> dict[str, object]:
    out = subprocess.run([sys.executable, "-c", _JOIN, address, str(rank), transport],
                         capture_output=True, text=True, cwd=ROOT, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"join failed: {out.stderr[-2000:]}")
    result: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--joins", type=int, default=10)
    p.add_argument("--transport", default="auto", choices=("auto", "tcp", "ucx"),
                   help="the workers' and the server's transport (default: auto)")
    args = p.parse_args(argv)
    proc, address = start_ps(args.transport)
    try:
        print(f"tensorx ps --workers 2 at {address}")
        times = []
        for i in range(args.joins):
            r = join(address, i % 2, args.transport)
            times.append(float(r["join_s"]))  # type: ignore[arg-type]
            print(f"join {i:2d} rank {i % 2}: {1e3 * times[-1]:7.1f} ms  lanes={r['lanes']} "
                  f"ucx loaded={r['ucx_loaded']}", flush=True)
        print(f"median join over {len(times)}: {1e3 * statistics.median(times):.1f} ms "
              f"(min {1e3 * min(times):.1f}, max {1e3 * max(times):.1f})")
    finally:
        proc.terminate()
        proc.wait(10)


if __name__ == "__main__":
    main()
