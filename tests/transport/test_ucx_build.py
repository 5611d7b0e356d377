"""The UCX binding is built lazily, cached, and fails as TransportUnavailableError."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("libucx")

from tensorx.errors import TransportUnavailableError
from tensorx.transport import _ucp

pytestmark = pytest.mark.ucx


def test_import_has_no_side_effects() -> None:
    code = ("import os, sys; import tensorx.transport.ucx; "
            "assert 'ucxx' not in sys.modules and 'libucx' not in sys.modules; "
            "assert not [k for k in os.environ if k.startswith('UCX_')], os.environ")
    env = {k: v for k, v in os.environ.items() if not k.startswith("UCX_")}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=60)


def test_missing_compiler_is_transport_unavailable(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TENSORX_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setattr(_ucp, "_loaded", None)
    with pytest.raises(TransportUnavailableError, match="C compiler"):
        _ucp.load()
    assert not list(tmp_path.rglob("*.so"))


def test_build_is_cached_per_version_abi_and_source() -> None:
    lib = _ucp.load()
    assert _ucp.load() is lib
    version, _, libdir = _ucp.ucx_paths()
    cache = _ucp.cache_dir(version, libdir)
    assert version in cache.name
    assert list(cache.glob("_tensorx_ucp*.so"))
    assert lib.version().startswith(version.split(".")[0])
    assert lib.status_string(-16) == "Request canceled"
