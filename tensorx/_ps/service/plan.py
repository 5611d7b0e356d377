"""The plan a shard serves and the state built from it: adopted from the first hello or
a checkpoint. When every worker leaves before the first update the plan is *idle*: kept,
with the parameters rank 0 gave, so that a worker of it that comes back is welcomed at once
(rank 0's hello takes its parameters again, as the first one did), and released as soon as
a hello for another plan arrives (a worker of another model that said hello and left must
not lock the shard)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from tensorx._ps.rows.sparse import SparseReceiver
from tensorx._ps.state.shard import ShardLayout, ShardState, checkpoint_path, load_checkpoint
from tensorx._ps.state.shard_layout import dynamic_path_ok
from tensorx.errors import UsageError

if TYPE_CHECKING:
    from tensorx._ps.service.losses import LossWatch
    from tensorx._ps.service.options import ShardOptions
    from tensorx._ps.service.outbox import Outbox
    from tensorx.graph_analyzer import TransferPlan

logger = logging.getLogger("tensorx.ps")  # one logger name for the whole server


class PlanHolder:
    """The plan of a shard and the state built from it (see the module docstring).

    ``shared``: build the arenas in /dev/shm; ``losses``: told that every rank is back
    (silent) when the plan goes idle or is released; ``outbox``: closes a released state
    once no answer reads it any more; ``forget_slots``: called when the plan is released
    (the slots exported for it are gone with its state)."""

    def __init__(self, options: ShardOptions, shared: bool, losses: LossWatch,
                 outbox: Outbox, forget_slots: Callable[[], None]) -> None:
        self._options = options
        self._shared = shared
        self._losses = losses
        self._outbox = outbox
        self._forget_slots = forget_slots
        self.state: ShardState | None = None
        self.plan: TransferPlan | None = None
        self.plan_bytes = b""
        self.sparse: SparseReceiver | None = None
        self.initialised = False  # parameters came from rank 0 or a checkpoint
        self.resumed = False      # ... from a checkpoint: the plan is never released
        self.idle = False  # every worker left before the first update

    @property
    def version(self) -> int:
        return self.state.version if self.state is not None else 0

    def restore(self) -> int | None:
        """Adopt the plan and state of the checkpoint, if there is one: its version."""
        o = self._options
        if o.checkpoint_dir is None:
            return None
        path = checkpoint_path(o.checkpoint_dir, o.shard, o.num_shards)
        saved = load_checkpoint(path, o.checkpoint_keep)
        if saved is None:
            return None
        plan, plan_bytes, state, sparse = self._build(bytes(saved["plan"]))
        try:  # refused (another optimizer): nothing of the server's changed, nothing left open
            state.load_state_dict(saved, optimizer=o.resume_optimizer)
        except BaseException:
            state.close()
            if sparse is not None:
                sparse.close()
            raise
        self._set_plan(plan, plan_bytes, state, sparse)
        self.initialised = self.resumed = True
        logger.info("ps shard %d resumed from %s at version %d%s", o.shard, path,
                    state.version, "" if o.resume_optimizer else
                    " (the parameters alone: a fresh optimizer, resume_optimizer=False)")
        return state.version

    def adopt(self, plan_bytes: bytes) -> TransferPlan:
        return self._set_plan(*self._build(plan_bytes))

    async def adopt_async(self, plan_bytes: bytes) -> TransferPlan:
        """:meth:`adopt`, with the state (arenas, optimizer: seconds for a large model
        on a busy host) built in a thread, so that the loop goes on serving, e.g. the
        handshakes of the other workers, which have their own deadline."""
        return self._set_plan(*await asyncio.to_thread(self._build, plan_bytes))

    def joined(self, rank: int) -> None:
        """``rank`` was admitted: an idle plan is in use again, and rank 0 gives the
        parameters again, as the first time."""
        if self.idle and rank == 0:
            self.initialised = False
        self.idle = False

    def took_parameters(self) -> None:
        """The state holds rank 0's parameters."""
        self.initialised = True

    def _set_plan(self, plan: TransferPlan, plan_bytes: bytes, state: ShardState,
                  sparse: SparseReceiver | None) -> TransferPlan:
        self.state, self.sparse = state, sparse
        self.plan, self.plan_bytes = plan, plan_bytes
        return plan

    def _build(self, plan_bytes: bytes) -> tuple[TransferPlan, bytes, ShardState,
                                                 SparseReceiver | None]:
        """The plan and the state for it (nothing of the holder's changed)."""
        from tensorx.graph_analyzer import TransferPlan  # noqa: PLC0415 (imports torch: when a plan arrives)

        o = self._options
        plan = TransferPlan.from_bytes(plan_bytes)
        if plan.num_shards != o.num_shards:
            raise UsageError(f"plan has {plan.num_shards} shards, this server "
                             f"{o.num_shards}")
        layout = ShardLayout.from_plan(plan, o.shard)
        # the optimizer factory runs here: if it raises (a foreign optimizer is a
        # UsageError), the plan is not adopted and the next hello tries again
        try:
            state = ShardState(layout, o.num_workers, o.optimizer, o.lr_scheduler,
                               flat=o.flat, shared=self._shared, device=o.device)
        except (OSError, MemoryError, RuntimeError, OverflowError) as exc:
            raise UsageError(f"cannot build this shard's state for the plan ({layout.nbytes} B "
                             f"per arena, {o.num_workers + 2} arenas): {exc}") from exc
        try:
            sparse = SparseReceiver(plan, o.shard, o.num_workers, o.device) \
                if dynamic_path_ok(plan) and plan.header_bytes(o.shard) else None
        except BaseException:
            state.close()
            raise
        return plan, plan_bytes, state, sparse

    def release_if_idle(self, connected: bool, closed: bool) -> None:
        """No worker left (``connected`` false) before the first update: the plan is idle
        (see the module docstring); without parameters yet, nothing is worth keeping:
        released now. ``closed``: the server is closing (never idle then)."""
        if connected or self.plan is None or self.resumed or self.version or self.idle:
            return
        if self.initialised and not closed:
            self.idle = True
            for rank in range(self._options.num_workers):
                self._losses.back(rank)  # an idle shard waits for its workers silently
            logger.info("ps shard %d: every worker left before the first update; plan %s kept "
                        "with rank 0's parameters for its workers to come back (a hello of "
                        "another plan replaces it)", self._options.shard, self.plan.fingerprint)
            return
        self.release()

    def release(self) -> None:
        """Forget the plan and its state: the next hello sets it."""
        assert self.plan is not None
        logger.info("ps shard %d: plan %s released (the next hello sets it)",
                    self._options.shard, self.plan.fingerprint)
        self.idle = False
        state, sparse = self.state, self.sparse
        self.plan, self.plan_bytes, self.state, self.sparse = None, b"", None, None
        self.initialised = False
        self._forget_slots()
        for rank in range(self._options.num_workers):
            self._losses.back(rank)  # a fresh shard waits for its first workers silently

        def close() -> None:
            if state is not None:
                state.close()
            if sparse is not None:
                sparse.close()

        if state is None:
            close()
        else:  # answers to workers that left may still read the arena
            self._outbox.release(state.params_region, close)

    def close(self) -> None:
        """Free the state (the server has closed)."""
        if self.state is not None:
            self.state.close()
        if self.sparse is not None:
            self.sparse.close()
