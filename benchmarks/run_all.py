"""Everything ``make bench`` runs: PS rounds (both placements), training throughput and the
sparse-embedding step (:mod:`benchmarks.sparse`).

Writes ``OUT/performance.md`` (machine line, tables, target checks: docs/performance.md
is pasted from it), ``OUT/ps_round.png``, ``OUT/train_throughput.png`` and
``OUT/sparse.png``; every number in it comes from this one run.

    python benchmarks/run_all.py                 # about 12 minutes on 2 cores
    python benchmarks/run_all.py --quick         # fewer blocks, a smoke test
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import ps_round, sparse, train_throughput


def machine() -> str:
    """One line naming what produced the numbers."""
    cpu = "unknown CPU"
    with open("/proc/cpuinfo", errors="replace") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    import torch

    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    return (f"{cpu}, {os.cpu_count()} cores, {mem_gib:.0f} GiB, Linux "
            f"{platform.release()}, Python {platform.python_version()}, torch "
            f"{torch.__version__}, {_ucx_version()}; run {when}")


def _ucx_version() -> str:
    try:
        from importlib.metadata import version

        return f"ucxx {version('ucxx-cu12')}, libucx {version('libucx-cu12')}"
    except Exception:  # no UCX installed: tensorx runs on tcp only
        return "no UCX"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("bench-results"))
    p.add_argument("--quick", action="store_true", help="2 blocks each: a smoke test")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    t0 = time.monotonic()
    blocks = ["--blocks", "2"] if args.quick else []
    rows = ps_round.main(["--out", str(args.out), *blocks])
    train = train_throughput.main(["--out", str(args.out), *blocks])
    rows_sparse = sparse.main(["--out", str(args.out), *blocks])
    report = "\n".join([
        f"Machine: {machine()}.", "",
        "### One PS round (push all gradients, SGD on the PS, pull all parameters)", "",
        ps_round.table(rows),
        "### Training throughput (one PS, two workers, wide MLP, sync)", "",
        train_throughput.table(train), "",
        "### Sparse embeddings (one PS, two workers, DLRM-shaped, sync)", "",
        sparse.table(rows_sparse), "",
        "### Targets", "",
        *ps_round.targets(rows), *train_throughput.targets(train),
        *sparse.targets(rows_sparse), ""])
    path = args.out / "performance.md"
    path.write_text(report)
    print(f"\n{report}\nreport saved to {path}; whole run {time.monotonic() - t0:.0f} s")


if __name__ == "__main__":
    main()
