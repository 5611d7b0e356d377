"""``Node.connect(address, reconnect=)``: an endpoint that outlives its connection and its
owner's restart, with real owner processes (SIGTERM, SIGKILL) over TCP and the same-host
lane."""

from __future__ import annotations

import asyncio
import logging
import re
import signal
import time

import numpy as np
import pytest

import tensorx as tx
from tensorx.testing import wait_until
from tensorx.testing._table import COLS, TableOwner
from tests.support.lanes import assert_lane, node_transport

logger = logging.getLogger(__name__)


@pytest.mark.parametrize(("lane", "sig"), [
    ("tcp", signal.SIGTERM), ("tcp", signal.SIGKILL), ("cma", signal.SIGKILL),
    pytest.param("cma", signal.SIGTERM, marks=pytest.mark.slow)])  # (5 s: UCX starts twice)
async def test_an_endpoint_outlives_its_owners_restart(lane: str, sig: int) -> None:
    transport = node_transport(lane)
    owner = await TableOwner(transport=transport, fill=1).started()
    restarted: TableOwner | None = None
    try:
        async with tx.Node(None, transport=transport) as client:
            ep = await client.connect(owner.address, reconnect=30)
            assert_lane(ep, lane)
            first = ep.peer
            desc = await ep.lookup("table")
            out = np.zeros((2, COLS), np.float32)
            await ep.read_rows(out, desc, [0, 5])
            assert (out == 1).all()
            # an op in flight when the owner goes: a lookup (a request the owner answers
            # itself, whatever the lane) while the owner cannot answer
            owner.signal(signal.SIGSTOP)
            in_flight = asyncio.create_task(ep.lookup("table"))
            await asyncio.sleep(0.2)
            assert not in_flight.done()
            owner.signal(sig)
            owner.signal(signal.SIGCONT)
            if sig == signal.SIGKILL:  # (SIGTERM: the owner may answer it before it goes)
                with pytest.raises(tx.BrokenError):
                    await in_flight
            else:
                await asyncio.gather(in_flight, return_exceptions=True)
            await owner.exited()
            gone = time.monotonic()
            restarted = await TableOwner(owner.address, transport, fill=2).started()
            # an op with the old descriptor waits for the reconnection, then is refused
            # saying why and what to do
            with pytest.raises(tx.RegionError, match=r"before it restarted .* look it up "
                               r"again \(await ep.lookup\('table'\)\)"):
                await ep.read_rows(out, desc, [0, 1])
            desc = await ep.lookup("table")
            await ep.read_rows(out, desc, [0, 5])
            logger.info("%s, %s: back %.2f s after the owner exited", lane,
                        signal.Signals(sig).name, time.monotonic() - gone)
            assert (out == 2).all() and ep.peer != first and not ep.closed
            assert_lane(ep, lane)
            assert client.endpoints == [ep] and client.disconnected.empty()
    finally:
        owner.kill()
        if restarted is not None:
            restarted.kill()


async def test_a_dropped_connection_to_the_same_node_keeps_its_descriptors() -> None:
    async with tx.Node(transport="tcp") as owner, tx.Node(None, transport="tcp") as client:
        table = np.arange(8, dtype=np.float32).reshape(4, 2)
        desc = owner.export(table, name="t")
        ep = await client.connect(owner.address, reconnect=10)
        messages = ep.messages
        old = owner.endpoints[0]
        old.abort()  # the link breaks; the owner lives on
        await wait_until(lambda: owner.endpoints and owner.endpoints[0] is not old,
                         what="the client's new connection")
        out = np.zeros((1, 2), np.float32)
        await ep.read_rows(out, desc, [3])  # waits for the reconnection; same node
        assert out.tolist() == [[6, 7]] and ep.peer == owner.id
        await owner.endpoints[0].notify(b"after")
        assert await messages.get(5) == b"after"  # the same stream, on the new connection


async def test_an_endpoint_that_cannot_reconnect_is_broken_saying_why() -> None:
    async with tx.Node(None, transport="tcp") as client:
        async with tx.Node(transport="tcp") as owner:
            address = owner.address
            ep = await client.connect(address, reconnect=0.5)
            messages = ep.messages
        assert await client.disconnected.get() is ep  # after the reconnect budget
        says = (f"endpoint to {address}: the connection ended (the peer closed it) and could "
                f"not reconnect to {address} within 0.5 s")
        with pytest.raises(tx.BrokenError, match=f"^{re.escape(says)}") as info:
            await ep.read(tx.MemoryRegion.allocate(8), tx.MemoryRegion.allocate(8).descriptor())
        host_port = address.removeprefix("tcp://")
        assert str(info.value).endswith(f"connection refused: nothing listens at {host_port} "
                                        "(not started yet, stopped, or another port?)")
        with pytest.raises(tx.BrokenError, match=f"^{re.escape(says)}"):
            await messages.get(1)
        assert ep.closed and not ep.reconnecting and client.endpoints == []


async def test_closing_an_endpoint_that_reconnects_stops_it() -> None:
    async with tx.Node(None, transport="tcp") as client:
        async with tx.Node(transport="tcp") as owner:
            ep = await client.connect(owner.address, reconnect=60)
        await asyncio.sleep(0.05)
        assert ep.reconnecting
        await ep.aclose()
        assert not ep.reconnecting and client.endpoints == []
        with pytest.raises(tx.ClosedError):
            await ep.lookup("t")


async def test_reconnect_must_be_positive_seconds() -> None:
    async with tx.Node(None) as client:
        for bad in (0, -1, "5", True):
            with pytest.raises(tx.UsageError, match="reconnect is seconds"):
                await client.connect("tcp://127.0.0.1:1", reconnect=bad)  # type: ignore[arg-type]
