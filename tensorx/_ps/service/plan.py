"""The plan a shard serves and the state built from it: adopted from the first hello or
a checkpoint. When every worker leaves before the first update the plan is *idle*: kept,
with the parameters rank 0 gave, so that a worker of it that comes back is welcomed at once
(rank 0's hello takes its parameters again, as the first one did), and released as soon as
a hello for another plan arrives (a worker of another model that said hello and left must
not lock the shard)."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from tensorx._ps.rows.sparse import SparseReceiver
from tensorx._ps.service.core import ShardCore
from tensorx._ps.state.shard import ShardLayout, ShardState, checkpoint_path, load_checkpoint
from tensorx._ps.state.shard_layout import dynamic_path_ok
from tensorx.errors import UsageError

if TYPE_CHECKING:
    from tensorx.graph_analyzer import TransferPlan

logger = logging.getLogger("tensorx.ps")  # one logger name for the whole server


class PlanHolder(ShardCore):
    """The part of a ParameterServer that owns its plan and state."""

    def _restore(self) -> None:
        if self.checkpoint_dir is None:
            return
        path = checkpoint_path(self.checkpoint_dir, self.shard, self.num_shards)
        saved = load_checkpoint(path, self.checkpoint_keep)
        if saved is None:
            return
        plan, plan_bytes, state, sparse = self._build(bytes(saved["plan"]))
        try:  # refused (another optimizer): nothing of the server's changed, nothing left open
            state.load_state_dict(saved, optimizer=self.resume_optimizer)
        except BaseException:
            state.close()
            if sparse is not None:
                sparse.close()
            raise
        self._set_plan(plan, plan_bytes, state, sparse)
        self._initialised = self._resumed = True
        self._saved_version = state.version
        logger.info("ps shard %d resumed from %s at version %d%s", self.shard, path,
                    state.version, "" if self.resume_optimizer else
                    " (the parameters alone: a fresh optimizer, resume_optimizer=False)")

    def _adopt_plan(self, plan_bytes: bytes) -> TransferPlan:
        return self._set_plan(*self._build(plan_bytes))

    async def _adopt_plan_async(self, plan_bytes: bytes) -> TransferPlan:
        """:meth:`_adopt_plan`, with the state (arenas, optimizer: seconds for a large model
        on a busy host) built in a thread, so that the loop goes on serving, e.g. the
        handshakes of the other workers, which have their own deadline."""
        return self._set_plan(*await asyncio.to_thread(self._build, plan_bytes))

    def _set_plan(self, plan: TransferPlan, plan_bytes: bytes, state: ShardState,
                  sparse: SparseReceiver | None) -> TransferPlan:
        self.state, self._sparse = state, sparse
        self._plan, self._plan_bytes = plan, plan_bytes
        return plan

    def _build(self, plan_bytes: bytes) -> tuple[TransferPlan, bytes, ShardState,
                                                 SparseReceiver | None]:
        """The plan and the state for it (nothing of the server's changed)."""
        from tensorx.graph_analyzer import TransferPlan  # noqa: PLC0415 (imports torch: when a plan arrives)

        plan = TransferPlan.from_bytes(plan_bytes)
        if plan.num_shards != self.num_shards:
            raise UsageError(f"plan has {plan.num_shards} shards, this server "
                             f"{self.num_shards}")
        layout = ShardLayout.from_plan(plan, self.shard)
        # the optimizer factory runs here: if it raises (a foreign optimizer is a
        # UsageError), the plan is not adopted and the next hello tries again
        try:
            state = ShardState(layout, self.num_workers, self._optimizer,
                               self._lr_scheduler, flat=self.flat,
                               shared=self.sharing.wanted, device=self.device)
        except (OSError, MemoryError, RuntimeError, OverflowError) as exc:
            raise UsageError(f"cannot build this shard's state for the plan ({layout.nbytes} B "
                             f"per arena, {self.num_workers + 2} arenas): {exc}") from exc
        try:
            sparse = SparseReceiver(plan, self.shard, self.num_workers, self.device) \
                if dynamic_path_ok(plan) and plan.header_bytes(self.shard) else None
        except BaseException:
            state.close()
            raise
        return plan, plan_bytes, state, sparse

    def _release_plan_if_idle(self) -> None:
        """No worker left before the first update: the plan is idle (see the module
        docstring); without parameters yet, nothing is worth keeping: released now."""
        if self._peers or self._plan is None or self._resumed or self.version or self._idle:
            return
        if self._initialised and not self._closed:
            self._idle = True
            for rank in range(self.num_workers):
                self.losses.back(rank)  # an idle shard waits for its workers silently
            logger.info("ps shard %d: every worker left before the first update; plan %s kept "
                        "with rank 0's parameters for its workers to come back (a hello of "
                        "another plan replaces it)", self.shard, self._plan.fingerprint)
            return
        self._release_plan()

    def _release_plan(self) -> None:
        """Forget the plan and its state: the next hello sets it."""
        assert self._plan is not None
        logger.info("ps shard %d: plan %s released (the next hello sets it)", self.shard,
                    self._plan.fingerprint)
        self._idle = False
        state, sparse = self.state, self._sparse
        self._plan, self._plan_bytes, self.state, self._sparse = None, b"", None, None
        self._initialised = False
        self._slot_descs.clear()
        self._header_descs.clear()
        for rank in range(self.num_workers):
            self.losses.back(rank)  # a fresh shard waits for its first workers silently

        def close() -> None:
            if state is not None:
                state.close()
            if sparse is not None:
                sparse.close()

        if state is None:
            close()
        else:  # answers to workers that left may still read the arena
            self.outbox.release(state.params_region, close)
