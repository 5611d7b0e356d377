"""The UCX binding's first build: quiet when it works, the compiler's words when it fails."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from tests.support.host import NOBODY, as_root, plant
from tests.support.lanes import HAVE_UCX
from tests.support.logs import only_warning

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


def binding_file() -> Path:
    """Where the binding lives under the current cache root: the deterministic name another
    user would plant a shared object under."""
    from tensorx.transport import _ucp

    version, _, lib = _ucp.ucx_paths()
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    return _ucp.cache_dir(version, lib) / f"_tensorx_ucp{suffix}"


def load_here(marker: Path, caplog: pytest.LogCaptureFixture,
              monkeypatch: pytest.MonkeyPatch) -> str:
    """Load the binding in this process as a node's start would: the planted object that
    creates ``marker`` was not loaded (whatever the load did), and the binding works; the
    one WARNING the load logged."""
    from tensorx.transport import _ucp

    monkeypatch.setattr(_ucp, "_loaded", None)
    with caplog.at_level(logging.WARNING, logger="tensorx"):
        try:
            lib = _ucp.load()
        finally:
            assert not marker.exists(), "the planted object was loaded"
    assert lib.status_string(-16) == "Request canceled"
    return only_warning(caplog)


@pytest.mark.parametrize(("how", "why"), [
    ("world-writable cache", "writable by other users"),
    ("cache is a link", "symbolic link"),
    pytest.param("object of another uid", "owned by uid 65534", marks=as_root),
])
def test_a_binding_another_user_planted_is_never_loaded(
        tmp_path: Path, how: str, why: str, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """A shared object under the binding's name in a cache another user could write (its
    constructor would run as us at Node.start): not loaded; the binding is built privately,
    with one WARNING naming the path and why."""
    cache = tmp_path / "cache"
    root = tmp_path / "link" if how == "cache is a link" else cache
    cache.mkdir()
    cache.chmod(0o777 if how == "world-writable cache" else 0o700)
    if how == "cache is a link":
        root.symlink_to(cache)
    monkeypatch.setenv("TENSORX_CACHE_DIR", str(root))
    planted, marker = binding_file(), tmp_path / "marker"
    plant(planted, marker)
    if how == "object of another uid":
        planted.parent.chmod(0o700)
        os.chown(planted, NOBODY, NOBODY)
    said = load_here(marker, caplog, monkeypatch)
    assert why in said and str(tmp_path) in said, said


def test_a_binding_replaced_after_its_build_is_rebuilt(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """The binding an earlier process built, then replaced under the same name: the digest
    recorded at the build tells; it is rebuilt, not loaded."""
    cache = tmp_path / "cache"
    done = build(cache)
    assert done.returncode == 0, done.stdout + done.stderr
    monkeypatch.setenv("TENSORX_CACHE_DIR", str(cache))
    marker = tmp_path / "marker"
    plant(binding_file(), marker)
    said = load_here(marker, caplog, monkeypatch)
    assert "does not match" in said, said
