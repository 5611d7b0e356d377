"""Pipeline-parallel training steps: tensorx.pipelining against torch.distributed.pipelining
over gloo (the same schedule) and the torch.distributed.rpc pipeline pattern (RRefs and
``rpc_async`` per micro-batch, as PyTorch's ``distributed/rpc/pipeline`` example).

    python benchmarks/pipeline.py                  # T1-T4, one host (about 4 minutes)
    python benchmarks/pipeline.py --netns          # T1 across two network namespaces too
    python benchmarks/pipeline.py --quick          # fewer steps, a smoke test

The rows go to ``OUT/pipeline.json`` and T1's chart to ``OUT/pipeline.png`` (``--out``,
default ``bench-results``).

Every stage is a process of its own with one torch thread (two stages on two cores). A
step's time is the first stage's (it starts the step and ends it when the last gradient
is back), the median over the timed steps.

* T1: two stages of near-identity modules (x * w), GPipe with 8 micro-batches, boundary
  tensors of 64 KiB and 16 MiB, forward and backward.
* T2: two stages of two transformer blocks each, a sequence length per micro-batch drawn
  from 64-512: tensorx with ``dynamic=(1,)`` against torch with every micro-batch padded to
  512, and against tensorx with every micro-batch at the mean length (static slots).
* T3: each step against the schedule model, GPipe's makespan with every micro-batch's
  forward and backward timed alone in this run and no communication ((m + p - 1)(t_f +
  t_b) when the micro-batches are alike): the floor.
* T4: receive bytes registered per stage against torch's receive buffers (one per
  micro-batch and direction).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from benchmarks._charts import save  # noqa: E402

M = 8  # micro-batches
COLS = 1024
SIZES = {"64K": 16, "16M": 4096}  # rows per micro-batch: rows x 1024 floats
D_MODEL, BATCH, MAX_LEN = 128, 4, 512


# -- models --------------------------------------------------------------------------------
class Scale(nn.Module):
    """Near-identity: x * w (the boundary is all there is to measure)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(COLS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.w


def blocks() -> nn.Module:
    return nn.Sequential(*(nn.TransformerEncoderLayer(D_MODEL, 4, 256, dropout=0.0,
                                                      batch_first=True) for _ in range(2)))


def lengths(steps: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [[int(v) for v in torch.randint(64, MAX_LEN + 1, (M,), generator=g)]
            for _ in range(steps)]


def module_for(case: dict[str, Any], rank: int) -> nn.Module:
    torch.manual_seed(rank)
    return Scale() if case["kind"] == "t1" else blocks()


def micro_batches(case: dict[str, Any], step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    if case["kind"] == "t1":
        return [torch.randn(case["rows"], COLS, generator=g) for _ in range(M)]
    lens = lengths(step + 1)[step]
    if case["shape"] == "padded":
        lens = [MAX_LEN] * M
    elif case["shape"] == "static":
        lens = [case["mean"]] * M
    return [torch.randn(BATCH, L, D_MODEL, generator=g) for L in lens]


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (out * out).mean()


# -- one stage process ---------------------------------------------------------------------
def stage_main(cfg: dict[str, Any]) -> None:
    torch.set_num_threads(1)
    case, rank, system = cfg["case"], cfg["rank"], cfg["system"]
    os.environ.update({"MASTER_ADDR": cfg["host"], "MASTER_PORT": str(cfg["port"]),
                       "RANK": str(rank), "WORLD_SIZE": str(cfg["world"])})
    times: list[float] = []
    extra: dict[str, Any] = {}
    steps = cfg["warm"] + cfg["steps"]
    if system == "rpc":
        times = rpc_main(cfg, steps)
    elif rank < 2:
        mod = module_for(case, rank)
        run, extra = (tensorx_stage if system == "tensorx" else torch_stage)(cfg, mod)
        for step in range(steps):
            mbs = micro_batches(case, step)
            started = time.perf_counter()
            run(mbs)
            times.append(time.perf_counter() - started)
        extra.update(extra.pop("final", lambda: {})())
    print("RESULT " + json.dumps({"rank": rank, "times": times[cfg["warm"]:], **extra}),
          flush=True)
    if system == "torch":
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def tensorx_stage(cfg: dict[str, Any], mod: nn.Module) -> tuple[Any, dict[str, Any]]:
    from tensorx import pipelining as pp
    from tensorx._ps.common.rendezvous import connect_store

    rank = cfg["rank"]
    options: dict[str, Any] = {"store": connect_store(120.0), "timeout": 120.0}
    if cfg["case"].get("shape") == "dynamic" and rank == 1:
        options.update(dynamic=(1,), max_shapes=[(BATCH, MAX_LEN, D_MODEL)])
    stage = pp.PipelineStage(mod, rank, 2, "cpu", **options)
    sched = pp.ScheduleGPipe(stage, M, loss_fn=loss_fn if rank == 1 else None)
    target = torch.zeros(1)

    def run(mbs: list[torch.Tensor]) -> None:
        if rank == 0:
            sched.step(mbs)
        else:
            sched.step(target=[target] * M)

    def final() -> dict[str, Any]:
        info = {"registered": stage.plan.registered_bytes, "stats": stage.stats(),
                "lane": {k: v["host"] or v["transport"] for k, v in
                         stage.info["peers"].items()}}
        stage.close()
        return info

    return run, {"final": final}


def torch_stage(cfg: dict[str, Any], mod: nn.Module) -> tuple[Any, dict[str, Any]]:
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    rank = cfg["rank"]
    dist.init_process_group("gloo", rank=rank, world_size=2)
    # Shapes given up front (torch's static metadata): its inference at the first step
    # deadlocks over gloo on this torch (the last stage blocks sending its backward
    # metadata while the first waits on its first activation send).
    example = micro_batches(cfg["case"], 0)[0]
    if cfg["case"].get("shape") == "dynamic":
        raise ValueError("torch pipelining needs static shapes")
    with torch.no_grad():
        out = mod(example)
    stage = PipelineStage(mod, rank, 2, torch.device("cpu"), input_args=(example,),
                          output_args=(out,))
    sched = ScheduleGPipe(stage, M, loss_fn=loss_fn if rank == 1 else None)
    target = torch.zeros(1)

    def run(mbs: list[torch.Tensor]) -> None:
        if rank == 0:
            sched.step(torch.cat(mbs))
        else:
            sched.step(target=target.expand(len(mbs)).clone())

    def final() -> dict[str, Any]:
        # torch holds one receive buffer per micro-batch and direction
        recv = sum(t.numel() * t.element_size() for info in stage.args_recv_info.values()
                   for r in info for t in [getattr(r, "buffer", None)]
                   if isinstance(t, torch.Tensor))
        # its gradient receives are allocated per micro-batch at each backward (one per
        # micro-batch and direction, as its activations): counted as torch documents them
        grads = M * example.numel() * example.element_size() if rank == 0 else 0
        return {"registered": recv + grads}

    return run, {"final": final}


_SHARDS: dict[str, Any] = {}


class RpcShard:
    """One stage of the RPC pattern, living in its worker process."""

    def __init__(self, case: dict[str, Any], rank: int) -> None:
        import threading

        self.mod = module_for(case, rank - 1)
        self.lock = threading.Lock()

    def forward(self, x_rref: Any) -> torch.Tensor:
        x = x_rref.to_here()
        with self.lock:
            return self.mod(x)


def rpc_main(cfg: dict[str, Any], steps: int) -> list[float]:
    import torch.distributed.autograd as dist_autograd
    import torch.distributed.rpc as rpc

    rank = cfg["rank"]
    opts = rpc.TensorPipeRpcBackendOptions(num_worker_threads=16, rpc_timeout=300)
    rpc.init_rpc(f"w{rank}", rank=rank, world_size=3, rpc_backend_options=opts)
    times = []
    if rank == 0:
        p1 = rpc.remote("w1", RpcShard, args=(cfg["case"], 1))
        p2 = rpc.remote("w2", RpcShard, args=(cfg["case"], 2))
        for step in range(steps):
            mbs = micro_batches(cfg["case"], step)
            started = time.perf_counter()
            with dist_autograd.context() as ctx:
                futs = []
                for x in mbs:
                    y = p1.remote().forward(rpc.RRef(x))
                    futs.append(p2.rpc_async().forward(y))
                outs = torch.futures.wait_all(futs)
                loss = sum(loss_fn(o, o) for o in outs) / M
                dist_autograd.backward(ctx, [loss])
            times.append(time.perf_counter() - started)
    rpc.shutdown()
    return times


# -- the floor: each stage's compute alone ------------------------------------------------
def compute_floor(case: dict[str, Any], first: int, steps: int) -> list[float]:
    """The schedule model: GPipe's makespan over two stages with every micro-batch's
    forward and backward timed (one thread, this process) and no communication, for each
    step the systems time, ``first`` to ``first + steps - 1``, with its shapes (T2's
    sequence lengths differ from step to step: each step is held to its own model). The
    compute runs in GPipe's order, each stage's forwards of every micro-batch, then their
    backwards, so every micro-batch's graph is alive until its backward as in the
    schedule (timed one micro-batch at a time, forward then backward, varying lengths ran
    faster than any pipeline can: their memory was reused at once)."""
    torch.set_num_threads(1)
    spans = []
    mods = [module_for(case, rank) for rank in range(2)]
    for step in [first, *range(first, first + steps)]:  # the first once unmeasured (warm-up)
        f: list[list[float]] = [[], []]
        b: list[list[float]] = [[], []]
        inputs: list[list[torch.Tensor]] = [[], []]
        outputs: list[list[torch.Tensor]] = [[], []]
        h = micro_batches(case, step)
        for rank, mod in enumerate(mods):
            for x in h:
                x = x.detach().requires_grad_(rank > 0)
                t0 = time.perf_counter()
                out = mod(x)
                f[rank].append(time.perf_counter() - t0)
                inputs[rank].append(x)
                outputs[rank].append(out)
            h = outputs[rank]
        for rank in reversed(range(2)):
            for j, out in enumerate(outputs[rank]):
                t0 = time.perf_counter()
                if rank == 1:
                    loss_fn(out, out).backward()
                else:
                    out.backward(inputs[1][j].grad)  # the gradient stage 1 sends back
                b[rank].append(time.perf_counter() - t0)
        spans.append(gpipe_makespan(f, b))
    return spans[1:]


def gpipe_makespan(f: list[list[float]], b: list[list[float]]) -> float:
    """When the last backward ends, each stage running its micro-batches' forwards in
    order, then their backwards, each waiting for its input from the neighbour."""
    p, m = len(f), len(f[0])
    done_f = [[0.0] * m for _ in range(p)]
    done_b = [[0.0] * m for _ in range(p)]
    free = [0.0] * p
    for s in range(p):
        for j in range(m):
            free[s] = max(free[s], done_f[s - 1][j] if s else 0.0) + f[s][j]
            done_f[s][j] = free[s]
    for s in reversed(range(p)):
        for j in range(m):
            free[s] = max(free[s], done_b[s + 1][j] if s < p - 1 else 0.0) + b[s][j]
            done_b[s][j] = free[s]
    return free[0]


# -- the driver ----------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_system(system: str, case: dict[str, Any], warm: int, steps: int,
               placement: Any = None, logdir: Path = Path("bench-results")) -> dict[str, Any]:
    world = 3 if system == "rpc" else 2
    host = placement.server_host if placement is not None else "127.0.0.1"
    port = free_port()
    procs = []
    logdir.mkdir(parents=True, exist_ok=True)
    for rank in range(world):
        cfg = {"system": system, "case": case, "rank": rank, "world": world, "host": host,
               "port": port, "warm": warm, "steps": steps}
        prefix: tuple[str, ...] = ()
        env = dict(os.environ)
        if placement is not None:
            server = rank == 0 or (system == "rpc" and rank == 1)
            prefix = placement.server_prefix if server else placement.client_prefix
            env.update(placement.server_env if server else placement.client_env)
            env["TENSORX_TOKEN"] = "pipeline-bench-" + str(port)
        log = (logdir / f"pipeline-{system}-{case['name']}-{rank}.log").open("w")
        procs.append(subprocess.Popen([*prefix, sys.executable, __file__, "--stage",
                                       json.dumps(cfg)], cwd=ROOT, env=env,
                                      stdout=subprocess.PIPE, stderr=log, text=True))
    results = []
    for p in procs:
        out, _ = p.communicate(timeout=900)
        lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
        if p.returncode != 0 or not lines:
            raise RuntimeError(f"{system} {case['name']}: a stage failed (rc {p.returncode}); "
                               f"see {logdir}/pipeline-{system}-{case['name']}-*.log")
        results.append(json.loads(lines[-1][7:]))
    first = results[0]
    return {"median": statistics.median(first["times"]), "results": results}


def cases(quick: bool) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = [{"name": f"t1-{k}", "kind": "t1", "rows": v}
                                 for k, v in SIZES.items()]
    mean = round(statistics.mean(v for step in lengths(3) for v in step))
    out += [{"name": "t2-dynamic", "kind": "t2", "shape": "dynamic"},
            {"name": "t2-static", "kind": "t2", "shape": "static", "mean": mean},
            {"name": "t2-padded", "kind": "t2", "shape": "padded"}]
    return out


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stage", help=argparse.SUPPRESS)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--netns", action="store_true", help="T1 across two namespaces too")
    p.add_argument("--out", type=Path, default=Path("bench-results"))
    args = p.parse_args(argv)
    if args.stage:
        stage_main(json.loads(args.stage))
        return []
    rows = []
    warm, steps = (1, 2) if args.quick else (3, 10)
    for case in cases(args.quick):
        # T1 64 KiB steps are short; T2's lengths vary by step, so more steps for its medians
        n = {"t1": steps if case.get("rows", 0) < 1000 else max(2, steps // 2),
             "t2": max(2, steps - 2)}[case["kind"]]
        spans = compute_floor(case, warm, n)
        model = statistics.median(spans)
        systems = ["tensorx", "torch", "rpc"] if case["kind"] == "t1" else (
            ["torch"] if case["shape"] == "padded" else ["tensorx"])
        for system in systems:
            got = run_system(system, case, warm, n, logdir=args.out)
            row = {"case": case["name"], "system": system, "place": "one host",
                   "step_s": got["median"], "model_s": model,
                   # each timed step against its own model, the median of those ratios
                   "vs_model": statistics.median(
                       t / m for t, m in zip(got["results"][0]["times"], spans, strict=True)),
                   "registered": [r.get("registered") for r in got["results"]],
                   "lane": got["results"][0].get("lane")}
            rows.append(row)
            print(f"{case['name']:12} {system:8} step {row['step_s'] * 1e3:9.2f} ms  "
                  f"schedule model {model * 1e3:8.2f} ms  registered {row['registered']}",
                  flush=True)
    if args.netns:
        from benchmarks.netns import Unavailable, two_hosts

        try:
            with two_hosts() as placement:
                for case in cases(args.quick)[:2]:
                    for system in ("tensorx", "torch"):
                        got = run_system(system, case, warm, max(2, steps // 2), placement,
                                         args.out)
                        rows.append({"case": case["name"], "system": system,
                                     "place": "two namespaces", "step_s": got["median"],
                                     "model_s": None, "vs_model": None,
                                     "registered": None,
                                     "lane": got["results"][0].get("lane")})
                        print(f"{case['name']:12} {system:8} netns step "
                              f"{got['median'] * 1e3:9.2f} ms", flush=True)
        except Unavailable as exc:
            print(f"two namespaces: skipped ({exc})")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "pipeline.json").write_text(json.dumps(rows, indent=1))
    print()
    print(table(rows))
    plot(rows, args.out / "pipeline.png")
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    def find(case: str, system: str, place: str = "one host") -> dict[str, Any] | None:
        return next((r for r in rows if r["case"] == case and r["system"] == system
                     and r["place"] == place), None)

    lines = ["| case | placement | tensorx ms | torch (gloo) ms | RPC ms | tensorx/torch | "
             "tensorx/RPC | schedule model ms | tensorx/model |",
             "|---|---|---|---|---|---|---|---|---|"]
    for case in ("t1-64K", "t1-16M"):
        for place in ("one host", "two namespaces"):
            tx, tt, rp = find(case, "tensorx", place), find(case, "torch", place), \
                find(case, "rpc", place)
            if tx is None:
                continue
            lines.append(
                f"| {case} | {place} | {tx['step_s'] * 1e3:.2f} | "
                f"{_ms(tt)} | {_ms(rp)} | {_ratio(tx, tt)} | {_ratio(tx, rp)} | "
                f"{_ms(tx, 'model_s')} | {_vs_model(tx)} |")
    dyn, sta, pad = find("t2-dynamic", "tensorx"), find("t2-static", "tensorx"), \
        find("t2-padded", "torch")
    if dyn is not None:
        lines += ["", "| T2 (transformer, length 64-512) | step ms | schedule model ms |",
                  "|---|---|---|",
                  f"| tensorx, dynamic lengths | {_ms(dyn)} | {_ms(dyn, 'model_s')} |",
                  f"| tensorx, every micro-batch at the mean length | {_ms(sta)} | "
                  f"{_ms(sta, 'model_s')} |",
                  f"| torch (gloo), padded to {MAX_LEN} | {_ms(pad)} | {_ms(pad, 'model_s')} |",
                  "", f"dynamic / torch padded: {_ratio(dyn, pad)}; dynamic / static: "
                  f"{_ratio(dyn, sta)}; dynamic / its schedule model: "
                  f"{_vs_model(dyn)}; static / its model: {_vs_model(sta)}"]
    regs = [r for r in rows if r["registered"] and r["case"].startswith("t1")]
    if regs:
        lines += ["", "| T4 receive bytes (stage 0, stage 1) | tensorx | torch |", "|---|---|---|"]
        for case in ("t1-64K", "t1-16M"):
            tx, tt = find(case, "tensorx"), find(case, "torch")
            if tx and tt:
                lines.append(f"| {case} | {tx['registered']} | {tt['registered']} |")
    return "\n".join(lines)


PLOTTED = {"tensorx": "tensorx", "torch": "torch (gloo)", "rpc": "RPC"}


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """T1's step ms per system, one panel per boundary size, a group of bars per placement;
    the schedule model (the floor) a dashed line across its group. Row keys used: case,
    system, place, step_s, model_s (None where not measured)."""
    rows = [r for r in rows if all(r.get(k) is not None for k in ("case", "system", "place",
                                                                  "step_s"))
            and r["case"].startswith("t1") and r["system"] in PLOTTED]
    if not rows:
        print(f"pipeline: no T1 rows, no chart written to {path}", flush=True)
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = list(dict.fromkeys(r["case"] for r in rows))
    fig, axes = plt.subplots(1, len(sizes), figsize=(5.5 * len(sizes), 4.2), squeeze=False)
    width = 0.8 / len(PLOTTED)
    for ax, case in zip(axes[0], sizes, strict=True):
        here = [r for r in rows if r["case"] == case]
        places = list(dict.fromkeys(r["place"] for r in here))
        for i, (system, name) in enumerate(PLOTTED.items()):
            ms = {r["place"]: r["step_s"] * 1e3 for r in here if r["system"] == system}
            ax.bar([j + i * width for j in range(len(places))],
                   [ms.get(p, 0) for p in places], width, label=name)
        floors = [(j, r["model_s"] * 1e3) for j, p in enumerate(places) for r in here
                  if r["place"] == p and r["system"] == "tensorx" and r.get("model_s")]
        for n, (j, y) in enumerate(floors):
            ax.hlines(y, j - width / 2, j + 0.8 - width / 2, colors="k", linestyles="--",
                      label="schedule model (floor)" if n == 0 else None)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(places))])
        ax.set_xticklabels(places)
        ax.set_title(f"pipeline step, T1, boundary {case.removeprefix('t1-')}")
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel("ms per step (median)")
    print(save(fig, path), flush=True)


def _ms(row: dict[str, Any] | None, key: str = "step_s") -> str:
    return "-" if row is None or row.get(key) is None else f"{row[key] * 1e3:.2f}"


def _vs_model(row: dict[str, Any] | None) -> str:
    """A row's steps against their schedule models (the median of the per-step ratios)."""
    if row is None or row.get("vs_model") is None:
        return "-"
    return f"{row['vs_model']:.2f}x"


def _ratio(a: dict[str, Any] | None, b: dict[str, Any] | None, key: str = "step_s") -> str:
    if a is None or b is None or not b.get(key):
        return "-"
    return f"{a['step_s'] / b[key]:.2f}x"


if __name__ == "__main__":
    main()
