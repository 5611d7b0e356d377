"""What the service loop of a :class:`~tensorx.ps.ParameterServer` reads of the server.

The server is composed of parts, one job each, each built with what it needs:
:mod:`~tensorx._ps.service.plan` (the plan and the state built from it),
:mod:`~tensorx._ps.service.session` (a worker's hello, welcome and departure),
:mod:`~tensorx._ps.service.steps` (a push, the update it completes and the parameters sent
back), :mod:`~tensorx._ps.service.pipelined` (a sync update applied part by part) and
:mod:`~tensorx._ps.service.answer` (what the workers of an update are answered).
:class:`ShardCore` declares what the one mixin left,
:mod:`~tensorx._ps.service.loop` (a session per peer, taking turns), reads of the server,
so that it reads, and type-checks, on its own.
"""

from __future__ import annotations

import abc
import asyncio
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tensorx._ps.service.losses import LossWatch
    from tensorx._ps.service.norm_exchange import NormExchange
    from tensorx._ps.service.optim_service import OptimService
    from tensorx._ps.service.pipelined import PipelinedRounds
    from tensorx._ps.service.plan import PlanHolder
    from tensorx._ps.service.schedule import Scheduler
    from tensorx._ps.service.session import Sessions
    from tensorx._ps.service.steps import Updates
    from tensorx._ps.state.shard import ShardState


class ShardCore(abc.ABC):
    """What the service loop reads of the server (see the module docstring)."""

    # settings
    num_workers: int
    shard: int
    timeout: float | None
    send_timeout: float | None
    # the parts and helpers it calls
    scheduler: Scheduler
    losses: LossWatch
    optim: OptimService
    _norms: NormExchange | None
    plans: PlanHolder  # the plan and the state built from it (_ps.service.plan)
    sessions: Sessions  # the workers: hello, welcome, departure (_ps.service.session)
    rounds: PipelinedRounds  # a sync update applied part by part (_ps.service.pipelined)
    updates: Updates  # a push, the update it completes and the answers (_ps.service.steps)
    # the service
    _turn: asyncio.Lock  # one message (or loss) handled at a time, see _ps.service.loop
    _sessions: set[asyncio.Task[None]]
    _closed: bool  # aclose() has begun
    _saved_version: int | None
    stats: dict[str, Any]

    # -- offered by ParameterServer -------------------------------------------------------
    @property
    @abc.abstractmethod
    def state(self) -> ShardState | None: ...

    @abc.abstractmethod
    def _check_done(self) -> None: ...
