"""The service loop of a shard: every notification, disconnect and loss becomes an
:class:`~tensorx._ps.inbox.Event` that one consumer handles at a time, so that an update
and the writes out of its arena never interleave (async and bounded answers go on after
their event, from an arena the next update leaves alone: :mod:`tensorx._ps.outbox`)."""

from __future__ import annotations

import contextlib
import logging
from typing import Any

from tensorx._ps import protocol
from tensorx._ps.core import ShardCore
from tensorx._ps.inbox import Event
from tensorx.endpoint import Endpoint
from tensorx.errors import ProtocolError, TensorxError

logger = logging.getLogger("tensorx.ps")  # one logger name for the whole server


class ServiceLoop(ShardCore):
    """The part of a ParameterServer that turns what arrives into handled events."""

    async def _pump_notifications(self) -> None:
        while True:
            ep, payload = await self.node.notifications.get()
            # a peer shard's gradient norm is taken here: the service loop may wait for it
            if self._norms is None or ep in self._peers or not self._norms.take(ep, payload):
                self._events.offer(ep, payload)

    async def _pump_disconnects(self) -> None:
        while True:
            ep = await self.node.disconnected.get()
            if self._norms is not None and self._norms.owns(ep):
                self._norms.lost(ep)
            else:
                self._events.post(Event("gone", ep))

    def _post_lost(self, rank: int) -> None:
        self._events.post(Event("lost", None, rank=rank))

    async def _run(self) -> None:
        """The one consumer of events: updates and writes out of the arena never interleave.
        Ends when the server closes, even if a handler lost the cancellation that
        ``aclose()`` sent it (a library may swallow one; the loop must not outlive it)."""
        while not self._closed:
            event = await self._events.get()
            try:
                try:
                    await self._dispatch(event)
                except TensorxError as exc:
                    if event.ep is None:
                        raise
                    await self._refuse(event.ep, exc)
            except Exception:  # one bad peer or bug must not stop the service
                logger.exception("ps shard %d: failed handling a message", self.shard)

    async def _dispatch(self, event: Event) -> None:
        if event.kind == "lost":
            decision = self.losses.declare(event.rank, self.scheduler, self._connected())
            self.stats["worker_losses"] = self.losses.declared
            await self._act(decision)
        elif event.ep is not None and event.kind == "gone":
            await self._leave(event.ep, "disconnected")
        elif event.ep is not None:
            await self._handle(event.ep, event.payload)


    async def _handle(self, ep: Endpoint, payload: bytes) -> None:
        msg = protocol.decode(payload)
        kind = msg["t"]
        if kind == "hello":
            await self._hello(ep, msg)
        elif kind == "push":
            await self._push(ep, msg)
        elif kind == "bye":
            await self._goodbye(ep)
        elif kind in ("state_get", "state_done", "state_put"):
            self._saved_version = None  # a loaded optimizer state is worth a checkpoint
            await self._optim_request(ep, kind, msg)
        else:
            raise ProtocolError(f"unexpected {kind!r} message from a worker")

    async def _refuse(self, ep: Endpoint, exc: TensorxError) -> None:
        logger.warning("ps shard %d refused %s: %s", self.shard, ep.peer, exc)
        with contextlib.suppress(TensorxError):
            await ep.notify(protocol.encode("error", code=type(exc).__name__, msg=str(exc)),
                            timeout=self.send_timeout)
        if ep in self._peers:
            await self._leave(ep, f"refused ({type(exc).__name__})")

    async def _optim_request(self, ep: Endpoint, kind: str, msg: dict[str, Any]) -> None:
        if ep not in self._peers or self.state is None or not self._initialised:
            raise ProtocolError(f"{kind} before a completed handshake")
        if kind == "state_get":
            await self.optim.lend(ep, self.state, self.timeout)
        elif kind == "state_done":
            self.optim.returned(ep)
        else:
            await self.optim.load(ep, msg, self.state, self.timeout)

