"""examples/nanogpt.py: nanoGPT's loop on a sync PS with 2 workers trains exactly as one
process on the union batch (warmup + cosine LR through param_group["lr"], weight-decay
groups, clipping, gradient accumulation), including after a checkpoint and a resume."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from tensorx.remote_optimizer import RemoteOptimizer
from tests.support.clusters import on_ranks, run_example
from tests.support.lanes import assert_link, link_options, links

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def load_example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("nanogpt", ROOT / "examples" / "nanogpt.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["nanogpt"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


nanogpt = load_example()
CFG = nanogpt.TrainConfig(max_iters=12, eval_interval=6, eval_iters=1, warmup_iters=3,
                          lr_decay_iters=10)


def single(resume: dict[str, Any] | None = None) -> tuple[Any, list[dict[str, Any]]]:
    def make(model: Any) -> torch.optim.Optimizer:
        return nanogpt.configure_optimizers(model.named_parameters(), CFG.weight_decay,
                                            CFG.learning_rate, (CFG.beta1, CFG.beta2))

    return nanogpt.train(CFG, nanogpt.GPTConfig(), make, None, resume)  # type: ignore[no-any-return]


def distributed(link: str, resume: dict[str, Any] | None = None
                ) -> list[tuple[Any, list[Any]]]:
    options = link_options(link)
    with nanogpt.serving(CFG, 2, num_shards=2, **options) as ps:
        def work(rank: int) -> tuple[Any, list[dict[str, Any]]]:
            made: list[RemoteOptimizer] = []

            def make(model: Any) -> RemoteOptimizer:
                made.append(RemoteOptimizer(model, ps, rank, 2, **options))
                return made[-1]

            try:
                trained = nanogpt.train(CFG, nanogpt.GPTConfig(), make, rank, resume,
                                        clip_here=False)
                for opt in made:
                    assert_link(opt.worker, link)
                return trained  # type: ignore[no-any-return]
            finally:
                for opt in made:
                    opt.close()

        return on_ranks(work)


def assert_same_model(got: Any, want: Any) -> None:
    for (name, a), b in zip(got.named_parameters(), want.parameters(), strict=True):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-5, atol=1e-5, msg=name)


def assert_same_optimizer(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert got["param_groups"] == want["param_groups"]
    assert got["state"].keys() == want["state"].keys()
    for i, entry in want["state"].items():
        assert got["state"][i].keys() == entry.keys()
        for key, value in entry.items():
            torch.testing.assert_close(got["state"][i][key], value, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("link", links())
def test_nanogpt_on_two_workers_equals_one_process_through_a_resume(link: str) -> None:
    want, want_ckpts = single()
    (model0, ckpts), (model1, none) = distributed(link)
    assert none == []  # rank 0 alone evaluates and checkpoints, as in nanoGPT
    assert_same_model(model0, want)
    assert_same_model(model1, want)
    assert [c["iter_num"] for c in ckpts] == [c["iter_num"] for c in want_ckpts] == [6]
    assert_same_optimizer(ckpts[0]["optimizer"], want_ckpts[0]["optimizer"])
    lrs = {g["lr"] for g in ckpts[0]["optimizer"]["param_groups"]}
    assert lrs == {nanogpt.get_lr(6, CFG)}  # the schedule reached the server
    assert [g["weight_decay"] for g in ckpts[0]["optimizer"]["param_groups"]] == [0.1, 0.0]

    (resumed, _), _ = distributed(link, resume=ckpts[0])
    assert_same_model(resumed, want)


def test_the_example_runs_and_resumes(tmp_path: Path) -> None:
    args = ["--transport", "tcp", "--eval-interval", "3", "--out", str(tmp_path)]
    out = run_example("nanogpt.py", "--max-iters", "4", *args, timeout=200)
    assert "final val loss" in out and (tmp_path / "ckpt.pt").exists()
    again = run_example("nanogpt.py", "--max-iters", "7", *args, "--resume", timeout=200)
    assert "resumed from iter 3" in again and "iter 6:" in again, again
