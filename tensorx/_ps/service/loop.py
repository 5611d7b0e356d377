"""The service of a shard: one session per peer, one message at a time for the whole shard.

Every endpoint a peer opens gets a session task (``Node(handler=...)``) that reads that
endpoint's own message stream, in order, and ends with it: a peer's departure is the end
of its stream, so it is handled after everything the peer sent (a goodbye is never
overtaken by the disconnect behind it). The sessions take turns (:attr:`ServiceLoop.turn`,
a FIFO lock) to handle a message, so an update and the writes out of its arena never interleave
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
from typing import TYPE_CHECKING, Any

from tensorx._ps.wire import protocol
from tensorx.errors import ProtocolError, TensorxError, error_code

if TYPE_CHECKING:
    from tensorx._ps.service.losses import LossWatch
    from tensorx._ps.service.norm_exchange import NormExchange
    from tensorx._ps.service.optim_service import OptimService
    from tensorx._ps.service.options import ShardOptions
    from tensorx._ps.service.pipelined import PipelinedRounds
    from tensorx._ps.service.plan import PlanHolder
    from tensorx._ps.service.schedule import Decision, Scheduler
    from tensorx._ps.service.session import Sessions
    from tensorx._ps.service.steps import Updates
    from tensorx.endpoint import Endpoint

logger = logging.getLogger("tensorx.ps")  # one logger name for the whole server


class ServiceLoop:
    """The part of a ParameterServer that turns what arrives into handled messages.

    It owns the turn (:attr:`turn`) and the session tasks (:attr:`tasks`); a message goes to
    ``sessions`` (hello, goodbye), ``updates`` (push), ``rounds`` (part) or ``optim`` (a
    RemoteOptimizer's requests, on the state ``plans`` holds); a peer shard's norm to
    ``norms``; what ``on_worker_loss`` decides (``losses``, ``scheduler``) to ``updates``.
    What it asks of the server: ``closed()`` (aclose() has begun), ``goodbye_done()``
    (after a goodbye) and ``optim_touched()`` (a RemoteOptimizer request arrived)."""

    def __init__(self, options: ShardOptions, *, sessions: Sessions, updates: Updates,  # noqa: PLR0913 (each helper and call it uses, by name: no back-reference to the server)
                 rounds: PipelinedRounds, plans: PlanHolder, optim: OptimService,
                 losses: LossWatch, scheduler: Scheduler, norms: NormExchange | None,
                 stats: dict[str, Any], closed: Callable[[], bool],
                 goodbye_done: Callable[[], None], optim_touched: Callable[[], None]) -> None:
        self._options = options
        self._sessions = sessions
        self._updates = updates
        self._rounds = rounds
        self._plans = plans
        self._optim = optim
        self._losses = losses
        self._scheduler = scheduler
        self._norms = norms
        self._stats = stats
        self._closed = closed
        self._goodbye_done = goodbye_done
        self._optim_touched = optim_touched
        self.turn = asyncio.Lock()  # sessions take turns: see the module docstring
        self.tasks: set[asyncio.Task[None]] = set()  # a session's, or a loss policy's

    async def session(self, ep: Endpoint) -> None:
        """One peer's messages, handled in order, each in its turn; then its departure."""
        self.tasks.add(asyncio.current_task())  # type: ignore[arg-type]
        try:
            async for payload in ep.messages:
                if self._norms is not None and ep not in self._sessions.peers and \
                        self._norms.take(ep, payload):
                    continue
                async with self.turn:
                    if not self._closed():
                        await self._handle_safely(ep, payload)
                if self._closed():  # a handler may have lost aclose()'s cancellation
                    return
            await self._ended(ep)
        finally:
            self.tasks.discard(asyncio.current_task())  # type: ignore[arg-type]

    async def _ended(self, ep: Endpoint) -> None:
        if self._norms is not None and self._norms.owns(ep):
            self._norms.lost(ep)  # no turn: an update may be waiting for this very news
            return
        async with self.turn:
            if not self._closed():
                await self._sessions.leave(ep, "disconnected")

    async def _handle_safely(self, ep: Endpoint, payload: bytes) -> None:
        try:
            try:
                await self._handle(ep, payload)
            except TensorxError as exc:
                await self.refuse(ep, exc)
        except Exception:  # one bad peer or bug must not stop the service
            logger.exception("ps shard %d: failed handling a message", self._options.shard)

    def post_lost(self, rank: int) -> None:
        """``rank``'s ``worker_loss_timeout`` ran out: act on it in a turn of its own."""
        self._spawn(self._policy(
            lambda: self._losses.declare(rank, self._scheduler, self._sessions.connected()),
            f"the loss of rank {rank}"))

    def post_overdue(self, barrier: int) -> None:
        """The clock of sync barrier ``barrier`` ran out: act on it in a turn of its own."""
        self._spawn(self._policy(
            lambda: self._losses.overdue(barrier, self._scheduler, self._sessions.connected()),
            f"the ranks late for barrier {barrier}"))

    async def _policy(self, decide: Callable[[], Decision], what: str) -> None:
        """Apply what ``on_worker_loss`` decides (``decide()``, called in the turn)."""
        async with self.turn:
            if self._closed():
                return
            try:
                decision = decide()
                self._stats["worker_losses"] = self._losses.declared
                await self._updates.act(decision)
            except Exception:
                logger.exception("ps shard %d: failed acting on %s", self._options.shard, what)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _handle(self, ep: Endpoint, payload: bytes) -> None:
        msg = protocol.decode(payload)
        kind = msg["t"]
        if kind == "hello":
            await self._sessions.hello(ep, msg)
        elif kind == "push":
            await self._updates.push(ep, msg)
        elif kind == "part":
            await self._rounds.part(ep, msg)
        elif kind == "bye":
            await self._sessions.goodbye(ep)
            self._goodbye_done()
        elif kind in ("state_get", "state_done", "state_put", "state_commit"):
            self._optim_touched()  # a loaded optimizer state is worth a checkpoint
            await self._optim_request(ep, kind, msg)
        else:
            raise ProtocolError(f"unexpected {kind!r} message from a worker")

    async def refuse(self, ep: Endpoint, exc: TensorxError) -> None:
        """Tell ``ep`` why it is refused; a worker then leaves, any other peer is closed."""
        logger.warning("ps shard %d refused %s: %s", self._options.shard, ep.peer, exc)
        with contextlib.suppress(TensorxError):
            await ep.notify(protocol.encode("error", code=error_code(exc), msg=str(exc)),
                            timeout=self._options.send_timeout)
        if ep in self._sessions.peers:
            await self._sessions.leave(ep, f"refused ({type(exc).__name__})")
        else:  # it proved nothing here but its token: its stream ends once this is read
            with contextlib.suppress(TensorxError):
                await ep.aclose()

    async def _optim_request(self, ep: Endpoint, kind: str, msg: dict[str, Any]) -> None:
        peers = self._sessions.peers
        if ep not in peers or self._plans.state is None or not self._plans.initialised:
            raise ProtocolError(f"{kind} before a completed handshake")
        rank = peers[ep].rank
        if kind == "state_get":
            await self._optim.lend(ep, self._plans.state, self._options.timeout)
        elif kind == "state_done":
            self._optim.returned(ep)
        elif kind == "state_put":  # every rank the barrier counts loads (_ps.service.optim_load)
            counted = set(range(self._options.num_workers)) - self._scheduler.excused \
                - self._sessions.finished
            await self._optim.put(ep, rank, msg, self._plans.state, counted,
                                 sorted(self._scheduler.pending), self._options.timeout)
        else:
            await self._optim.commit(ep, rank, msg["load"], self._plans.state,
                                     self._options.timeout)
