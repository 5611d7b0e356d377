"""``Node.attach``: a same-host peer maps a region its owner allocated in shared memory.

The owner is a real process; the descriptor crosses between them as bytes, as it would over
any control channel. The parameter server's same-host mapping is one use of this
(``tests/test_ps_shm.py``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import multiprocessing as mp
from collections.abc import AsyncIterator
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import pytest

import tensorx as tx
from tensorx.node import SHM_KEY

NBYTES = 1 << 16


def _owner_main(conn: Connection, access: str) -> None:
    asyncio.run(_owner(conn, access))


async def _owner(conn: Connection, access: str) -> None:
    async with tx.Node(transport="tcp") as node:
        shared = tx.MemoryRegion.allocate(NBYTES, shared=True)
        private = tx.MemoryRegion.allocate(NBYTES)
        conn.send((node.export(shared, access).to_bytes(),
                   node.export(private, access).to_bytes()))
        view = shared.view(np.uint8)
        while True:
            cmd, arg = await asyncio.to_thread(conn.recv)
            if cmd == "fill":
                view[:] = arg
                conn.send("ok")
            elif cmd == "read":
                conn.send(bytes(view[:16]))
            elif cmd == "close":
                shared.close()
                conn.send("ok")
            else:
                return


@pytest.fixture(params=["rw", "r"])
async def owner(request: pytest.FixtureRequest) -> AsyncIterator[tuple[Any, str]]:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_owner_main, args=(child, request.param), daemon=True)
    proc.start()
    try:
        assert await asyncio.to_thread(parent.poll, 60), "owner never started"
        yield parent, request.param
    finally:
        parent.send(("stop", None))
        proc.join(10)
        if proc.is_alive():
            proc.kill()


def ask(conn: Any, cmd: str, arg: Any = None) -> Any:
    conn.send((cmd, arg))
    assert conn.poll(30), f"owner did not answer {cmd}"
    return conn.recv()


async def test_attach_maps_the_owners_memory(owner: tuple[Any, str]) -> None:
    conn, access = owner
    shared, _ = conn.recv()
    async with tx.Node(listen=None, transport="tcp") as node:
        region = node.attach(shared)  # bytes or a descriptor, both taken
        try:
            assert region.nbytes == NBYTES
            mine = region.view(np.uint8)
            ask(conn, "fill", 7)
            assert (mine == 7).all()  # the owner's stores show, no copy, no lane
            mine[:16] = 9
            # exported "rw": mapped shared, our stores reach the owner; "r": copy-on-write
            assert ask(conn, "read") == bytes([9 if access == "rw" else 7] * 16)
            ask(conn, "close")  # the owner unlinks the file; our mapping stays valid
            assert mine[:16].tolist() == [9] * 16
        finally:
            region.close()
        with pytest.raises(tx.RegionError):  # the file is gone now
            node.attach(shared)


async def test_attach_refuses_what_it_cannot_map(owner: tuple[Any, str]) -> None:
    conn, access = owner
    shared, private = (tx.RegionDescriptor.from_bytes(b) for b in conn.recv())
    async with tx.Node(listen=None, transport="tcp") as node:
        with pytest.raises(tx.UsageError, match="not in shared memory"):
            node.attach(private)
        moved = {**shared.keys, SHM_KEY: {**shared.keys[SHM_KEY], "host": "elsewhere"}}
        with pytest.raises(tx.UsageError, match="another host"):
            node.attach(dataclasses.replace(shared, keys=moved))
        if access == "r":
            with pytest.raises(tx.UsageError, match="read-only"):
                node.attach(shared, private=False)
        forged = {**shared.keys, SHM_KEY: {"host": shared.keys[SHM_KEY]["host"],
                                           "name": "../../etc/passwd"}}
        with pytest.raises(tx.TensorxError):
            node.attach(dataclasses.replace(shared, keys=forged))
        with pytest.raises(tx.UsageError):
            node.attach(object())  # type: ignore[arg-type]
