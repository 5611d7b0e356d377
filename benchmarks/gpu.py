"""GPU benchmarks: one-sided GPU->GPU transfers and a PS round on the GPU, each against a
baseline measured in the same run.

1. **transfer**: 256 MiB one-sided write and read between two processes (two ``tx.Node``\\ s;
   the owner exports a ``cuda:0`` region, the client writes/reads it from its own ``cuda:0``
   region), per path: the default (the same-host CUDA IPC lane where it exists),
   ``transport="ucx"`` and ``transport="tcp"`` (GPU memory staged through the host), the last
   two with ``TENSORX_CUDA_IPC=0`` (and ``ucx-noeh``: UCX without peer error handling,
   ``TENSORX_UCX_ERROR_HANDLING=0``). Baseline: a plain torch device-to-device copy of the same
   size, timed in the same client process, interleaved with the transfers. Medians after
   warm-up; GB/s is bytes moved / seconds (one direction); the lane that really ran comes
   from ``ep.info``. Goal: >= 0.8x the torch copy.
2. **ps**: one PS round (worker pushes every gradient, PS applies plain SGD, worker gets
   every parameter back) with ResNet-50 and BERT-base parameter shapes, model and server on
   the GPU, sync mode, 1 and 2 workers: ``tx.ParameterServer(..., device="cuda:0")`` with
   the defaults, against ``torch.distributed.rpc`` with TensorPipe and ``device_maps`` (the
   PyTorch batch-update parameter-server pattern). Both systems of a (model, workers) pair
   run side by side and are measured in alternating blocks. Goal: <= 0.3x TensorPipe's time.

Every part has timeouts and a failed or skipped row says why; progress goes to stderr, the
table to stdout, ``--json PATH`` writes every row; processes' logs go to ``--logdir``.

    python benchmarks/gpu.py                               # everything, ~3-4 min on one H200
    python benchmarks/gpu.py --parts transfer --reps 30
    python benchmarks/gpu.py --self-test                   # host memory, tiny: checks the harness
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.baselines.pair import (
    PYTHON,
    ROOT,
    SAME_HOST,
    BenchError,
    Pair,
    System,
    _Proc,
)

TRANSFER_GOAL = 0.8  # tensorx GB/s / torch copy GB/s, at least
PS_GOAL = 0.05  # tensorx ms per round / TensorPipe's, at most
FLOOR_GOAL = 2.0  # tensorx ms per round / the floor's (no transport), at most
MIN_ROW_S = 10.0  # below this much budget left, rows are skipped (and say so)
MODEL_LABELS = {"resnet50": "ResNet-50", "bert-base": "BERT-base", "tiny": "tiny",
                "many-small": "many-small"}


@dataclass(frozen=True)
class TransferPath:
    label: str
    transport: str
    env: tuple[tuple[str, str], ...] = ()


PATHS = {
    "ipc": TransferPath("default (CUDA IPC on)", "auto"),
    "ucx": TransferPath('transport="ucx", CUDA IPC off', "ucx", (("TENSORX_CUDA_IPC", "0"),)),
    # not a default: UCX without peer error handling (its cuda_ipc/cuda_copy lanes on one host)
    "ucx-noeh": TransferPath('transport="ucx", error_handling off, CUDA IPC off', "ucx",
                             (("TENSORX_CUDA_IPC", "0"), ("TENSORX_UCX_ERROR_HANDLING", "0"))),
    "tcp": TransferPath('transport="tcp", CUDA IPC off', "tcp", (("TENSORX_CUDA_IPC", "0"),)),
}
SYSTEMS = {
    "tensorx": System("tensorx (defaults)", "gpu-tensorx"),
    "tensorx-flat": System("tensorx flat=True", "gpu-tensorx", ("--variant", "flat")),
    "tensorx-per-tensor": System("tensorx flat=False", "gpu-tensorx",
                                 ("--variant", "per-tensor")),
    "tensorpipe": System("TensorPipe RPC", "gpu-tensorpipe"),
}


def progress(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class Budget:
    def __init__(self, seconds: float) -> None:
        self.deadline = time.monotonic() + seconds

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def timeout(self, cap: float) -> float:
        """A part's timeout: its cap, cut to what is left (but never below MIN_ROW_S)."""
        return max(MIN_ROW_S, min(cap, self.left()))


def short(exc: BaseException) -> str:
    """One line for the table: the error's first line and the last line of the log."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    if not lines:
        return type(exc).__name__
    return lines[0] if len(lines) == 1 else f"{lines[0]} ... {lines[-1]}"


def gbps(nbytes: int, seconds: float | None) -> float | None:
    return nbytes / seconds / 1e9 if seconds else None


# -- part 1: transfers -------------------------------------------------------------------------
def _gpu_proc(role: str, path: TransferPath, args: argparse.Namespace, extra: list[str]
              ) -> _Proc:
    cmd = [PYTHON, "-m", "benchmarks.baselines.gpu_copy", role, "--size", str(args.size),
           "--device", args.device, "--transport", path.transport, *extra]
    key = next(k for k, p in PATHS.items() if p == path)
    return _Proc(cmd, args.logdir / f"transfer-{key}-{role}.log", dict(path.env))


def _finish(proc: _Proc | None) -> None:
    if proc is None:
        return
    if proc.popen.poll() is None:
        with contextlib.suppress(OSError):
            proc.send("quit")
        with contextlib.suppress(Exception):
            proc.popen.wait(10)
    proc.stop(timeout=10)


def transfer_row(key: str, args: argparse.Namespace, budget: Budget) -> dict[str, Any]:
    path = PATHS[key]
    row: dict[str, Any] = {"part": "transfer", "path": key, "label": path.label,
                           "size": args.size, "device": args.device, "status": "ok"}
    if budget.left() < MIN_ROW_S:
        row["status"] = "skipped: time budget spent"
        return row
    timeout = budget.timeout(args.row_timeout)
    owner = client = None
    try:
        owner = _gpu_proc("owner", path, args, [])
        ready = json.loads(owner.expect("READY", timeout))
        client = _gpu_proc("client", path, args, [
            "--address", ready["address"], "--desc", ready["desc"], "--reps", str(args.reps),
            "--warmup", str(args.warmup), "--max-s", str(timeout / 2)])
        res = json.loads(client.expect("RESULT", timeout))
    except (BenchError, OSError, ValueError) as exc:
        row["status"] = "failed: " + short(exc)
        progress(f"  {path.label}: {row['status']}")
        return row
    finally:
        _finish(client)
        _finish(owner)
    info = res["info"]
    row.update(transport=info.get("transport"), lanes=info.get("lanes", []),
               gpu=info.get("gpu"), why=info.get("why"), verified=res["verified"],
               reps=res["reps"], copy_s=res["copy"], write_s=res["write"], read_s=res["read"])
    row["copy_gbps"] = gbps(args.size, res["copy"])
    for k in ("copy_small", "write_small", "read_small", "raw_write", "raw_read"):
        row[f"{k}_s"] = res.get(k)
    row["small"] = res.get("small")
    row["raw_write_gbps"] = gbps(args.size, res.get("raw_write"))
    row["raw_read_gbps"] = gbps(args.size, res.get("raw_read"))
    if res.get("error"):
        row["status"] = "failed: " + res["error"]
        progress(f"  {path.label}: {row['status']} (torch copy {_f(row['copy_gbps'], '.1f')} "
                 f"GB/s)")
        return row
    row["write_gbps"] = gbps(args.size, res["write"])
    row["read_gbps"] = gbps(args.size, res["read"])
    row["write_vs_copy"] = row["write_gbps"] / row["copy_gbps"]
    row["read_vs_copy"] = row["read_gbps"] / row["copy_gbps"]
    progress(f"  {path.label}: ep.info transport={info.get('transport')!r} "
             f"lanes={info.get('lanes')} gpu={info.get('gpu')!r}; write "
             f"{row['write_gbps']:.1f} GB/s ({row['write_vs_copy']:.2f}x copy), read "
             f"{row['read_gbps']:.1f} GB/s ({row['read_vs_copy']:.2f}x), torch copy "
             f"{row['copy_gbps']:.1f} GB/s, {row['reps']} reps")
    return row


def run_transfers(args: argparse.Namespace, budget: Budget) -> list[dict[str, Any]]:
    progress(f"transfer: {args.size} B on {args.device}, paths {', '.join(args.paths)}")
    return [transfer_row(k, args, budget) for k in args.paths]


# -- part 2: PS rounds -------------------------------------------------------------------------
def _start(pairs: dict[str, Pair]) -> dict[str, str]:
    """Start every pair in parallel; returns {key: why} for those that failed (killed)."""
    with ThreadPoolExecutor(len(pairs)) as pool:
        futures = {k: pool.submit(p.start) for k, p in pairs.items()}
    failed = {}
    for k, f in futures.items():
        if f.exception() is not None:
            failed[k] = "failed to start: " + short(f.exception())  # type: ignore[arg-type]
            pairs.pop(k).kill()
    return failed


def _measure(pairs: dict[str, Pair], failed: dict[str, str], args: argparse.Namespace,
             budget: Budget, timeout: float) -> dict[str, list[float]]:
    """Alternating blocks (A B .. then .. B A); a pair that fails is killed and left out."""
    times: dict[str, list[float]] = {k: [] for k in pairs}
    counts: dict[str, int] = {}

    def run(k: str, n: int) -> list[float] | None:
        try:
            return pairs[k].run(n, timeout)
        except (BenchError, OSError, ValueError) as exc:
            failed[k] = "failed while running: " + short(exc)
            pairs.pop(k).kill()
            return None

    for k in list(pairs):
        probe = run(k, 1)
        if probe is not None:
            counts[k] = max(1, min(args.max_rounds, round(args.block_s / max(probe[0], 1e-6))))
    for b in range(args.blocks):
        if b and budget.left() < MIN_ROW_S:
            progress(f"  time budget: stopping after {b} of {args.blocks} blocks")
            break
        order = [k for k in counts if k in pairs]
        for k in order if b % 2 == 0 else order[::-1]:
            got = run(k, counts[k])
            if got is not None:
                times[k] += got
    return {k: t for k, t in times.items() if k in pairs and t}


def floor_row(model: str, workers: int, args: argparse.Namespace, budget: Budget
              ) -> dict[str, Any]:
    """The round's floor, measured alone before the systems start: the device copies of
    the push and the pull and the SGD step, in one process (benchmarks/baselines/
    gpu_floor.py)."""
    row: dict[str, Any] = {"part": "ps", "model": model, "workers": workers,
                           "device": args.device, "key": "floor", "status": "ok",
                           "system": "floor: push + pull copies and SGD step, no transport"}
    cmd = [PYTHON, "-m", "benchmarks.baselines.gpu_floor", "--model", model, "--workers",
           str(workers), "--device", args.device]
    try:
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                              timeout=budget.timeout(60.0), check=True)
        line = next(ln for ln in done.stdout.splitlines() if ln.startswith("RESULT "))
        res = json.loads(line.split(" ", 1)[1])
    except (subprocess.SubprocessError, OSError, StopIteration, ValueError) as exc:
        row["status"] = "failed: " + short(exc)
        return row
    row.update(median_s=res["round"], parts={k: res[k] for k in ("push", "step", "pull")})
    return row


def ps_group(model: str, workers: int, args: argparse.Namespace, budget: Budget
             ) -> list[dict[str, Any]]:
    base = {"part": "ps", "model": model, "workers": workers, "device": args.device}
    maps = " (device_maps)" if args.device != "cpu" else ""
    rows = [{**base, "key": k, "status": "ok",
             "system": SYSTEMS[k].label + (maps if k == "tensorpipe" else "")}
            for k in args.systems]
    if budget.left() < MIN_ROW_S:
        for r in rows:
            r["status"] = "skipped: time budget spent"
        return rows
    timeout = budget.timeout(args.ps_timeout)
    progress(f"ps: {MODEL_LABELS.get(model, model)}, {workers} worker(s): starting "
             f"{', '.join(SYSTEMS[k].label for k in args.systems)}")
    opts = ("--device", args.device, "--workers", str(workers), "--threads", str(args.threads))
    floor = floor_row(model, workers, args, budget) if args.floor else None  # GPU idle
    pairs = {k: Pair(System(f"{SYSTEMS[k].label} {workers}w",
                            SYSTEMS[k].system, (*SYSTEMS[k].options, *opts)),
                     model, SAME_HOST, args.logdir, clients=workers, start_timeout=timeout)
             for k in args.systems}
    failed: dict[str, str] = {}
    try:
        failed.update(_start(pairs))
        infos = {k: p.info for k, p in pairs.items()}
        times = _measure(pairs, failed, args, budget, timeout) if pairs else {}
    finally:
        for p in pairs.values():
            p.close()
    med = {k: statistics.median(t) for k, t in times.items()}
    ref = med.get("tensorpipe")
    for r in rows:
        k = r["key"]
        if k in failed or k not in med:
            r["status"] = failed.get(k, "failed: no rounds measured")
            continue
        info = infos.get(k, {})
        r.update(median_s=med[k], rounds=len(times[k]), transport=info.get("transport"),
                 lanes=info.get("lanes", []), gpu=info.get("gpu"),
                 mapped=info.get("mapped", False),
                 vs_tensorpipe=med[k] / ref if ref else None)
        if floor is not None and floor.get("median_s"):
            r["vs_floor"] = med[k] / floor["median_s"]
    if floor is not None:
        if ref and floor.get("median_s"):
            floor["vs_tensorpipe"] = floor["median_s"] / ref
        rows.append(floor)
    progress("  " + "; ".join(
        f"{r['system']}: " + (f"{r['median_s'] * 1e3:.2f} ms (lanes {r.get('lanes')}, "
                              f"gpu {r.get('gpu')!r})" if "median_s" in r else r["status"])
        for r in rows))
    return rows


def run_ps(args: argparse.Namespace, budget: Budget) -> list[dict[str, Any]]:
    return [r for model in args.models for w in args.workers
            for r in ps_group(model, w, args, budget)]


# -- output ------------------------------------------------------------------------------------
def _cut(text: str, n: int = 200) -> str:
    return text if len(text) <= n else text[:n - 3] + "..."


def _f(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def _us(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e6:.0f}"


def transfer_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| path | lanes (ep.info) | write GB/s | read GB/s | torch copy GB/s |"
             " write / copy | read / copy | IPC copy alone GB/s, write / read |"
             " 4 KiB write / read / torch copy, us | reps | status |", "|---" * 11 + "|"]
    for r in rows:
        lanes = f"{r.get('transport', '-')}: {', '.join(r.get('lanes') or []) or '-'}"
        if r.get("gpu"):
            lanes += f" (gpu: {r['gpu']})"
        raw = (f"{_f(r.get('raw_write_gbps'), '.1f')} / {_f(r.get('raw_read_gbps'), '.1f')}"
               if r.get("raw_write_gbps") else "-")
        small = (f"{_us(r.get('write_small_s'))} / {_us(r.get('read_small_s'))} / "
                 f"{_us(r.get('copy_small_s'))}")
        lines.append(f"| {r['label']} | {lanes} | {_f(r.get('write_gbps'), '.1f')} | "
                     f"{_f(r.get('read_gbps'), '.1f')} | {_f(r.get('copy_gbps'), '.1f')} | "
                     f"{_f(r.get('write_vs_copy'), '.3f')} | {_f(r.get('read_vs_copy'), '.3f')}"
                     f" | {raw} | {small} | {r.get('reps', '-')} | {_cut(r['status'])} |")
    return "\n".join(lines)


def ps_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| model | workers | system | lanes | ms / round (median) | vs TensorPipe |"
             " vs floor | rounds | status |", "|---" * 9 + "|"]
    for r in rows:
        lanes = ", ".join((["mapped"] if r.get("mapped") else []) + (r.get("lanes") or []))
        lanes = lanes or "-"
        if r.get("gpu"):
            lanes += f" (gpu: {r['gpu']})"
        ms = r["median_s"] * 1e3 if "median_s" in r else None
        lines.append(f"| {MODEL_LABELS.get(r['model'], r['model'])} | {r['workers']} | "
                     f"{r['system']} | {lanes} | {_f(ms, '.3f')} | "
                     f"{_f(r.get('vs_tensorpipe'), '.3f')} | {_f(r.get('vs_floor'), '.2f')} | "
                     f"{r.get('rounds', '-')} | {_cut(r['status'])} |")
    return "\n".join(lines)


def goals(rows: list[dict[str, Any]]) -> list[str]:
    out = []
    for r in rows:
        if r["part"] == "transfer" and "write_vs_copy" in r:
            for op in ("write", "read"):
                x = r[f"{op}_vs_copy"]
                out.append(f"- transfer, {r['label']}, {op}: {x:.3f}x the torch copy (goal >= "
                           f"{TRANSFER_GOAL}x) {'MET' if x >= TRANSFER_GOAL else 'missed'}")
        if r["part"] == "ps" and r["key"].startswith("tensorx") and r.get("vs_tensorpipe"):
            x, f = r["vs_tensorpipe"], r.get("vs_floor")
            floor = "" if f is None else (f"; {f:.2f}x the floor measured in the same run "
                                          f"(goal <= {FLOOR_GOAL}x) "
                                          f"{'MET' if f <= FLOOR_GOAL else 'missed'}")
            out.append(f"- PS round, {MODEL_LABELS.get(r['model'], r['model'])}, "
                       f"{r['workers']} worker(s), {r['system']}: {x:.3f}x TensorPipe's time "
                       f"(goal <= {PS_GOAL}x) {'MET' if x <= PS_GOAL else 'missed'}{floor}")
    return out


def machine(device: str) -> str:
    import platform

    import torch

    try:
        gpu = torch.cuda.get_device_name(device) if device.startswith("cuda") else "no GPU used"
    except Exception as exc:  # no CUDA here: say so, the rows already say what failed
        gpu = f"no GPU ({short(exc)})"
    return (f"{gpu}; {platform.node()}, Python {platform.python_version()}, torch "
            f"{torch.__version__}; run {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")


# -- main --------------------------------------------------------------------------------------
def _size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


def _list(text: str, choices: Any = None) -> list[str]:
    items = [x for x in text.split(",") if x]
    bad = [x for x in items if choices is not None and x not in choices]
    if bad:
        raise argparse.ArgumentTypeError(f"{bad} not among {sorted(choices)}")
    return items


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(__doc__.splitlines()[-3:]))
    p.add_argument("--parts", type=lambda s: _list(s, ("transfer", "ps")),
                   default=["transfer", "ps"], help="transfer,ps")
    p.add_argument("--device", default=None, help="cuda:0 (default), or cpu: host memory")
    p.add_argument("--self-test", action="store_true",
                   help="--device cpu, tiny sizes and model, few reps: checks the harness "
                        "end to end (the figures mean nothing)")
    p.add_argument("--size", type=_size, default=None, help="transfer bytes (default 256M)")
    p.add_argument("--paths", type=lambda s: _list(s, PATHS), default=list(PATHS),
                   help=f"transfer paths, of {', '.join(PATHS)}")
    p.add_argument("--reps", type=int, default=None, help="timed transfers (default 20)")
    p.add_argument("--warmup", type=int, default=None, help="untimed first transfers (3)")
    p.add_argument("--models", type=lambda s: _list(s, MODEL_LABELS), default=None,
                   help="resnet50,bert-base (default); also many-small, tiny")
    p.add_argument("--workers", type=lambda s: [int(x) for x in _list(s)], default=[1, 2],
                   help="worker counts, e.g. 1,2")
    p.add_argument("--systems", type=lambda s: _list(s, SYSTEMS),
                   default=["tensorx", "tensorpipe"], help=f"of {', '.join(SYSTEMS)}")
    p.add_argument("--blocks", type=int, default=None, help="alternating blocks (default 3)")
    p.add_argument("--block-s", type=float, default=None, help="seconds per block (1.0)")
    p.add_argument("--max-rounds", type=int, default=200, help="rounds per block, at most")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads per process")
    p.add_argument("--no-floor", dest="floor", action="store_false",
                   help="skip the PS round's floor (device copies and step, no transport)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="whole-run budget: rows past it are skipped, each part's timeout "
                        "cut to it (default 240)")
    p.add_argument("--row-timeout", type=float, default=90.0, help="per transfer row, s")
    p.add_argument("--ps-timeout", type=float, default=120.0,
                   help="per PS start, and per block, s")
    p.add_argument("--json", type=Path, default=None, help="write every row here")
    p.add_argument("--logdir", type=Path, default=Path("bench-results/gpu-logs"))
    args = p.parse_args(argv)
    test = args.self_test
    for name, full, tiny in (("device", "cuda:0", "cpu"), ("size", 256 << 20, 1 << 20),
                             ("reps", 20, 3), ("warmup", 3, 1), ("blocks", 3, 2),
                             ("block_s", 1.0, 0.05), ("budget_s", 240.0, 180.0),
                             ("models", ["resnet50", "bert-base"], ["tiny"])):
        if getattr(args, name) is None:
            setattr(args, name, tiny if test else full)
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    t0 = time.monotonic()
    budget = Budget(args.budget_s)
    args.logdir.mkdir(parents=True, exist_ok=True)
    progress(f"gpu benchmark: parts {args.parts}, device {args.device}, budget "
             f"{args.budget_s:.0f} s, logs in {args.logdir}")
    rows = []
    if "transfer" in args.parts:
        rows += run_transfers(args, budget)
    if "ps" in args.parts:
        rows += run_ps(args, budget)
    result = {"machine": machine(args.device), "seconds": round(time.monotonic() - t0, 1),
              "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
              "rows": rows}
    out = [f"Machine: {result['machine']}; whole run {result['seconds']:.0f} s.", ""]
    if args.device == "cpu":
        out += ["(--device cpu: host memory, a check of the harness; the figures mean "
                "nothing)", ""]
    transfers = [r for r in rows if r["part"] == "transfer"]
    if transfers:
        out += [f"**One-sided transfer, {transfers[0]['size'] / 2**20:g} MiB, "
                f"{args.device} -> {args.device}, two processes** (medians)", "",
                transfer_table(transfers), ""]
    ps = [r for r in rows if r["part"] == "ps"]
    if ps:
        out += [f"**One PS round on {args.device}, sync, plain SGD** (medians)", "",
                ps_table(ps), ""]
    if args.device != "cpu":
        out += ["**Goals**", "", *(goals(rows) or ["- (no figures to check)"])]
    print("\n".join(out), flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1, default=str))
        progress(f"rows saved to {args.json}")
    return result


if __name__ == "__main__":
    main()
