"""The UCX binding's first build: quiet when it works, the compiler's words when it fails."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import HAVE_UCX

pytestmark = [pytest.mark.ucx, pytest.mark.skipif(not HAVE_UCX, reason="ucxx not installed")]

BUILD = ("import logging, sys; logging.basicConfig(level=logging.WARNING)\n"
         "from tensorx.errors import TransportUnavailableError\n"
         "from tensorx.transport import _ucp\n"
         "try:\n    _ucp.load()\nexcept TransportUnavailableError as exc:\n"
         "    print('unavailable:', exc); sys.exit(3)\n")


def build(cache: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", BUILD], text=True, capture_output=True,
                          timeout=300, check=False,
                          env={**os.environ, "TENSORX_CACHE_DIR": str(cache), **env})


def test_the_first_build_prints_nothing(tmp_path: Path) -> None:
    done = build(tmp_path / "cache")
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout == "" and done.stderr == ""  # no pages of C compiler warnings
    assert list((tmp_path / "cache").glob("ucp-*/_tensorx_ucp*.so"))


def test_a_failed_build_shows_what_the_compiler_said(tmp_path: Path) -> None:
    cc = tmp_path / "cc"
    cc.write_text("#!/bin/sh\necho 'bogus compiler says no' >&2\nexit 1\n")
    cc.chmod(0o755)
    done = build(tmp_path / "cache", CC=str(cc))
    assert done.returncode == 3, done.stdout + done.stderr
    assert "cannot compile the UCX binding" in done.stdout
    assert "bogus compiler says no" in done.stderr
