"""A caller's time budget reaches every step it covers: no fixed cap shortens it.

Each test stands in a clock that moves only when told (tensorx._deadline reads it), a
step that "takes" longer than the old cap by moving it, and the next step reporting the
budget it was handed: exact figures, no waiting, no wall clock.
"""

from __future__ import annotations

from typing import Any

import pytest

import tensorx as tx
from tensorx import _deadline
from tensorx.transport._ucx_probe import AddressProbe
from tests.support.lanes import HAVE_UCX

needs_ucx = pytest.mark.skipif(not HAVE_UCX, reason="ucxx not installed")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(_deadline, "_clock", c)
    return c


@pytest.mark.parametrize("budget", [3600.0, None])
async def test_a_ucx_address_probe_gets_the_callers_budget(budget: float | None) -> None:
    """It got at most 10 s (PROBE_TIMEOUT), and 10 s when the caller gave no limit."""
    given: list[float | None] = []

    async def run(address: bytes, error_handling: bool,
                  timeout: float | None) -> tuple[int, int, str]:
        given.append(timeout)
        return 0, 0, "OK"

    probe = AddressProbe(-1, {})  # never runs a child
    probe._run = run  # type: ignore[method-assign]
    await probe.check(b"address", True, "peer", budget)
    assert given == [budget]


@pytest.mark.ucx
@needs_ucx
@pytest.mark.parametrize("budget", [3600.0, None])
async def test_opening_a_ucx_lane_spends_the_callers_connect_budget(
        clock: Clock, budget: float | None) -> None:
    """Opening a UCX lane (within Node.connect) had at most 10 s (CONNECT_TIMEOUT), also
    under timeout=None: a probe that took 11 s left the connect step nothing."""
    from tensorx.transport.ucx import UcxFactory, UcxLane

    given: dict[str, Any] = {}

    async def probe(address: bytes, error_handling: bool, peer: str,
                    timeout: float | None) -> None:
        given["probe"] = timeout
        clock.now += 11.0  # answers after the old cap

    async def connect(self: UcxLane, timeout: float | None) -> None:
        given["connect"] = timeout

    factory = UcxFactory()
    try:
        factory._probe.check = probe  # type: ignore[method-assign]
        original, UcxLane._connect = UcxLane._connect, connect  # type: ignore[method-assign]
        try:
            lane = await factory.connect(factory.local_info(), peer="self", timeout=budget)
        finally:
            UcxLane._connect = original  # type: ignore[method-assign]
        lane.abort()
    finally:
        await factory.aclose()
    assert given == {"probe": budget, "connect": None if budget is None else budget - 11.0}


@pytest.mark.ucx
@needs_ucx
async def test_reopening_a_force_closed_ucx_endpoint_spends_the_ops_budget(
        clock: Clock) -> None:
    """An op that had to reopen the endpoint (a read before it raised) gave the reopening
    at most 2 s (CLOSE_TIMEOUT) of its budget."""
    from tensorx.transport.ucx import UcxFactory

    factory = UcxFactory()
    try:
        lane = await factory.connect(factory.local_info(), peer="self", timeout=60)
        try:
            given: list[float | None] = []
            real_connect = lane._connect

            async def connect(timeout: float | None) -> None:
                given.append(timeout)
                await real_connect(timeout)

            lane._connect = connect  # type: ignore[method-assign]
            lane._rt.forget(lane._teardown(True))  # as a read that raised leaves it
            lane._reopen = True
            await lane.flush(timeout=3600)
            assert given == [3600]
        finally:
            await lane.aclose()
    finally:
        await factory.aclose()


@pytest.mark.parametrize("budget", [3600.0, None])
async def test_asking_the_owner_about_a_descriptor_spends_the_ops_budget(
        clock: Clock, budget: float | None) -> None:
    """Over a lane that bypasses the owner, the endpoint checks a new descriptor with it
    first: that question waited the node's timeout (30 s), whatever the op's budget."""
    async with tx.Node(same_host=True, timeout=30) as owner, \
            tx.Node(None, same_host=True, timeout=30) as node:
        with tx.MemoryRegion.allocate(64) as theirs, tx.MemoryRegion.allocate(64) as mine:
            desc = owner.export(theirs)
            ep = await node.connect(owner.address)
            assert ep._lane.bypasses_owner  # (cma, or ucx)
            given: list[float | None] = []
            real = ep._channel.requests.validate

            async def validate(rid: int, ck: int, timeout: float | None) -> tuple[int, str]:
                given.append(timeout)
                return await real(rid, ck, timeout)

            ep._channel.requests.validate = validate  # type: ignore[method-assign]
            await ep.write(mine, desc, timeout=budget)
            await ep.read(mine, desc, timeout=budget)  # known now: not asked again
    assert given == [budget]
