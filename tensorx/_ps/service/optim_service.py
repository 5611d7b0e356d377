"""A shard's side of :class:`tensorx.RemoteOptimizer`: hyperparameters and optimizer state.

* Hyperparameters (:mod:`tensorx._ps.wire.hyper`): the welcome describes the optimizer's groups;
  each push may carry changes, set just before the update that push takes part in (lowest
  rank wins a conflict); each answer carries the values after the update when they changed
  since that worker last heard them.
* State (:mod:`tensorx._ps.wire.optim_state`): on ``state_get`` the shard packs its optimizer's
  state into a fresh region that the asking worker may read (one per worker at a time,
  freed on ``state_done`` or when the worker leaves). A load (``state_put``, then
  ``state_commit``) is every rank's and every shard's or none's (see
  :mod:`tensorx._ps.service.optim_load`): the shard reads one packed region, after checking the
  manifest against its own entries, checks what it holds against the optimizer (see
  :mod:`tensorx._ps.update.optim_check`), and loads it once every rank has committed. A refused
  load is answered with the error; the workers stay connected.

The service loop calls these between updates, so the state is never read or loaded halfway
through one.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

import torch

from tensorx._ps.service.optim_load import RULE, LoadRound, Put
from tensorx._ps.update import optim_check
from tensorx._ps.wire import hyper, optim_state, protocol
from tensorx._text import printable
from tensorx.endpoint import Endpoint
from tensorx.errors import ProtocolError, TensorxError, UsageError, error_code
from tensorx.memregion import MemoryRegion, RegionDescriptor
from tensorx.node import Node

if TYPE_CHECKING:
    from tensorx._ps.state.shard import ShardState

__all__ = ["OptimService"]

logger = logging.getLogger(__name__)


class OptimService:
    """Hyperparameter changes and state transfers for one shard's optimizer."""

    def __init__(self, shard: int, node: Node) -> None:
        self.shard = shard
        self.node = node
        self.pending = hyper.Pending(shard)
        self._seen: dict[Endpoint, list[dict[str, Any]]] = {}
        self._lent: dict[Endpoint, MemoryRegion] = {}
        self._round = LoadRound()

    # -- hyperparameters ------------------------------------------------------------------
    def welcome(self, ep: Endpoint, state: ShardState) -> dict[str, Any]:
        """The welcome's ``optim``: defaults and groups (hyperparameters and entry labels)."""
        opt = state.optimizer
        if opt is None:
            self._seen[ep] = []
            return {"defaults": {}, "groups": [], "flat": False}
        groups = optim_state.groups_of(opt, state.param_labels(), list(state.param_numels()))
        self._seen[ep] = [g["hp"] for g in groups]
        return {"defaults": hyper.snapshot([opt.defaults])[0], "groups": groups,
                "flat": state.param_labels() is None}

    def pushed(self, rank: int, sent: Any, state: ShardState) -> None:
        """Keep ``rank``'s changes for the update its push takes part in: all of them, or,
        when one is refused (UsageError naming it), none."""
        if state.optimizer is None:
            return
        try:
            changes = _checked(state.optimizer, sent)
        except UsageError as exc:
            raise UsageError(f"rank {rank}'s step refused: {exc}") from None
        self.pending.pushed(rank, changes)

    def before_update(self, ranks: list[int], state: ShardState) -> None:
        if state.optimizer is not None:
            self.pending.apply(ranks, state.optimizer.param_groups)

    def answer(self, ep: Endpoint, state: ShardState) -> list[dict[str, Any]]:
        """The params answer's ``hyper``: the groups' values, if ``ep`` has not heard them."""
        if state.optimizer is None:
            return []
        now = hyper.snapshot(state.optimizer.param_groups)
        if self._seen.get(ep) == now:
            return []
        self._seen[ep] = now
        return now

    async def forget(self, ep: Endpoint, rank: int | None, timeout: float | None) -> None:
        """``ep`` left: drop its pending changes, free what it borrowed, and refuse a load
        in progress (it can no longer be every rank's)."""
        if rank is not None:
            self.pending.drop(rank)
        self._seen.pop(ep, None)
        self._free(ep)
        if rank is not None and self._round.open:
            await self._fail([e for e in self._round.eps() if e is not ep], UsageError(
                f"rank {rank} left while rank(s) {sorted(self._round.puts)} loaded "
                f"optimizer state: {RULE}"), timeout)

    # -- state ----------------------------------------------------------------------------
    def _labelled(self, state: ShardState) -> tuple[torch.optim.Optimizer, dict[int, str]]:
        opt, label_of = state.optimizer, state.param_labels()
        assert opt is not None  # (callers ask only of a shard with an optimizer)
        if state.fast is not None:
            state.fast.expose()  # the flat update's state, per parameter
        if label_of is None:
            raise UsageError("the optimizer state of a flat=True server cannot be transferred "
                             "(its parameters span several tensors); run it with flat=False")
        return opt, label_of

    async def lend(self, ep: Endpoint, state: ShardState, timeout: float | None) -> None:
        """Answer ``state_get``: pack the state into a region ``ep`` may read."""
        self._free(ep)
        manifest: dict[str, Any] = {"groups": [], "tensors": {}, "values": {}}
        region = MemoryRegion.allocate(optim_state.ALIGN)
        if state.optimizer is not None:
            opt, label_of = self._labelled(state)
            packed = optim_state.pack(optim_state.state_of(opt, label_of))
            region.close()
            region = packed.region()
            manifest = packed.manifest(optim_state.groups_of(
                opt, label_of, list(state.param_numels())))
        self._lent[ep] = region
        desc = self.node.export(region, access="r")
        await ep.notify(protocol.encode("state", manifest=manifest, region=desc.to_bytes()),
                        timeout=timeout)

    def returned(self, ep: Endpoint) -> None:
        """``state_done``: the worker has read what it borrowed."""
        self._free(ep)

    def _free(self, ep: Endpoint) -> None:
        region = self._lent.pop(ep, None)
        if region is not None:
            region.close()

    # -- loads: every rank, the same state, every shard or none (see _ps.service.optim_load) ------
    def _precheck(self, msg: dict[str, Any], state: ShardState) -> None:
        """A put's manifest against this shard's entries (ProtocolError: malformed). A
        shard without an optimizer (the plan left it no parameters) has no state: a put
        for it carries no groups and no entries, as a torch optimizer over no parameters
        has none."""
        numels: dict[str, int] = {}
        groups = 0
        if state.optimizer is not None:
            opt, _ = self._labelled(state)
            numels, groups = state.param_numels(), len(opt.param_groups)
        nbytes = RegionDescriptor.from_bytes(msg["region"]).nbytes
        try:  # the manifest first: it names an entry this shard does not hold
            optim_state.check_manifest(msg["manifest"], numels, nbytes, groups)
            if nbytes > optim_state.bound(numels) + optim_state.ALIGN:
                raise ProtocolError(f"optimizer state of {nbytes} B is more than this "
                                    "shard's entries can have")
        except ProtocolError as exc:
            if state.optimizer is not None:
                raise
            raise ProtocolError(f"{exc} (this shard has no optimizer: the plan left it no "
                                "parameters, so it has no optimizer state to load)") from None

    async def put(self, ep: Endpoint, rank: int, msg: dict[str, Any], state: ShardState,
                  counted: set[int], stepping: list[int], timeout: float | None) -> None:
        """``state_put`` from ``rank``: once every ``counted`` rank has sent the same one
        (and none is ``stepping``: pushed, not answered), read, check and keep it."""
        try:
            self._precheck(msg, state)  # a malformed put (ProtocolError): its refusal
        except UsageError as exc:
            await self._fail([*self._round.eps(), ep], exc, timeout)
            return
        if self._round.staged is not None:
            await self._fail([ep], UsageError(f"rank {rank} loads optimizer state while "
                                              f"a load is being committed: {RULE}"), timeout)
            return
        if stepping:
            await self._fail([*self._round.eps(), ep], UsageError(
                f"rank {rank} loads optimizer state while rank(s) {stepping} are in a "
                f"step: {RULE}"), timeout)
            return
        self._round.puts[rank] = Put(ep, msg["manifest"], msg["region"], msg["digest"])
        missing = self._round.missing(counted)
        if missing:
            await ep.notify(protocol.encode("waiting", why=(
                f"optimizer state: waiting for rank(s) {missing} to load the same state "
                "(every rank loads it between the same two steps)")), timeout=timeout)
            return
        round_ = self._round
        try:
            why = round_.disagreement()
            if why:
                raise UsageError(why)
            round_.staged = await self._read(round_.first(), state, timeout)
        except TensorxError as exc:
            await self._fail(round_.eps(), exc, timeout)
            return
        await self._tell(round_.eps(), protocol.encode("state_checked"), timeout)

    async def _read(self, put: Put, state: ShardState, timeout: float | None
                    ) -> tuple[list[dict[str, Any]], optim_state.State]:
        """The state ``put`` describes, read from its region and checked; nothing (no
        groups, no entries: what :meth:`_precheck` let through) for a shard without an
        optimizer."""
        if state.optimizer is None:
            return [], {}
        opt, label_of = self._labelled(state)
        desc = RegionDescriptor.from_bytes(put.region)
        region = MemoryRegion.allocate(desc.nbytes)
        try:
            await put.ep.read(region, desc, timeout=timeout)
            if optim_state.digest(region) != put.digest:
                raise ProtocolError("the optimizer state read differs from its digest")
            loaded = optim_state.unpack(put.manifest, region)
        finally:
            region.close()
        saved = _checked(opt, [g["hp"] for g in put.manifest["groups"]])
        optim_check.check_state(opt, label_of, saved, loaded)
        return saved, loaded

    async def commit(self, ep: Endpoint, rank: int, load: bool, state: ShardState,
                     timeout: float | None) -> None:
        """``state_commit``: once every rank that put has committed, load what was kept
        if all of them say so (every shard checked it), else drop it."""
        round_ = self._round
        put = round_.puts.get(rank)
        if put is None or put.ep is not ep or round_.staged is None or rank in round_.commits:
            raise ProtocolError("state_commit without a checked optimizer state")
        verdict = round_.commit(rank, load)
        if verdict is None:
            return
        self._round = LoadRound()
        if not verdict:
            await self._fail(round_.eps(), UsageError(
                "optimizer state not loaded: another shard refused it"), timeout)
            return
        hps: list[dict[str, Any]] = []
        if state.optimizer is not None:
            opt, label_of = self._labelled(state)
            try:
                _replace(opt, label_of, *round_.staged)
            except UsageError as exc:
                await self._fail(round_.eps(), exc, timeout)
                return
            hps = hyper.snapshot(opt.param_groups)
            logger.info("ps shard %d: optimizer state loaded (%d entries, ranks %s)",
                        self.shard, len(round_.staged[1]), sorted(round_.puts))
        for eps in round_.eps():
            self._seen[eps] = hps
        await self._tell(round_.eps(), protocol.encode("state_loaded", hyper=hps), timeout)

    async def stepping(self, rank: int, step: int, timeout: float | None) -> None:
        """``rank`` pushed: a load in progress, which it did not join, is refused."""
        if self._round.open:
            await self._fail(self._round.eps(), UsageError(
                f"rank {rank} pushed its step {step} while rank(s) {sorted(self._round.puts)} "
                f"loaded optimizer state: {RULE}"), timeout)

    async def _fail(self, eps: list[Endpoint], exc: TensorxError,
                    timeout: float | None) -> None:
        """Refuse the load in progress (and ``eps``' puts) with ``exc``; nothing loaded."""
        self._round = LoadRound()
        logger.warning("ps shard %d: optimizer state not loaded: %s", self.shard, exc)
        await self._tell(eps, protocol.encode("error", code=error_code(exc), msg=str(exc)),
                         timeout)

    async def _tell(self, eps: list[Endpoint], payload: bytes, timeout: float | None) -> None:
        await asyncio.gather(*(ep.notify(payload, timeout=timeout) for ep in eps),
                             return_exceptions=True)


def _checked(optimizer: torch.optim.Optimizer, sent: Any) -> list[dict[str, Any]]:
    """A peer's hyperparameters for ``optimizer``'s groups, checked (see
    :mod:`tensorx._ps.update.optim_check`)."""
    changes = hyper.check(sent, [{k: v for k, v in g.items() if k not in hyper.SKIP}
                                 for g in optimizer.param_groups])
    optim_check.check_hyper(optimizer, changes)
    return changes


def _replace(optimizer: torch.optim.Optimizer, label_of: dict[int, str], hps: list[dict[str, Any]],
             loaded: optim_state.State) -> None:
    """Load checked state; if the optimizer fails on it all the same, put back what it
    had (UsageError: nothing was loaded)."""
    before = optimizer.state_dict()
    try:
        optim_state.load_into(optimizer, label_of, hps, loaded)
    except Exception as exc:
        optimizer.load_state_dict(before)
        raise UsageError(f"the server's optimizer ({type(optimizer).__name__}) could not "
                         f"load this state: {type(exc).__name__}: {printable(exc)}; "
                         "nothing was loaded") from exc
