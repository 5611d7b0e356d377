"""Meeting across machines through the launcher's store: ``torch.distributed.TCPStore``.

Processes start under torchrun (or anything that sets ``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT``). Each parameter-server shard publishes its address under
``tensorx/ps/<shard>``; workers wait for all of them. No home-made cluster manager.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta
from typing import Protocol
from urllib.parse import urlsplit

from tensorx.errors import TimeoutError, UsageError

__all__ = ["Store", "advertised", "connect_store", "launched", "lookup", "publish", "wait_keys"]

KEY = "tensorx/ps/{}"


class Store(Protocol):
    """What tensorx uses of a launcher's key-value store (torch.distributed's TCPStore)."""

    def set(self, key: str, value: str) -> None: ...

    def get(self, key: str) -> bytes: ...

    def wait(self, keys: list[str], timeout: timedelta) -> None: ...


def launched() -> bool:
    """True when a launcher set the torchrun environment."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def connect_store(timeout: float = 300.0) -> Store:
    """The launcher's TCPStore: hosted by torchrun's agent, or by rank 0 when there is none."""
    if not launched():
        raise UsageError("RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT must be set "
                         "(start under torchrun)")
    from torch.distributed import TCPStore  # type: ignore[attr-defined]  # noqa: PLC0415 (optional dependency)

    agent_hosts = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    is_master = int(os.environ["RANK"]) == 0 and not agent_hosts
    return TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                    int(os.environ["WORLD_SIZE"]), is_master,
                    timedelta(seconds=timeout), wait_for_workers=False)


def advertised(address: str) -> str:
    """``address`` with a wildcard host replaced by this machine's outward address."""
    parts = urlsplit(address)
    if parts.hostname not in ("0.0.0.0", "::", ""):
        return address
    return f"{parts.scheme}://{_outward_ip()}:{parts.port}"


def _outward_ip() -> str:
    target = os.environ.get("MASTER_ADDR", "8.8.8.8")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((target, 9))  # UDP: no packet is sent; picks the route's source address
            return str(s.getsockname()[0])
        except OSError:
            return socket.gethostbyname(socket.gethostname())


def publish(store: Store, shard: int, address: str) -> None:
    store.set(KEY.format(shard), advertised(address))


def lookup(store: Store, num_shards: int, timeout: float = 300.0) -> list[str]:
    """Every shard's address, in shard order; waits until all have published."""
    keys = [KEY.format(s) for s in range(num_shards)]
    return wait_keys(store, keys, timeout, f"parameter servers did not publish {keys}")


def wait_keys(store: Store, keys: list[str], timeout: float, missing: str,
              hint: str = "") -> list[str]:
    """The values of ``keys`` in ``store``, waiting up to ``timeout`` s for all of them;
    else TimeoutError saying ``missing`` (then ``hint``)."""
    try:
        store.wait(keys, timedelta(seconds=timeout))
    except Exception as exc:  # torch raises its own DistStoreError / RuntimeError
        raise TimeoutError(f"{missing} within {timeout} s: {hint or exc}") from exc
    return [store.get(k).decode() for k in keys]
