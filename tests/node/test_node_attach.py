"""``Node.attach``: a same-host peer maps a region its owner allocated in shared memory.

The owner is a real process; the descriptor crosses between them as bytes, as it would over
any control channel. The parameter server's same-host mapping is one use of this
(``tests/ps/worker/test_ps_shm.py``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator

import numpy as np
import pytest

import tensorx as tx
from tensorx.node import SHM_KEY
from tensorx.testing import OwnerProcess, digest

NBYTES = 1 << 16


@pytest.fixture(params=["rw", "r"])
async def owner(request: pytest.FixtureRequest) -> AsyncIterator[tuple[OwnerProcess, str]]:
    async with OwnerProcess("tcp") as proc:
        yield proc, request.param


async def exports(owner: OwnerProcess, access: str) -> tuple[bytes, bytes]:
    """The owner's region in shared memory and one in private memory, both exported
    ``access``: as descriptor bytes, as they would cross any control channel."""
    shared = await owner.call("export_allocated", NBYTES, 0, access, True)
    private = await owner.call("export_allocated", NBYTES, 0, access, False)
    return shared, private


async def test_attach_maps_the_owners_memory(owner: tuple[OwnerProcess, str]) -> None:
    proc, access = owner
    shared, _ = await exports(proc, access)
    rid = tx.RegionDescriptor.from_bytes(shared).region_id
    async with tx.Node(listen=None, transport="tcp") as node:
        region = node.attach(shared)  # bytes or a descriptor, both taken
        try:
            assert region.nbytes == NBYTES
            mine = region.view(np.uint8)
            await proc.call("fill", rid, 7)
            assert (mine == 7).all()  # the owner's stores show, no copy, no lane
            mine[:16] = 9
            # exported "rw": mapped shared, our stores reach the owner; "r": copy-on-write
            seen = bytes([9 if access == "rw" else 7] * 16) + bytes([7] * (NBYTES - 16))
            assert await proc.call("digest", rid) == digest(seen)
            await proc.call("close_region", rid)  # the owner unlinks the file; ours stays valid
            assert mine[:16].tolist() == [9] * 16
        finally:
            region.close()
        with pytest.raises(tx.RegionError):  # the file is gone now
            node.attach(shared)


async def test_attach_refuses_what_it_cannot_map(owner: tuple[OwnerProcess, str]) -> None:
    proc, access = owner
    shared, private = (tx.RegionDescriptor.from_bytes(b) for b in await exports(proc, access))
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
