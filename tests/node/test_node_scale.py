"""Messages whose size grows with a node: at ten times a real node's counts.

``tensorx info --node`` lists what a node exports and who is connected: a server with a
thousand exports, or a hundred workers, answered more than one header holds, and the
connection was closed as a protocol error. The answer now comes in pages. The parameter
server's messages that grow with the model (the hello's plan, the welcome's optimizer
groups, the optimizer state's manifest) ride in notifications of up to 16 MiB.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

import tensorx as tx
from tensorx import _wire
from tensorx._commands.info import format_node, query_node
from tensorx._ps.wire import protocol
from tensorx.graph_analyzer import GraphAnalyzer
from tests.support.lanes import transports

EXPORTS = 10_000  # the issue saw 1000 fail
PEERS = 900       # ... and 90 peers over tcp (70 over ucx)
TENSORS = 20_000  # a large model has a couple of thousand


@contextlib.contextmanager
def many_peers(node: tx.Node, like: Any, count: int) -> Iterator[None]:
    """``count`` more endpoints in ``node``'s table, each answering ``like``'s info under
    its own peer id (the answer reads nothing else of them); taken out again after."""

    class Seen:
        def __init__(self, i: int) -> None:
            self.info = {**like.info, "peer": f"{i:016x}"}

    fakes = [Seen(i) for i in range(count)]
    table: dict[Any, Any] = node._peers.endpoints
    table.update(dict.fromkeys(fakes))
    try:
        yield
    finally:
        for fake in fakes:
            del table[fake]


@pytest.mark.parametrize("transport", transports())
async def test_info_lists_every_export_and_peer_of_a_large_node(transport: str) -> None:
    async with tx.Node(transport=transport) as node, \
            tx.Node(listen=None, transport=transport) as client:
        regions = [tx.MemoryRegion.allocate(64) for _ in range(EXPORTS)]
        for region in regions:
            node.export(region, access="r")
        await client.connect(node.address)
        for _ in range(500):  # the accepting side adopts its endpoint once both are READY
            if node.endpoints:
                break
            await asyncio.sleep(0.01)
        with many_peers(node, node.endpoints[0], PEERS):
            answer = await query_node(node.address, None)
        assert len({e["region"] for e in answer["exports"]}) == EXPORTS  # each once
        assert len(answer["endpoints"]) == PEERS + 1  # the client, and the table's others
        assert "next" not in answer
        text = format_node(answer)
        assert f"exports ({EXPORTS}):" in text and f"endpoints ({PEERS + 1}," in text


def test_a_page_holds_one_header_and_an_item_too_large_is_noted() -> None:
    items = [{"peer": f"{i:04x}", "why": "x" * 300} for i in range(1000)]
    got, start = [], 0
    while True:
        page = _wire.page({"node": "n", "endpoints": items}, "endpoints", start)
        _wire.encode(_wire.Kind.ANSWER, {"req": 1, "data": page})  # fits in a header
        got += page["endpoints"]
        if "next" not in page:
            break
        start = page["next"]
    assert got == items
    huge = _wire.page({"node": "n", "exports": [{"x": "y" * _wire.MAX_HEADER}]}, "exports", 0)
    assert huge["exports"] == [{"omitted": huge["exports"][0]["omitted"]}]
    assert _wire.OMITTED in huge["exports"][0]["omitted"]


class Many(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.ps = nn.ParameterList([nn.Parameter(torch.zeros(2)) for _ in range(n)])


def test_a_servers_messages_for_a_model_of_many_tensors_fit() -> None:
    """The hello (the plan), the welcome (each tensor's label in its optimizer group) and
    the optimizer state's manifest, for :data:`TENSORS` tensors: each well under the
    16 MiB a control message may be, and read back as sent."""
    plan = GraphAnalyzer(Many(TENSORS)).plan()
    labels = [e.name for e in plan.entries]
    desc = b"d" * 64
    messages = {
        "hello": dict(proto=protocol.PROTOCOL, rank=0, num_workers=2, shard=0, num_shards=1,
                      fingerprint=plan.fingerprint, plan=plan.to_bytes(), params=desc,
                      verify=False, share=True, shards=None),
        "welcome": dict(slot=desc, headers=b"", version=0, mode="sync", checksum=None,
                        share={}, optim={"defaults": {"lr": 0.1}, "flat": False, "groups": [
                            {"hp": {"lr": 0.1}, "params": labels}]}, parts=[]),
        "state": dict(manifest={n: [i * 16, 8, "float32", [2]] for i, n in enumerate(labels)},
                      region=desc),
    }
    for kind, fields in messages.items():
        raw = protocol.encode(kind, **fields)
        assert len(raw) < protocol.MAX_CONTROL // 4, (kind, len(raw))
        assert protocol.decode(raw)["t"] == kind
