"""The examples run as a user would run them: real processes, real sockets."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.support.clusters import run_example

ROOT = Path(__file__).resolve().parents[2]


def test_train_digits_reaches_95_percent() -> None:
    out = run_example("train_digits.py", "--transport", "tcp", "--quiet")
    match = re.search(r"^accuracy (\d\.\d+)$", out, re.MULTILINE)
    assert match, out
    assert float(match.group(1)) >= 0.95


def test_pipeline_example_trains_digits_across_stage_processes() -> None:
    out = run_example("pipeline.py", "--stages", "2", "--epochs", "3", "--quiet")
    match = re.search(r"^accuracy (\d\.\d+)$", out, re.MULTILINE)
    assert match, out
    assert float(match.group(1)) >= 0.85
    assert "lanes cma" in out, out  # two stages on one host: the same-host lane


def test_embedding_service_runs_both_services_and_reports_ratios() -> None:
    """A few hundred ops against each service (the figures of a real run are in its
    docstring's command; here only that it runs, end to end, and reports)."""
    out = run_example("embedding_service.py", "--ops", "200", "--concurrency", "8",
                      timeout=120)
    for system in ("tensorx", "torch rpc"):
        for op in ("read", "write"):
            assert re.search(rf"^{system} .* {op} +8 +\d+ ", out, re.MULTILINE), out
    assert "tensorx / torch rpc, this run: p50 read of one row" in out, out


def test_custom_trainer_two_line_conversion_trains() -> None:
    source = (ROOT / "examples" / "custom_trainer.py").read_text()
    assert len(re.findall(r"# tensorx$", source, re.MULTILINE)) == 2
    out = run_example("custom_trainer.py", "--transport", "tcp", "--epochs", "3")
    match = re.search(r"^accuracy (\d\.\d+)$", out, re.MULTILINE)
    assert match, out
    assert float(match.group(1)) >= 0.85


@pytest.mark.slow
def test_async_service_workers_join_and_leave() -> None:
    out = run_example("async_service.py", "--transport", "tcp", "--steps", "200",
                      timeout=300)
    assert "worker 2 left" in out
    match = re.search(r"^accuracy (\d\.\d+)$", out, re.MULTILINE)
    assert match, out
    assert float(match.group(1)) >= 0.85
