"""Shards publish their addresses in the launcher's TCPStore; workers find them there."""

from __future__ import annotations

import socket

import pytest

from tensorx._ps.common import rendezvous
from tensorx.errors import TimeoutError, UsageError
from tensorx.worker import ps_addresses


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def torchrun_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)


@pytest.mark.usefixtures("torchrun_env")
def test_workers_find_the_published_shards(monkeypatch: pytest.MonkeyPatch) -> None:
    host_store = rendezvous.connect_store(timeout=10)  # rank 0 hosts it (no agent)
    rendezvous.publish(host_store, 1, "tcp://0.0.0.0:7001")
    rendezvous.publish(host_store, 0, "tcp://10.0.0.5:7000")
    monkeypatch.setenv("RANK", "1")
    found = ps_addresses(2, timeout=10)
    assert found[0] == "tcp://10.0.0.5:7000"
    assert found[1].startswith("tcp://") and ":7001" in found[1]
    assert "0.0.0.0" not in found[1]  # a wildcard is replaced by a reachable address


@pytest.mark.usefixtures("torchrun_env")
def test_a_missing_shard_times_out_clearly() -> None:
    store = rendezvous.connect_store(timeout=10)
    with pytest.raises(TimeoutError, match="tensorx/ps/0"):
        rendezvous.lookup(store, 1, timeout=0.5)


def test_without_a_launcher_it_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    with pytest.raises(UsageError, match="torchrun"):
        rendezvous.connect_store()
