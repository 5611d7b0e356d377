"""A fallback from the lane a user would expect is one WARNING per process, saying why and
how to change it; the endpoint's INFO line is short and whole; ``ep.info["lanes"]`` names
every lane that carries data and only paths that exist."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import tensorx as tx
from tensorx import _cuda, node
from tests.support.lanes import HAVE_UCX

pytestmark = pytest.mark.usefixtures("fresh_fallbacks")
ROOT = Path(__file__).resolve().parents[2]


def _said(caplog: pytest.LogCaptureFixture, text: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if text in r.getMessage()]


async def connect_twice(why: str) -> tuple[dict[str, Any], list[tuple[int, str]]]:
    """Two endpoints from a client-only node to a server (``why="peer"``: one without
    UCX); the last endpoint's info and what tensorx logged at INFO and above."""
    records: list[tuple[int, str]] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append((record.levelno, record.getMessage()))

    keep, log = Keep(logging.INFO), logging.getLogger("tensorx")
    level = log.level
    log.addHandler(keep)
    log.setLevel(logging.INFO)
    try:
        peer = {"transport": "tcp"} if why == "peer" else {}
        async with tx.Node(**peer) as a, tx.Node(listen=None) as b:
            for _ in range(2):
                ep = await b.connect(a.address)
                table = a.export(tx.MemoryRegion.register(np.arange(8, dtype=np.float32)))
                out = np.zeros(8, np.float32)
                await ep.read(tx.MemoryRegion.register(out), table)
                assert out[7] == 7
            info = {k: v for k, v in ep.info.items() if k in ("transport", "lanes", "skipped")}
    finally:
        log.removeHandler(keep)
        log.setLevel(level)
    return info, records


@pytest.mark.skipif(not HAVE_UCX, reason="UCX must be installed to be unused")
@pytest.mark.parametrize("why", ["here", "peer"])
async def test_ucx_installed_but_unused_is_one_warning(why: str) -> None:
    """UCX that cannot start here (no RDMA device, its tcp not allowed: a user's defaults
    on this host), or a peer without UCX: the first endpoint of the process logs one
    WARNING with the reason and what to do; the others (both sides, in this one process)
    say it at INFO (a server whose client lacks UCX says it at INFO only). Host memory
    still takes the same-host lane, and ``ep.info`` says so. Each case runs in a process
    of its own: UCX has one context per process, which the first node to start it sets
    up (here without its tcp, which would then be missing for the tests after it)."""
    script = ("import asyncio, json, sys; from tests.node.test_node_loud import connect_twice; "
              f"print(json.dumps(asyncio.run(connect_twice({why!r}))))")
    env = {**os.environ, "TENSORX_UCX_TCP": "0" if why == "here" else "1",
           "PYTHONPATH": str(ROOT)}
    done = await asyncio.to_thread(subprocess.run, [sys.executable, "-c", script], cwd=ROOT,
                                   env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    info, records = json.loads(done.stdout.strip().splitlines()[-1])
    assert info["transport"] != "ucx", info
    said = [(level, text) for level, text in records if "UCX is installed but unused" in text]
    assert said and said[0][0] == logging.WARNING, records
    assert [level for level, _ in said[1:]] == [logging.INFO] * (len(said) - 1)
    line = said[0][1]
    assert "transport='tcp' chooses TCP without this warning" in line, line
    # (which side warns first, and whether it lacks UCX itself or its peer does, depends
    # on which node starts UCX: said either way)
    if "the peer offers no UCX" in line:
        assert "usable on the peer too" in line, line
    else:
        assert "TENSORX_UCX_TCP=1" in line, line
    cma = ["cma"] if why == "here" else []  # a transport="tcp" peer offers no CMA
    assert info["lanes"] == [*cma, "tcp/socket"], info


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
