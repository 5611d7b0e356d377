"""A service process for restart tests: a :class:`tensorx.Node` that exports a float32
table under the name ``"table"`` (every element ``fill``), prints its address, and serves
until SIGTERM, on which it closes its node (its peers see a clean close) and exits. Run it
with :class:`TableOwner`, or ``python -m tensorx.testing._table LISTEN TRANSPORT FILL``."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np

import tensorx as tx
from tensorx._deadline import wait_for

ROWS, COLS = 16, 4


class TableOwner:
    """The service above in a process of its own, which a test can signal (SIGTERM,
    SIGKILL, SIGSTOP) and start again at the same address."""

    def __init__(self, listen: str = "tcp://127.0.0.1:0", transport: str = "auto",
                 fill: float = 1.0) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(Path(tx.__file__).parents[1]), os.environ.get("PYTHONPATH", "")])}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tensorx.testing._table", listen, transport, str(fill)],
            stdout=subprocess.PIPE, env=env, text=True)
        self.address = ""

    async def started(self, timeout: float = 30.0) -> TableOwner:
        """Wait for its address (it listens then)."""
        assert self.proc.stdout is not None
        line = await wait_for(asyncio.to_thread(self.proc.stdout.readline), timeout)
        if not line:
            raise RuntimeError(f"the table owner exited ({self.proc.wait()}) before listening")
        self.address = line.strip()
        return self

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    async def exited(self, timeout: float = 30.0) -> int:
        return await wait_for(asyncio.to_thread(self.proc.wait), timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


async def _serve(listen: str, transport: str, fill: float) -> None:
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    table = np.full((ROWS, COLS), fill, np.float32)
    async with tx.Node(listen, transport=transport) as node:
        node.export(table, name="table")
        print(node.address, flush=True)
        await stop.wait()


if __name__ == "__main__":
    asyncio.run(_serve(sys.argv[1], sys.argv[2], float(sys.argv[3])))
