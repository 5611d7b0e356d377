"""Train a CNN on scikit-learn's digits split across pipeline stages, one process each.

Each stage is a ``tensorx.pipelining.PipelineStage``: the activations of every micro-batch
are written one-sided into the next stage's receive slots, and their gradients back into
the previous stage's. The last stage shows the progress and, at the end, the accuracy on
the held-out digits (a forward-only ``eval`` through every stage).

    python examples/pipeline.py                          # 3 stages, 1F1B, 4 micro-batches
    python examples/pipeline.py --stages 4 --schedule gpipe --microbatches 8
    torchrun --nproc-per-node 3 examples/pipeline.py --launcher torchrun
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import queue
import socket
import time
import traceback
from typing import Any

import torch
from torch import nn

from tensorx import pipelining as pp

SEED = 0


def stage_modules(stages: int) -> list[nn.Module]:
    """The model, cut into ``stages`` consecutive parts (2 to 4)."""
    torch.manual_seed(SEED)
    convs = [nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.ReLU()),
             nn.Sequential(nn.Conv2d(16, 32, 3, padding=1, stride=2), nn.ReLU()),
             nn.Sequential(nn.Conv2d(32, 32, 3, padding=1), nn.ReLU())]
    head = nn.Sequential(nn.Flatten(), nn.Linear(32 * 4 * 4, 10))
    if stages == 2:
        return [nn.Sequential(convs[0], convs[1]), nn.Sequential(convs[2], head)]
    if stages == 3:
        return [convs[0], nn.Sequential(convs[1], convs[2]), head]
    return [*convs, head]


def load_digits() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Digits ship inside scikit-learn: no download. 8x8 images, stratified 80/20 split."""
    from sklearn.datasets import load_digits as sk_digits
    from sklearn.model_selection import train_test_split

    x, y = sk_digits(return_X_y=True)
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=0.2, stratify=y,
                                              random_state=SEED)
    as_x = lambda a: torch.tensor(a / 16.0, dtype=torch.float32).reshape(-1, 1, 8, 8)  # noqa: E731
    return as_x(x_tr), torch.tensor(y_tr), as_x(x_te), torch.tensor(y_te)


def run_stage(rank: int, args: argparse.Namespace, peers: dict[int, str] | None,
              results: Any = None) -> dict[str, Any]:
    torch.set_num_threads(1)
    x_tr, y_tr, x_te, y_te = load_digits()
    last = rank == args.stages - 1
    module = stage_modules(args.stages)[rank]
    schedule = pp.Schedule1F1B if args.schedule == "1f1b" else pp.ScheduleGPipe
    out: dict[str, Any] = {"rank": rank}
    with pp.PipelineStage(module, rank, args.stages, "cpu", peers=peers,
                          transport=args.transport) as stage:
        sched = schedule(stage, args.microbatches,
                         loss_fn=nn.CrossEntropyLoss() if last else None)
        opt = torch.optim.SGD(module.parameters(), lr=0.05, momentum=0.9)
        batches = len(x_tr) // args.batch_size
        bar = _bar(args, batches) if last else None
        started = time.perf_counter()
        for epoch in range(args.epochs):
            order = torch.randperm(len(x_tr), generator=torch.Generator().manual_seed(epoch))
            for b in range(batches):
                idx = order[b * args.batch_size:(b + 1) * args.batch_size]
                opt.zero_grad()
                losses: list[torch.Tensor] = []
                if rank == 0:
                    sched.step(x_tr[idx])
                elif last:
                    sched.step(target=y_tr[idx], losses=losses)
                else:
                    sched.step()
                opt.step()
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(epoch=epoch, loss=f"{torch.stack(losses).mean():.3f}")
        seconds = time.perf_counter() - started
        module.eval()
        correct = 0
        for b in range(0, len(x_te), args.batch_size):  # batches no larger than training's:
            chunk = x_te[b:b + args.batch_size]        # the slots hold a training micro-batch
            logits = sched.eval(chunk) if rank == 0 else sched.eval()
            if last:
                correct += int((logits.argmax(1) == y_te[b:b + args.batch_size]).sum())
        if bar is not None:
            bar.close()
        if last:
            out["accuracy"] = correct / len(x_te)
            out["ms_per_step"] = seconds / (args.epochs * batches) * 1e3
        out["lanes"] = {s: "cma" if str(p["host"]).startswith("cma") else p["transport"]
                        for s, p in stage.info["peers"].items()}
        out["registered"] = stage.plan.registered_bytes
    if results is not None:
        results.put(("done", out))
    return out


def _bar(args: argparse.Namespace, batches: int) -> Any:
    from tqdm import tqdm

    return tqdm(total=args.epochs * batches, desc=f"digits, {args.stages} stages",
                unit="step", disable=args.quiet)


def _child(results: Any, rank: int, args: argparse.Namespace, peers: dict[int, str]) -> None:
    try:
        run_stage(rank, args, peers, results)
    except BaseException:
        results.put(("error", f"stage {rank}:\n{traceback.format_exc()}"))


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [int(s.getsockname()[1]) for s in socks]
    for s in socks:
        s.close()
    return ports


def main(argv: list[str] | None = None) -> float:
    args = parse_args(argv)
    if args.launcher == "torchrun":
        out = run_stage(int(os.environ["RANK"]), args, None)
        if "accuracy" in out:
            print(f"accuracy {out['accuracy']:.4f}")
        return float(out.get("accuracy", 0.0))
    peers = {i: f"tcp://127.0.0.1:{p}" for i, p in enumerate(free_ports(args.stages))}
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_child, args=(results, r, args, peers), name=f"stage-{r}")
             for r in range(args.stages)]
    t0 = time.perf_counter()
    for p in procs:
        p.start()
    done: list[dict[str, Any]] = []
    try:
        deadline = time.monotonic() + args.timeout
        while len(done) < len(procs):
            try:
                kind, value = results.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise SystemExit(f"timed out after {args.timeout:.0f} s") from None
            if kind == "error":
                raise SystemExit(value)
            done.append(value)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    last = max(done, key=lambda d: d["rank"])
    lanes = sorted({lane for d in done for lane in d["lanes"].values()})
    print(f"stages {args.stages}  {args.schedule}  {args.microbatches} micro-batches  "
          f"lanes {', '.join(map(str, lanes))}  {last['ms_per_step']:.2f} ms/step  "
          f"receive slots {sum(d['registered'] for d in done)} B  "
          f"wall {time.perf_counter() - t0:.1f} s")
    print(f"accuracy {last['accuracy']:.4f}")
    return float(last["accuracy"])


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stages", type=int, choices=(2, 3, 4), default=3)
    p.add_argument("--schedule", choices=("1f1b", "gpipe"), default="1f1b")
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--transport", choices=("auto", "tcp", "ucx"), default="auto")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--launcher", choices=("local", "torchrun"), default="local",
                   help="local: spawn one process per stage here; torchrun: one stage per rank")
    return p.parse_args(argv)


if __name__ == "__main__":
    main()
