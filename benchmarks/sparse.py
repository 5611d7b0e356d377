"""Sparse embedding models: a DLRM-shaped training step, tensorx against an RPC PS that moves rows.

One PS and two workers, sync, SGD (``benchmarks/baselines/sparse_train.py``): tensorx with
default options (``transport="auto"``) and over tcp, against a ``torch.distributed.rpc``
(TensorPipe) parameter server that moves only the rows a worker touched and needs. Two table
scales with the same batches (``dlrm``: 132 MB of tables; ``dlrm-x10``: 1.3 GB): a system
whose step moves rows keeps its step time as the tables grow, one that moves tables does not.
Placements: one host, and two network namespaces joined by a veth pair (where permitted).
All systems of a model are started, run unmeasured warm-up steps, then are measured in
alternating blocks (4 x 20 steps each by default: a step's time swings 11-22 ms here, so
fewer steps give a median that moves by 20%); a step's time is the slower worker's. Prints
a markdown table with the ratios and the project's goals (a step in at most 0.5x the RPC PS's
time, within 1.2x of it with ten times the rows, a server apply rate of at least 1e7 rows/s);
results go to ``OUT/sparse.json``, a chart to ``OUT/sparse.png``.

    python benchmarks/sparse.py
    python benchmarks/sparse.py --models dlrm --placements same --blocks 2
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
from benchmarks.baselines import sparse_train
from benchmarks.baselines.pair import WARMUP_ROUNDS, Pair, Placement, System, warm_up
from benchmarks.ps_round import placement

SYSTEMS = {
    "tensorx": System("tensorx (defaults)", "sparse-tensorx", ("--transport", "auto")),
    "tensorx-tcp": System("tensorx tcp", "sparse-tensorx", ("--transport", "tcp")),
    "rpc": System("torch.distributed.rpc PS moving rows (TensorPipe)", "sparse-rpc"),
    "local": System("no PS: each worker's own step (the floor)", "sparse-local"),
}
REFERENCE = "rpc"
START_TIMEOUT = 600.0
# At 1.3 GB of tables each system holds several copies (worker tables, the PS's tables and
# gradient slots): all four at once were OOM-killed on a 23 GiB VM, so the large model runs
# the rows that answer "does the step grow with the tables" by default.
LARGE_SYSTEMS = "tensorx,rpc,local"
MODELS = {"dlrm": "DLRM-shaped, 132 MB of tables", "dlrm-x10": "DLRM-shaped, 1.3 GB of tables"}


def progress(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def measure(keys: list[str], model: str, place: Placement, args: argparse.Namespace
            ) -> list[dict[str, Any]]:
    # a system that moves whole tables takes minutes over its warm-up steps at 1.3 GB
    pairs = {k: Pair(SYSTEMS[k], model, place, args.out / "logs",
                     clients=sparse_train.WORKERS, start_timeout=START_TIMEOUT) for k in keys}
    with ThreadPoolExecutor(len(pairs)) as pool:
        futures = {k: pool.submit(p.start) for k, p in pairs.items()}
    for k, f in futures.items():
        if f.exception() is not None:
            progress(f"  {SYSTEMS[k].label} failed to start, left out: {f.exception()}")
            pairs.pop(k).kill()
    times: dict[str, list[float]] = {k: [] for k in pairs}
    try:
        warm_up(pairs, args.warmup)  # past tensorx's probing and the first look-ups' faults
        order = list(pairs)
        for b in range(args.blocks):
            for k in order if b % 2 == 0 else order[::-1]:
                times[k] += pairs[k].run(args.steps)
            progress(f"  {place.name}, {model}: block {b + 1}/{args.blocks} done")
    finally:
        for p in pairs.values():
            p.close()
    med = {k: statistics.median(t) for k, t in times.items() if t}
    ref = med.get(REFERENCE)
    return [{"placement": place.name, "model": model, "key": k, "system": SYSTEMS[k].label,
             "ms": m * 1e3, "vs_rpc": m / ref if ref else None, "steps": len(times[k]),
             "lanes": pairs[k].info.get("lanes"), "host": pairs[k].info.get("host", ""),
             "rows": pairs[k].info.get("rows")} for k, m in med.items()]


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| placement | model | system | ms / step (median) | time vs RPC PS | steps |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        vs = "-" if r["vs_rpc"] is None else f"{r['vs_rpc']:.2f}x"
        lines.append(f"| {r['placement']} | {MODELS[r['model']]} | {r['system']} | "
                     f"{r['ms']:.1f} | {vs} | {r['steps']} |")
    return "\n".join(lines)


FLOOR = "local"


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """ms per step per system, one panel per placement, one group of bars per table size;
    the no-PS floor a dashed line across its group. Row keys used: placement, model, key, ms."""
    rows = [r for r in rows if all(r.get(k) is not None for k in ("placement", "model", "key",
                                                                  "ms"))
            and r["key"] in SYSTEMS and r["model"] in MODELS]
    if not rows:
        progress(f"sparse: no rows, no chart written to {path}")
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    places = list(dict.fromkeys(r["placement"] for r in rows))
    fig, axes = plt.subplots(1, len(places), figsize=(6.5 * len(places), 4.2), squeeze=False)
    for ax, place in zip(axes[0], places, strict=True):
        here = {(r["model"], r["key"]): r["ms"] for r in rows if r["placement"] == place}
        models = [m for m in MODELS if any(m == mm for mm, _ in here)]
        keys = [k for k in SYSTEMS if k != FLOOR and any(k == kk for _, kk in here)]
        width = 0.8 / max(1, len(keys))
        for i, k in enumerate(keys):
            ax.bar([j + i * width for j in range(len(models))],
                   [here.get((m, k), 0) for m in models], width, label=SYSTEMS[k].label)
        floors = [(j, here[(m, FLOOR)]) for j, m in enumerate(models) if (m, FLOOR) in here]
        for n, (j, y) in enumerate(floors):
            ax.hlines(y, j - width / 2, j + 0.8 - width / 2, colors="k", linestyles="--",
                      label=SYSTEMS[FLOOR].label if n == 0 else None)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(models))])
        ax.set_xticklabels([MODELS[m] for m in models], fontsize=8)
        ax.set_title(f"sparse embeddings, {place}")
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel("ms per step (median)")
    progress(save(fig, path))


def targets(rows: list[dict[str, Any]]) -> list[str]:
    out = []
    for r in rows:
        if r["key"] == "tensorx" and r["model"] == "dlrm" and r["vs_rpc"] is not None:
            ok = r["vs_rpc"] <= 0.5
            out.append(f"- {r['placement']}, DLRM step, tensorx defaults: {r['vs_rpc']:.2f}x "
                       f"the RPC PS's time (target <= 0.5x) {'MET' if ok else 'missed'}")
        if r["key"] == "local" and r["model"] == "dlrm" and r["vs_rpc"] is not None:
            out.append(f"- {r['placement']}, DLRM step without any PS: {r['vs_rpc']:.2f}x the "
                       "RPC PS's time (no PS step can take less)")
    for place in dict.fromkeys(r["placement"] for r in rows):
        by = {(r["key"], r["model"]): r["ms"] for r in rows if r["placement"] == place}
        for key in ("tensorx", "rpc", "local"):  # local: how much the step itself grows
            if (key, "dlrm") in by and (key, "dlrm-x10") in by:
                grow = by[(key, "dlrm-x10")] / by[(key, "dlrm")]
                note = " (target: within 1.2x)" if key == "tensorx" else ""
                out.append(f"- {place}, {SYSTEMS[key].label}: 10x larger tables, step time "
                           f"x{grow:.2f}{note}" + (f" {'MET' if grow <= 1.2 else 'missed'}"
                                                    if key == "tensorx" else ""))
    return out


def apply_rate(rows: int = 1_000_000, dim: int = 64, touched: int = 4096, workers: int = 2,
               repeats: int = 20) -> dict[str, float]:
    """Rows per second a shard applies with SGD, on one core: one table of ``rows`` x ``dim``
    floats, ``workers`` pushes of ``touched`` distinct rows each per update (the server's
    averaging of the rows, the sparse step and the changed-row bookkeeping; no network).

    The pushes are drawn before the timing starts, more of them than the last-level cache
    holds (48 MiB of rows), and taken in turn: each update reads rows that have not been
    touched for a while, as rows just received would be, without a ``randperm`` of the
    whole table (8 MB written) between any two updates evicting everything first. The
    floor, a gather and a scatter of as many rows, is measured the same way."""
    import torch
    from torch import nn

    from tensorx._ps.state.shard import ShardLayout, ShardState
    from tensorx.graph_analyzer import GraphAnalyzer

    torch.set_num_threads(1)
    model = nn.Sequential(nn.Embedding(rows, dim, sparse=True))
    layout = ShardLayout.from_plan(GraphAnalyzer(model).plan(), 0)
    state = ShardState(layout, workers, lambda p: torch.optim.SGD(p, lr=0.01))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # initial values, as rank 0's parameters give a real shard
        state.params[0].normal_(generator=gen)
    name = layout.param_specs()[0].name
    pool = [(torch.randperm(rows, generator=gen)[:touched].sort().values,
             torch.randn(touched, dim, generator=gen))
            for _ in range(max(2 * workers, (48 << 20) // (touched * dim * 4)))]
    turn = iter(range(1 << 62))

    def draw() -> tuple[Any, Any]:
        return pool[next(turn) % len(pool)]

    times, floor = [], []
    for _ in range(repeats):
        for r in range(workers):
            state.put_rows(r, {name: draw()})
        t0 = time.perf_counter()
        state.apply(list(range(workers)))
        times.append(time.perf_counter() - t0)
        ids = torch.cat([draw()[0] for _ in range(workers)]).unique()
        floor.append(_move_rows(state.params[0].data, ids) * workers * touched / len(ids))
    state.close()
    per = statistics.median(times)
    return {"rows_per_update": workers * touched, "s_per_update": per,
            "rows_per_s": workers * touched / per,
            "move_rows_per_s": workers * touched / statistics.median(floor)}


def _move_rows(table: Any, ids: Any) -> float:
    """Seconds to read rows ``ids`` of ``table`` and write them back (one gather, one
    scatter, with the torch-ops update's primitives: what any row update costs in memory
    traffic, the arithmetic left out)."""
    from tensorx._ps.rows.tables import put_rows, take_rows

    t0 = time.perf_counter()
    put_rows(table, ids, take_rows(table, ids))
    return time.perf_counter() - t0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"of {', '.join(SYSTEMS)}")
    p.add_argument("--models", default=",".join(MODELS), help=f"of {', '.join(MODELS)}")
    p.add_argument("--large-systems", default=LARGE_SYSTEMS,
                   help="the systems run for dlrm-x10 (of --systems); 'all': every one")
    p.add_argument("--placements", default="same,netns", help="same,netns")
    p.add_argument("--blocks", type=int, default=4, help="alternating blocks per system")
    p.add_argument("--steps", type=int, default=20, help="steps per block")
    p.add_argument("--warmup", type=int, default=WARMUP_ROUNDS,
                   help="unmeasured steps per system first, one system after the other "
                        "(see benchmarks/baselines/pair.py: tensorx probes its choices "
                        "over its first steps; a worker's first look-ups fault its tables' "
                        "pages in)")
    p.add_argument("--out", type=Path, default=Path("bench-results"))
    return p.parse_args(argv)


def keys_for(model: str, keys: list[str], large: str) -> list[str]:
    """The systems measured for ``model``: all of ``keys``, but for the large model only
    those of ``large`` as well (the reference always)."""
    if model != "dlrm-x10" or large == "all":
        return keys
    allowed = set(large.split(",")) | {REFERENCE}
    return [k for k in keys if k in allowed]


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    args = parse_args(argv)
    keys = [k for k in args.systems.split(",") if k]
    rows: list[dict[str, Any]] = []
    for name in args.placements.split(","):
        with placement(name) as place:
            if place is None:
                continue
            for model in args.models.split(","):
                run = keys_for(model, keys, args.large_systems)
                progress(f"{place.name}, {MODELS[model]}: starting "
                         f"{', '.join(SYSTEMS[k].label for k in run)} (one PS + "
                         f"{sparse_train.WORKERS} workers each)")
                rows += measure(run, model, place, args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "sparse.json").write_text(json.dumps(rows, indent=1))
    touched = next((r["rows"] for r in rows if r.get("rows")), None)
    print()
    print(table(rows))
    if touched:
        print(f"\nRows a worker's step touches: {touched} of "
              f"{sum(sparse_train.table_rows(1)):,} (dlrm) / "
              f"{sum(sparse_train.table_rows(10)):,} (dlrm-x10).")
    rate = apply_rate()
    print(f"\nServer apply rate (SGD, one core, 1e6 x 64-float table, "
          f"{rate['rows_per_update']} pushed rows per update): {rate['rows_per_s']:.3g} rows/s "
          f"(target >= 1e7) {'MET' if rate['rows_per_s'] >= 1e7 else 'missed'}; reading and "
          f"writing back as many random rows of the table alone: "
          f"{rate['move_rows_per_s']:.3g} rows/s")
    print("\n".join(targets(rows)))
    plot(rows, args.out / "sparse.png")
    return rows


if __name__ == "__main__":
    main()
