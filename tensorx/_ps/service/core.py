"""What the parts of a :class:`~tensorx.ps.ParameterServer` share.

The server is one object assembled from parts, one job each: :mod:`~tensorx._ps.service.plan`
(the plan and the state built from it), :mod:`~tensorx._ps.service.loop` (a session per peer),
:mod:`~tensorx._ps.service.session` (a worker's hello, welcome and departure) and
:mod:`~tensorx._ps.service.steps` (a push, the update it completes and the parameters sent back).
:class:`ShardCore` declares the state they share (set by ``ParameterServer.__init__``) and
what each part offers the others, so each module reads, and type-checks, on its own.
"""

from __future__ import annotations

import abc
import asyncio
import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tensorx._ps.common.stats import ShardTimings
    from tensorx._ps.service.answer import Peer
    from tensorx._ps.service.applier import Applier
    from tensorx._ps.service.grads import GradProcessing
    from tensorx._ps.service.losses import LossWatch
    from tensorx._ps.service.nonfinite import NonFiniteGuard
    from tensorx._ps.service.norm_exchange import NormExchange
    from tensorx._ps.service.optim_service import OptimService
    from tensorx._ps.service.outbox import Outbox
    from tensorx._ps.service.pipelined import PipelinedRounds
    from tensorx._ps.service.plan import PlanHolder
    from tensorx._ps.service.samehost import Sharing
    from tensorx._ps.service.schedule import Scheduler
    from tensorx._ps.service.steps import Updates
    from tensorx._ps.state.shard import OptimizerFactory, SchedulerFactory, ShardState
    from tensorx.endpoint import Endpoint
    from tensorx.errors import TensorxError
    from tensorx.memregion import RegionDescriptor
    from tensorx.node import Node


class ShardCore(abc.ABC):
    """The state and the cross-part methods of one shard (see the module docstring)."""

    # settings
    mode: str
    num_workers: int
    shard: int
    num_shards: int
    timeout: float | None
    send_timeout: float | None
    checkpoint_dir: str | os.PathLike[str] | None
    checkpoint_every: int | None
    checkpoint_keep: int
    resume_optimizer: bool  # resume the checkpoint's optimizer state, or parameters alone
    flat: bool | None  # None: flat update when it gives the same result (see _ps.update.flat)
    share_memory: bool
    device: str  # "cpu" or "cuda:N", see tensorx._ps.common.device
    _optimizer: OptimizerFactory
    _lr_scheduler: SchedulerFactory | None
    # helpers, one job each
    node: Node
    scheduler: Scheduler
    losses: LossWatch
    nonfinite: NonFiniteGuard
    grads: GradProcessing
    sharing: Sharing
    optim: OptimService
    outbox: Outbox
    timings: ShardTimings
    _norms: NormExchange | None
    plans: PlanHolder  # the plan and the state built from it (_ps.service.plan)
    _saved_version: int | None
    # workers
    _peers: dict[Endpoint, Peer]
    _waiting: list[Peer]
    _finished: set[int]
    _slot_descs: dict[int, RegionDescriptor]
    _header_descs: dict[int, bytes]
    # the service
    _turn: asyncio.Lock  # one message (or loss) handled at a time, see _ps.service.loop
    _sessions: set[asyncio.Task[None]]
    _stopped: asyncio.Event
    _closed: bool  # aclose() has begun
    rounds: PipelinedRounds  # a sync update applied part by part (_ps.service.pipelined)
    updates: Updates  # a push, the update it completes and the answers (_ps.service.steps)
    _applier: Applier  # the apply thread, of the round and of an answer sent in parts
    _until: str | None
    stats: dict[str, Any]

    def _connected(self) -> list[int]:
        return sorted(p.rank for p in self._peers.values())

    # -- offered by ParameterServer -------------------------------------------------------
    @property
    @abc.abstractmethod
    def version(self) -> int: ...

    @property
    @abc.abstractmethod
    def state(self) -> ShardState | None: ...

    @abc.abstractmethod
    def checkpoint(self) -> bool: ...

    @abc.abstractmethod
    def _release_plan_if_idle(self) -> None: ...

    # -- offered by service.ServiceLoop ---------------------------------------------------
    @abc.abstractmethod
    async def _refuse(self, ep: Endpoint, exc: TensorxError) -> None: ...

    # -- offered by session.Sessions ------------------------------------------------------
    @abc.abstractmethod
    async def _hello(self, ep: Endpoint, msg: dict[str, Any]) -> None: ...

    @abc.abstractmethod
    async def _goodbye(self, ep: Endpoint) -> None: ...

    @abc.abstractmethod
    async def _leave(self, ep: Endpoint, why: str, close: bool = True) -> None: ...

    @abc.abstractmethod
    async def _tell_waiting(self, held: list[Peer]) -> None: ...

    @abc.abstractmethod
    async def _welcome(self, peer: Peer) -> None: ...
