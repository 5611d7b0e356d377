"""One pipeline stage process of the tests:
``python -m tests.support.pipeline_worker SPEC RANK``.

SPEC (json) lists runs; for each, this process builds its stage (meeting the others
through the test's TCPStore under a prefix of the run's own), trains ``steps`` steps with
SGD and saves its losses (last stage) and its module's state to ``out/<run>-<rank>.pt``.
A run with ``"die_at"`` makes that rank exit hard in the middle of that step; one with
``"expect_error"`` saves the error the step raised instead.
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta
from typing import Any

import torch

from tensorx import pipelining as pp
from tests.support import pipeline_models as models


def run(spec: dict[str, Any], run: dict[str, Any], rank: int, store: Any) -> None:
    name, world, m = run["model"], run["stages"], run["m"]
    options: dict[str, Any] = {"transport": run.get("transport", "auto"),
                               "timeout": run.get("timeout", 30.0),
                               "store": torch.distributed.PrefixStore(run["id"], store),
                               **models.stage_options(name, rank)}
    if name in models.SPLIT_POINTS:
        model = models.whole(name, world)
        x0 = models.batches(name, 1, m)[0][0]
        pipe = pp.split(model, models.SPLIT_POINTS[name],
                        example_args=(torch.tensor_split(x0, m)[0],))
        stage = pipe.build_stage(rank, "cpu", **options)
    else:
        module = models.parts(name, world)[rank]
        stage = pp.PipelineStage(module, rank, world, "cpu", **options)
    sched = getattr(pp, run["schedule"])(
        stage, m, loss_fn=models.loss_fn(name) if rank == world - 1 else None)
    opt = torch.optim.SGD(stage.submod.parameters(), lr=0.1)
    losses: list[list[float]] = []
    out: dict[str, Any] = {}
    with stage:
        try:
            for i, (x, y) in enumerate(models.batches(name, run.get("steps", 2), m)):
                if run.get("die_at") == [i, rank]:
                    die_in_forward(stage.submod, after=2)
                if run.get("grow_at") == i and rank == 0:
                    x = torch.cat([x, x])  # micro-batches twice as large as planned
                opt.zero_grad()
                step: list[Any] = []
                if rank == 0:
                    sched.step(x)
                elif rank == world - 1:
                    sched.step(target=y, losses=step)
                else:
                    sched.step()
                opt.step()
                losses.append([v.item() for v in step])
        except Exception as exc:  # the test asserts on it
            out["error"] = f"{type(exc).__name__}: {exc}"
            out["elapsed"] = time.monotonic()
        out["lanes"] = {s: p["host"] or p["transport"] for s, p in stage.info["peers"].items()}
        out["transports"] = {s: p["transport"] for s, p in stage.info["peers"].items()}
        out["plan"] = [(r.src, r.dst, r.slots, r.grad_slots, r.slot_bytes)
                       for r in stage.plan.rows]
        out["registered"] = stage.plan.registered_bytes
        out["stats"] = stage.stats()
    out["losses"] = losses
    out["state"] = {k: v.detach().clone() for k, v in stage.submod.state_dict().items()}
    torch.save(out, os.path.join(spec["out"], f"{run['id']}-{rank}.pt"))


def die_in_forward(module: torch.nn.Module, after: int) -> None:
    """Exit hard in the forward of micro-batch ``after`` (counted from 0), mid-step."""
    calls = [0]

    def hook(*_: Any) -> None:
        calls[0] += 1
        if calls[0] > after:
            os._exit(3)

    module.register_forward_pre_hook(hook)


def main() -> None:
    spec = json.loads(open(sys.argv[1]).read())
    rank = int(sys.argv[2])
    torch.set_num_threads(1)
    store = torch.distributed.TCPStore("127.0.0.1", spec["store_port"], is_master=False,
                                       timeout=timedelta(seconds=60))
    for r in spec["runs"]:
        if rank < r["stages"]:
            run(spec, r, rank, store)


if __name__ == "__main__":
    main()
