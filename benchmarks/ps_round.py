"""One PS round with real model shapes: tensorx against TensorPipe RPC, gRPC and raw sockets.

A round: the worker pushes every gradient, the PS applies plain SGD, the worker gets every
parameter back. Models: ResNet-50 (161 tensors, 25.6M parameters), BERT-base (199 tensors,
109M) and many-small (2000 tensors of 256 floats). Every system runs as its own server and
client processes (``benchmarks/baselines/``); all of a model's systems are started, then
measured in alternating blocks (A B C .. then .. C B A) so that the machine's noise hits them
alike, each after unmeasured warm-up rounds of its own (past tensorx's probing of its
choices over its first rounds: ``benchmarks/baselines/pair.py``). Placements: same host
(loopback) and two network namespaces joined by a veth pair (skipped with a message where
namespaces cannot be made). "tensorx shm" is tensorx as
shipped (``share_memory=True``): on one host the worker maps the PS's arenas, in two
namespaces (two "hosts") it must not, and its row says which it did; every other tensorx
row measures the copy path (``--share-memory off``).

    python benchmarks/ps_round.py                       # everything, table + chart
    python benchmarks/ps_round.py --models resnet50 --placements same --blocks 6
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import netns
from benchmarks._charts import save
from benchmarks.baselines import common
from benchmarks.baselines.pair import (
    SAME_HOST,
    WARMUP_ROUNDS,
    Pair,
    Placement,
    System,
    warm_up,
)

SYSTEMS = {  # tensorx rows: ParameterServer and Worker defaults but for what the label says
    "tensorx-ucx": System("tensorx ucx (defaults, share_memory=False)", "tensorx",
                          ("--transport", "ucx")),
    "tensorx-ucx-noeh": System("tensorx ucx, no err. handling (defaults, share_memory=False)",
                               "tensorx", ("--transport", "ucx-shm")),
    "tensorx-tcp": System("tensorx tcp (defaults, share_memory=False)", "tensorx",
                          ("--transport", "tcp")),
    # transport="auto", the default: on one host, host memory over the same-host CMA lane
    "tensorx-auto": System("tensorx auto (defaults, share_memory=False)", "tensorx",
                           ("--transport", "auto")),
    # tensorx's defaults (transport="auto", share_memory=True): on one host the worker maps
    # the PS's arenas; between hosts it copies over the lane auto picks
    "tensorx-shm": System("tensorx shm (defaults)", "tensorx",
                          ("--transport", "auto", "--share-memory", "on")),
    "tensorpipe": System("TensorPipe RPC", "tensorpipe"),
    "grpc": System("gRPC", "grpc"),
    "raw": System("raw socket", "raw"),
}
EXPERIMENTS = {  # what a different design would give (kept as evidence, not run by default)
    "x-raw-pipelined": System("EXP raw socket, pipelined", "raw", ("--variant", "pipelined")),
    # the PS applying and answering in one piece (before updates were sent part by part)
    "x-tcp-one-part": System("EXP tensorx tcp, update in one part", "tensorx",
                             ("--transport", "tcp", "--variant", "one-part")),
    "x-ucx-one-part": System("EXP tensorx ucx, update in one part", "tensorx",
                             ("--transport", "ucx", "--variant", "one-part")),
    # the sync round with its choice forced (the default measures both and keeps the faster)
    "x-auto-early": System("EXP tensorx auto, parts applied as they land (pipeline=True)",
                           "tensorx", ("--transport", "auto", "--variant", "early")),
    "x-auto-no-early": System("EXP tensorx auto, once all have landed (pipeline=False)",
                              "tensorx", ("--transport", "auto", "--variant", "no-early")),
    "x-tcp-early": System("EXP tensorx tcp, parts applied as they land (pipeline=True)",
                          "tensorx", ("--transport", "tcp", "--variant", "early")),
    "x-tcp-no-early": System("EXP tensorx tcp, once all have landed (pipeline=False)",
                             "tensorx", ("--transport", "tcp", "--variant", "no-early")),
    # the update as it was by default before flat=None: the optimizer steps each tensor
    "x-shm-per-tensor": System("EXP tensorx shm, flat=False (per-tensor update)", "tensorx",
                               ("--transport", "tcp", "--share-memory", "on",
                                "--variant", "per-tensor")),
    "x-tcp-per-tensor": System("EXP tensorx tcp, flat=False (per-tensor update)", "tensorx",
                               ("--transport", "tcp", "--variant", "per-tensor")),
    "x-tcp-flat-params": System("EXP tensorx tcp, flat=True (flat optimizer parameters)",
                                "tensorx", ("--transport", "tcp", "--variant", "flat-params")),
}
ALL = {**SYSTEMS, **EXPERIMENTS}
REFERENCES = ("tensorpipe", "grpc")
MODEL_LABELS = {"resnet50": "ResNet-50", "bert-base": "BERT-base", "many-small": "many-small"}
# Bytes alive per system and model byte (worker params+grads, PS params+slot+acc, buffers).
LIVE_FACTOR = 7


def progress(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# -- measuring -------------------------------------------------------------------------------
def start_all(keys: list[str], model: str, placement: Placement, logdir: Path
              ) -> dict[str, Pair]:
    """Start every system's pair in parallel (imports dominate); close them all on failure."""
    pairs = {k: Pair(ALL[k], model, placement, logdir) for k in keys}
    with ThreadPoolExecutor(len(pairs)) as pool:
        futures = {k: pool.submit(p.start) for k, p in pairs.items()}
    failed = {k: f.exception() for k, f in futures.items() if f.exception() is not None}
    for k, exc in failed.items():
        progress(f"  {ALL[k].label} failed to start, left out: {exc}")
        pairs.pop(k).close()
    return pairs


MIN_ROUNDS = 2  # per block: a median of 3 rounds (BERT-base at 0.4 s, block_s 0.6) swung 40%


def rounds_per_block(pair: Pair, block_s: float) -> int:
    probe = pair.run(1)[0]
    return max(MIN_ROUNDS, min(50, round(block_s / max(probe, 1e-6))))


def measure(pairs: dict[str, Pair], blocks: int, block_s: float, warmup: int = WARMUP_ROUNDS,
            rounds: int | None = None) -> dict[str, list[float]]:
    if warmup:
        warm_up(pairs, warmup)
    counts = {k: rounds or rounds_per_block(p, block_s) for k, p in pairs.items()}
    times: dict[str, list[float]] = {k: [] for k in pairs}
    order = list(pairs)
    for b in range(blocks):
        for k in order if b % 2 == 0 else order[::-1]:
            times[k] += pairs[k].run(counts[k])
    return times


def groups(keys: list[str], model: str, budget: int) -> list[list[str]]:
    """Systems to run side by side: all of them if memory allows, else the references plus
    as many others as fit (so every ratio is still measured in the same run)."""
    per = LIVE_FACTOR * common.model_bytes(model)
    if per * len(keys) <= budget:
        return [keys]
    refs = [k for k in keys if k in REFERENCES]
    others = [k for k in keys if k not in REFERENCES]
    room = max(1, budget // per - len(refs))
    return [refs + others[i:i + room] for i in range(0, len(others), room)] or [refs]


def run_model(keys: list[str], model: str, placement: Placement,
              args: argparse.Namespace) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for group in groups(keys, model, int(args.memory_gb * 2**30)):
        progress(f"{placement.name}, {MODEL_LABELS[model]}: starting "
                 f"{', '.join(ALL[k].label for k in group)}")
        pairs = start_all(group, model, placement, args.logdir)
        try:
            check_mapping(pairs, placement)
            times = measure(pairs, args.blocks, args.block_s, args.warmup, args.rounds)
        finally:
            for p in pairs.values():
                p.close()
        rows += summarise(times, pairs, model, placement, seen={r["key"] for r in rows})
        progress("  " + ", ".join(f"{label(k, pairs[k].info)} "
                                  f"{statistics.median(t) * 1e3:.1f} ms"
                                  for k, t in times.items()))
    return rows


def summarise(times: dict[str, list[float]], pairs: dict[str, Pair], model: str,
              placement: Placement, seen: set[str]) -> list[dict[str, Any]]:
    med = {k: statistics.median(t) for k, t in times.items()}
    nbytes = 2 * common.model_bytes(model)  # gradients out, parameters back
    rows = []
    for k, m in med.items():
        if k in seen:
            continue
        rows.append({"placement": placement.name, "model": model, "key": k,
                     "system": label(k, pairs[k].info), "median_s": m,
                     "rounds": len(times[k]), "mapped": pairs[k].info.get("mapped", False),
                     "gbps": nbytes / m / 1e9, "lanes": pairs[k].info.get("lanes", []),
                     "vs_tensorpipe": m / med["tensorpipe"] if "tensorpipe" in med else None,
                     "vs_grpc": m / med["grpc"] if "grpc" in med else None})
    return rows


def label(key: str, info: dict[str, Any]) -> str:
    if "--share-memory" not in ALL[key].options:
        return ALL[key].label
    return ALL[key].label + (" (mapped)" if info.get("mapped") else " (not mapped: copies)")


def check_mapping(pairs: dict[str, Pair], placement: Placement) -> None:
    """Two namespaces stand for two hosts: a worker that mapped there is a bug."""
    for k, p in pairs.items():
        if p.info.get("mapped") and placement is not SAME_HOST:
            raise RuntimeError(f"{ALL[k].label} mapped the PS's memory in {placement.name}")


# -- the guards' costs, next to a round ------------------------------------------------------
def guard_costs(model: str, rows: list[dict[str, Any]]) -> list[str]:
    """What two guards cost per round on this model's shapes, timed here in this process,
    as a share of the tensorx rounds measured above in the same run: the shard's non-finite
    check of a pushed gradient, and a mapped worker's check for edits in place before it
    reads a pull (same host: its copy-on-write pages, found in pagemap).

    The shard checks the gradient as it folds it (every mode: the ranks' gradients summed
    into the shard's own memory, here one rank's copied; see tensorx._ps.update.fold), in
    one pass, so the check is timed as the difference: the fold and check as the shard does
    them (``checked``: the fold kernel where it is built, else torch ops in pieces) less the
    fold alone (torch ops). With the kernel the difference is about nothing, or below."""
    import torch

    from tensorx._ps.service.nonfinite import checked
    from tensorx._ps.state.shard import ShardLayout, ShardState
    from tensorx._ps.update import fold as folding
    from tensorx._ps.update.foldkernel import streamed
    from tensorx.graph_analyzer import GraphAnalyzer
    from tensorx.memregion import MemoryRegion

    plan = GraphAnalyzer(common.ShapeModel(common.MODELS[model]())).plan()
    state = ShardState(ShardLayout.from_plan(plan, 0), 1,
                       lambda p: torch.optim.SGD(p, lr=common.LR), shared=True)
    try:
        fold = _median_s(lambda: state.fold([0], check=False))
        fold_check = _median_s(lambda: checked(state, [0]))
        check = fold_check - fold
        how = "torch ops in pieces"
        if folding.kernel():
            how = "the fold kernel, one pass" + (
                ", written past the caches" if streamed(state.layout.nbytes) else "")
        edits = None
        if state.params_region.shared_name is not None:
            mapped = MemoryRegion.attach(state.params_region.shared_name,
                                         state.params_region.nbytes, private=True)
            mapped.view(torch.uint8).sum()  # the model has read every page
            edits = _median_s(mapped.drop_own_writes)
            mapped.close()
    finally:
        state.close()
    out = []
    for r in rows:
        if r["model"] == model and r["key"].startswith("tensorx"):
            line = (f"- {MODEL_LABELS[model]}, {r['placement']}, {r['system']} "
                    f"({r['median_s'] * 1e3:.1f} ms/round): fold + non-finite check "
                    f"{fold_check * 1e3:.2f} ms ({how}), fold alone {fold * 1e3:.2f} ms "
                    f"(torch ops), so the check adds "
                    + (f"{check * 1e3:.2f} ms = {check / r['median_s']:.1%} of a round"
                       if check > 0 else "nothing (the checked fold is the faster by "
                       f"{-check * 1e3:.2f} ms)"))
            if r["mapped"] and edits is not None:
                line += (f"; edit-in-place check {edits * 1e3:.2f} ms = "
                         f"{edits / r['median_s']:.1%}")
            out.append(line)
    return out


FLOOR_BYTES = 32 << 20  # smaller models' rounds are bound by per-tensor work, not memory


def memory_floor(model: str, rows: list[dict[str, Any]]) -> list[str]:
    """The least a same-host round can take on this host's memory, timed here with one
    torch thread: what no lane can skip (the check, the SGD update, and on the copy path a
    copy of the gradient in and of the parameters out), one after the other, against the
    TensorPipe round measured above. One after the other because that is what two cores
    give here when memory bandwidth is the limit: two copies at once are timed too. Plain
    torch, no tensorx: the shard's fold (its own copy of the gradient, see
    :func:`guard_costs`) is tensorx's choice, not part of the floor."""
    import threading

    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        n = common.model_bytes(model) // 4
        a, b, c, d = (torch.ones(n) for _ in range(4))
        copy = _median_s(lambda: b.copy_(a), 5)
        check = _median_s(lambda: a.sum(), 5)
        update = _median_s(lambda: a.add_(c, alpha=-1e-9), 5)

        def two() -> None:
            other = threading.Thread(target=lambda: d.copy_(c))
            other.start()
            b.copy_(a)
            other.join()
        both = _median_s(two, 5)
    finally:
        torch.set_num_threads(threads)
    tp = next((r["median_s"] for r in rows if r["model"] == model and
               r["placement"] == SAME_HOST.name and r["key"] == "tensorpipe"), None)
    mapped, copied = check + update, 2 * copy + check + update

    def of_tp(x: float) -> str:
        return f" = {x / tp:.3f}x TensorPipe's round" if tp else ""
    return [f"- {MODEL_LABELS[model]} ({n * 4 / 1e6:.0f} MB): copy {copy * 1e3:.2f} ms, "
            f"two copies at once {both * 1e3:.2f} ms ({2 * copy / both:.2f}x the speed of "
            f"one after the other), non-finite check {check * 1e3:.2f} ms, SGD update "
            f"{update * 1e3:.2f} ms; floor mapped (check + update) {mapped * 1e3:.2f} ms"
            f"{of_tp(mapped)}; floor copy path (+ two copies) {copied * 1e3:.2f} ms"
            f"{of_tp(copied)}"]


def _median_s(fn: Any, n: int = 7) -> float:
    fn()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# -- placements ------------------------------------------------------------------------------
@contextlib.contextmanager
def placement(name: str) -> Iterator[Placement | None]:
    if name == "same":
        yield SAME_HOST
        return
    try:
        with netns.two_hosts() as p:
            yield p
    except netns.Unavailable as exc:
        progress(f"two namespaces: skipped ({exc})")
        yield None


# -- output ----------------------------------------------------------------------------------
def ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}x"


def table(rows: list[dict[str, Any]]) -> str:
    lines = []
    for place in dict.fromkeys(r["placement"] for r in rows):
        lines += [f"**{place}**", "",
                  "| model | system | s / round (median) | GB/s | time vs TensorPipe |"
                  " time vs gRPC | rounds |", "|---|---|---|---|---|---|---|"]
        for r in (r for r in rows if r["placement"] == place):
            lines.append(f"| {MODEL_LABELS[r['model']]} | {r['system']} | "
                         f"{r['median_s']:.4f} | {r['gbps']:.2f} | "
                         f"{ratio(r['vs_tensorpipe'])} | {ratio(r['vs_grpc'])} | "
                         f"{r['rounds']} |")
        lines.append("")
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    places = list(dict.fromkeys(r["placement"] for r in rows))
    fig, axes = plt.subplots(1, len(places), figsize=(6.5 * len(places), 4.2), squeeze=False)
    for ax, place in zip(axes[0], places, strict=True):
        _bars(ax, [r for r in rows if r["placement"] == place])
        ax.set_title(f"one PS round, {place}")
    axes[0][0].set_ylabel("seconds per round (median, log)")
    progress(save(fig, path))


def _bars(ax: Any, rows: list[dict[str, Any]]) -> None:
    models = list(dict.fromkeys(r["model"] for r in rows))
    keys = [k for k in ALL if any(r["key"] == k for r in rows)]
    width = 0.8 / max(1, len(keys))
    for i, k in enumerate(keys):
        ys = [next((r["median_s"] for r in rows if r["model"] == m and r["key"] == k), 0)
              for m in models]
        ax.bar([j + i * width for j in range(len(models))], ys, width, label=ALL[k].label)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(models))])
    ax.set_xticklabels([MODEL_LABELS[m] for m in models])
    ax.set_yscale("log")
    ax.legend(fontsize=7)


# The project's goals for one PS round: (placement, model, system key, column, limit). They
# judge the defaults ("tensorx-shm": as shipped) in both placements, and the copy path on one
# host under transport="auto" (the same-host lane).
TARGETS = [
    ("same host", "resnet50", "tensorx-shm", "vs_tensorpipe", 0.15),
    ("same host", "many-small", "tensorx-shm", "vs_tensorpipe", 0.03),
    ("two namespaces (veth)", "resnet50", "tensorx-shm", "vs_tensorpipe", 0.7),
    ("two namespaces (veth)", "bert-base", "tensorx-shm", "vs_tensorpipe", 0.7),
    ("two namespaces (veth)", "many-small", "tensorx-shm", "vs_tensorpipe", 0.03),
    ("two namespaces (veth)", "resnet50", "tensorx-shm", "vs_grpc", 1 / 12),
    ("same host", "resnet50", "tensorx-auto", "vs_tensorpipe", 0.5),
    ("same host", "bert-base", "tensorx-auto", "vs_tensorpipe", 0.5),
]


def targets(rows: list[dict[str, Any]]) -> list[str]:
    """Each target of :data:`TARGETS` against the row it names, where that row was run."""
    out = []
    for place, model, key, col, limit in TARGETS:
        for r in rows:
            if (r["placement"], r["model"], r["key"]) == (place, model, key) \
                    and r[col] is not None:
                ok = "MET" if r[col] <= limit else "missed"
                out.append(f"- PS round, {place}, {MODEL_LABELS[model]}, {r['system']}: "
                           f"{col.replace('_', ' ')} {r[col]:.3f}x (target <= {limit:.3g}x) "
                           f"{ok}")
    return out


# -- main ------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(MODEL_LABELS))
    p.add_argument("--systems", default=",".join(SYSTEMS),
                   help=f"of {', '.join(ALL)}")
    p.add_argument("--placements", default="same,netns", help="same,netns")
    p.add_argument("--blocks", type=int, default=3, help="alternating blocks per system")
    p.add_argument("--block-s", type=float, default=0.6, help="target seconds per block")
    p.add_argument("--rounds", type=int, default=None,
                   help="rounds per block (default: as many as fill --block-s)")
    p.add_argument("--warmup", type=int, default=WARMUP_ROUNDS,
                   help=f"unmeasured rounds first (default {WARMUP_ROUNDS}); "
                   "--warmup 0 --blocks 1 --rounds 10: a short run's first 10 rounds")
    p.add_argument("--memory-gb", type=float, default=12.0,
                   help="run fewer systems side by side when a model would need more")
    p.add_argument("--out", type=Path, default=Path("bench-results"))
    p.add_argument("--plot", type=Path, default=None, help="PNG (default OUT/ps_round.png)")
    args = p.parse_args(argv)
    args.logdir = args.out / "logs"
    return args


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    args = parse_args(argv)
    keys = [k for k in args.systems.split(",") if k]
    rows: list[dict[str, Any]] = []
    for name in args.placements.split(","):
        with placement(name) as place:
            if place is None:
                continue
            for model in args.models.split(","):
                rows += run_model(keys, model, place, args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "ps_round.json").write_text(json.dumps(rows, indent=1))
    print()
    print(table(rows))
    print("\n".join(targets(rows)))
    print("\nGuards, per round (timed in this process):")
    for model in dict.fromkeys(r["model"] for r in rows):
        print("\n".join(guard_costs(model, rows)))
    big = [m for m in dict.fromkeys(r["model"] for r in rows if r["placement"] ==
                                    SAME_HOST.name) if common.model_bytes(m) >= FLOOR_BYTES]
    if big:
        print("\nMemory floors, same host (timed in this process, one thread):")
        for model in big:
            print("\n".join(memory_floor(model, rows)))
    plot(rows, args.plot or args.out / "ps_round.png")
    return rows


if __name__ == "__main__":
    main()
