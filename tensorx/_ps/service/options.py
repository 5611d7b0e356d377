"""A shard's settings, grouped: what :class:`~tensorx.ps.ParameterServer` was constructed
with (checked there), fixed for its lifetime and handed to the parts that need them."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tensorx._ps.state.shard import OptimizerFactory, SchedulerFactory


@dataclass(frozen=True)
class ShardOptions:
    """The settings of one shard (see ``ParameterServer`` for what each means)."""

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
    optimizer: OptimizerFactory
    lr_scheduler: SchedulerFactory | None
    pipeline: bool | None  # apply a sync round's parts as they land (None: measure)
