"""Transport conformance: :func:`tensorx.testing.check_lane` over every lane (a real owner
process, real sockets), one test per check so that a failure names it."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import AsyncIterator
from typing import Any

import pytest

import tensorx as tx
from tensorx.testing import LANE_CHECKS, LanePair, MakePair, check_lane, owner_pair
from tests.support.lanes import assert_lane, lanes, node_transport


def lane_pair(lane: str) -> MakePair:
    """:func:`owner_pair` over ``lane``, which the endpoint is checked to use."""
    make = owner_pair(node_transport(lane))

    @contextlib.asynccontextmanager
    async def checked() -> AsyncIterator[LanePair]:
        async with make() as pair:
            assert_lane(pair.ep, lane)
            yield pair

    return checked


@pytest.mark.parametrize("check", list(LANE_CHECKS))
@pytest.mark.parametrize("lane", lanes())
async def test_lane(lane: str, check: str) -> None:
    await check_lane(lane_pair(lane), [check])


async def test_a_lane_that_loses_bytes_fails_the_suite_naming_the_check() -> None:
    """What a lane's author sees: the suite over a TCP endpoint whose writes move nothing."""
    make = owner_pair("tcp")

    @contextlib.asynccontextmanager
    async def lossy() -> AsyncIterator[LanePair]:
        async with make() as pair:
            async def write(*args: Any, **kw: Any) -> None:
                pass

            pair.ep.write = write  # type: ignore[method-assign]
            yield pair

    with pytest.raises(AssertionError) as failed:
        await check_lane(lossy, ["sizes"])
    if sys.version_info >= (3, 11):
        assert failed.value.__notes__ == ["in lane check 'sizes'"]


async def test_unknown_checks_are_named() -> None:
    with pytest.raises(tx.UsageError, match="no lane check nope"):
        await check_lane(owner_pair("tcp"), ["nope"])


async def test_a_notification_the_tcp_lane_carries_waits_for_same_host_writes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Same host with TCP as the lane between hosts (UCX off): a write of no bytes goes by
    TCP, which carries its notification in the write's frame, while a large write is still
    in flight by CMA. The notification waits for the CMA write (it once overtook it)."""
    monkeypatch.setenv("TENSORX_UCX_TCP", "0")
    make = owner_pair("auto")

    @contextlib.asynccontextmanager
    async def over_cma_and_tcp() -> AsyncIterator[LanePair]:
        async with make() as pair:
            assert pair.ep.info["lanes"] == ["cma", "tcp/socket"], pair.ep.info
            yield pair

    await check_lane(over_cma_and_tcp, ["notify-with-data-after-large-writes"])
