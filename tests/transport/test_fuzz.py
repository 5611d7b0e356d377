"""A bounded atheris run over the frame and descriptor parsers (fuzz/fuzz_wire.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("atheris")
HARNESS = Path(__file__).resolve().parents[2] / "fuzz" / "fuzz_wire.py"


def test_parsers_survive_coverage_guided_fuzzing(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(HARNESS), "-runs=50000", f"-artifact_prefix={tmp_path}/"],
        capture_output=True, text=True, timeout=100, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Done 50000 runs" in result.stderr
