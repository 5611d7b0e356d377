"""The floor of a PS round on one GPU: the same bytes and the same update with no transport
and no second process. ``python -m benchmarks.baselines.gpu_floor --model resnet50
--workers 2 --device cuda:0``.

One round, in one process, on one device: each worker's gradient (one flat tensor, as a
worker's gradient arena) copied into its slot (the push), the slots averaged when there are
several, one step of ``torch.optim.SGD`` (fused) over the parameters as one flat tensor
(what a GPU shard's flat update runs), and the parameters copied into each worker's
parameter arena (the pull). Timed as the PS rounds are: wall clock from a synchronized
device to a synchronized device. Prints ``RESULT {"round": s, "push": s, "step": s,
"pull": s, "bytes": n}`` (medians; the parts timed apart, each synchronized).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch

from benchmarks.baselines import common


def measure(model: str, workers: int, device: str, rounds: int, warmup: int  # noqa: C901 (one measurement, read top to bottom)
            ) -> dict[str, float]:
    n = common.numel(common.MODELS[model]())

    def full(value: float) -> torch.Tensor:
        return torch.full((n,), value, dtype=torch.float32, device=device)

    grads = [full(common.GRAD_VALUE) for _ in range(workers)]  # the workers' arenas
    slots = [full(0.0) for _ in range(workers)]                # the server's slots
    acc = full(0.0)
    params = torch.nn.Parameter(full(0.01))
    arenas = [full(0.0) for _ in range(workers)]               # the workers' parameters
    fused = device.startswith("cuda")
    opt = torch.optim.SGD([params], lr=common.LR, fused=fused or None)

    def sync() -> None:
        if device.startswith("cuda"):
            torch.cuda.synchronize(device)

    def push() -> None:
        for g, s in zip(grads, slots, strict=True):
            s.copy_(g)

    def step() -> None:
        if workers == 1:
            params.grad = slots[0]
        else:
            torch.add(slots[0], slots[1], out=acc)
            for s in slots[2:]:
                acc.add_(s)
            acc.div_(workers)
            params.grad = acc
        opt.step()

    def pull() -> None:
        with torch.no_grad():
            for a in arenas:
                a.copy_(params)

    def whole() -> None:
        push()
        step()
        pull()

    def timed(fn: Callable[[], None]) -> float:
        sync()
        t = time.perf_counter()
        fn()
        sync()
        return time.perf_counter() - t

    parts = {"round": whole, "push": push, "step": step, "pull": pull}
    times: dict[str, list[float]] = {k: [] for k in parts}
    for i in range(warmup + rounds):
        for k, fn in parts.items():
            t = timed(fn)
            if i >= warmup:
                times[k].append(t)
    out = {k: statistics.median(v) for k, v in times.items()}
    return {**out, "bytes": 4 * n}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="resnet50", choices=sorted(common.MODELS))
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    args = p.parse_args(argv)
    common.setup_process(1)
    with torch.no_grad():
        result = measure(args.model, args.workers, args.device, args.rounds, args.warmup)
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
