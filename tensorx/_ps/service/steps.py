"""A step on a shard: a worker's push, the update it completes (as the scheduler decides),
and the parameters written back to the workers it releases."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from tensorx._ps.common.gather import together
from tensorx._ps.service.answer import Peer, RowsAnswer, apply_in_parts, last_part, send_params
from tensorx._ps.service.core import ShardCore
from tensorx._ps.service.schedule import Decision
from tensorx._ps.wire import protocol
from tensorx.endpoint import Endpoint
from tensorx.errors import OptimizerError, ProtocolError, TensorxError, error_code

logger = logging.getLogger("tensorx.ps")  # one logger name for the whole server


class Steps(ShardCore):
    """The part of a ParameterServer that applies pushes and answers them."""

    async def _push(self, ep: Endpoint, msg: dict[str, Any]) -> None:
        peer = self._peers.get(ep)
        if peer is None and ep.closed:
            return  # the last words of a connection that has left: never applied
        if peer is None or self.state is None or not self.plans.initialised:
            raise ProtocolError("push before a completed handshake")
        if self.scheduler.again(peer.rank, msg["step"]):
            self._again(peer, msg["step"])
            return
        if self.scheduler.late(peer.rank):  # it missed a barrier: see tensorx._ps.service.losses
            raise self.losses.late(peer.rank, msg["step"])
        self.sharing.check_mapped(peer, msg["mapped"])
        await self.optim.stepping(peer.rank, msg["step"], self.timeout)
        self.optim.pushed(peer.rank, msg["hyper"], self.state)
        peer.step = msg["step"]
        peer.held = msg["version"]
        self.stats["pushes"] += 1
        lag = self.state.version - msg["version"]
        self.stats["max_version_lag"] = max(self.stats["max_version_lag"], lag)
        self.timings.pushed(peer.rank, peer.step, lag)
        if self.rounds.active():
            self.rounds.pushed(peer, msg["parts"])
        if self.plans.sparse is not None:
            self.plans.sparse.announce(peer.rank, msg["staging"], msg["inbox"])
            rows = await self.plans.sparse.receive(ep, peer.rank, self.timeout)
            self.state.put_rows(peer.rank, rows)
            self.stats["sparse_rows"] += rows.num_rows
        opens = not self.scheduler.pending
        await self._act(self.scheduler.push(peer.rank, msg["step"]))
        if self.mode == "sync" and peer.rank in self.scheduler.pending:
            if opens:  # the barrier's first push: its clock starts (_ps.service.losses)
                self.losses.opened(self.scheduler.barrier)
            await self._tell_waiting([peer])

    def _again(self, peer: Peer, step: int) -> None:
        """``peer`` pushed ``step`` again (its step timed out and it retried it): taken
        once, the retry changes nothing here (a worker retries with the gradient it pushed)
        and the worker gets the one answer to that step. One INFO line per step retried."""
        if peer.retried == step:
            return
        peer.retried = step
        logger.info("ps shard %d: rank %d pushed its step %d again (a retry after a timeout); "
                    "taken once: %s", self.shard, peer.rank, step,
                    "it waits for the barrier" if peer.rank in self.scheduler.pending
                    else "its answer has been sent")

    async def _act(self, decision: Decision) -> None:
        assert self.state is not None
        if decision.apply and self.rounds.active():
            await self.rounds.start(decision)
            return
        by_rank = {p.rank: p for p in self._peers.values()}
        if decision.apply:
            decision = await self._drop_nonfinite(decision, by_rank)
            if self.state is None:
                return  # the refused rank was the last one: the plan was released
        targets = [by_rank[r] for r in decision.release if r in by_rank]
        sending: dict[int, list[asyncio.Future[None]]] = {}
        if decision.apply:
            self.stats["barrier_s"] += self.timings.barrier_done()
            t0 = time.perf_counter()
            if self.grads.active and not await self._process_grads(decision.apply, targets):
                return
            self.optim.before_update(decision.apply, self.state)
            if self.mode != "sync":  # answers still in flight keep the arena they read
                await self.outbox.make_room(self.state)
                self.stats["arena_moves"] = self.outbox.moves
            copies = [p for p in targets if not p.mapped and not self.outbox.pending(p.rank)]
            try:
                if copies and self.state.in_parts:
                    sending = await apply_in_parts(self._applier, self.state, decision.apply,
                                                   copies, self.send_timeout, self.plans.sparse)
                else:
                    self.state.apply(decision.apply)
            except OptimizerError as exc:
                self.state.ungather()
                await self._fail_update(exc, targets)
                return
            self.stats["apply_s"] += self.timings.apply.since(t0)
            self.stats["updates"] += 1
            if self.checkpoint_every and self.state.version % self.checkpoint_every == 0:
                self.checkpoint()
        self.stats["max_gap"] = self.scheduler.max_gap
        if self.mode != "sync":  # each answer on its own: see tensorx._ps.service.outbox
            for p in targets:
                self._answer_later(p, sending.get(p.rank))
            return
        t0 = time.perf_counter()
        await together([self._send_params(p, sending.get(p.rank)) for p in targets])
        self.stats["send_s"] += self.timings.sent(t0, len(targets))

    def _answer_later(self, peer: Peer, sent: list[asyncio.Future[None]] | None) -> None:
        """Send ``peer`` the parameters as they are now, without waiting for it to take
        them (what it is sent, and from which arena, is fixed here)."""
        assert self.state is not None
        send = self._params_sender(peer, sent)

        async def answer() -> None:
            t0 = time.perf_counter()
            await send()
            self.stats["send_s"] += self.timings.sent(t0, 1)

        self.outbox.send(peer.rank, self.state.params_region, answer)

    async def _process_grads(self, ranks: list[int], targets: list[Peer]) -> bool:
        """Hook and clip the averaged gradient, if asked; False (and the error to the
        workers) if a peer shard's norm is missing or the hook failed: no update then."""
        try:
            await self.grads.run(self.state, ranks)
        except Exception as exc:
            logger.error("ps shard %d: update %d not applied: %s", self.shard,
                         self.version + 1, exc)
            await self._fail_update(exc, targets)
            return False
        self.stats.update(grad_norm=self.grads.last_norm, norm_exchange_s=self.grads.exchange_s)
        return True

    async def _fail_update(self, exc: Exception, targets: list[Peer]) -> None:
        """Tell every worker waiting for this update that it failed, and why, at once."""
        if isinstance(exc, OptimizerError):
            logger.error("ps shard %d: %s", self.shard, exc)
        error = protocol.encode("error", code=error_code(exc), msg=str(exc))
        await asyncio.gather(*(p.ep.notify(error, timeout=self.timeout) for p in targets),
                             return_exceptions=True)

    async def _drop_nonfinite(self, decision: Decision, by_rank: dict[int, Peer]) -> Decision:
        """Fold the gradients the update steps with and check the fold; leave out those
        holding NaN or Inf, per ``on_nonfinite`` (the others are folded again, and checked)."""
        assert self.state is not None
        steps = {r: p.step for r, p in by_rank.items()}
        while decision.apply:
            bad, finite = self.nonfinite.check(self.state, decision.apply, steps)
            if finite:
                return decision
            self.state.ungather()
            self.stats["nonfinite"] = self.nonfinite.count
            if self.nonfinite.policy == "refuse":
                for rank, names in bad.items():
                    if rank in by_rank:
                        await self._refuse(by_rank[rank].ep,
                                           self.nonfinite.error(rank, steps[rank], names))
                if self.state is None:
                    break  # the refused rank was the last one: the plan was released
            decision = self.nonfinite.decide(decision, bad)
        return decision

    async def _send_params(self, peer: Peer,
                           sent: list[asyncio.Future[None]] | None = None) -> None:
        await self._params_sender(peer, sent)()

    def _params_sender(self, peer: Peer, sent: list[asyncio.Future[None]] | None,
                       last: tuple[int, int] | None = None
                       ) -> Callable[[], Awaitable[None]]:
        """The answer to ``peer`` as of now (arena, version, checksum, hyperparameters),
        to be sent by awaiting the result; a failed or late send drops ``peer``. With
        ``sent`` (parts on their way), the notification travels with part ``last``
        ((offset, nbytes); default: the state's last part)."""
        assert self.state is not None
        state = self.state
        region, last = state.params_region, last or last_part(state)
        # a worker that holds a recent version gets, of the sparse tables, the changed rows
        changed = None if peer.mapped or not state.rows else \
            state.changed.since(peer.held, state.version)
        rows = RowsAnswer.plan(self.plans.sparse, peer.rank, state, changed)
        msg = protocol.encode("params", version=state.version, step=peer.step,
                              checksum=state.checksum(), hyper=self.optim.answer(peer.ep, state),
                              rows=rows.nbytes, rows_want=rows.want)

        async def send() -> None:
            try:
                await send_params(region, peer, msg, sent, last, self.send_timeout,
                                  changed, state, rows)
            except TensorxError as exc:
                if self._peers.get(peer.ep) is peer:  # else it has left already
                    self._drop(peer, "", exc)

        return send

