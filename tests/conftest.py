from __future__ import annotations

import atexit
import importlib.util
import json
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import hypothesis  # noqa: F401  # see below
import pytest

# Imported before any test runs, not by its pytest plugin at the session's end: there, the
# import's ast.parse can race with a thread a test left compiling (torch's lazy imports in a
# shard's apply thread) and CPython 3.11.7 raises "SystemError: AST constructor recursion
# depth mismatch" (gh-106905: the parser's depth counter was global state), after every
# test passed, when a single file that does not use hypothesis is run on its own.

if TYPE_CHECKING:
    from tensorx.endpoint import Endpoint
    from tensorx.transport.cma import CmaLane
    from tensorx.worker import Worker

# Tokenless nodes use the per-user secret: keep the tests' one out of the real home
# (set before any test runs, so every process the tests start inherits it).
# A process the tests spawn imports this module again: it keeps the folder it inherited.
if "TENSORX_SECRET_DIR" not in os.environ:
    os.environ["TENSORX_SECRET_DIR"] = tempfile.mkdtemp(prefix="tensorx-secret-")
    atexit.register(shutil.rmtree, os.environ["TENSORX_SECRET_DIR"], True)

HAVE_UCX = importlib.util.find_spec("ucxx") is not None
NOBODY = 65534  # "another user" (uid and gid of nobody)
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to play another user")

# This host has no RDMA NIC, so the suite's UCX lanes are UCX's tcp, which a node runs only
# when told the network is trusted (it bounds nothing). Child processes inherit this; the
# tests of the default (tests/test_ucx_safety.py) start their owners without it.
os.environ.setdefault("TENSORX_UCX_TCP", "1")
# Choices measured in one test (pipelined rounds, overlap) must not steer another, nor a
# later run of the suite: nothing is remembered across runs, but where a test says so
# (tests/test_ps_remembered.py, with a cache folder of its own).
os.environ["TENSORX_REMEMBER"] = "0"


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


def assert_lane(ep: Endpoint, lane: str) -> None:
    """``ep`` uses the lane a :func:`lanes` parameter names (and no other)."""
    host = str(ep.info.get("host", ""))
    if lane == "cma":
        assert host.startswith("cma"), ep.info
    else:
        assert ep.info["transport"] == lane and not host.startswith("cma"), ep.info


def links() -> list[object]:
    """The parameter-server variants every correctness test runs over: ``"default"``, what
    a user gets (``transport="auto"``, ``share_memory=True``: on one host the workers map
    the shards' arenas where the plan allows, and then no byte of a tensor crosses a
    lane), then each of :func:`lanes` with ``share_memory=False``, where every push and
    pull crosses that lane."""
    return [pytest.param("default", id="default"), *lanes()]


def link_options(link: str) -> dict[str, Any]:
    """``transport`` and ``share_memory`` for a :func:`links` parameter (servers and
    workers take both)."""
    if link == "default":
        return {"transport": "auto", "share_memory": True}
    return {"transport": node_transport(link), "share_memory": False}


def assert_link(worker: Worker, link: str) -> None:
    """A worker trained over a lane (any :func:`links` parameter but ``"default"``, which
    is whatever the defaults give) mapped nothing, and every endpoint of its node uses that
    lane and carried the worker's bytes: the test could not have passed with bytes never
    crossing it. Call it before the worker closes."""
    if link == "default":
        return
    assert not any(worker.mapped), worker.mapped
    eps = worker.node.endpoints
    assert eps, "the worker has no endpoint"
    for ep in eps:
        assert_lane(ep, link)
        moved = ep.stats.nbytes["write"] + ep.stats.nbytes["read"]
        assert moved > 0, f"no byte crossed {ep!r}"
        if link == "cma":  # the CMA lane carried ops itself, not the TCP lane under it
            assert cma_lane(ep).ops > 0, f"the CMA lane of {ep!r} carried no op"


def lanes_of(ep: Endpoint) -> list[Any]:
    """The lanes of ``ep``, fastest first."""
    lane: Any = ep._lane
    return list(getattr(lane, "lanes", [lane]))


def cma_lane(ep: Endpoint) -> CmaLane:
    """The CMA lane of ``ep``."""
    from tensorx.transport.cma import CmaLane

    found = [lane for lane in lanes_of(ep) if isinstance(lane, CmaLane)]
    assert found, f"no CMA lane among {lanes_of(ep)!r}"
    return found[0]


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


async def retried(caplog: pytest.LogCaptureFixture, attempts: int = 1) -> None:
    """Wait until a worker logged ``attempts`` failed rejoin attempts (``caplog`` set to
    INFO for ``tensorx.worker``): a server restarted after that is met by a retry."""
    from tensorx.testing import wait_until

    await wait_until(lambda: any(f"rejoin attempt {attempts} failed" in r.getMessage()
                                 for r in caplog.records), 30, what="a failed rejoin attempt")


def only_warning(caplog: pytest.LogCaptureFixture) -> str:
    """The one line logged at WARNING or above (asserted to be the only one)."""
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1, warnings
    return warnings[0]


def plant(path: Path, marker: Path) -> None:
    """Put at ``path`` (a new file in place of whatever is there, as an attacker would)
    a shared object whose constructor creates ``marker``: if anything ever loads it, even
    to fail at once on a missing symbol, ``marker`` exists. Skips without a C compiler."""
    cc = shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler here to build a planted object")
    source = ("#include <fcntl.h>\n#include <unistd.h>\n"
              "__attribute__((constructor)) static void planted(void) {\n"
              f"    int fd = open({json.dumps(str(marker))}, O_CREAT | O_WRONLY, 0600);\n"
              "    if (fd >= 0) close(fd);\n}\n")
    with tempfile.TemporaryDirectory(prefix="tensorx-plant-") as tmp:
        (Path(tmp) / "planted.c").write_text(source)
        out = Path(tmp) / "planted.so"
        subprocess.run([cc, "-shared", "-fPIC", "-o", str(out), str(Path(tmp) / "planted.c")],
                       check=True, capture_output=True, timeout=60)
        path.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(out, path.with_name(path.name + ".planting"))
    os.replace(path.with_name(path.name + ".planting"), path)
