"""Named exports (``node.export(region, name=)``) and ``ep.lookup(name)``, and what an op
on a descriptor that is no longer good says."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import tensorx as tx
from tests.support.lanes import lanes, node_transport


@pytest.mark.parametrize("lane", lanes())
async def test_a_peer_looks_a_named_export_up_and_uses_it(lane: str) -> None:
    table = np.arange(32, dtype=np.float32).reshape(8, 4)
    async with tx.Node(transport=node_transport(lane)) as owner, \
            tx.Node(None, transport=node_transport(lane)) as client:
        exported = owner.export(table, name="table")
        ep = await client.connect(owner.address)
        desc = await ep.lookup("table")
        assert desc == exported
        assert (desc.name, desc.dtype, desc.shape) == ("table", "float32", (8, 4))
        out = np.zeros(4, np.float32)
        await ep.read(tx.MemoryRegion.register(out), desc, 0, 16, 16)  # bytes: row 1
        assert out.tolist() == [4, 5, 6, 7]
        listed = (await ep.query("exports"))["exports"]
        assert [(e["name"], e["dtype"], e["shape"]) for e in listed] == \
            [("table", "float32", [8, 4])]


async def test_an_unknown_name_lists_the_names_there_are_and_no_cookie() -> None:
    async with tx.Node(transport="tcp") as owner, tx.Node(None, transport="tcp") as client:
        region_a = tx.MemoryRegion.register(bytearray(8))
        a = owner.export(region_a, name="a")
        owner.export(bytearray(8))  # unnamed: not listed
        ep = await client.connect(owner.address)
        with pytest.raises(tx.RegionError) as info:
            await ep.lookup("b")
        assert str(info.value).endswith(
            f"peer says: node {owner.id} exports no region named 'b'; its named exports: 'a'")
        assert str(a.cookie) not in str(info.value) and f"{a.cookie:x}" not in str(info.value)
        owner.unexport(region_a)
        with pytest.raises(tx.RegionError, match=r"it has no named exports \(Node.export"):
            await ep.lookup("a")


@pytest.mark.parametrize("name", ["", " a", "a ", "a" * 65, "a\nb", "\x1b[31m", 5])
async def test_a_bad_name_is_a_usage_error_at_both_ends(name: object) -> None:
    async with tx.Node(transport="tcp") as owner, tx.Node(None, transport="tcp") as client:
        with pytest.raises(tx.UsageError, match="1 to 64 printable characters"):
            owner.export(bytearray(8), name=name)  # type: ignore[arg-type]
        ep = await client.connect(owner.address)
        with pytest.raises(tx.UsageError, match="1 to 64 printable characters") as info:
            await ep.lookup(name)  # type: ignore[arg-type]
        assert "\x1b" not in str(info.value) and "\n" not in str(info.value)
        if isinstance(name, str) and len(name) <= 64:  # what the owner says to a peer
            # that sends one anyway (the schema bounds its length): escaped
            with pytest.raises(tx.UsageError, match="peer says: an export's name") as said:
                await ep._channel.requests.query("lookup", 5, name=name)
            assert "\x1b" not in str(said.value) and "\n" not in str(said.value)


async def test_exporting_under_a_taken_name_replaces_the_export_that_had_it() -> None:
    old, new = np.zeros(4, np.int64), np.ones(4, np.int64)
    async with tx.Node(transport="tcp") as owner, tx.Node(None, transport="tcp") as client:
        first = owner.export(old, name="w")
        ep = await client.connect(owner.address)
        assert await ep.lookup("w") == first
        second = owner.export(new, name="w")
        assert await ep.lookup("w") == second != first
        out = tx.MemoryRegion.register(np.zeros(4, np.int64))
        # (the revocation came before the lookup's answer, on the same connection)
        with pytest.raises(tx.RegionError, match=r"\('w'\) was closed or unexported by its "
                           r"owner, or exported again under a new descriptor: look it up "
                           r"again \(await ep.lookup\('w'\)\)"):
            await ep.read(out, first)
        await ep.read(out, second)
        assert out.view(np.int64).tolist() == [1, 1, 1, 1]
        owner.unexport(tx.MemoryRegion.register(new))
        with pytest.raises(tx.RegionError, match="no region named 'w'"):
            await ep.lookup("w")
        # re-exported without a name: the name is gone with the export it belonged to
        owner.export(old, name="w")
        owner.export(old)
        with pytest.raises(tx.RegionError, match="no region named 'w'"):
            await ep.lookup("w")


async def test_a_descriptor_of_a_node_that_restarted_at_that_address_says_so() -> None:
    table = np.zeros((4, 2), np.float32)
    async with tx.Node(None, transport="tcp") as client:
        async with tx.Node(transport="tcp") as first:
            address = first.address
            first.export(table, name="table")
            stale = await (await client.connect(address)).lookup("table")
        async with tx.Node(address, transport="tcp") as second:  # restarted, same port
            second.export(table, name="table")
            ep = await client.connect(address)
            with pytest.raises(tx.RegionError) as info:
                await ep.read(tx.MemoryRegion.register(np.zeros(2, np.float32)), stale)
            assert str(info.value) == (
                f"region {stale.region_id:#x} ('table') was exported by node {first.id}, "
                f"the node at {address} before it restarted (it is node {second.id} now); a "
                "restarted node's regions have new descriptors: look it up again "
                "(await ep.lookup('table'))")
            await ep.read(tx.MemoryRegion.register(np.zeros(2, np.float32)),
                          await ep.lookup("table"))


async def test_a_descriptor_of_another_node_or_never_exported_says_what_to_use() -> None:
    async with tx.Node(transport="tcp") as a, tx.Node(transport="tcp") as b, \
            tx.Node(None, transport="tcp") as client:
        of_b = b.export(bytearray(8))
        ep = await client.connect(a.address)
        local = tx.MemoryRegion.register(bytearray(8))
        with pytest.raises(tx.RegionError, match=(
                f"belongs to node {b.id}, but this endpoint reaches node {a.id} at "
                f"{a.address}: use the descriptor on an endpoint to its owner")):
            await ep.read(local, of_b)
        with pytest.raises(tx.RegionError, match=r"was never exported: its descriptor comes "
                           r"from region.descriptor\(\)"):
            await ep.read(local, tx.MemoryRegion.allocate(8).descriptor())


@pytest.mark.parametrize("lane", lanes())
async def test_a_forged_or_altered_descriptor_says_what_to_do(lane: str) -> None:
    async with tx.Node(transport=node_transport(lane)) as owner, \
            tx.Node(None, transport=node_transport(lane)) as client:
        desc = owner.export(bytearray(64), name="t")
        ep = await client.connect(owner.address)
        local = tx.MemoryRegion.register(bytearray(8))
        with pytest.raises(tx.RegionError, match=(
                f"region {desc.region_id:#x} is not exported here under that descriptor "
                r"\(unexported, closed or exported again by its owner, or forged\): get its "
                r"current one \(ep.lookup\(name\) for a named export\)")):
            await ep.read(local, dataclasses.replace(desc, cookie=desc.cookie ^ 1))
        if lane != "tcp":  # a lane that bypasses the owner asks it about the descriptor
            with pytest.raises(tx.RegionError, match=r"claims 128 B.*but its owner exported "
                               r"64 B.*\(altered or forged\)"):
                await ep.read(local, dataclasses.replace(desc, nbytes=128))
