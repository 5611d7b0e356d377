"""The suite's environment (set before any test runs) and its fixtures. Helpers the tests
share are in :mod:`tests.support`, imported from there."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from collections.abc import Iterator

import hypothesis  # noqa: F401  # see below
import pytest

# Imported before any test runs, not by its pytest plugin at the session's end: there, the
# import's ast.parse can race with a thread a test left compiling (torch's lazy imports in a
# shard's apply thread) and CPython 3.11.7 raises "SystemError: AST constructor recursion
# depth mismatch" (gh-106905: the parser's depth counter was global state), after every
# test passed, when a single file that does not use hypothesis is run on its own.

# Tokenless nodes use the per-user secret: keep the tests' one out of the real home
# (set before any test runs, so every process the tests start inherits it).
# A process the tests spawn imports this module again: it keeps the folder it inherited.
if "TENSORX_SECRET_DIR" not in os.environ:
    os.environ["TENSORX_SECRET_DIR"] = tempfile.mkdtemp(prefix="tensorx-secret-")
    atexit.register(shutil.rmtree, os.environ["TENSORX_SECRET_DIR"], True)

# This host has no RDMA NIC, so the suite's UCX lanes are UCX's tcp, which a node runs only
# when told the network is trusted (it bounds nothing). Child processes inherit this; the
# tests of the default (tests/transport/test_ucx_safety.py) start their owners without it.
os.environ.setdefault("TENSORX_UCX_TCP", "1")
# Choices measured in one test (pipelined rounds, overlap) must not steer another, nor a
# later run of the suite: nothing is remembered across runs, but where a test says so
# (tests/ps/common/test_ps_remembered.py, with a cache folder of its own).
os.environ["TENSORX_REMEMBER"] = "0"


@pytest.fixture
def one_torch_thread() -> Iterator[None]:
    """Tiny ops on a shared 2-core box: OpenMP spinning costs more than it brings. For
    modules that train (``pytestmark = pytest.mark.usefixtures("one_torch_thread")``)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def fresh_fallbacks(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process has warned about no fallback yet (each kind warns once per process)."""
    from tensorx import _loud

    monkeypatch.setattr(_loud, "_said", set())
