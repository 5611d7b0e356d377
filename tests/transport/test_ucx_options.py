"""A bad UCX setting is a UsageError naming it when the node starts, for a node that listens
(UCX starts at once) and for one that only connects (UCX starts at its first UCX peer, which
may never come): never a failure in the middle of a handshake, nor a setting taken as it is."""

from __future__ import annotations

from typing import Any

import pytest

import tensorx as tx
from tests.support.lanes import HAVE_UCX

pytestmark = pytest.mark.skipif(not HAVE_UCX, reason="ucxx not installed")

BAD = {
    "chunk_bytes": ({"chunk_bytes": 0}, "chunk_bytes must be an int >= 1"),
    "inline_bytes": ({"inline_bytes": -1}, "inline_bytes must be an int >= 0"),
    "inline_progress": ({"inline_progress": 2.5}, "inline_progress must be an int"),
    "progress_spin_us": ({"progress_spin_us": -5}, "progress_spin_us must be a number >= 0"),
    "tls": ({"tls": 5}, "tls must be a string"),
    "options": ({"options": {"RNDV_THRESH": 1, 2: "y"}}, "options must map UCX setting names"),
    "error_handling": ({"error_handling": "yes"}, "error_handling must be True, False or None"),
    "unknown": ({"chunk": 1}, "unknown setting .chunk. .the settings are error_handling, tls"),
}


@pytest.mark.parametrize("listen", [None, "127.0.0.1:0"], ids=["connects", "listens"])
@pytest.mark.parametrize("case", list(BAD))
async def test_a_bad_ucx_setting_fails_when_the_node_starts(listen: str | None,
                                                            case: str) -> None:
    options, message = BAD[case]
    node = tx.Node(listen=listen, transport="auto", ucx_options=options)
    with pytest.raises(tx.UsageError, match=message):
        await start(node)


async def start(node: tx.Node) -> None:
    async with node:
        pass


async def test_good_settings_still_start() -> None:
    options: dict[str, Any] = {"chunk_bytes": 1 << 20, "inline_bytes": 0, "inline_progress": 0,
                               "progress_spin_us": 20.0, "options": {"RNDV_THRESH": "8k"}}
    async with tx.Node(listen=None, transport="auto", ucx_options=options) as node:
        assert node.transport == "auto"
