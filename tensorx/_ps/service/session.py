"""A worker's session with a shard: hello (rank claim, plan check, admission), welcome,
and departure (goodbye, disconnect, a dropped send), after which its slot is renewed."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from tensorx._deadline import Deadline
from tensorx._ps.service.admission import PROBE_S, holder_alive, rank_taken
from tensorx._ps.service.answer import Peer, drop
from tensorx._ps.wire import protocol
from tensorx.errors import PlanMismatchError, ProtocolError, TensorxError
from tensorx.memregion import RegionDescriptor

if TYPE_CHECKING:
    from tensorx._ps.service.losses import LossWatch
    from tensorx._ps.service.norm_exchange import NormExchange
    from tensorx._ps.service.optim_service import OptimService
    from tensorx._ps.service.options import ShardOptions
    from tensorx._ps.service.outbox import Outbox
    from tensorx._ps.service.pipelined import PipelinedRounds
    from tensorx._ps.service.plan import PlanHolder
    from tensorx._ps.service.samehost import Sharing
    from tensorx._ps.service.schedule import Scheduler
    from tensorx._ps.service.steps import Updates
    from tensorx._ps.state.shard import ShardState
    from tensorx.endpoint import Endpoint
    from tensorx.node import Node

logger = logging.getLogger("tensorx.ps")  # one logger name for the whole server


class Sessions:
    """The part of a ParameterServer that admits workers and lets them go.

    It owns the workers: ``peers`` (by endpoint; the server makes the dict, the other parts
    read it), those waiting for rank 0's parameters, the ranks that said goodbye and the
    slot descriptors exported for each rank on ``node``. A departure goes to ``rounds``
    (nothing of its push stays) and its decision to ``updates``; ``plans`` is checked at
    hello and released once idle (never while ``closed()``)."""

    def __init__(self, options: ShardOptions, peers: dict[Endpoint, Peer], *, node: Node,  # noqa: PLR0913 (each helper and call it uses, by name: no back-reference to the server)
                 plans: PlanHolder, sharing: Sharing, optim: OptimService, losses: LossWatch,
                 scheduler: Scheduler, outbox: Outbox, norms: NormExchange | None,
                 rounds: PipelinedRounds, updates: Updates,
                 closed: Callable[[], bool]) -> None:
        self._options = options
        self._peers = peers
        self._node = node
        self._plans = plans
        self._sharing = sharing
        self._optim = optim
        self._losses = losses
        self._scheduler = scheduler
        self._outbox = outbox
        self._norms = norms
        self._rounds = rounds
        self._updates = updates
        self._closed = closed
        self._waiting: list[Peer] = []  # said hello before the parameters were initialised
        self._finished: set[int] = set()  # ranks that said goodbye (until they join again)
        self._slot_descs: dict[int, RegionDescriptor] = {}
        self._header_descs: dict[int, bytes] = {}

    @property
    def _state(self) -> ShardState | None:
        return self._plans.state  # read anew each time: a departure may release the plan

    @property
    def peers(self) -> Mapping[Endpoint, Peer]:
        """The workers admitted, by endpoint."""
        return self._peers

    @property
    def finished(self) -> frozenset[int]:
        """The ranks that said goodbye (until they join again)."""
        return frozenset(self._finished)

    def connected(self) -> list[int]:
        return sorted(p.rank for p in self._peers.values())

    def _release_plan_if_idle(self) -> None:
        self._plans.release_if_idle(bool(self._peers), self._closed())

    def forget_slots(self) -> None:
        """The plan was released: the slots exported for its state are gone with it."""
        self._slot_descs.clear()
        self._header_descs.clear()

    async def hello(self, ep: Endpoint, msg: dict[str, Any]) -> None:
        """A worker's hello: claim its rank, check (or adopt) the plan, admit it."""
        o = self._options
        protocol.check_hello(msg, o.shard, o.num_shards, o.num_workers)
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
                await self.leave(ep, "refused at hello", close=False)
            self._release_plan_if_idle()
            raise

    async def _claim(self, rank: int) -> None:
        """Take ``rank`` from a holder that is gone; RankTakenError while it is alive."""
        for old in [e for e, p in self._peers.items() if p.rank == rank]:
            if await holder_alive(old, Deadline(self._options.timeout).least(PROBE_S)):
                raise rank_taken(rank, old)
            await self.leave(old, "gone (a new connection claims its rank)")

    async def _admit(self, ep: Endpoint, msg: dict[str, Any]) -> None:
        assert self._state is not None
        rank = msg["rank"]
        peer = Peer(rank, ep, RegionDescriptor.from_bytes(msg["params"]))
        self._peers[ep] = peer
        self._state.verify = self._state.verify or msg["verify"]
        if rank not in self._slot_descs:
            self._slot_descs[rank] = self._node.export(self._state.slot_region(rank), access="w")
            self._header_descs[rank] = b"" if self._plans.sparse is None else self._node.export(
                self._plans.sparse.headers[rank], access="w").to_bytes()
        peer.offered = self._sharing.offer(self._state, rank, msg["share"])
        self._plans.joined(rank)  # idle: rank 0 gives the parameters, as the first time
        self._scheduler.join(rank)
        self._finished.discard(rank)
        away = self._losses.back(rank)
        logger.info("ps shard %d: worker rank %d joined from %s%s", self._options.shard, rank,
                    ep.peer, "" if away is None else
                    f" (back after {away:.1f} s; fresh gradient slot)")
        if self._plans.initialised or rank == 0:
            if not self._plans.initialised:
                await ep.read(self._state.params_region, peer.params, timeout=self._options.timeout)
                self._plans.took_parameters()
                logger.info("ps shard %d: initial parameters from rank 0", self._options.shard)
            waiting, self._waiting = [*self._waiting, peer], []
            await asyncio.gather(*(self.welcome(p) for p in waiting))
        else:
            self._waiting.append(peer)

    async def _check_plan(self, msg: dict[str, Any]) -> None:
        plans = self._plans
        if plans.idle and plans.plan is not None and \
                msg["fingerprint"] != plans.plan.fingerprint:
            plans.release()  # idle, and asked for by nobody: see tensorx._ps.service.plan
        if plans.plan is None:
            plan = await plans.adopt_async(msg["plan"])
            logger.info("ps shard %d: %s", self._options.shard, plan.summary())
            return
        if msg["fingerprint"] != plans.plan.fingerprint:
            plans.plan.check_same(msg["plan"], ours="this shard's plan (the first worker's)",
                                  theirs="the joining worker's")
            raise PlanMismatchError(f"plan fingerprint {msg['fingerprint']} differs from "
                                    f"{plans.plan.fingerprint} though the plans hold the same "
                                    "tensors: run the same tensorx version everywhere")

    async def welcome(self, peer: Peer) -> None:
        """Write ``peer`` the parameters with its welcome; in async and bounded modes
        without waiting for it to take them (see :mod:`tensorx._ps.service.outbox`)."""
        assert self._state is not None
        if self._rounds.defer(peer):  # the arena is mid-update: welcomed after the round
            return
        region = self._state.params_region
        # Written even when mapping is offered: the worker may yet fail to map and copy.
        msg = protocol.encode(
            "welcome", slot=self._slot_descs[peer.rank].to_bytes(),
            headers=self._header_descs[peer.rank], version=self._state.version,
            mode=self._options.mode, checksum=self._state.checksum(),
            share=self._sharing.offer_message(self._state, peer, self._node,
                                             self._slot_descs[peer.rank]),
            optim=self._optim.welcome(peer.ep, self._state), parts=self._rounds.parts_offer())

        async def send() -> None:
            try:
                await peer.ep.write(region, peer.params, notify=msg,
                                    timeout=self._options.send_timeout)
            except TensorxError as exc:
                if self._peers.get(peer.ep) is peer:
                    drop(self._options.shard, peer, "at welcome", exc)

        if self._options.mode == "sync":
            await send()
        else:
            self._outbox.send(peer.rank, region, send)

    async def leave(self, ep: Endpoint, why: str, close: bool = True) -> None:
        """``ep`` is gone (``why``): nothing of its worker stays; act on what that decides."""
        peer = self._peers.pop(ep, None)
        await self._optim.forget(ep, None if peer is None else peer.rank, self._options.timeout)
        if peer is None:
            with contextlib.suppress(TensorxError):
                await ep.aclose()  # a refused or half-joined peer: release its connection
            return
        self._waiting = [p for p in self._waiting if p.ep is not ep]
        rank = peer.rank
        await self._rounds.lost(rank)  # before its slot is renewed: nothing of it stays
        self._log_departure(rank, why)
        if close:
            with contextlib.suppress(TensorxError):
                await ep.aclose()
        self._retire_slot(rank)
        finished = rank in self._finished
        if self._options.mode == "sync" and not finished:
            self._losses.gone(rank)
        await self._updates.act(self._scheduler.leave(rank))
        if self._options.mode == "sync" and finished:
            # a rank that said goodbye pushes no more: later barriers go on without it
            await self._updates.act(self._scheduler.excuse(rank))
        elif self._options.mode == "sync":
            held = [p for p in self._peers.values() if p.rank in self._scheduler.pending]
            await self.tell_waiting(held)
        self._release_plan_if_idle()

    async def goodbye(self, ep: Endpoint) -> None:
        """``ep``'s worker is finished: it leaves, and later barriers go on without it."""
        peer = self._peers.get(ep)
        if peer is not None:
            self._finished.add(peer.rank)
        await self.leave(ep, "finished (said goodbye)")

    async def tell_waiting(self, held: list[Peer]) -> None:
        """Tell ranks held at the sync barrier which absent ranks it waits for and why, so
        that a worker that gives up names the cause, not just a timeout."""
        connected = self.connected()
        away = [r for r in self._scheduler.waiting_for() if r not in connected]
        if not away or not held:
            return
        note = protocol.encode("waiting", why=self._losses.explain(away))
        for peer in held:
            with contextlib.suppress(TensorxError):
                await peer.ep.notify(note, timeout=self._options.timeout)

    def _log_departure(self, rank: int, why: str) -> None:
        level, text = self._losses.departure(rank, why, rank in self._scheduler.pending,
                                            rank in self._finished, self._options.mode == "sync")
        logger.log(level, "ps shard %d: worker rank %d %s", self._options.shard, rank, text)

    def _retire_slot(self, rank: int) -> None:
        """Give ``rank`` fresh gradient memory. The old slot is closed: its descriptor is
        revoked at every peer and its /dev/shm file unlinked, so nothing a departed connection
        wrote (or might still write) there is ever applied; the next hello exports the new
        slot under a new descriptor."""
        if self._state is None or rank not in self._slot_descs:
            return
        del self._slot_descs[rank], self._header_descs[rank]
        self._state.renew_slot(rank)
        if self._plans.sparse is not None:
            self._plans.sparse.renew(rank)
