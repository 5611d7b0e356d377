"""End-to-end PS training throughput: one PS and two workers, steps per second.

A communication-heavy model (a wide MLP, 20M parameters, small batches; see
``benchmarks/baselines/training.py``) trained in sync mode by:

* tensorx (``ParameterServer`` + ``RemoteOptimizer`` in a plain PyTorch loop), as shipped
  (overlap measured, see :mod:`tensorx._ps.worker.buckets`) and with gradient overlap forced on
  (buckets written during backward) and off, over tcp and over UCX, all on the
  copy path; and as shipped (``share_memory=True``): the workers map the PS's arenas;
* the ``torch.distributed.rpc`` parameter-server pattern (TensorPipe) from the PyTorch
  tutorial.

On one host, and across two network namespaces joined by a veth pair (two hosts' copy path:
nothing is mapped there; skipped where namespaces cannot be made). All systems of a
placement are started, run unmeasured warm-up steps one after the other (past tensorx's
probing of its choices: ``benchmarks/baselines/pair.py``), then are measured in alternating
blocks of steps; a step's time is the slower worker's. Prints a markdown table; results go
to ``OUT/train_throughput.json``, a chart to ``OUT/train_throughput.png``.

    python benchmarks/train_throughput.py
    python benchmarks/train_throughput.py --systems tensorx-tcp-overlap,rpc --blocks 6
    python benchmarks/train_throughput.py --placements netns   # two hosts' copy path
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._charts import save
from benchmarks.baselines import training
from benchmarks.baselines.pair import Pair, Placement, System, warm_up
from benchmarks.ps_round import placement

SYSTEMS = {
    # the defaults (transport="auto", overlap measured), first as shipped (on one host the workers
    # map the PS's arenas), then on the copy path (the same-host lane moves every byte)
    "tensorx-defaults": System("tensorx defaults (share_memory=True)", "train-tensorx",
                               ("--transport", "auto", "--share-memory", "on")),
    "tensorx-auto-overlap": System("tensorx defaults, share_memory=False (same-host lane)",
                                   "train-tensorx", ("--transport", "auto")),
    "tensorx-tcp-overlap": System("tensorx tcp, overlap on", "train-tensorx",
                                  ("--transport", "tcp", "--overlap", "on")),
    "tensorx-tcp": System("tensorx tcp, overlap off", "train-tensorx",
                          ("--transport", "tcp", "--overlap", "off")),
    "tensorx-ucx-overlap": System("tensorx ucx, overlap on", "train-tensorx",
                                  ("--transport", "ucx", "--overlap", "on")),
    "tensorx-ucx": System("tensorx ucx, overlap off", "train-tensorx",
                          ("--transport", "ucx", "--overlap", "off")),
    "tensorx-shm": System("tensorx shm", "train-tensorx",
                          ("--transport", "tcp", "--share-memory", "on")),
    "rpc": System("torch.distributed.rpc PS (TensorPipe)", "train-rpc"),
}
EXPERIMENTS: dict[str, System] = {}
ALL = {**SYSTEMS, **EXPERIMENTS}
REFERENCE = "rpc"


def progress(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def start_all(keys: list[str], place: Placement, logdir: Path) -> dict[str, Pair]:
    pairs = {k: Pair(ALL[k], "wide-mlp", place, logdir, clients=training.WORKERS)
             for k in keys}
    with ThreadPoolExecutor(len(pairs)) as pool:
        futures = {k: pool.submit(p.start) for k, p in pairs.items()}
    for k, f in futures.items():
        if f.exception() is not None:
            progress(f"  {ALL[k].label} failed to start, left out: {f.exception()}")
            pairs.pop(k).close()
    return pairs


def measure(pairs: dict[str, Pair], blocks: int, steps: int) -> dict[str, list[float]]:
    warm_up(pairs)
    times: dict[str, list[float]] = {k: [] for k in pairs}
    order = list(pairs)
    for b in range(blocks):
        for k in order if b % 2 == 0 else order[::-1]:
            times[k] += pairs[k].run(steps)
        progress(f"  block {b + 1}/{blocks} done")
    return times


def label(key: str, info: dict[str, Any]) -> str:
    if "--share-memory" not in ALL[key].options:
        return ALL[key].label
    return ALL[key].label + (" (mapped)" if info.get("mapped") else " (not mapped: copies)")


def summarise(times: dict[str, list[float]], pairs: dict[str, Pair], place: Placement
              ) -> list[dict[str, Any]]:
    rate = {k: 1.0 / statistics.median(t) for k, t in times.items()}
    ref = rate.get(REFERENCE)
    return [{"placement": place.name, "key": k, "system": label(k, pairs[k].info),
             "steps_per_s": r,
             "median_step_s": 1.0 / r, "steps": len(times[k]),
             "vs_rpc": r / ref if ref else None} for k, r in rate.items()]


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| placement | system | steps/s (median step) | ms / step | throughput vs RPC PS "
             "| steps |", "|---|---|---|---|---|---|"]
    for r in rows:
        vs = "-" if r["vs_rpc"] is None else f"{r['vs_rpc']:.2f}x"
        lines.append(f"| {r['placement']} | {r['system']} | {r['steps_per_s']:.2f} | "
                     f"{r['median_step_s'] * 1e3:.1f} | {vs} | {r['steps']} |")
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Steps/s per system, one panel per placement; the RPC PS (the baseline) grey, hatched
    and as a dashed line. Row keys used: placement, key, system, steps_per_s."""
    rows = [r for r in rows if all(r.get(k) is not None
                                   for k in ("placement", "key", "system", "steps_per_s"))]
    if not rows:
        progress(f"training throughput: no rows, no chart written to {path}")
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    places = list(dict.fromkeys(r["placement"] for r in rows))
    fig, axes = plt.subplots(1, len(places), figsize=(6.5 * len(places), 4.2), squeeze=False)
    for ax, place in zip(axes[0], places, strict=True):
        here = [r for r in rows if r["placement"] == place]
        ref = [r["key"] == REFERENCE for r in here]
        ax.barh([r["system"] for r in here], [r["steps_per_s"] for r in here],
                color=["grey" if b else "C0" for b in ref], hatch=["//" if b else "" for b in ref])
        for r in here:
            if r["key"] == REFERENCE:
                ax.axvline(r["steps_per_s"], color="grey", ls="--", label="RPC PS (baseline)")
                ax.legend(fontsize=7)
        ax.invert_yaxis()
        ax.tick_params(axis="y", labelsize=7)
        ax.set_title(f"training throughput, {place}")
        ax.set_xlabel("steps/s (median step)")
    progress(save(fig, path))


def targets(rows: list[dict[str, Any]]) -> list[str]:
    return [f"- training, {r['placement']}, {r['system']}: {r['vs_rpc']:.2f}x the RPC "
            f"pattern's throughput "
            f"(target >= 1.5x) {'MET' if r['vs_rpc'] >= 1.5 else 'missed'}"
            for r in rows if r["key"] != REFERENCE and r["vs_rpc"] is not None]


def run_placement(keys: list[str], place: Placement, args: argparse.Namespace
                  ) -> list[dict[str, Any]]:
    progress(f"training throughput, {place.name}: starting "
             f"{', '.join(ALL[k].label for k in keys)} (one PS + {training.WORKERS} workers each)")
    pairs = start_all(keys, place, args.out / "logs")
    try:
        times = measure(pairs, args.blocks, args.steps)
    finally:
        for p in pairs.values():
            p.close()
    return summarise(times, pairs, place)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"of {', '.join(ALL)}")
    p.add_argument("--blocks", type=int, default=3, help="alternating blocks per system")
    p.add_argument("--steps", type=int, default=8, help="steps per block")
    p.add_argument("--placements", default="same,netns",
                   help="same,netns (two network namespaces: two hosts' copy path)")
    p.add_argument("--out", type=Path, default=Path("bench-results"))
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    args = parse_args(argv)
    keys = [k for k in args.systems.split(",") if k]
    rows: list[dict[str, Any]] = []
    for name in args.placements.split(","):
        with placement(name) as place:
            if place is not None:
                rows += run_placement(keys, place, args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "train_throughput.json").write_text(json.dumps(rows, indent=1))
    print()
    print(table(rows))
    print("\n".join(targets(rows)))
    plot(rows, args.out / "train_throughput.png")
    return rows


if __name__ == "__main__":
    main()
