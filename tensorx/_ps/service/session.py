"""A worker's session with a shard: hello (rank claim, plan check, admission), welcome,
and departure (goodbye, disconnect, a dropped send), after which its slot is renewed."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from tensorx._deadline import Deadline
from tensorx._ps.service.admission import PROBE_S, holder_alive, rank_taken
from tensorx._ps.service.answer import Peer, drop
from tensorx._ps.service.core import ShardCore
from tensorx._ps.wire import protocol
from tensorx.endpoint import Endpoint
from tensorx.errors import PlanMismatchError, ProtocolError, TensorxError
from tensorx.memregion import RegionDescriptor

logger = logging.getLogger("tensorx.ps")  # one logger name for the whole server


class Sessions(ShardCore):
    """The part of a ParameterServer that admits workers and lets them go."""

    async def _hello(self, ep: Endpoint, msg: dict[str, Any]) -> None:
        protocol.check_hello(msg, self.shard, self.num_shards, self.num_workers)
        if ep in self._peers:
            raise ProtocolError("a second hello on one connection")
        await self._claim(msg["rank"])
        if self._norms is not None:
            self._norms.learn(msg.get("shards"))
        await self._check_plan(msg)
        try:
            await self._admit(ep, msg)
        except BaseException:
            if ep in self._peers:  # undo the admission; _refuse still answers on ep
                await self._leave(ep, "refused at hello", close=False)
            self._release_plan_if_idle()
            raise

    async def _claim(self, rank: int) -> None:
        """Take ``rank`` from a holder that is gone; RankTakenError while it is alive."""
        for old in [e for e, p in self._peers.items() if p.rank == rank]:
            if await holder_alive(old, Deadline(self.timeout).least(PROBE_S)):
                raise rank_taken(rank, old)
            await self._leave(old, "gone (a new connection claims its rank)")

    async def _admit(self, ep: Endpoint, msg: dict[str, Any]) -> None:
        assert self.state is not None
        rank = msg["rank"]
        peer = Peer(rank, ep, RegionDescriptor.from_bytes(msg["params"]))
        self._peers[ep] = peer
        self.state.verify = self.state.verify or msg["verify"]
        if rank not in self._slot_descs:
            self._slot_descs[rank] = self.node.export(self.state.slot_region(rank), access="w")
            self._header_descs[rank] = b"" if self.plans.sparse is None else self.node.export(
                self.plans.sparse.headers[rank], access="w").to_bytes()
        peer.offered = self.sharing.offer(self.state, rank, msg["share"])
        self.plans.joined(rank)  # idle: rank 0 gives the parameters, as the first time
        self.scheduler.join(rank)
        self._finished.discard(rank)
        away = self.losses.back(rank)
        logger.info("ps shard %d: worker rank %d joined from %s%s", self.shard, rank, ep.peer,
                    "" if away is None else f" (back after {away:.1f} s; fresh gradient slot)")
        if self.plans.initialised or rank == 0:
            if not self.plans.initialised:
                await ep.read(self.state.params_region, peer.params, timeout=self.timeout)
                self.plans.took_parameters()
                logger.info("ps shard %d: initial parameters from rank 0", self.shard)
            waiting, self._waiting = [*self._waiting, peer], []
            await asyncio.gather(*(self._welcome(p) for p in waiting))
        else:
            self._waiting.append(peer)

    async def _check_plan(self, msg: dict[str, Any]) -> None:
        plans = self.plans
        if plans.idle and plans.plan is not None and \
                msg["fingerprint"] != plans.plan.fingerprint:
            plans.release()  # idle, and asked for by nobody: see tensorx._ps.service.plan
        if plans.plan is None:
            plan = await plans.adopt_async(msg["plan"])
            logger.info("ps shard %d: %s", self.shard, plan.summary())
            return
        if msg["fingerprint"] != plans.plan.fingerprint:
            plans.plan.check_same(msg["plan"], ours="this shard's plan (the first worker's)",
                                  theirs="the joining worker's")
            raise PlanMismatchError(f"plan fingerprint {msg['fingerprint']} differs from "
                                    f"{plans.plan.fingerprint} though the plans hold the same "
                                    "tensors: run the same tensorx version everywhere")

    async def _welcome(self, peer: Peer) -> None:
        """Write ``peer`` the parameters with its welcome; in async and bounded modes
        without waiting for it to take them (see :mod:`tensorx._ps.service.outbox`)."""
        assert self.state is not None
        if self.rounds.defer(peer):  # the arena is mid-update: welcomed after the round
            return
        region = self.state.params_region
        # Written even when mapping is offered: the worker may yet fail to map and copy.
        msg = protocol.encode(
            "welcome", slot=self._slot_descs[peer.rank].to_bytes(),
            headers=self._header_descs[peer.rank], version=self.state.version,
            mode=self.mode, checksum=self.state.checksum(),
            share=self.sharing.offer_message(self.state, peer, self.node,
                                             self._slot_descs[peer.rank]),
            optim=self.optim.welcome(peer.ep, self.state), parts=self.rounds.parts_offer())

        async def send() -> None:
            try:
                await peer.ep.write(region, peer.params, notify=msg, timeout=self.send_timeout)
            except TensorxError as exc:
                if self._peers.get(peer.ep) is peer:
                    drop(self.shard, peer, "at welcome", exc)

        if self.mode == "sync":
            await send()
        else:
            self.outbox.send(peer.rank, region, send)

    async def _leave(self, ep: Endpoint, why: str, close: bool = True) -> None:
        peer = self._peers.pop(ep, None)
        await self.optim.forget(ep, None if peer is None else peer.rank, self.timeout)
        if peer is None:
            with contextlib.suppress(TensorxError):
                await ep.aclose()  # a refused or half-joined peer: release its connection
            return
        self._waiting = [p for p in self._waiting if p.ep is not ep]
        rank = peer.rank
        await self.rounds.lost(rank)  # before its slot is renewed: nothing of it stays
        self._log_departure(rank, why)
        if close:
            with contextlib.suppress(TensorxError):
                await ep.aclose()
        self._retire_slot(rank)
        finished = rank in self._finished
        if self.mode == "sync" and not finished:
            self.losses.gone(rank)
        await self.updates.act(self.scheduler.leave(rank))
        if self.mode == "sync" and finished:
            # a rank that said goodbye pushes no more: later barriers go on without it
            await self.updates.act(self.scheduler.excuse(rank))
        elif self.mode == "sync":
            held = [p for p in self._peers.values() if p.rank in self.scheduler.pending]
            await self._tell_waiting(held)
        self._release_plan_if_idle()

    async def _goodbye(self, ep: Endpoint) -> None:
        peer = self._peers.get(ep)
        if peer is not None:
            self._finished.add(peer.rank)
        await self._leave(ep, "finished (said goodbye)")
        self._check_done()

    def _check_done(self) -> None:
        if self._until == "workers_done" and len(self._finished) == self.num_workers:
            if not self._stopped.is_set():
                logger.info("ps shard %d: every worker said goodbye; stopping", self.shard)
            self._stopped.set()

    async def _tell_waiting(self, held: list[Peer]) -> None:
        """Tell ranks held at the sync barrier which absent ranks it waits for and why, so
        that a worker that gives up names the cause, not just a timeout."""
        connected = self._connected()
        away = [r for r in self.scheduler.waiting_for() if r not in connected]
        if not away or not held:
            return
        note = protocol.encode("waiting", why=self.losses.explain(away))
        for peer in held:
            with contextlib.suppress(TensorxError):
                await peer.ep.notify(note, timeout=self.timeout)

    def _log_departure(self, rank: int, why: str) -> None:
        level, text = self.losses.departure(rank, why, rank in self.scheduler.pending,
                                            rank in self._finished, self.mode == "sync")
        logger.log(level, "ps shard %d: worker rank %d %s", self.shard, rank, text)

    def _retire_slot(self, rank: int) -> None:
        """Give ``rank`` fresh gradient memory. The old slot is closed: its descriptor is
        revoked at every peer and its /dev/shm file unlinked, so nothing a departed connection
        wrote (or might still write) there is ever applied; the next hello exports the new
        slot under a new descriptor."""
        if self.state is None or rank not in self._slot_descs:
            return
        del self._slot_descs[rank], self._header_descs[rank]
        self.state.renew_slot(rank)
        if self.plans.sparse is not None:
            self.plans.sparse.renew(rank)
