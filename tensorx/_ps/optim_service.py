"""A shard's side of :class:`tensorx.RemoteOptimizer`: hyperparameters and optimizer state.

* Hyperparameters (:mod:`tensorx._ps.hyper`): the welcome describes the optimizer's groups;
  each push may carry changes, set just before the update that push takes part in (lowest
  rank wins a conflict); each answer carries the values after the update when they changed
  since that worker last heard them.
* State (:mod:`tensorx._ps.optim_state`): on ``state_get`` the shard packs its optimizer's
  state into a fresh region that the asking worker may read (one per worker at a time,
  freed on ``state_done`` or when the worker leaves); on ``state_put`` it reads the worker's
  packed region, after checking the manifest against its own entries, and loads it.

The service loop calls these between updates, so the state is never read or loaded halfway
through one.
"""

from __future__ import annotations

import logging
from typing import Any

from tensorx._ps import hyper, optim_check, optim_state, protocol
from tensorx._text import printable
from tensorx.endpoint import Endpoint
from tensorx.errors import ProtocolError, UsageError, error_code
from tensorx.memregion import MemoryRegion, RegionDescriptor
from tensorx.node import Node

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

    # -- hyperparameters ------------------------------------------------------------------
    def welcome(self, ep: Endpoint, state: Any) -> dict[str, Any]:
        """The welcome's ``optim``: defaults and groups (hyperparameters and entry labels)."""
        opt = state.optimizer
        if opt is None:
            self._seen[ep] = []
            return {"defaults": {}, "groups": [], "flat": False}
        groups = optim_state.groups_of(opt, state.param_labels(), list(state.param_numels()))
        self._seen[ep] = [g["hp"] for g in groups]
        return {"defaults": hyper.snapshot([opt.defaults])[0], "groups": groups,
                "flat": state.param_labels() is None}

    def pushed(self, rank: int, sent: Any, state: Any) -> None:
        """Keep ``rank``'s changes for the update its push takes part in: all of them, or,
        when one is refused (UsageError naming it), none."""
        if state.optimizer is None:
            return
        try:
            changes = _checked(state.optimizer, sent)
        except UsageError as exc:
            raise UsageError(f"rank {rank}'s step refused: {exc}") from None
        self.pending.pushed(rank, changes)

    def before_update(self, ranks: list[int], state: Any) -> None:
        if state.optimizer is not None:
            self.pending.apply(ranks, state.optimizer.param_groups)

    def answer(self, ep: Endpoint, state: Any) -> list[dict[str, Any]]:
        """The params answer's ``hyper``: the groups' values, if ``ep`` has not heard them."""
        if state.optimizer is None:
            return []
        now = hyper.snapshot(state.optimizer.param_groups)
        if self._seen.get(ep) == now:
            return []
        self._seen[ep] = now
        return now

    def forget(self, ep: Endpoint, rank: int | None) -> None:
        """``ep`` left: drop its pending changes and free what it borrowed."""
        if rank is not None:
            self.pending.drop(rank)
        self._seen.pop(ep, None)
        self._free(ep)

    # -- state ----------------------------------------------------------------------------
    def _labelled(self, state: Any) -> tuple[Any, dict[int, str]]:
        opt, label_of = state.optimizer, state.param_labels()
        if state.fast is not None:
            state.fast.expose()  # the flat update's state, per parameter
        if label_of is None:
            raise UsageError("the optimizer state of a flat=True server cannot be transferred "
                             "(its parameters span several tensors); run it with flat=False")
        return opt, label_of

    async def lend(self, ep: Endpoint, state: Any, timeout: float | None) -> None:
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

    async def load(self, ep: Endpoint, msg: dict[str, Any], state: Any,
                   timeout: float | None) -> None:
        """Answer ``state_put``: check the manifest, read the packed state, check it
        against the optimizer, load it. A state refused for what it holds (UsageError) is
        answered with the error and leaves the worker connected; a malformed one
        (ProtocolError) is the worker's refusal."""
        try:
            hps = await self._load(ep, msg, state, timeout)
        except UsageError as exc:
            logger.warning("ps shard %d: optimizer state from %s refused: %s", self.shard,
                           ep.peer, exc)
            await ep.notify(protocol.encode("error", code=error_code(exc), msg=str(exc)),
                            timeout=timeout)
            return
        await ep.notify(protocol.encode("state_loaded", hyper=hps), timeout=timeout)

    async def _load(self, ep: Endpoint, msg: dict[str, Any], state: Any,
                    timeout: float | None) -> list[dict[str, Any]]:
        desc = RegionDescriptor.from_bytes(msg["region"])
        if state.optimizer is None:
            return []
        opt, label_of = self._labelled(state)
        numels = state.param_numels()
        if desc.nbytes > optim_state.bound(numels) + optim_state.ALIGN:
            raise ProtocolError(f"optimizer state of {desc.nbytes} B is more than "
                                "this shard's entries can have")
        optim_state.check_manifest(msg["manifest"], numels, desc.nbytes,
                                   len(opt.param_groups))
        region = MemoryRegion.allocate(desc.nbytes)
        try:
            await ep.read(region, desc, timeout=timeout)
            loaded = optim_state.unpack(msg["manifest"], region)
        finally:
            region.close()
        saved = _checked(opt, [g["hp"] for g in msg["manifest"]["groups"]])
        optim_check.check_state(opt, label_of, saved, loaded)
        _replace(opt, label_of, saved, loaded)
        hps = hyper.snapshot(opt.param_groups)
        self._seen[ep] = hps
        logger.info("ps shard %d: optimizer state loaded (%d entries)", self.shard,
                    len(loaded))
        return hps

def _checked(optimizer: Any, sent: Any) -> list[dict[str, Any]]:
    """A peer's hyperparameters for ``optimizer``'s groups, checked (see
    :mod:`tensorx._ps.optim_check`)."""
    changes = hyper.check(sent, [{k: v for k, v in g.items() if k not in hyper.SKIP}
                                 for g in optimizer.param_groups])
    optim_check.check_hyper(optimizer, changes)
    return changes


def _replace(optimizer: Any, label_of: dict[int, str], hps: list[dict[str, Any]],
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
