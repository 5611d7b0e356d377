"""The control channel's way out: frames leave in the order they were queued.

When nothing is queued, a frame goes out right where it is queued, with one gathered
``sendmsg`` of its header and payload (no copy of the payload); whatever the kernel does
not take, and everything queued behind it, is sent by a writer task. GPU payloads stream
through pinned host buffers (``_staging.py``) in that task.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import socket
from collections.abc import Callable
from typing import Any

from tensorx import _wire
from tensorx._wire import Kind
from tensorx.errors import BrokenError, TensorxError
from tensorx.transport import _staging
from tensorx.transport._exceptions import map_exceptions
from tensorx.transport._futures import fresh_copy, set_once
from tensorx.transport._sock import IOV_MAX, advance
from tensorx.transport._staging import SendStager, StagedRange

__all__ = ["SendQueue"]

logger = logging.getLogger("tensorx.transport.control")

Frame = tuple[list[Any], "asyncio.Future[None] | None"]


class SendQueue:
    """Frames to one peer, in order. ``lost`` is called once when the socket fails (the
    channel that owns this queue then closes everything)."""

    def __init__(self, sock: socket.socket, label: str, stats: dict[str, int],
                 lost: Callable[[TensorxError], None]) -> None:
        self._sock = sock
        self._label = label
        self._stats = stats
        self._lost_cb = lost
        self._loop = asyncio.get_running_loop()
        self._queue: collections.deque[Frame] = collections.deque()
        self._wakeup = asyncio.Event()
        self._taken = asyncio.Event()  # set whenever the writer has taken the queue
        self._busy = False  # the writer is sending a batch
        self._error: TensorxError | None = None
        self._stage = SendStager()  # GPU payloads: the writer's staging buffers
        self._lost = map_exceptions(f"{label}: connection lost")
        self._writer: asyncio.Task[None] | None = None

    @property
    def backlog(self) -> int:
        """Frames queued and not yet taken by the writer."""
        return len(self._queue)

    @property
    def task(self) -> asyncio.Task[None] | None:
        return self._writer

    def start(self) -> None:
        self._writer = self._loop.create_task(self._write_loop(), name=f"tx-write {self._label}")

    # -- queueing -------------------------------------------------------------------------
    def enqueue(self, parts: list[Any], done: asyncio.Future[None] | None = None) -> None:
        """Send ``parts`` after everything queued before them; ``done`` completes once
        they have been handed to the kernel. Raises the channel's error once it failed."""
        self._put(parts, done, not _staging.has_staged(parts))

    def send_host(self, parts: list[Any]) -> None:
        """:meth:`enqueue` of an op frame in host buffers, nobody waiting on it (no staging
        scan: the caller knows)."""
        self._put(parts, None, True)

    def _put(self, parts: list[Any], done: asyncio.Future[None] | None, now: bool) -> None:
        """Queue ``parts``; ``now``: host buffers only, which go out right here when
        nothing is queued before them."""
        if self._error is not None:
            raise self._error
        if now and not self._queue and not self._busy:
            try:
                with self._lost:
                    parts = self._send_some(parts)
            except BrokenError as exc:
                self._lost_cb(fresh_copy(exc))
                raise
            if not parts:
                if done is not None:
                    done.set_result(None)
                return
        self._queue.append((parts, done))
        self._wakeup.set()

    def send(self, kind: Kind, header: dict[str, Any],
             payload: Any = None) -> asyncio.Future[None]:
        """Queue one frame; the future completes once it has been handed to the kernel."""
        done: asyncio.Future[None] = self._loop.create_future()
        size = len(payload) if payload is not None else 0
        self.enqueue([_wire.encode(kind, header, size), payload] if size
                     else [_wire.encode(kind, header)], done)
        return done

    def post(self, kind: Kind, header: dict[str, Any], payload: Any = None) -> None:
        """Queue one frame nobody waits for (a reply)."""
        size = len(payload) if payload is not None else 0
        self.enqueue([_wire.encode(kind, header, size), payload] if size
                     else [_wire.encode(kind, header)])

    async def drained(self) -> None:
        """Return once the writer has taken what is queued now (or the channel failed)."""
        self._taken.clear()
        await self._taken.wait()

    def fail(self, exc: TensorxError) -> None:
        """Fail every queued frame's waiter and stop the writer. Idempotent."""
        if self._error is not None:
            return
        self._error = exc
        for _, fut in self._queue:
            if fut is not None:
                set_once(fut, fresh_copy(exc))
        self._queue.clear()
        self._wakeup.set()
        self._taken.set()
        if self._writer is not None and self._writer is not asyncio.current_task():
            self._writer.cancel()
        self._stage.release()

    async def join(self) -> None:
        writer, self._writer = self._writer, None
        if writer is not None and writer is not asyncio.current_task():
            writer.cancel()
            await asyncio.gather(writer, return_exceptions=True)

    # -- the writer -----------------------------------------------------------------------
    def _send_some(self, parts: list[Any]) -> list[Any]:
        """One non-blocking gathered send; returns what is left (memoryview slices)."""
        try:
            sent = self._sock.sendmsg(parts if len(parts) <= IOV_MAX else parts[:IOV_MAX])
        except BlockingIOError:
            return parts
        self._stats["bytes_out"] += sent
        return advance(parts, sent)

    async def _write_loop(self) -> None:
        try:
            with self._lost:
                while self._error is None:
                    await self._wakeup.wait()
                    self._wakeup.clear()
                    while self._queue:
                        await self._send_batch()
        except BrokenError as exc:
            self._lost_cb(exc)
        except Exception as exc:  # a bug: close as broken rather than leave a dead writer
            logger.exception("%s: writer failed", self._label)
            self._lost_cb(BrokenError(f"{self._label}: internal error: {exc!r}"))
        finally:
            self._busy = False

    async def _send_batch(self) -> None:
        """Send everything queued with gathered writes, then complete its futures."""
        self._busy = True
        parts: list[Any] = []
        done: list[asyncio.Future[None]] = []
        while self._queue:
            frame, fut = self._queue.popleft()
            parts.extend(frame)
            if fut is not None:
                done.append(fut)
        self._taken.set()
        for run in _staging.split_staged(parts):  # a GPU payload streams through staging
            if isinstance(run, StagedRange):
                await self._stage.stream(run, self._send_all)
            else:
                await self._send_all(run)
        self._busy = False
        self._stats["frames_out"] += len(done)
        for fut in done:
            if not fut.done():
                fut.set_result(None)

    async def _send_all(self, parts: list[Any]) -> None:
        while parts:
            parts = self._send_some(parts)
            if parts:
                await self._writable()

    async def _writable(self) -> None:
        fut: asyncio.Future[None] = self._loop.create_future()
        fd = self._sock.fileno()
        self._loop.add_writer(fd, set_once, fut)
        try:
            await fut
        finally:
            self._loop.remove_writer(fd)

    @property
    def staging_buffers(self) -> int:
        """Pinned staging buffers held now (tests check the pool's bound)."""
        return self._stage.buffers
