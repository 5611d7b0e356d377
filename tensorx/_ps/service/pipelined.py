"""A sync update applied part by part as the workers' gradients land (the I/O of it).

See :mod:`tensorx._ps.service.round` for what is guaranteed and how. The parts are the flat
update's ranges; the welcome lists them (``parts``), a worker's push comes first and each
part follows with a ``part`` message carried by its write. Each time a part of every rank
of the barrier is in, it is applied in the shard's apply thread (the loop meanwhile lands
the next parts) and written back to every worker that copies, at once; the ``params``
notification follows the last part. A rank of the barrier that goes away, or a part that
holds NaN or Inf, restores every part applied so far from its backup first. What is checked
for NaN and Inf is each part as folded into the shard's own memory, which is what is applied
(:mod:`tensorx._ps.update.fold`): the slots stay writable by their ranks all along.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from tensorx._ps.common import remembered
from tensorx._ps.common.abtimer import EarlyChooser
from tensorx._ps.common.remembered import Memory
from tensorx._ps.service import round as rounds
from tensorx._ps.service.nonfinite import Verdict, checked, nonfinite_names
from tensorx._ps.service.round import PartBackups, Round
from tensorx.errors import OptimizerError, ProtocolError

if TYPE_CHECKING:
    from tensorx._ps.common.stats import ShardTimings
    from tensorx._ps.service.answer import Peer
    from tensorx._ps.service.applier import Applier
    from tensorx._ps.service.grads import GradProcessing
    from tensorx._ps.service.nonfinite import NonFiniteGuard
    from tensorx._ps.service.optim_service import OptimService
    from tensorx._ps.service.options import ShardOptions
    from tensorx._ps.service.plan import PlanHolder
    from tensorx._ps.service.schedule import Decision, Scheduler
    from tensorx._ps.state.shard import ShardState
    from tensorx.endpoint import Endpoint
    from tensorx.errors import TensorxError

T = TypeVar("T")

logger = logging.getLogger("tensorx.ps")  # one logger name for the whole server

Writes = dict[int, list["asyncio.Future[None]"]]
Sender = Callable[["Peer", "list[asyncio.Future[None]] | None", "tuple[int, int] | None"],
                  Callable[[], Awaitable[None]]]


class PipelinedRounds:
    """The part of a ParameterServer that applies a sync update part by part.

    It owns the round (its parts landed, applied and backed up, the writes on their way,
    the ranks it answers, the workers welcomed after it) and the choice of applying parts
    early (``options.pipeline``, measured or remembered). It reads the shard's state from
    ``plans`` and its workers from ``peers`` (by endpoint, kept by the server's sessions);
    ``scheduler``, ``optim``, ``nonfinite``, ``grads``, ``timings``, ``stats`` and
    ``applier`` (the apply thread, shared with the server's updates in parts) are the
    server's. What it asks of the server: ``answer(peer, sent, last)`` (a worker's
    ``params`` answer, to be awaited), ``fail(exc, targets)`` (an update failed),
    ``welcome(peer)``, ``refuse(ep, exc)`` and ``checkpoint()``."""

    def __init__(self, options: ShardOptions, plans: PlanHolder, peers: Mapping[Endpoint, Peer],  # noqa: PLR0913 (each helper and call it uses, by name: no back-reference to the server)
                 *, scheduler: Scheduler, optim: OptimService, nonfinite: NonFiniteGuard,
                 grads: GradProcessing, timings: ShardTimings, stats: dict[str, Any],
                 applier: Applier, answer: Sender,
                 fail: Callable[[Exception, list[Peer]], Awaitable[None]],
                 welcome: Callable[[Peer], Awaitable[None]],
                 refuse: Callable[[Endpoint, TensorxError], Awaitable[None]],
                 checkpoint: Callable[[], bool]) -> None:
        self._options = options
        self._plans = plans
        self._peers = peers
        self._scheduler = scheduler
        self._optim = optim
        self._nonfinite_guard = nonfinite
        self._grads = grads
        self._timings = timings
        self._stats = stats
        self._applier = applier
        self._answer = answer
        self._fail = fail
        self._welcome = welcome
        self._refuse = refuse
        self._checkpoint = checkpoint
        self._round: Round | None = None
        self._round_of: ShardState | None = None  # the state _round belongs to
        self._backups: PartBackups | None = None
        self._writes: Writes = {}  # parts on their way, by rank
        self._release: list[int] = []  # the ranks the round answers
        self._round_t0 = 0.0
        self._deferred: list[Peer] = []  # joined while a round was open: welcomed after it
        self.chooser = EarlyChooser(options.pipeline)  # apply parts as they land? (abtimer)
        self._memory = Memory("pipelined", self.chooser)  # ... as measured in an earlier run

    @property
    def current(self) -> Round | None:
        """The round of the current (or last) state, if one was made."""
        return self._round

    @property
    def open(self) -> bool:
        """A round is in progress: the arena is mid-update."""
        return self._round is not None and self._round.open

    # -- set up ------------------------------------------------------------------------
    def active(self) -> bool:
        """Is a sync update applied part by part on this shard now?"""
        state = self._plans.state
        return self._options.mode == "sync" and state is not None and state.pipelined \
            and not self._grads.active

    def parts_offer(self) -> list[list[int]]:
        """The welcome's ``parts``: [[offset, nbytes], ...], or [] when not pipelined."""
        if not self.active():
            return []
        state = self._plans.state
        assert state is not None
        return [list(state.part_bytes(k)) for k in range(state.num_parts)]

    def defer(self, peer: Peer) -> bool:
        """Welcome ``peer`` after the round in progress, if there is one (then True)."""
        if not self.open:
            return False
        self._deferred.append(peer)
        return True

    def _the_round(self) -> Round:
        """The round of the current state (a state built anew gets a new one)."""
        state = self._plans.state
        assert state is not None
        if self._round is None or self._round_of is not state:
            self._round = Round([state.part_bytes(k)[1] for k in range(state.num_parts)])
            self._round_of, self._backups = state, PartBackups(state.layout.nbytes)
            self._writes = {}
        return self._round

    # -- messages ----------------------------------------------------------------------
    def pushed(self, peer: Peer, done: list[Any]) -> None:
        """A push on a pipelined shard: which parts of ``peer``'s gradient are in."""
        rnd = self._the_round()
        rnd.header(peer.rank, range(rnd.num_parts) if peer.mapped else done,
                   time.perf_counter())

    async def part(self, ep: Endpoint, msg: dict[str, Any]) -> None:
        peer = self._peers.get(ep)
        if peer is None and ep.closed:
            return  # the last words of a connection that has left
        if peer is None or not self.active():
            raise ProtocolError("a part message, but no pipelined push is in progress")
        self._the_round().land(peer.rank, msg["k"])
        await self._advance()

    # -- the round ---------------------------------------------------------------------
    async def start(self, decision: Decision) -> None:
        """The barrier is complete: apply parts as they are (or become) ready."""
        state = self._plans.state
        assert state is not None
        rnd = self._the_round()
        for r in decision.apply:
            rnd.landed.setdefault(r, set())
        self._stats["barrier_s"] += self._timings.barrier_done()
        self._optim.before_update(decision.apply, state)
        rnd.start(decision.apply)
        self._recall(decision.apply)
        rnd.early = self.chooser.early()
        rnd.eligible = rnd.outstanding() >= rounds.EARLY_BYTES
        self._release = list(decision.release)
        self._round_t0 = time.perf_counter()
        await self._advance()

    async def _advance(self) -> None:
        """Apply every part that can be, write it back; commit after the last."""
        rnd = self._the_round()
        while rnd.ranks is not None and not rnd.complete():
            settled = rnd.all_landed()
            todo = rnd.ready()
            if rnd.skip or not todo or (not settled and (
                    not rnd.early or rnd.outstanding() < rounds.EARLY_BYTES)):
                break
            # nothing can undo the rest: check it all first (in the same trip to the thread)
            check = settled and not rnd.checked
            try:
                verdict = await self._in_thread(self._apply_parts, rnd.ranks, todo,
                                                not settled, check)
            except OptimizerError as exc:
                await self._round_failed(exc)
                return
            rnd.checked = rnd.checked or check
            if not verdict.finite:
                await self._nonfinite(verdict.bad)
                continue
            self._write_back([k for k in todo if k in rnd.applied], hold_last=rnd.complete())
        if rnd.skip and rnd.all_landed():
            await self._finish_round(updated=False)
        elif rnd.complete():
            await self._finish_round(updated=True)

    async def _in_thread(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn`` in the shard's apply thread; if we are cancelled meanwhile (the server
        closes), the thread still finishes what it does (see :meth:`abandon`)."""
        return await self._applier.run(fn, *args)

    def _check_parts(self, ranks: list[int], parts: list[int]) -> Verdict:
        """Fold ``parts`` of ``ranks``' gradients into the shard's memory, and check that
        (what :meth:`_apply_parts` then applies)."""
        state = self._plans.state
        assert state is not None
        return checked(state, ranks, parts)

    def _apply_parts(self, ranks: list[int], parts: list[int], backup: bool,
                     check: bool = False) -> Verdict:
        """Apply ``parts`` (in the apply thread), each after its fold, its check and its
        backup when ``backup`` (else as :meth:`_check_parts` folded them; ``check``: folded
        and checked all first, here, and none applied unless all are finite); not finite:
        the ranks whose gradient is not (the parts before were applied, unless ``check``)."""
        state, rnd, backups = self._plans.state, self._round, self._backups
        assert state is not None
        assert rnd is not None
        assert backups is not None
        if check:
            verdict = self._check_parts(ranks, parts)
            if not verdict.finite:
                return verdict
        with torch.no_grad():
            for k in parts:
                if backup:
                    verdict = self._check_parts(ranks, [k])
                    if not verdict.finite:
                        return verdict
                    start, n = state.part_bytes(k)
                    owner, key = state.part_state(k)
                    backups.backup(k, state.params_region.view(torch.uint8, (n,), start),
                                   start, owner.get(key))
                    rnd.backed_up.add(k)
                    self._stats["parts_early"] += 1
                state.apply_part(ranks, k)
                rnd.applied.append(k)
        return Verdict([], True)

    def _write_back(self, parts: list[int], hold_last: bool) -> None:
        """Start writing ``parts`` of the new parameters to every worker that copies (the
        last one of the update waits for the ``params`` notification to travel with it)."""
        state = self._plans.state
        assert state is not None
        if hold_last:
            parts = parts[:-1]
        if not parts:
            return
        region = state.params_region
        spans = [state.part_bytes(k) for k in parts]
        for peer in self._copying():
            ops = [(region, peer.params, off, off, n) for off, n in spans]
            self._writes.setdefault(peer.rank, []).append(asyncio.ensure_future(
                peer.ep.write_many(ops, timeout=self._options.send_timeout)))

    def _copying(self) -> list[Peer]:
        by_rank = {p.rank: p for p in self._peers.values()}
        return [by_rank[r] for r in self._release if r in by_rank and not by_rank[r].mapped]

    async def _finish_round(self, updated: bool) -> None:
        """Commit (or, with nothing applied, end) the round and answer its workers."""
        assert self._plans.state is not None
        assert self._round is not None
        rnd, state = self._round, self._plans.state
        last = state.part_bytes(rnd.applied[-1]) if updated else None
        writes, self._writes = self._writes, {}
        if updated:
            state.finish_update()
            self._stats["updates"] += 1
            self._stats["apply_s"] += self._timings.apply.since(self._round_t0)
            every = self._options.checkpoint_every
            if every and state.version % every == 0:
                self._checkpoint()
        measured = (rnd.early, rnd.t_first) if updated and rnd.eligible else None
        rnd.finish()
        by_rank = {p.rank: p for p in self._peers.values()}
        targets = [by_rank[r] for r in self._release if r in by_rank]
        self._release = []
        self._stats["max_gap"] = self._scheduler.max_gap
        t0 = time.perf_counter()
        await asyncio.gather(*(self._answer(p, writes.get(p.rank), last)()
                               for p in targets))
        self._stats["send_s"] += self._timings.sent(t0, len(targets))
        if measured is not None and measured[1] is not None:
            self._measured(measured[0], time.perf_counter() - measured[1])
        await self._welcome_deferred()

    def _measured(self, early: bool, seconds: float) -> None:
        """A round that could apply parts early took ``seconds``: tell the chooser, and
        say once when it has decided (again); remember it for the next run."""
        before = self.chooser.decided
        self.chooser.observe(early, seconds)
        if self.chooser.decided != before:
            logger.info("ps shard %d: pipelined rounds: %s", self._options.shard,
                        self.chooser.decided)
            self._memory.decided()

    def _recall(self, ranks: list[int]) -> None:
        """Key the chooser by the plan and how the round's ranks move their bytes (mapped,
        or the lanes of their endpoints); a choice measured for that before is taken."""
        peers = sorted((p for p in self._peers.values() if p.rank in ranks),
                       key=lambda p: p.rank)
        o = self._options
        sig = (self._plans.state, tuple((p.rank, p.mapped, id(p.ep)) for p in peers))

        def how() -> tuple[str, str]:
            moved = sorted({"mapped" if p.mapped else _lanes(p.ep) for p in peers})
            return (self._plans.state.layout.fingerprint if self._plans.state else "",
                    f"shard {o.shard}/{o.num_shards} workers {o.num_workers} "
                    + ",".join(moved))

        if self._memory.keyed(sig, how):
            logger.info("ps shard %d: pipelined rounds: %s, as measured before on this host "
                        "(%s)", self._options.shard, "parts applied as they land" if
                        self.chooser.choice else "once all have landed", remembered.FILE)

    # -- when it cannot go on as it started ----------------------------------------------
    async def _rollback(self) -> None:
        """Put back every part applied so far (what the workers were sent of them is
        superseded by what they are sent later)."""
        rnd, state, backups = self._round, self._plans.state, self._backups
        if rnd is None or state is None or backups is None:
            return
        writes, self._writes = self._writes, {}
        await asyncio.gather(*(f for fs in writes.values() for f in fs),
                             return_exceptions=True)
        with torch.no_grad():
            for k in reversed(rnd.applied):
                if k not in rnd.backed_up:  # applied once nothing could undo it: never here
                    logger.error("ps shard %d: part %d cannot be rolled back",
                                 self._options.shard, k)
                    continue
                start, n = state.part_bytes(k)
                owner, key = state.part_state(k)
                backups.restore(k, state.params_region.view(torch.uint8, (n,), start), start,
                                owner, key)
        state.ungather()  # what was folded: the barrier's ranks may change
        if rnd.applied:
            self._stats["rollbacks"] += 1
            logger.info("ps shard %d: rolled back %d part(s) of update %d", self._options.shard,
                        len(rnd.applied), state.version + 1)
        rnd.applied.clear()
        rnd.backed_up.clear()
        rnd.checked = False

    async def lost(self, rank: int) -> None:
        """``rank`` is gone: nothing of its push stays; a barrier it belonged to is open
        again (the others' pushes stand, the policy decides about it)."""
        rnd = self._round
        if rnd is None or self._round_of is not self._plans.state:
            return
        if rnd.ranks is not None and rank in rnd.ranks:
            await self._rollback()
        others = rnd.drop(rank)
        if others is not None:
            self._release = []
            self._scheduler.reopen(others)
            await self._welcome_deferred()

    async def _nonfinite(self, bad: list[int]) -> None:
        """Some of the barrier's gradients hold NaN or Inf (``on_nonfinite`` decides), or
        none does but their mean (``bad`` empty: no update)."""
        rnd = self._the_round()
        assert rnd.ranks is not None
        await self._rollback()
        if not bad:
            self._nonfinite_guard.overflowed(rnd.ranks)
            self._stats["nonfinite"] = self._nonfinite_guard.count
            rnd.skip = True
            return
        by_rank = {p.rank: p for p in self._peers.values()}
        steps = {r: p.step for r, p in by_rank.items()}
        names = await self._nonfinite_names(rnd, bad)
        for r in bad:
            self._nonfinite_guard.flag(r, steps.get(r, -1), names[r])
        self._stats["nonfinite"] = self._nonfinite_guard.count
        if self._nonfinite_guard.policy == "skip":
            rnd.skip = True  # no update: answered once every part has landed
            return
        rnd.ranks = [r for r in rnd.ranks if r not in bad]
        self._release = [r for r in self._release if r not in bad]
        for r in bad:
            rnd.landed.pop(r, None)
            if r in by_rank:
                await self._refuse(by_rank[r].ep,
                                   self._nonfinite_guard.error(r, steps[r], names[r]))
        if not rnd.ranks:
            rnd.skip = True

    async def _nonfinite_names(self, rnd: Round, bad: list[int]) -> dict[int, list[str]]:
        """Each ``bad`` rank's tensors that hold NaN or Inf among the parts of its push that
        have landed (the others may hold its last push's), read in the apply thread."""
        state = self._plans.state
        assert state is not None
        spans = {r: [state.part_bytes(k) for k in sorted(rnd.landed.get(r, ()))] for r in bad}
        names: dict[int, list[str]] = await self._in_thread(
            lambda: {r: nonfinite_names(state, r, s) for r, s in spans.items()})
        return names

    async def _round_failed(self, exc: OptimizerError) -> None:
        await self._rollback()
        assert self._plans.state is not None
        assert self._round is not None
        by_rank = {p.rank: p for p in self._peers.values()}
        targets = [by_rank[r] for r in self._release if r in by_rank]
        self._round.finish()
        self._release = []
        await self._fail(exc, targets)
        await self._welcome_deferred()

    async def abandon(self) -> None:
        """The server closes mid-round: let the apply thread finish (a round's part, or an
        answer's: :mod:`tensorx._ps.service.applier`), then undo the round's parts, so that a
        checkpoint never holds part of a round's update."""
        await self._applier.settle()
        if self._round is not None and self._round.open:
            await self._rollback()
        self._applier.close()

    async def _welcome_deferred(self) -> None:
        """Welcome the workers that joined while a round was open (they get its result)."""
        if self._round is not None and self._round.open:
            return
        deferred, self._deferred = self._deferred, []
        await asyncio.gather(*(self._welcome(p) for p in deferred if p.ep in self._peers))


def _lanes(ep: Endpoint) -> str:
    """How ``ep`` moves host memory, in a word or two: ``tcp``, ``ucx``, ``tcp+cma``."""
    info = ep.info
    host = str(info.get("host", ""))
    return str(info.get("transport")) + ("+" + host.split(" ", 1)[0] if host else "")
