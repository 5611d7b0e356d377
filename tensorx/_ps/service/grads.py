"""Server-side processing of the averaged gradient, between averaging and the optimizer step.

With ``grad_hook=`` or ``clip_grad_norm=`` a shard first averages the workers' gradients
into its gradient memory (one worker's is copied there: the slots stay as written), then:

1. ``grad_hook(named_grads)`` runs on that shard's part: ``[(model name, gradient), ...]``
   in model order, the tensors the optimizer's ``.grad`` are (change them in place);
2. clipping scales every gradient by ``min(1, max_norm / (norm + 1e-6))`` as
   ``torch.nn.utils.clip_grad_norm_`` does, where ``norm`` is the 2-norm of the whole
   gradient over all shards (:mod:`tensorx._ps.service.norm_exchange` adds up the shards' parts);
3. the optimizer steps.

Without either, nothing here runs and the update path copies nothing.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from tensorx._ps.service.norm_exchange import NormExchange
from tensorx.errors import UsageError

if TYPE_CHECKING:
    from tensorx._ps.state.shard import ShardState

__all__ = ["GradHook", "GradProcessing", "check_max_norm"]

GradHook = Callable[[list[tuple[str, torch.Tensor]]], Any]


def check_max_norm(value: float | None) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(value) or value <= 0:
        raise UsageError(f"clip_grad_norm must be a positive number, got {value!r}")
    return float(value)


class GradProcessing:
    """The hook and the clipping of one shard; :attr:`last_norm` is the last global norm."""

    def __init__(self, clip_grad_norm: float | None, grad_hook: GradHook | None,
                 exchange: NormExchange | None) -> None:
        self.max_norm = check_max_norm(clip_grad_norm)
        if grad_hook is not None and not callable(grad_hook):
            raise UsageError(f"grad_hook must be callable, got {type(grad_hook).__name__}")
        self.hook = grad_hook
        self.exchange = exchange
        self.last_norm: float | None = None
        self.exchange_s = 0.0  # time spent waiting for the other shards' norms, in total

    @property
    def active(self) -> bool:
        return self.max_norm is not None or self.hook is not None

    async def run(self, state: ShardState, ranks: list[int]) -> None:
        """Gather ``ranks``' average into ``state``, hook it, clip it; the caller steps. If
        this raises, ``state`` is left as if nothing had been gathered."""
        state.gather(ranks)
        try:
            await self._process(state, ranks)
        except BaseException:
            state.ungather()
            raise

    async def _process(self, state: ShardState, ranks: list[int]) -> None:
        if self.hook is not None:
            self.hook(state.named_grads())
        if self.max_norm is None:
            return
        sumsq = state.grad_sumsq()
        if self.exchange is not None:
            t0 = time.perf_counter()
            sumsq = await self.exchange.total(state.version + 1, ranks, sumsq)
            self.exchange_s += time.perf_counter() - t0
        norm = math.sqrt(sumsq) if sumsq >= 0 else math.nan
        self.last_norm = norm
        factor = self.max_norm / (norm + 1e-6)
        if not factor >= 1.0:  # as torch: a nan norm makes the gradient nan, inf zeroes it
            state.scale_grads(factor)
