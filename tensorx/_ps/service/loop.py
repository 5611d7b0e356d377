"""The service of a shard: one session per peer, one message at a time for the whole shard.

Every endpoint a peer opens gets a session task (``Node(handler=...)``) that reads that
endpoint's own message stream, in order, and ends with it: a peer's departure is the end
of its stream, so it is handled after everything the peer sent (a goodbye is never
overtaken by the disconnect behind it). The sessions take turns (:attr:`_turn`, a FIFO
lock) to handle a message, so an update and the writes out of its arena never interleave
(async and bounded answers go on after their turn, from an arena the next update leaves
alone: :mod:`tensorx._ps.service.outbox`). What a peer can make the shard hold is its stream's
bound: a peer whose messages wait for their turn is held back by TCP.

A peer shard's gradient norm (``clip_grad_norm``) is taken without a turn: the update
holding the turn may be waiting for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Coroutine
from typing import Any

from tensorx._ps.service.core import ShardCore
from tensorx._ps.service.schedule import Decision
from tensorx._ps.wire import protocol
from tensorx.endpoint import Endpoint
from tensorx.errors import ProtocolError, TensorxError, error_code

logger = logging.getLogger("tensorx.ps")  # one logger name for the whole server


class ServiceLoop(ShardCore):
    """The part of a ParameterServer that turns what arrives into handled messages."""

    async def _session(self, ep: Endpoint) -> None:
        """One peer's messages, handled in order, each in its turn; then its departure."""
        self._sessions.add(asyncio.current_task())  # type: ignore[arg-type]
        try:
            async for payload in ep.messages:
                if self._norms is not None and ep not in self.sessions.peers and \
                        self._norms.take(ep, payload):
                    continue
                async with self._turn:
                    if not self._closed:
                        await self._handle_safely(ep, payload)
                if self._closed:  # a handler may have lost aclose()'s cancellation
                    return
            await self._ended(ep)
        finally:
            self._sessions.discard(asyncio.current_task())  # type: ignore[arg-type]

    async def _ended(self, ep: Endpoint) -> None:
        if self._norms is not None and self._norms.owns(ep):
            self._norms.lost(ep)  # no turn: an update may be waiting for this very news
            return
        async with self._turn:
            if not self._closed:
                await self.sessions.leave(ep, "disconnected")

    async def _handle_safely(self, ep: Endpoint, payload: bytes) -> None:
        try:
            try:
                await self._handle(ep, payload)
            except TensorxError as exc:
                await self._refuse(ep, exc)
        except Exception:  # one bad peer or bug must not stop the service
            logger.exception("ps shard %d: failed handling a message", self.shard)

    def _post_lost(self, rank: int) -> None:
        """``rank``'s ``worker_loss_timeout`` ran out: act on it in a turn of its own."""
        self._spawn(self._policy(
            lambda: self.losses.declare(rank, self.scheduler, self.sessions.connected()),
            f"the loss of rank {rank}"))

    def _post_overdue(self, barrier: int) -> None:
        """The clock of sync barrier ``barrier`` ran out: act on it in a turn of its own."""
        self._spawn(self._policy(
            lambda: self.losses.overdue(barrier, self.scheduler, self.sessions.connected()),
            f"the ranks late for barrier {barrier}"))

    async def _policy(self, decide: Callable[[], Decision], what: str) -> None:
        """Apply what ``on_worker_loss`` decides (``decide()``, called in the turn)."""
        async with self._turn:
            if self._closed:
                return
            try:
                decision = decide()
                self.stats["worker_losses"] = self.losses.declared
                await self.updates.act(decision)
            except Exception:
                logger.exception("ps shard %d: failed acting on %s", self.shard, what)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._sessions.add(task)
        task.add_done_callback(self._sessions.discard)

    async def _handle(self, ep: Endpoint, payload: bytes) -> None:
        msg = protocol.decode(payload)
        kind = msg["t"]
        if kind == "hello":
            await self.sessions.hello(ep, msg)
        elif kind == "push":
            await self.updates.push(ep, msg)
        elif kind == "part":
            await self.rounds.part(ep, msg)
        elif kind == "bye":
            await self.sessions.goodbye(ep)
            self._check_done()
        elif kind in ("state_get", "state_done", "state_put", "state_commit"):
            self._saved_version = None  # a loaded optimizer state is worth a checkpoint
            await self._optim_request(ep, kind, msg)
        else:
            raise ProtocolError(f"unexpected {kind!r} message from a worker")

    async def _refuse(self, ep: Endpoint, exc: TensorxError) -> None:
        logger.warning("ps shard %d refused %s: %s", self.shard, ep.peer, exc)
        with contextlib.suppress(TensorxError):
            await ep.notify(protocol.encode("error", code=error_code(exc), msg=str(exc)),
                            timeout=self.send_timeout)
        if ep in self.sessions.peers:
            await self.sessions.leave(ep, f"refused ({type(exc).__name__})")
        else:  # it proved nothing here but its token: its stream ends once this is read
            with contextlib.suppress(TensorxError):
                await ep.aclose()

    async def _optim_request(self, ep: Endpoint, kind: str, msg: dict[str, Any]) -> None:
        peers = self.sessions.peers
        if ep not in peers or self.state is None or not self.plans.initialised:
            raise ProtocolError(f"{kind} before a completed handshake")
        rank = peers[ep].rank
        if kind == "state_get":
            await self.optim.lend(ep, self.state, self.timeout)
        elif kind == "state_done":
            self.optim.returned(ep)
        elif kind == "state_put":  # every rank the barrier counts loads (_ps.service.optim_load)
            counted = set(range(self.num_workers)) - self.scheduler.excused - self.sessions.finished
            await self.optim.put(ep, rank, msg, self.state, counted,
                                 sorted(self.scheduler.pending), self.timeout)
        else:
            await self.optim.commit(ep, rank, msg["load"], self.state, self.timeout)
