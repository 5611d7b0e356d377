"""A node that only connects starts UCX once a peer offers it, and then chooses the lanes a
node with UCX started up front would (transport/_ucx_later.py)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest

import tensorx as tx
from tensorx.testing import wait_until
from tests.support.lanes import HAVE_UCX

needs_ucx = pytest.mark.skipif(not HAVE_UCX, reason="ucxx not installed")


def test_a_client_that_meets_no_ucx_peer_never_loads_ucx() -> None:
    """In a process of its own: only there is "UCX never loaded" a fact to assert."""
    code = textwrap.dedent("""
        import asyncio
        import tensorx as tx
        from tensorx.transport import _ucp

        async def main():
            async with tx.Node(transport="tcp") as server, \\
                    tx.Node(None, transport="auto") as client:
                ep = await client.connect(server.address)
                assert ep.info["transport"] == "tcp", ep.info
                assert "not started here" in ep.info["skipped"]["ucx"], ep.info
                assert client._ucx_later is not None and not client._ucx_later.started
            assert _ucp._loaded is None, "UCX was loaded"
            print("ok")

        asyncio.run(main())
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=False)
    assert out.stdout.strip() == "ok", out.stderr[-3000:]


@needs_ucx
async def test_a_client_starts_ucx_for_a_peer_that_offers_it_and_chooses_as_before() -> None:
    data = np.zeros(64, dtype=np.uint8)
    async with tx.Node() as server, tx.Node(None) as late, \
            tx.Node("tcp://127.0.0.1:0") as eager:  # a listening node starts UCX at once
        assert late._ucx_later is not None and eager._ucx_later is None
        before = late.export(data)  # exported before UCX started: no UCX keys
        assert "ucx" not in before.keys
        ep_late, ep_eager = await late.connect(server.address), \
            await eager.connect(server.address)
        assert late._ucx_later is None  # started and taken
        for key in ("transport", "lanes", "why"):
            assert ep_late.info[key] == ep_eager.info[key], (ep_late.info, ep_eager.info)
        assert ep_late.info["transport"] == "ucx"
        [after] = late.exports()
        assert "ucx" in after.keys and after.cookie == before.cookie
        await wait_until(lambda: any(ep.peer == late.id for ep in server.endpoints))
        peer_ep = next(ep for ep in server.endpoints if ep.peer == late.id)
        src = tx.MemoryRegion.register(np.full(64, 7, dtype=np.uint8))
        await peer_ep.write(src, before)  # the old descriptor: over TCP, owner-checked
        assert (data == 7).all()
        src.view(np.uint8)[:] = 9
        await peer_ep.write(src, after)  # the new one: over UCX
        assert (data == 9).all()


@needs_ucx
async def test_require_and_transport_ucx_start_ucx_up_front() -> None:
    for options in ({"require": "ucx"}, {"transport": "ucx"}):
        async with tx.Node(None, **options) as node:  # type: ignore[arg-type]
            assert node._ucx_later is None
            assert any(f.name == "ucx" for f in node._factories)
