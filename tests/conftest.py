from __future__ import annotations

import atexit
import importlib.util
import os
import shutil
import tempfile
from collections.abc import Iterator

import pytest

# Tokenless nodes use the per-user secret: keep the tests' one out of the real home
# (set before any test runs, so every process the tests start inherits it).
# A process the tests spawn imports this module again: it keeps the folder it inherited.
if "TENSORX_SECRET_DIR" not in os.environ:
    os.environ["TENSORX_SECRET_DIR"] = tempfile.mkdtemp(prefix="tensorx-secret-")
    atexit.register(shutil.rmtree, os.environ["TENSORX_SECRET_DIR"], True)

HAVE_UCX = importlib.util.find_spec("ucxx") is not None

# This host has no RDMA NIC, so the suite's UCX lanes are UCX's tcp, which a node runs only
# when told the network is trusted (it bounds nothing). Child processes inherit this; the
# tests of the default (tests/test_ucx_safety.py) start their owners without it.
os.environ.setdefault("TENSORX_UCX_TCP", "1")


def transports() -> list[object]:
    """Every backend the conformance suite runs over; ucx only where ucxx imports."""
    return ["tcp", pytest.param("ucx", marks=[pytest.mark.ucx, pytest.mark.skipif(
        not HAVE_UCX, reason="ucxx not installed")])]


def lanes() -> list[object]:
    """:func:`transports` and the same-host lane: ``"cma"`` is ``transport="auto"`` (the
    default) between two nodes of this host, which then move host memory by CMA."""
    return [*transports(), "cma"]


def node_transport(lane: str) -> str:
    """The ``Node(transport=)`` of a :func:`lanes` parameter."""
    return "auto" if lane == "cma" else lane


@pytest.fixture
def one_torch_thread() -> Iterator[None]:
    """Tiny ops on a shared 2-core box: OpenMP spinning costs more than it brings. For
    modules that train (``pytestmark = pytest.mark.usefixtures("one_torch_thread")``)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
