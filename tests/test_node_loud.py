"""A fallback from the lane a user would expect is one WARNING per process, saying why and
how to change it; the endpoint's INFO line is short and whole; ``ep.info["lanes"]`` names
every lane that carries data and only paths that exist."""

from __future__ import annotations

import logging
import sys

import numpy as np
import pytest

import tensorx as tx
from tensorx import _cuda, node

from .conftest import HAVE_UCX

pytestmark = pytest.mark.usefixtures("fresh_fallbacks")


def _said(caplog: pytest.LogCaptureFixture, text: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if text in r.getMessage()]


@pytest.mark.skipif(not HAVE_UCX, reason="UCX must be installed to be unused")
@pytest.mark.parametrize("why", ["here", "peer"])
async def test_ucx_installed_but_unused_is_one_warning(
        why: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """UCX that cannot start here (no RDMA device, its tcp not allowed: a user's defaults
    on this host), or a peer without UCX: the first endpoint of the process logs one
    WARNING with the reason and what to do; the others (both sides, in this one process)
    say it at INFO (a server whose client lacks UCX says it at INFO only). Host memory
    still takes the same-host lane, and ``ep.info`` says so."""
    caplog.set_level(logging.INFO, logger="tensorx")
    if why == "here":
        monkeypatch.setenv("TENSORX_UCX_TCP", "0")
    peer = {"transport": "tcp"} if why == "peer" else {}
    async with tx.Node(**peer) as a, tx.Node(listen=None) as b:
        for _ in range(2):
            ep = await b.connect(a.address)
            table = a.export(tx.MemoryRegion.register(np.arange(8, dtype=np.float32)))
            out = np.zeros(8, np.float32)
            await ep.read(tx.MemoryRegion.register(out), table)
            assert out[7] == 7
    if ep.info["transport"] == "ucx":
        pytest.skip("UCX started here with its tcp (another test's context, this process)")
    said = _said(caplog, "UCX is installed but unused")
    assert said[0].levelno == logging.WARNING
    assert [r.levelno for r in said[1:]] == [logging.INFO] * (len(said) - 1)
    line = said[0].getMessage()
    assert "transport='tcp' chooses TCP without this warning" in line, line
    # (which side warns first, and whether it lacks UCX itself or its peer does, depends
    # on this process's one UCX context and on which node starts UCX: said either way)
    if "the peer offers no UCX" in line:
        assert "usable on the peer too" in line, line
    else:
        assert "TENSORX_UCX_TCP=1" in line, line
    cma = ["cma"] if why == "here" else []  # a transport="tcp" peer offers no CMA
    assert ep.info["lanes"] == [*cma, "tcp/socket"], ep.info


async def test_no_warning_when_tcp_is_chosen_or_ucx_is_not_installed(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="tensorx")
    async with tx.Node(transport="tcp") as a, tx.Node(listen=None, transport="tcp") as b:
        await b.connect(a.address)
    monkeypatch.setattr(node, "_installed", lambda module: False)
    monkeypatch.setitem(sys.modules, "tensorx.transport.ucx", None)  # import fails
    async with tx.Node() as a, tx.Node(listen=None) as b:
        await b.connect(a.address)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


async def test_info_line_is_short_and_whole_and_lanes_name_what_exists(
        caplog: pytest.LogCaptureFixture) -> None:
    """The endpoint's INFO line is cut nowhere (the reasons go to DEBUG and ``ep.info``);
    a CPU-only process lists no GPU path; the CMA lane is among ``lanes``."""
    caplog.set_level(logging.DEBUG, logger="tensorx.node")
    async with tx.Node() as a, tx.Node(listen=None) as b:
        ep = await b.connect(a.address)
    lines = [r for r in _said(caplog, "endpoint ") if "<->" in r.getMessage()]
    infos = [r.getMessage() for r in lines if r.levelno == logging.INFO]
    assert len(infos) == 2
    for line in infos:
        assert len(line) <= 200 and "more)" not in line and "why=" not in line, line
        assert f"lanes={','.join(ep.info['lanes'])}" in line or "lanes=" in line
    assert any("why=" in r.getMessage() for r in lines if r.levelno == logging.DEBUG)
    assert ep.info["lanes"][0] == "cma" and ep.info["host"].startswith("cma")
    if not _cuda.available():
        assert "gpu" not in ep.info
        assert not any("gpu=" in line for line in infos)
