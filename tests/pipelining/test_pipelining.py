"""Pipeline training across real stage processes equals one process training the whole
model on the same micro-batches, over every lane, for a CNN, a transformer whose sequence
length varies per micro-batch and a model with a skip connection between non-adjacent
stages; 2 to 4 stages, GPipe and 1F1B, 1 to 8 micro-batches, uneven last micro-batches,
fewer micro-batches than stages."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support import pipeline_models as models
from tests.support.lanes import HAVE_UCX

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ROOT = Path(__file__).resolve().parents[2]
LANES = ["tcp", "auto", *(["ucx"] if HAVE_UCX else [])]


def _runs() -> list[dict[str, Any]]:
    runs = []
    for lane in LANES:
        runs += [
            {"id": f"cnn-gpipe-{lane}", "model": "cnn", "stages": 2,
             "schedule": "ScheduleGPipe", "m": 4, "transport": lane},
            {"id": f"transformer-1f1b-{lane}", "model": "transformer", "stages": 3,
             "schedule": "Schedule1F1B", "m": 3, "transport": lane},
            {"id": f"skip-1f1b-{lane}", "model": "skip", "stages": 3,
             "schedule": "Schedule1F1B", "m": 4, "transport": lane},
        ]
    runs += [
        {"id": "mlp-1f1b-4-stages-2-mb", "model": "mlp", "stages": 4,
         "schedule": "Schedule1F1B", "m": 2},
        {"id": "mlp-1f1b-4-stages-1-mb", "model": "mlp", "stages": 4,
         "schedule": "Schedule1F1B", "m": 1},
        {"id": "mlp-gpipe-4-stages-8-mb", "model": "mlp", "stages": 4,
         "schedule": "ScheduleGPipe", "m": 8},
        {"id": "cnn-1f1b-4-stages-5-mb", "model": "cnn", "stages": 4,
         "schedule": "Schedule1F1B", "m": 5},
        {"id": "transformer-gpipe-2-stages", "model": "transformer", "stages": 2,
         "schedule": "ScheduleGPipe", "m": 2},
        {"id": "skip-gpipe-1-mb", "model": "skip", "stages": 3,
         "schedule": "ScheduleGPipe", "m": 1},
    ]
    return runs


# Runs that fail on purpose, after the others in the same processes (the last one ends
# rank 2's process).
FAILING = [
    {"id": "grows", "model": "mlp", "stages": 2, "schedule": "Schedule1F1B", "m": 2,
     "grow_at": 1, "timeout": 20.0},
    {"id": "killed", "model": "mlp", "stages": 3, "schedule": "Schedule1F1B", "m": 4,
     "die_at": [1, 2], "timeout": 20.0},
]


def launch(tmp: Path, runs: list[dict[str, Any]], timeout: float = 240.0
           ) -> dict[str, list[dict[str, Any]]]:
    """Run ``runs`` in real stage processes (as many as the most stages of any run) and
    return each run's per-rank results."""
    store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True,
                                       timeout=timedelta(seconds=60), wait_for_workers=False)
    spec = {"store_port": store.port, "out": str(tmp), "runs": runs}
    (tmp / "spec.json").write_text(json.dumps(spec))
    world = max(r["stages"] for r in runs)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, "-m", "tests.support.pipeline_worker",
                               str(tmp / "spec.json"), str(rank)], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for rank in range(world)]
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=timeout)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    out: dict[str, list[dict[str, Any]]] = {}
    for r in runs:
        results = []
        for rank in range(r["stages"]):
            path = tmp / f"{r['id']}-{rank}.pt"
            results.append(torch.load(path, weights_only=False) if path.exists() else None)
        out[r["id"]] = results
    out["_logs"] = logs  # type: ignore[assignment]
    store = None
    return out


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    return launch(tmp_path_factory.mktemp("pipeline"), _runs() + FAILING)


@pytest.mark.parametrize("run", _runs(), ids=lambda r: r["id"])
def test_pipeline_training_equals_one_process(trained: dict[str, Any], run: dict[str, Any]
                                              ) -> None:
    results = trained[run["id"]]
    assert all(r is not None for r in results), trained["_logs"]
    for r in results:
        assert "error" not in r, r["error"]
    losses, state = models.reference(run["model"], run["stages"], run["m"], 2)
    got = results[-1]["losses"]
    assert len(got) == len(losses)
    for a, b in zip(got, losses, strict=True):
        assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-6, rtol=1e-5), (a, b)
    if run["model"] in models.SPLIT_POINTS:
        merged = {k: v for r in results for k, v in r["state"].items()}
    else:
        merged = {f"{rank}.{k}": v for rank, r in enumerate(results)
                  for k, v in r["state"].items()}
    assert set(merged) == set(state)
    for k, v in state.items():
        assert torch.allclose(merged[k], v, atol=1e-6, rtol=1e-5), k
    # the bytes crossed the lane the run names
    lane = run.get("transport", "auto")
    for r in results:
        for peer, name in r["lanes"].items():
            if lane == "auto":
                assert str(name).startswith("cma"), (peer, name)
            else:
                assert r["transports"][peer] == lane and not str(name).startswith("cma")
        assert r["stats"]["transfers_sent"] > 0


def test_slots_follow_the_schedule(trained: dict[str, Any]) -> None:
    """1F1B registers at most (stages - sender) activation slots per boundary, GPipe one
    per micro-batch; gradient slots: the stages the boundary spans, plus one (1F1B), half
    the micro-batches (GPipe)."""
    def slots(run: str, rank: int) -> list[tuple[int, ...]]:
        return sorted(tuple(row[:4]) for row in trained[run][rank]["plan"])

    # stage 2 receives from 1 and, over the skip connection, from 0
    assert slots("skip-1f1b-tcp", 2) == [(0, 2, 3, 3), (1, 2, 2, 2)]
    assert slots("mlp-gpipe-4-stages-8-mb", 1) == [(0, 1, 8, 4), (1, 2, 8, 4)]
    # 1F1B, 5 micro-batches over 4 stages: 4 in flight after stage 0, 2 after stage 2
    assert slots("cnn-1f1b-4-stages-5-mb", 1) == [(0, 1, 4, 2), (1, 2, 3, 2)]
    assert slots("cnn-1f1b-4-stages-5-mb", 3) == [(2, 3, 2, 2)]
    # a slot holds the first (largest) micro-batch: 13 rows in 4 micro-batches, 4 x 16 floats
    assert trained["skip-1f1b-tcp"][2]["plan"][0][4] == 4 * 16 * 4


def test_a_stage_killed_mid_step_stops_every_other_stage_naming_it(
        trained: dict[str, Any]) -> None:
    results = trained["killed"]
    assert results[2] is None  # it died before saving anything
    for rank in (0, 1):  # stage 1 lost its endpoint; stage 0 heard it from stage 1
        error = results[rank]["error"]
        assert error.startswith("BrokenError"), error
        assert "stage 2" in error, error
        assert results[rank]["losses"] == [[]], results[rank]  # step 0 done, not step 1


def test_a_tensor_larger_than_its_slot_is_a_plan_mismatch_naming_the_boundary(
        trained: dict[str, Any]) -> None:
    sender, receiver = trained["grows"]
    error = sender["error"]
    assert error.startswith("PlanMismatchError"), error
    assert "boundary 0 -> 1" in error and "[7, 16]" in error and "[4, 16]" in error, error
    assert "max_shapes" in error, error  # the remedy
    assert receiver["error"].startswith("BrokenError: stage 0 failed: PlanMismatchError"), \
        receiver["error"]
