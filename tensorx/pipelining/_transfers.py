"""The transfers on a stage's boundaries, once planned: waiting for transfer ``n``'s mark
and taking its tensors in place, writing ours into the peer's ring when a slot is free, and
handing slots back. State lives on the stage's loop (each :class:`Edge`'s); the stage's
failure is learnt and reported through :class:`Failures`, one way."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine, Iterable
from typing import Any, Protocol

import torch

from tensorx.endpoint import Endpoint
from tensorx.errors import BrokenError, ClosedError, ProtocolError, TensorxError, TimeoutError
from tensorx.pipelining._boundary import STAGING, Edge, expire, retrieved_future
from tensorx.pipelining._meeting import Meeting
from tensorx.pipelining._protocol import encode, shapes_from
from tensorx.pipelining._rings import nbytes_of

__all__ = ["INLINE_BYTES", "Failures", "Transfers"]

logger = logging.getLogger("tensorx.pipelining")

INLINE_BYTES = 1 << 20  # a transfer up to this size is sent before the step goes on


class Failures(Protocol):
    """What :class:`Transfers` learns of its stage's failure, and tells it."""

    def check_failed(self) -> None:
        """Raise the stage's failure, if it has one (ClosedError once it is closed)."""

    def failure(self) -> BaseException | None:
        """What failed first on the stage, if anything has."""

    def failed(self, exc: BaseException, origin: int | None = None,
               why: str | None = None) -> None:
        """The stage fails with ``exc`` (``origin``: the stage that failed first; ``why``:
        what to tell the others)."""


class Transfers:
    """The transfers of stage ``me`` over ``meeting``'s links, on ``loop``; every wait
    bounded by ``timeout`` seconds; counted in ``stats`` (the stage's, shared)."""

    def __init__(self, me: int, loop: asyncio.AbstractEventLoop, meeting: Meeting,
                 stats: dict[str, Any], timeout: float, failures: Failures) -> None:
        self.me = me
        self.timeout = timeout
        self._loop = loop
        self._meeting = meeting
        self._stats = stats
        self._failures = failures

    def timed_out(self, peer: int, what: str, edge: Edge, mb: str = "") -> TimeoutError:
        return TimeoutError(f"stage {self.me} waited {self.timeout:g} s for stage "
                            f"{peer} {what}{mb} ({edge.name}); is stage {peer} running and "
                            "at the same step?")

    async def _bounded(self, fut: asyncio.Future[Any]) -> Any:
        """``await fut`` for at most the stage's timeout (then asyncio.TimeoutError); a
        failure of the stage sets its exception on ``fut`` too."""
        handle = self._loop.call_later(self.timeout, expire, fut)
        try:
            return await fut
        finally:
            handle.cancel()

    # -- receiving ---------------------------------------------------------------------------
    async def _await_message(self, edge: Edge, n: int, what: str, mb: str) -> dict[str, Any]:
        self._failures.check_failed()
        if n in edge.inbox:
            return edge.inbox.pop(n)
        waiter = edge.waiting.setdefault(n, retrieved_future(self._loop))
        try:
            return await self._bounded(waiter)  # type: ignore[no-any-return]
        except asyncio.TimeoutError:
            edge.waiting.pop(n, None)
            raise self.timed_out(edge.peer, what, edge, mb) from None

    async def receive(self, edge: Edge, n: int, mb: str) -> list[torch.Tensor]:
        """Receiver of a planned boundary: transfer ``n``'s activations, in place in their
        slot."""
        started = time.perf_counter()
        msg = await self._await_message(edge, n, "to send its activations", mb)
        self._stats["wait_s"] += time.perf_counter() - started
        assert edge.layout is not None
        assert edge.mine is not None
        who = f"stage {edge.src}"
        shapes = shapes_from(msg.get("shapes"), edge.layout.capacity, who, "F")
        edge.expect = max(edge.expect, n + 1)
        moved = sum(nbytes_of(m.dtype, s) for m, s in zip(edge.layout.metas, shapes,
                                                          strict=True))
        edge.bytes += moved
        self._stats["bytes_received"] += moved
        self._stats["transfers_received"] += 1
        return edge.mine.views(n, shapes)

    async def receive_grads(self, edge: Edge, n: int, mb: str) -> list[torch.Tensor | None]:
        """Sender of activations: the gradients of transfer ``n``, in place."""
        started = time.perf_counter()
        msg = await self._await_message(edge, n, "to send the gradients", mb)
        self._stats["wait_s"] += time.perf_counter() - started
        assert edge.layout is not None
        who = f"stage {edge.dst}"
        has = msg.get("has")
        if not isinstance(has, list) or len(has) != len(edge.layout.metas) or any(
                not isinstance(h, bool) for h in has):
            raise ProtocolError(f"{who} sent 'B' with a malformed gradient list")
        shapes = edge.shapes.pop(n)
        edge.expect = max(edge.expect, n + 1)
        if any(has) and edge.mine is None:
            raise ProtocolError(f"{who} sent gradients on {edge.name}, which has none")
        views = edge.mine.views(n, shapes) if edge.mine is not None else [None] * len(has)
        return [v if h else None for v, h in zip(views, has, strict=True)]

    # -- sending -----------------------------------------------------------------------------
    async def _send(self, edge: Edge, kind: str, n: int, ops: list[tuple[int, int]],
                    header: dict[str, Any]) -> None:
        """Write transfer ``n`` from the staging slot into the peer's ring, then mark it."""
        try:
            started = time.perf_counter()
            slots = edge.slots if kind == "F" else edge.grad_slots
            need = n + 1 - slots
            if edge.credits < need:
                fut = retrieved_future(self._loop)
                edge.credit_waits.append((need, fut))
                try:
                    await self._bounded(fut)
                except asyncio.TimeoutError:
                    raise self.timed_out(edge.peer, "to hand back a slot", edge,
                                         f" (transfer {n})") from None
            self._stats["credit_wait_s"] += time.perf_counter() - started
            ep = self._meeting.links.get(edge.peer)
            if ep is None:
                self._failures.check_failed()
                raise BrokenError(f"stage {edge.peer} is not connected")
            payload = encode(kind, n=n, **header)
            if any(nb for _, nb in ops):
                assert edge.staging is not None
                assert edge.theirs is not None
                assert edge.layout is not None
                base = edge.staging.base(n)
                remote = (n % slots) * edge.layout.slot_bytes
                writes = [(edge.staging.region, edge.theirs, off, remote + off - base, nb)
                          for off, nb in ops if nb]
                await ep.write_many(writes, notify=payload)
            else:
                await ep.notify(payload)
            moved = sum(nb for _, nb in ops)
            edge.bytes += moved
            self._stats["bytes_sent"] += moved
            self._stats["transfers_sent"] += 1
        except (BrokenError, ClosedError) as exc:
            first = self._failures.failure()
            if first is not None:  # (what failed first is what every stage hears)
                raise type(first)(str(first)) from None
            where = self._meeting.lanes.get(edge.peer, {}).get("address", "?")
            lost = BrokenError(f"stage {edge.peer} at {where} is gone ({exc}); stage "
                               f"{self.me} stops: restart every stage")
            self._failures.failed(lost, edge.peer, f"it is gone ({exc})")
            raise lost from None
        except TensorxError as exc:
            self._failures.failed(exc)
            raise

    async def dispatch(self, edge: Edge, kind: str, n: int, ops: list[tuple[int, int]],
                       header: dict[str, Any]) -> None:
        """Send transfer ``n``: a small one at once (the copy is this core's work either
        way, and a task per send costs more than it saves), a large one as a task that
        the next micro-batch's compute overlaps."""
        if sum(nb for _, nb in ops) <= INLINE_BYTES:
            await self._send(edge, kind, n, ops, header)
            return
        edge.pending[n % STAGING] = self._issue(self._send(edge, kind, n, ops, header))
        await asyncio.sleep(0)  # it starts before the next micro-batch computes

    def _issue(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = self._loop.create_task(coro)
        task.add_done_callback(lambda t: t.cancelled() or t.exception())
        return task

    async def staging_free(self, edge: Edge, n: int) -> None:
        """Transfer ``n``'s staging slot is free (the send that used it before has landed)."""
        prior = edge.pending[n % STAGING]
        if prior is not None:
            edge.pending[n % STAGING] = None
            await prior

    async def flush(self, edges: Iterable[Edge]) -> None:
        """Every send on ``edges`` has landed (or raised)."""
        for edge in edges:
            for i, task in enumerate(edge.pending):
                if task is not None:
                    edge.pending[i] = None
                    await task

    # -- handing slots back ------------------------------------------------------------------
    def hand_back(self, edge: Edge, n: int) -> None:
        """We are done with transfer ``n``: its slot goes back to the peer with the next
        message we send it on this boundary (``c``), or on its own once the peer's next
        transfer needs it."""
        edge.hand_back(n)
        self.maybe_flush(edge)

    def maybe_flush(self, edge: Edge) -> None:
        if edge.flush_needed():
            edge.flush_due = True
            self._loop.call_soon(self._flush_credit, edge)

    def _flush_credit(self, edge: Edge) -> None:
        edge.flush_due = False
        credit = edge.credit_due()
        ep = self._meeting.links.get(edge.peer)
        if credit is None or ep is None:
            return
        kind = "BR" if edge.sending else "FR"
        self._issue(self._notify_credit(ep, edge, encode(kind, n=credit)))

    async def _notify_credit(self, ep: Endpoint, edge: Edge, payload: bytes) -> None:
        try:
            await ep.notify(payload, timeout=self.timeout)
        except TensorxError as exc:
            if edge.peer not in self._meeting.gone:
                logger.debug("stage %d: handing back a slot to stage %d failed: %s",
                             self.me, edge.peer, exc)
