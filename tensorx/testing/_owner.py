"""A real owner process: a :class:`tensorx.Node` in a spawned process that exports guarded
regions on command, checks the order of notifications against its memory, and can play
the client of a transfer (optionally inside a network namespace)."""

from __future__ import annotations

import asyncio
import gc
import hashlib
import logging
import multiprocessing as mp
import os
import signal
import threading
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection as Pipe
from typing import Any

import numpy as np

from tensorx import _eventloop
from tensorx._deadline import wait_for
from tensorx._netns import enter_netns
from tensorx.endpoint import Endpoint
from tensorx.errors import TensorxError
from tensorx.memregion import MemoryRegion, RegionDescriptor
from tensorx.node import Node

GUARD = 4096
GUARD_BYTE = 0xA5


def pattern(nbytes: int, seed: int) -> np.ndarray:
    """Deterministic pseudo-random bytes (both processes can make the same ones)."""
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def digest(data: Any) -> str:
    return hashlib.sha256(memoryview(data)).hexdigest()


class OwnerProcess:
    """A spawned process with a Node that exports guarded regions on command.

    ``listen``: the node's address (a namespace's own IP needs a ``token``); ``netns``: run
    inside that network namespace (see :mod:`tensorx._netns`); ``env``: environment set in
    the child before its node starts; ``node_options``: further ``Node`` arguments (a node
    that fails to start answers the first call with why). The same process can play
    the client: ``connect``, then ``transfer`` (timed, errors returned, not raised).

    Notifications it receives are kept (``call("notes")``); ``check:<region>:<seed>`` and
    ``fill:<region>:<byte>:<piece>`` are checked against the region's memory on arrival
    (``call("violations")``) and answered ``checked``; ``echo:...`` is sent back as is.
    """

    def __init__(self, transport: str = "tcp", token: str | None = None,
                 timeout: float = 60.0, *, listen: str = "tcp://127.0.0.1:0",
                 netns: str | None = None, env: dict[str, str] | None = None,
                 node_options: dict[str, Any] | None = None) -> None:
        self.transport = transport
        self.token = token
        self.timeout = timeout
        ctx = mp.get_context("spawn")
        self._pipe, child = ctx.Pipe()
        self._proc = ctx.Process(target=_owner_main, daemon=True, args=(
            child, transport, token, listen, netns, env or {}, node_options or {}))
        self.address = ""

    async def __aenter__(self) -> OwnerProcess:
        return await asyncio.to_thread(self.start)

    def start(self) -> OwnerProcess:
        self._proc.start()
        self.address = self.call_blocking("address")
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    @property
    def pid(self) -> int:
        assert self._proc.pid is not None
        return self._proc.pid

    async def call(self, *cmd: Any) -> Any:
        """Run a command in the owner and return its result (child errors re-raised)."""
        return await wait_for(asyncio.to_thread(self.call_blocking, *cmd), self.timeout)

    def call_blocking(self, *cmd: Any) -> Any:
        """:meth:`call` for code without an event loop."""
        self._pipe.send(cmd)
        if not self._pipe.poll(self.timeout):
            raise TimeoutError(f"owner did not answer {cmd[0]!r} in {self.timeout} s")
        ok, value = self._pipe.recv()
        if not ok:
            raise RuntimeError(f"owner process failed on {cmd[0]!r}:\n{value}")
        return value

    async def export(self, nbytes: int, access: str = "rw", seed: int = 0) -> RegionDescriptor:
        return RegionDescriptor.from_bytes(await self.call("export", nbytes, access, seed))

    async def connect(self, address: str, timeout: float = 30.0) -> int:
        """Connect this process's node to ``address``; returns the endpoint's number."""
        index: int = await self.call("connect", address, timeout)
        return index

    async def transfer(self, ep: int, op: str, desc: RegionDescriptor, seed: int = 0,
                       timeout: float | None = 30.0) -> dict[str, Any]:
        """``op`` ("write" or "read") the whole region ``desc`` over endpoint ``ep``; a write
        sends ``pattern(desc.nbytes, seed)``. Returns ``{"ok", "error" (the tensorx error's
        class name), "message" (its text), "elapsed" (seconds, measured in this process),
        "digest" (of what a read got)}``."""
        result: dict[str, Any] = await self.call("transfer", ep, op, desc.to_bytes(), seed,
                                                 timeout)
        return result

    async def resources(self) -> dict[str, int]:
        """``{"fds", "tasks", "endpoints"}``: open file descriptors, asyncio tasks and
        endpoints of the process's node, for leak checks."""
        found: dict[str, int] = await self.call("resources")
        return found

    def kill(self) -> None:
        if self._proc.is_alive():
            os.kill(self.pid, signal.SIGKILL)
        self._proc.join(10)

    async def stop(self) -> None:
        await asyncio.to_thread(self.stop_blocking)

    def stop_blocking(self) -> None:
        if self._proc.is_alive():
            try:
                self.call_blocking("stop")
            except (RuntimeError, TimeoutError, OSError, EOFError):
                pass
            self._proc.join(10)
            if self._proc.is_alive():
                self.kill()
        self._pipe.close()

    def alive(self) -> bool:
        return self._proc.is_alive()


def _owner_main(pipe: Pipe, transport: str, token: str | None, listen: str,
                netns: str | None, env: dict[str, str], options: dict[str, Any]) -> None:
    if netns is not None:
        enter_netns(netns)  # first: every socket and thread after this lives in there
    os.environ.update(env)
    # asyncio's own loop unless the environment asks for another (TENSORX_LOOP)
    _eventloop.run(_Owner(pipe, transport, token, listen, options).run(), default="asyncio")


class _Owner:
    def __init__(self, pipe: Pipe, transport: str, token: str | None, listen: str,
                 options: dict[str, Any]) -> None:
        self.pipe = pipe
        self.node = Node(listen, transport=transport, token=token, **options)
        self.eps: list[Endpoint] = []
        self.unfinished: list[MemoryRegion] = []
        self.backing: dict[int, np.ndarray] = {}
        self.regions: dict[int, MemoryRegion] = {}
        self.notes: list[bytes] = []
        self.violations: list[str] = []
        self.expect: Callable[[bytes], str | None] | None = None
        self.warned = _Remember(logging.WARNING)
        logging.getLogger("tensorx").addHandler(self.warned)

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            await self.node.start()
        except Exception:  # answer the first command with why (e.g. a transport refused)
            failure = traceback.format_exc()
            if await loop.run_in_executor(None, self._recv) is not None:
                self._reply(False, failure)
            return
        async with self.node:
            drain = loop.create_task(self._drain_notifications())
            while True:
                cmd = await loop.run_in_executor(None, self._recv)
                if cmd is None or cmd[0] == "stop":
                    drain.cancel()
                    self._reply(True, None)
                    return
                try:
                    self._reply(True, await getattr(self, "do_" + cmd[0])(*cmd[1:]))
                except Exception:
                    self._reply(False, traceback.format_exc())

    def _recv(self) -> Any:
        try:
            return self.pipe.recv()
        except EOFError:
            return None

    def _reply(self, ok: bool, value: Any) -> None:
        threading.Thread(target=self.pipe.send, args=((ok, value),)).start()

    async def _drain_notifications(self) -> None:
        while True:
            ep, payload = await self.node.notifications.get()
            self.notes.append(payload)
            if payload.startswith((b"check:", b"fill:")):
                self._check_ordering(payload)
                await ep.notify(b"checked")
            elif payload.startswith(b"echo:"):  # a peer's barrier: we have seen its notes
                await ep.notify(payload)

    def _check_ordering(self, payload: bytes) -> None:
        """'check:<rid>:<seed>' - the region must already hold pattern(seed). The sender
        waits for our 'checked' before it writes again, so nothing newer can be there.
        'fill:<rid>:<byte>:<piece>' - the last byte of every ``piece`` bytes (the last to
        land of each write) must be ``byte``: a check fast enough to catch big writes."""
        if payload.startswith(b"fill:"):
            _, rid, value, piece = payload.decode().split(":")
            got = np.frombuffer(self.regions[int(rid)].buffer(), np.uint8)
            if not (got[int(piece) - 1::int(piece)] == int(value)).all():
                self.violations.append(f"notification {payload!r} arrived before its data")
            return
        _, rid, seed = payload.decode().split(":")
        region = self.regions[int(rid)]
        want = pattern(region.nbytes, int(seed))
        got = np.frombuffer(region.buffer(), np.uint8)
        if not np.array_equal(got, want):
            self.violations.append(f"notification {payload!r} arrived before its data")

    async def do_address(self) -> str:
        return self.node.address

    async def do_loop(self) -> str:
        """The module of the event loop's class: ``asyncio`` or ``uvloop``."""
        return type(asyncio.get_running_loop()).__module__.split(".")[0]

    async def do_export(self, nbytes: int, access: str, seed: int) -> bytes:
        backing = np.full(nbytes + 2 * GUARD, GUARD_BYTE, dtype=np.uint8)
        backing[GUARD:GUARD + nbytes] = pattern(nbytes, seed)
        region = MemoryRegion.register(backing[GUARD:GUARD + nbytes], writable=True)
        desc = self.node.export(region, access)
        self.backing[region.region_id] = backing
        self.regions[region.region_id] = region
        return desc.to_bytes()

    async def do_digest(self, rid: int) -> str:
        return digest(self.regions[rid].buffer())

    async def do_backing_digest(self, rid: int) -> str:
        """Digest of the exported range read from the backing array (valid after close)."""
        return digest(self.backing[rid][GUARD:-GUARD])

    async def do_guards_intact(self) -> bool:
        return all(bool((b[:GUARD] == GUARD_BYTE).all() and (b[-GUARD:] == GUARD_BYTE).all())
                   for b in self.backing.values())

    async def do_close_region(self, rid: int) -> None:
        self.regions[rid].close()

    async def do_export_again(self, rid: int, access: str, unexport: bool) -> bytes:
        """Export a region again (``unexport``: having unexported it first)."""
        region = self.regions[rid]
        if unexport:
            self.node.unexport(region)
        return self.node.export(region, access).to_bytes()

    async def do_export_allocated(self, nbytes: int, seed: int, access: str = "rw",
                                  shared: bool = False) -> bytes:
        """Export memory of its own (``MemoryRegion.allocate``; in /dev/shm where ``shared``,
        for a same-host peer to attach), freed once unreferenced."""
        region = MemoryRegion.allocate(nbytes, shared=shared)
        region.view(np.uint8)[:] = pattern(nbytes, seed)
        self.regions[region.region_id] = region
        return self.node.export(region, access).to_bytes()

    async def do_fill(self, rid: int, value: int) -> None:
        """Store ``value`` in every byte of an allocated region (this process's own stores)."""
        self.regions[rid].view(np.uint8)[:] = value

    async def do_replace(self, rid: int, seed: int) -> bytes:
        """Close an allocated region, drop it, and export a fresh one of the same size."""
        old = self.regions.pop(rid)
        old.close()
        nbytes = old.nbytes
        del old
        gc.collect()
        return await self.do_export_allocated(nbytes, seed)

    async def do_held(self) -> int:
        """Closed regions whose memory the node still holds for its peers."""
        return len(self.node._peers.held)  # noqa: SLF001 (test helper: no public count of held regions)

    async def do_notes(self) -> list[bytes]:
        return list(self.notes)

    async def do_violations(self) -> list[str]:
        return list(self.violations)

    async def do_warnings(self) -> list[str]:
        """WARNING (and worse) lines this process's tensorx loggers wrote."""
        return list(self.warned.lines)

    async def do_endpoints(self) -> int:
        return len(self.node.endpoints)

    async def do_resources(self) -> dict[str, int]:
        return {"fds": len(os.listdir("/proc/self/fd")), "tasks": len(asyncio.all_tasks()),
                "endpoints": len(self.node.endpoints)}

    async def do_connect(self, address: str, timeout: float) -> int:
        self.eps.append(await self.node.connect(address, timeout=timeout))
        return len(self.eps) - 1

    async def do_close_endpoints(self) -> None:
        for ep in self.eps:
            await ep.aclose()
        self.eps.clear()

    async def do_transfer(self, ep: int, op: str, raw: bytes, seed: int,
                          timeout: float | None) -> dict[str, Any]:
        desc = RegionDescriptor.from_bytes(raw)
        data = pattern(desc.nbytes, seed) if op == "write" else np.zeros(desc.nbytes, np.uint8)
        region = MemoryRegion.register(data, writable=op == "read")
        started, error, message = time.perf_counter(), "", ""
        try:
            await getattr(self.eps[ep], op)(region, desc, timeout=timeout)
        except TensorxError as exc:
            error, message = type(exc).__name__, str(exc)
        elapsed = time.perf_counter() - started
        if error:  # a timed-out op may still be moving bytes: keep its memory registered
            self.unfinished.append(region)
        else:
            region.close()
        return {"ok": not error, "error": error, "message": message, "elapsed": elapsed,
                "digest": digest(data) if op == "read" and not error else ""}



class _Remember(logging.Handler):
    """Keeps the messages of the records it sees (the owner's warnings, for tests)."""

    def __init__(self, level: int) -> None:
        super().__init__(level)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if len(self.lines) < 1000:
            self.lines.append(record.getMessage())
