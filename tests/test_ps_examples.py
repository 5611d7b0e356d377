"""The examples run as a user would run them: real processes, real sockets."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_example(name: str, *args: str, timeout: float = 100) -> str:
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / name), *args],
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    assert proc.returncode == 0, f"{name} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def test_train_digits_reaches_95_percent() -> None:
    out = run_example("train_digits.py", "--transport", "tcp", "--quiet")
    match = re.search(r"^accuracy (\d\.\d+)$", out, re.MULTILINE)
    assert match, out
    assert float(match.group(1)) >= 0.95
