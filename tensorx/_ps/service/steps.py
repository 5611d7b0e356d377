"""A step on a shard: a worker's push, the update it completes (as the scheduler decides),
and the parameters written back to the workers it releases."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any

from tensorx._ps.common.gather import together
from tensorx._ps.service.answer import Answers, Peer, apply_in_parts
from tensorx.errors import OptimizerError, ProtocolError

if TYPE_CHECKING:
    from tensorx._ps.common.stats import ShardTimings
    from tensorx._ps.service.applier import Applier
    from tensorx._ps.service.grads import GradProcessing
    from tensorx._ps.service.losses import LossWatch
    from tensorx._ps.service.nonfinite import NonFiniteGuard
    from tensorx._ps.service.optim_service import OptimService
    from tensorx._ps.service.options import ShardOptions
    from tensorx._ps.service.outbox import Outbox
    from tensorx._ps.service.pipelined import PipelinedRounds
    from tensorx._ps.service.plan import PlanHolder
    from tensorx._ps.service.samehost import Sharing
    from tensorx._ps.service.schedule import Decision, Scheduler
    from tensorx._ps.state.shard import ShardState
    from tensorx.endpoint import Endpoint
    from tensorx.errors import TensorxError

logger = logging.getLogger("tensorx.ps")  # one logger name for the whole server


class Updates:
    """The part of a ParameterServer that applies pushes and answers them.

    It reads the shard's state from ``plans`` and its workers from ``peers`` (by
    endpoint, kept by the server's sessions); a pipelined sync update goes to ``rounds``,
    answers and failures to ``answers``; the other helpers, ``stats`` and ``applier`` are
    the server's. What it asks of the server: ``refuse(ep, exc)`` (a worker whose gradient
    is refused), ``tell_waiting(held)`` (ranks held at the barrier) and ``checkpoint()``."""

    def __init__(self, options: ShardOptions, plans: PlanHolder, peers: Mapping[Endpoint, Peer],  # noqa: PLR0913 (each helper and call it uses, by name: no back-reference to the server)
                 *, scheduler: Scheduler, losses: LossWatch, sharing: Sharing,
                 optim: OptimService, outbox: Outbox, grads: GradProcessing,
                 nonfinite: NonFiniteGuard, timings: ShardTimings, stats: dict[str, Any],
                 applier: Applier, rounds: PipelinedRounds, answers: Answers,
                 refuse: Callable[[Endpoint, TensorxError], Awaitable[None]],
                 tell_waiting: Callable[[list[Peer]], Awaitable[None]],
                 checkpoint: Callable[[], bool]) -> None:
        self._options = options
        self._plans = plans
        self._peers = peers
        self._scheduler = scheduler
        self._losses = losses
        self._sharing = sharing
        self._optim = optim
        self._outbox = outbox
        self._grads = grads
        self._nonfinite = nonfinite
        self._timings = timings
        self._stats = stats
        self._applier = applier
        self._rounds = rounds
        self._answers = answers
        self._refuse = refuse
        self._tell_waiting = tell_waiting
        self._checkpoint = checkpoint

    @property
    def _state(self) -> ShardState | None:
        return self._plans.state  # read anew each time: a refusal may release the plan

    async def push(self, ep: Endpoint, msg: dict[str, Any]) -> None:
        """A worker's push: its gradient is in; act on what the barrier decides."""
        peer = self._peers.get(ep)
        if peer is None and ep.closed:
            return  # the last words of a connection that has left: never applied
        if peer is None or self._state is None or not self._plans.initialised:
            raise ProtocolError("push before a completed handshake")
        if self._scheduler.again(peer.rank, msg["step"]):
            self._again(peer, msg["step"])
            return
        if self._scheduler.late(peer.rank):  # it missed a barrier: see tensorx._ps.service.losses
            raise self._losses.late(peer.rank, msg["step"])
        self._sharing.check_mapped(peer, msg["mapped"])
        await self._optim.stepping(peer.rank, msg["step"], self._options.timeout)
        self._optim.pushed(peer.rank, msg["hyper"], self._state)
        peer.step = msg["step"]
        peer.held = msg["version"]
        self._stats["pushes"] += 1
        lag = self._state.version - msg["version"]
        self._stats["max_version_lag"] = max(self._stats["max_version_lag"], lag)
        self._timings.pushed(peer.rank, peer.step, lag)
        if self._rounds.active():
            self._rounds.pushed(peer, msg["parts"])
        if self._plans.sparse is not None:
            self._plans.sparse.announce(peer.rank, msg["staging"], msg["inbox"])
            rows = await self._plans.sparse.receive(ep, peer.rank, self._options.timeout)
            self._state.put_rows(peer.rank, rows)
            self._stats["sparse_rows"] += rows.num_rows
        opens = not self._scheduler.pending
        await self.act(self._scheduler.push(peer.rank, msg["step"]))
        if self._options.mode == "sync" and peer.rank in self._scheduler.pending:
            if opens:  # the barrier's first push: its clock starts (_ps.service.losses)
                self._losses.opened(self._scheduler.barrier)
            await self._tell_waiting([peer])

    def _again(self, peer: Peer, step: int) -> None:
        """``peer`` pushed ``step`` again (its step timed out and it retried it): taken
        once, the retry changes nothing here (a worker retries with the gradient it pushed)
        and the worker gets the one answer to that step. One INFO line per step retried."""
        if peer.retried == step:
            return
        peer.retried = step
        logger.info("ps shard %d: rank %d pushed its step %d again (a retry after a timeout); "
                    "taken once: %s", self._options.shard, peer.rank, step,
                    "it waits for the barrier" if peer.rank in self._scheduler.pending
                    else "its answer has been sent")

    async def act(self, decision: Decision) -> None:
        """Apply and answer as ``decision`` says (the scheduler's, or the loss policy's)."""
        assert self._state is not None
        if decision.apply and self._rounds.active():
            await self._rounds.start(decision)
            return
        by_rank = {p.rank: p for p in self._peers.values()}
        if decision.apply:
            decision = await self._drop_nonfinite(decision, by_rank)
            if self._state is None:
                return  # the refused rank was the last one: the plan was released
        targets = [by_rank[r] for r in decision.release if r in by_rank]
        sending: dict[int, list[asyncio.Future[None]]] = {}
        if decision.apply:
            self._stats["barrier_s"] += self._timings.barrier_done()
            t0 = time.perf_counter()
            if self._grads.active and not await self._process_grads(decision.apply, targets):
                return
            self._optim.before_update(decision.apply, self._state)
            if self._options.mode != "sync":  # answers still in flight keep the arena they read
                await self._outbox.make_room(self._state)
                self._stats["arena_moves"] = self._outbox.moves
            copies = [p for p in targets if not p.mapped and not self._outbox.pending(p.rank)]
            try:
                if copies and self._state.in_parts:
                    sending = await apply_in_parts(self._applier, self._state, decision.apply,
                                                   copies, self._options.send_timeout,
                                                   self._plans.sparse)
                else:
                    self._state.apply(decision.apply)
            except OptimizerError as exc:
                self._state.ungather()
                await self._answers.fail(exc, targets)
                return
            self._stats["apply_s"] += self._timings.apply.since(t0)
            self._stats["updates"] += 1
            every = self._options.checkpoint_every
            if every and self._state.version % every == 0:
                self._checkpoint()
        self._stats["max_gap"] = self._scheduler.max_gap
        if self._options.mode != "sync":  # each answer on its own: see tensorx._ps.service.outbox
            for p in targets:
                self._answer_later(p, sending.get(p.rank))
            return
        t0 = time.perf_counter()
        await together([self._send_params(p, sending.get(p.rank)) for p in targets])
        self._stats["send_s"] += self._timings.sent(t0, len(targets))

    def _answer_later(self, peer: Peer, sent: list[asyncio.Future[None]] | None) -> None:
        """Send ``peer`` the parameters as they are now, without waiting for it to take
        them (what it is sent, and from which arena, is fixed here)."""
        assert self._state is not None
        send = self._answers.sender(peer, sent)

        async def answer() -> None:
            t0 = time.perf_counter()
            await send()
            self._stats["send_s"] += self._timings.sent(t0, 1)

        self._outbox.send(peer.rank, self._state.params_region, answer)

    async def _process_grads(self, ranks: list[int], targets: list[Peer]) -> bool:
        """Hook and clip the averaged gradient, if asked; False (and the error to the
        workers) if a peer shard's norm is missing or the hook failed: no update then."""
        try:
            assert self._state is not None  # act() checked it; the property reads anew
            await self._grads.run(self._state, ranks)
        except Exception as exc:
            logger.error("ps shard %d: update %d not applied: %s", self._options.shard,
                         self._plans.version + 1, exc)
            await self._answers.fail(exc, targets)
            return False
        self._stats.update(grad_norm=self._grads.last_norm, norm_exchange_s=self._grads.exchange_s)
        return True

    async def _drop_nonfinite(self, decision: Decision, by_rank: dict[int, Peer]) -> Decision:
        """Fold the gradients the update steps with and check the fold; leave out those
        holding NaN or Inf, per ``on_nonfinite`` (the others are folded again, and checked)."""
        assert self._state is not None
        steps = {r: p.step for r, p in by_rank.items()}
        while decision.apply:
            bad, finite = self._nonfinite.check(self._state, decision.apply, steps)
            if finite:
                return decision
            self._state.ungather()
            self._stats["nonfinite"] = self._nonfinite.count
            if self._nonfinite.policy == "refuse":
                for rank, names in bad.items():
                    if rank in by_rank:
                        await self._refuse(by_rank[rank].ep,
                                           self._nonfinite.error(rank, steps[rank], names))
                if self._state is None:
                    break  # the refused rank was the last one: the plan was released
            decision = self._nonfinite.decide(decision, bad)
        return decision

    async def _send_params(self, peer: Peer,
                           sent: list[asyncio.Future[None]] | None = None) -> None:
        await self._answers.sender(peer, sent)()
