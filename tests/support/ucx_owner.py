"""The UCX lane's owner process: a spawned process whose main thread sits in its event loop
waiting for test commands on a pipe, while only UCX's progress thread serves the reads and
writes. It works below the Node (a bare ``UcxFactory`` and its lane), which
:class:`tensorx.testing.OwnerProcess` (a whole Node) cannot stand in for.

Imports ``ucxx`` (through ``tensorx.transport.ucx``): import it after
``pytest.importorskip("ucxx")``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import multiprocessing as mp
import os
import signal
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from tensorx.memregion import MemoryRegion, RegionDescriptor
from tensorx.transport.base import Op
from tensorx.transport.ucx import UcxFactory, UcxLane

MiB = 1 << 20
OWNER_BYTES = 64 * MiB + 4096


def pattern(n: int, seed: int) -> np.ndarray:
    """Deterministic bytes (both processes can make the same ones)."""
    return (np.arange(n, dtype=np.uint64) * 2654435761 + seed).astype(np.uint8)


def digest(buf: Any) -> str:
    return hashlib.sha1(bytes(buf)).hexdigest()


def _owner_main(conn: Connection, error_handling: bool) -> None:
    asyncio.run(_owner(conn, error_handling))


async def _owner(conn: Connection, error_handling: bool) -> None:
    factory = UcxFactory(error_handling=error_handling)
    region = MemoryRegion.allocate(OWNER_BYTES)
    region.view(np.uint8)[:] = pattern(OWNER_BYTES, 3)
    keys = factory.register(region)
    desc = RegionDescriptor("owner", region.region_id, 1, region.nbytes, "cpu", "rw",
                            {"ucx": keys})
    conn.send((factory.local_info(), desc.to_bytes(), os.getpid()))
    loop = asyncio.get_running_loop()
    lane: UcxLane | None = None
    while True:
        cmd, *args = await loop.run_in_executor(None, conn.recv)
        if cmd == "stop":
            break
        if cmd == "digest":
            off, n = args
            conn.send(digest(region.buffer()[off:off + n]))
        elif cmd == "lane":  # symmetric: the owner opens its own lane to the client
            lane = await factory.connect(args[0], peer="client", timeout=10)
            conn.send(lane.info)
        elif cmd == "write_back":  # owner writes its first n bytes into the client region
            n, remote = args[0], RegionDescriptor.from_bytes(args[1])
            assert lane is not None
            await lane.write(Op(region, remote, 0, 0, n), timeout=10)
            conn.send("ok")
    if lane is not None:
        await lane.aclose()
    await factory.aclose()
    conn.send("bye")


class Owner:
    """A spawned process holding ``OWNER_BYTES`` registered with a ``UcxFactory`` of its own
    (``desc``, filled with ``pattern(OWNER_BYTES, 3)``) and answering :meth:`ask` on a pipe:
    ``digest`` of a range, ``lane`` (open its own lane back), ``write_back``, ``stop``."""

    def __init__(self, error_handling: bool = True) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_owner_main, args=(child, error_handling), daemon=True)
        self.proc.start()
        child.close()
        if not self.conn.poll(60):
            raise RuntimeError("owner process did not start")
        info, desc, self.pid = self.conn.recv()
        self.info: dict[str, Any] = info
        self.desc = RegionDescriptor.from_bytes(desc)

    def ask(self, *cmd: Any) -> Any:
        self.conn.send(cmd)
        if not self.conn.poll(30):
            raise RuntimeError(f"owner did not answer {cmd[0]}")
        return self.conn.recv()

    def kill(self) -> None:
        if self.proc.is_alive():
            os.kill(self.pid, signal.SIGKILL)
        self.proc.join(10)

    def stop(self) -> None:
        if self.proc.is_alive():
            with contextlib.suppress(OSError, EOFError, RuntimeError):
                self.ask("stop")
            self.proc.join(10)
        self.kill()
        self.conn.close()


@contextlib.contextmanager
def owner_process(error_handling: bool = True) -> Iterator[Owner]:
    owner = Owner(error_handling)
    try:
        yield owner
    finally:
        owner.stop()
