"""The event loop tensorx's own processes run on (``tensorx._eventloop``): uvloop by
choice, never by import; and the TCP lane works the same on it."""

from __future__ import annotations

import asyncio
import sys

import numpy as np
import pytest

import tensorx as tx
from tensorx import _eventloop
from tensorx.errors import UsageError
from tensorx.testing import OwnerProcess, check_timed_out_reads, digest, pattern


def test_asyncio_is_asked_for_by_name_or_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not _eventloop.use_uvloop("asyncio")
    monkeypatch.setenv(_eventloop.ENV, "asyncio")
    assert not _eventloop.use_uvloop()
    assert _eventloop.run(_loop_module()) == "asyncio"


def test_a_default_is_only_a_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(_eventloop.ENV, raising=False)
    assert not _eventloop.use_uvloop(default="asyncio")
    assert not _eventloop.use_uvloop("asyncio", default="auto")


def test_an_unknown_loop_is_a_usage_error(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(UsageError, match="expected one of auto, asyncio, uvloop"):
        _eventloop.use_uvloop("trio")
    monkeypatch.setenv(_eventloop.ENV, "tokio")
    with pytest.raises(ValueError, match="tokio"):
        _eventloop.use_uvloop()


def test_uvloop_asked_for_but_missing_says_how_to_install(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)  # import uvloop -> ImportError
    monkeypatch.delenv(_eventloop.ENV, raising=False)
    with pytest.raises(UsageError, match=r"tensorx-rdma\[uvloop\]"):
        _eventloop.use_uvloop("uvloop")
    assert not _eventloop.use_uvloop()  # auto: asyncio's own, quietly
    assert _eventloop.run(_loop_module()) == "asyncio"


def test_importing_tensorx_installs_no_loop_policy() -> None:
    assert type(asyncio.get_event_loop_policy()).__module__.startswith("asyncio")


def test_tcp_lane_on_uvloop_both_sides() -> None:
    """Owner and client on uvloop: data both ways at small and large sizes, a write with
    its notification, and a timed-out read whose late reply never lands."""
    pytest.importorskip("uvloop")
    _eventloop.run(_tcp_on_uvloop(), "uvloop")


async def _loop_module() -> str:
    return type(asyncio.get_running_loop()).__module__.split(".")[0]


async def _tcp_on_uvloop() -> None:
    assert await _loop_module() == "uvloop"
    async with OwnerProcess("tcp", env={_eventloop.ENV: "uvloop"}) as owner, \
            tx.Node(listen=None, transport="tcp") as node:
        assert await owner.call("loop") == "uvloop"
        ep = await node.connect(owner.address)
        for nbytes in (8, 64 << 10, 16 << 20):
            desc = await owner.export(nbytes)
            data = pattern(nbytes, seed=nbytes % 251)
            await ep.write(tx.MemoryRegion.register(data), desc)
            assert await owner.call("digest", desc.region_id) == digest(data)
            back = np.zeros(nbytes, np.uint8)
            await ep.read(tx.MemoryRegion.register(back), desc)
            assert digest(back) == digest(data)
        desc = await owner.export(4096)
        await ep.write(tx.MemoryRegion.register(pattern(4096, 7)), desc,
                       notify=f"check:{desc.region_id}:7".encode())
        assert (await node.notifications.get())[1] == b"checked"
        big, small = await owner.export(64 << 20, seed=3), await owner.export(4096, seed=4)
        assert await check_timed_out_reads(ep, big, small, small_seed=4)
