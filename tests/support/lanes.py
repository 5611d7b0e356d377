"""The lanes and links the transport and parameter-server tests run over (as parameters),
and the checks that bytes really crossed the one a test asked for."""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from tensorx.endpoint import Endpoint
    from tensorx.transport.cma import CmaLane
    from tensorx.worker import Worker

HAVE_UCX = importlib.util.find_spec("ucxx") is not None


def transports() -> list[object]:
    """Every backend the conformance suite runs over; ucx only where ucxx imports."""
    return ["tcp", pytest.param("ucx", marks=[pytest.mark.ucx, pytest.mark.skipif(
        not HAVE_UCX, reason="ucxx not installed")])]


def lanes() -> list[object]:
    """:func:`transports` and the same-host lane: ``"cma"`` is ``transport="auto"`` (the
    default) between two nodes of this host, which then move host memory by CMA."""
    return [*transports(), "cma"]


def node_transport(lane: str) -> str:
    """The ``Node(transport=)`` of a :func:`lanes` parameter."""
    return "auto" if lane == "cma" else lane


def assert_lane(ep: Endpoint, lane: str) -> None:
    """``ep`` uses the lane a :func:`lanes` parameter names (and no other)."""
    host = str(ep.info.get("host", ""))
    if lane == "cma":
        assert host.startswith("cma"), ep.info
    else:
        assert ep.info["transport"] == lane and not host.startswith("cma"), ep.info


def links() -> list[object]:
    """The parameter-server variants every correctness test runs over: ``"default"``, what
    a user gets (``transport="auto"``, ``share_memory=True``: on one host the workers map
    the shards' arenas where the plan allows, and then no byte of a tensor crosses a
    lane), then each of :func:`lanes` with ``share_memory=False``, where every push and
    pull crosses that lane."""
    return [pytest.param("default", id="default"), *lanes()]


def link_options(link: str) -> dict[str, Any]:
    """``transport`` and ``share_memory`` for a :func:`links` parameter (servers and
    workers take both)."""
    if link == "default":
        return {"transport": "auto", "share_memory": True}
    return {"transport": node_transport(link), "share_memory": False}


def assert_link(worker: Worker, link: str, *, every: bool = True) -> None:
    """A worker trained over a lane (any :func:`links` parameter but ``"default"``, which
    is whatever the defaults give) mapped nothing, and every endpoint of its node uses that
    lane and carried the worker's bytes (``every=False``: at least one did, for a shard the
    plan left empty): the test could not have passed with bytes never crossing it. Call it
    before the worker closes."""
    if link == "default":
        return
    assert not any(worker.mapped), worker.mapped
    eps = worker.node.endpoints
    assert eps, "the worker has no endpoint"
    carried = []
    for ep in eps:
        assert_lane(ep, link)
        moved = ep.stats.nbytes["write"] + ep.stats.nbytes["read"]
        assert moved > 0 or not every, f"no byte crossed {ep!r}"
        if moved and link == "cma":  # the CMA lane carried ops itself, not the TCP lane under it
            assert cma_lane(ep).ops > 0, f"the CMA lane of {ep!r} carried no op"
        carried.append(moved > 0)
    assert any(carried), f"no byte crossed any of {eps!r}"


def lanes_of(ep: Endpoint) -> list[Any]:
    """The lanes of ``ep``, fastest first."""
    lane: Any = ep._lane
    return list(getattr(lane, "lanes", [lane]))


def cma_lane(ep: Endpoint) -> CmaLane:
    """The CMA lane of ``ep``."""
    from tensorx.transport.cma import CmaLane

    found = [lane for lane in lanes_of(ep) if isinstance(lane, CmaLane)]
    assert found, f"no CMA lane among {lanes_of(ep)!r}"
    return found[0]
