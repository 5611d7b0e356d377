"""Parameter servers and workers: in this event loop (:func:`servers`, :func:`workers`,
:func:`pipelined_cluster`, :func:`train_sync`), on a loop of their own for blocking callers
(:func:`serving_in_thread`), ``tensorx ps`` as a process
(:class:`PsProcess`), one thread per rank (:func:`on_ranks`), and the examples run as
processes (:func:`run_example`)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tensorx.ps import ParameterServer
from tensorx.worker import Worker
from tests.support.data import backward, batches
from tests.support.lanes import assert_link, link_options, node_transport
from tests.support.models import small_mlp
from tests.support.training import OptFactory

ROOT = Path(__file__).resolve().parents[2]


@contextlib.asynccontextmanager
async def servers(num_shards: int, num_workers: int, transport: str = "tcp",
                  **kw: Any) -> AsyncIterator[list[ParameterServer]]:
    async with contextlib.AsyncExitStack() as stack:
        shards = [await stack.enter_async_context(ParameterServer(
            "tcp://127.0.0.1:0", num_workers=num_workers, shard=s, num_shards=num_shards,
            transport=transport, **kw)) for s in range(num_shards)]
        yield shards


@contextlib.contextmanager
def serving_in_thread(num_shards: int, num_workers: int, **kw: Any) -> Iterator[list[str]]:
    """``num_shards`` real shards on a background event loop, for callers that block
    (``RemoteOptimizer``); yields their addresses. ``kw`` goes to every ParameterServer."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    run = lambda coro: asyncio.run_coroutine_threadsafe(coro, loop).result(60)  # noqa: E731
    shards: list[ParameterServer] = []
    try:
        for s in range(num_shards):
            ps = ParameterServer("tcp://127.0.0.1:0", num_workers=num_workers, shard=s,
                                 num_shards=num_shards, log_every=None, **kw)
            shards.append(ps)
            run(ps.start())
        yield [ps.address for ps in shards]
    finally:
        for ps in shards:
            run(ps.aclose())
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)
        loop.close()


@contextlib.asynccontextmanager
async def workers(models: Sequence[nn.Module], addresses: list[str], transport: str = "tcp",
                  **kw: Any) -> AsyncIterator[list[Worker]]:
    ws = [Worker(m, addresses, rank=r, num_workers=len(models), transport=transport, **kw)
          for r, m in enumerate(models)]
    try:
        await asyncio.gather(*(w.start() for w in ws))
        yield ws
    finally:
        await asyncio.gather(*(w.aclose() for w in ws), return_exceptions=True)


async def train_sync(opt: OptFactory, steps: int, num_shards: int, link: str = "default",
                     flat: bool = False, **kw: Any) -> list[torch.Tensor]:
    """Two sync workers over ``link`` (a :func:`links` parameter); rank 0's parameters."""
    data = batches(steps, 2)
    models = [small_mlp(), small_mlp(seed=99)]  # rank 1's own init must be overwritten
    options = link_options(link)
    async with servers(num_shards, 2, mode="sync", optimizer=opt, flat=flat, **options,
                       **kw) as shards, \
            workers(models, [ps.address for ps in shards], verify=True, **options) as ws:
        for step in data:
            for w, m, (x, y) in zip(ws, models, step, strict=True):
                w.zero_grad()
                backward(m, x, y)
            await asyncio.gather(*(w.step() for w in ws))
        for w in ws:
            assert_link(w, link)
        assert all(torch.equal(a, b) for a, b in
                   zip(models[0].parameters(), models[1].parameters(), strict=True))
        return [p.detach().clone() for p in models[0].parameters()]


@contextlib.asynccontextmanager
async def pipelined_cluster(lane: str, opt: OptFactory, models: Sequence[nn.Module],
                            **server: Any) -> AsyncIterator[tuple[ParameterServer, list[Worker]]]:
    """Two sync workers of ``models`` over ``lane`` (a :func:`lanes` parameter, nothing
    mapped) and one shard that applies parts as they land (unless ``pipeline`` says)."""
    transport = node_transport(lane)
    server.setdefault("pipeline", True)  # parts applied as they land (not chosen by timing)
    async with ParameterServer("tcp://127.0.0.1:0", num_workers=2, mode="sync",
                               optimizer=opt, transport=transport, share_memory=False,
                               log_every=None, **server) as ps:
        ws = [Worker(m, ps.address, rank=r, num_workers=2, transport=transport,
                     share_memory=False, overlap=False, timeout=30)
              for r, m in enumerate(models)]
        try:
            await asyncio.gather(*(w.start() for w in ws))
            yield ps, ws
        finally:
            await asyncio.gather(*(w.aclose() for w in ws), return_exceptions=True)


class PsProcess:
    """``python -m tensorx._commands.ps ...`` with its stdout lines collected; ``prefix``
    goes in front of the command (``ip netns exec NS``), ``env`` adds variables."""

    def __init__(self, *args: str, prefix: Sequence[str] = (),
                 env: dict[str, str] | None = None) -> None:
        environ = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self._log = tempfile.TemporaryFile(mode="w+")  # a file: a chatty log never blocks
        self.proc = subprocess.Popen(
            [*prefix, sys.executable, "-m", "tensorx._commands.ps", *args], env=environ,
            stdout=subprocess.PIPE, stderr=self._log, text=True)
        self.lines: list[str] = []
        self.log = ""
        self._got_line = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.strip())
            self._got_line.set()

    def addresses(self, n: int, timeout: float = 30.0) -> list[str]:
        for _ in range(int(timeout * 10)):
            found = [ln.rsplit(" ", 1)[1] for ln in self.lines if "listening on" in ln]
            if len(found) >= n:
                return found
            if self.proc.poll() is not None:
                break
            self._got_line.wait(0.1)
            self._got_line.clear()
        raise AssertionError(f"no address from tensorx ps: {self.stop()}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> str:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
        if not self._log.closed:
            self._log.seek(0)
            self.log = self._log.read()
            self._log.close()
        return self.log


def on_ranks(fn: Callable[[int], Any], n: int = 2) -> list[Any]:
    """``fn(rank)`` for every rank, each in its own thread; the first error is raised."""
    out: list[Any] = [None] * n
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            out[rank] = fn(rank)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    if errors:
        raise errors[0]
    assert not any(t.is_alive() for t in threads)
    return out


def run_example(name: str, *args: str, timeout: float = 100) -> str:
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / name), *args],
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    assert proc.returncode == 0, f"{name} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout
