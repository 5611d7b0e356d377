"""Schedules: the order in which a stage runs its micro-batches' forwards and backwards.

The same classes, arguments and ``step`` signatures as ``torch.distributed.pipelining``:
``ScheduleGPipe`` (every forward, then every backward) and ``Schedule1F1B`` (after a
warm-up of ``num_stages - stage_index - 1`` forwards, one forward then one backward). Every
stage builds the same schedule with the same ``n_microbatches``; the first stage gives the
batch (split along dimension 0 with ``torch.tensor_split``, as torch does), the last the
target, the others nothing. Gradients accumulate into the stage's parameters' ``.grad``
and are divided by ``n_microbatches`` at the end (``scale_grads=True``, torch's default):
the same as one process training on the whole batch with the micro-batches' losses
averaged.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import torch
from torch import nn

from tensorx.errors import TensorxError, UsageError
from tensorx.pipelining._stage import PipelineStage

if TYPE_CHECKING:
    from tensorx.pipelining._boundary import Edge

__all__ = ["PipelineScheduleSingle", "Schedule1F1B", "ScheduleGPipe"]

T = TypeVar("T")
TransferIds = list[tuple["Edge", int]]  # (boundary, transfer number) of each transfer


class StageSteps(Protocol):
    """What a schedule uses of its :class:`PipelineStage` (internal: the stage's methods
    for the schedules, documented there; not user API). A step runs on the stage's loop."""

    @property
    def submod(self) -> nn.Module: ...
    @property
    def stage_index(self) -> int: ...
    @property
    def num_stages(self) -> int: ...
    @property
    def is_first(self) -> bool: ...
    @property
    def is_last(self) -> bool: ...

    def attach_schedule(self, name: str, n_microbatches: int) -> None: ...
    def run_step(self, coro: Coroutine[Any, Any, T]) -> T: ...
    async def arun_step(self, coro: Coroutine[Any, Any, T]) -> T: ...
    async def prepare_step(self) -> None: ...
    async def forward_inputs(self, mb: int, step: int, args: tuple[Any, ...]
                             ) -> tuple[list[Any], list[bool], TransferIds]: ...
    async def send_outputs(self, mb: int, outputs: Sequence[torch.Tensor], train: bool
                           ) -> TransferIds: ...
    async def grads_of_outputs(self, mb: int, step: int, sent: Sequence[tuple[Edge, int]],
                               outputs: Sequence[torch.Tensor]
                               ) -> tuple[list[torch.Tensor | None], TransferIds]: ...
    async def send_grads(self, mb: int, received: Sequence[tuple[Edge, int]],
                         inputs: Sequence[Any]) -> None: ...
    def release(self, transfers: Sequence[tuple[Edge, int]]) -> None: ...
    async def finish_step(self) -> None: ...
    async def fail_step(self, exc: BaseException) -> None: ...


class PipelineScheduleSingle:
    """What the schedules share (one stage per process)."""

    def __init__(self, stage: PipelineStage, n_microbatches: int,
                 loss_fn: Callable[..., torch.Tensor] | None = None, *,
                 scale_grads: bool = True) -> None:
        if not isinstance(stage, PipelineStage):
            raise UsageError(f"stage must be a tensorx.pipelining.PipelineStage, got "
                             f"{type(stage).__name__}")
        if not isinstance(n_microbatches, int) or n_microbatches < 1:
            raise UsageError(f"n_microbatches must be an int >= 1, got {n_microbatches!r}")
        if stage.is_last and loss_fn is None:
            raise UsageError("the last stage's schedule needs loss_fn (loss_fn(output, target))")
        self._stage = stage
        self._stage_steps: StageSteps = stage  # all the schedule uses of it
        self._n_microbatches = n_microbatches
        self._loss_fn = loss_fn
        self.scale_grads = scale_grads
        self._steps = 0
        self._stage_steps.attach_schedule(type(self).__name__, n_microbatches)

    # -- torch's API ------------------------------------------------------------------------
    def step(self, *args: Any, target: Any = None, losses: list[Any] | None = None,
             **kwargs: Any) -> Any:
        """One training step: every micro-batch forward and backward. First stage: the
        batch (``args``); last stage: ``target=`` and ``losses=`` (a list the micro-batches'
        losses are appended to); returns the last stage's output (merged along dim 0)."""
        return self._run(args, kwargs, target, losses, True)

    def eval(self, *args: Any, target: Any = None, losses: list[Any] | None = None,
             **kwargs: Any) -> Any:
        """Forward only (no gradients, nothing kept for a backward)."""
        return self._run(args, kwargs, target, losses, False)

    async def astep(self, *args: Any, target: Any = None, losses: list[Any] | None = None,
                    **kwargs: Any) -> Any:
        """:meth:`step` for asyncio callers: the step runs on the stage's own loop, the
        caller's keeps running."""
        return await self._arun_there(args, kwargs, target, losses, True)

    async def aeval(self, *args: Any, target: Any = None, losses: list[Any] | None = None,
                    **kwargs: Any) -> Any:
        return await self._arun_there(args, kwargs, target, losses, False)

    # -- the order ---------------------------------------------------------------------------
    def _order(self, stage: int, stages: int, m: int) -> Iterator[tuple[str, int]]:
        raise NotImplementedError

    # -- running ---------------------------------------------------------------------------
    def _run(self, args: tuple[Any, ...], kwargs: dict[str, Any], target: Any,
             losses: list[Any] | None, train: bool) -> Any:
        """A step, from a caller's thread: it runs on the stage's loop (where its node
        is), computing there too: one hand-over per step, none per micro-batch."""
        return self._stage_steps.run_step(self._arun(args, kwargs, target, losses, train,
                                                  torch.get_num_threads()))

    async def _arun_there(self, args: tuple[Any, ...], kwargs: dict[str, Any], target: Any,
                          losses: list[Any] | None, train: bool) -> Any:
        return await self._stage_steps.arun_step(
            self._arun(args, kwargs, target, losses, train, torch.get_num_threads()))

    async def _arun(self, args: tuple[Any, ...], kwargs: dict[str, Any], target: Any,
                    losses: list[Any] | None, train: bool, threads: int) -> Any:
        stage = self._stage_steps
        if torch.get_num_threads() != threads:
            # the caller's torch.set_num_threads holds for its own thread (OpenMP's count is
            # per thread): the stage's loop computes with the caller's, not the default
            torch.set_num_threads(threads)
        if kwargs:
            raise UsageError(f"keyword inputs are not supported ({sorted(kwargs)}): pass "
                             "the stage's inputs positionally")
        m = self._n_microbatches
        if stage.is_first and not args:
            raise UsageError("the first stage's step needs the batch: sched.step(x)")
        if not stage.is_first and args:
            raise UsageError(f"stage {stage.stage_index} is not the first: its inputs come "
                             "from the previous stage; call step() without a batch")
        if stage.is_last and train and target is None:
            raise UsageError("the last stage's step needs target= (and optionally losses=)")
        arg_mbs = _split_args(args, m) if stage.is_first else [() for _ in range(m)]
        target_mbs = _split(target, m, "target") if target is not None else None
        step = self._steps
        self._steps += 1
        await stage.prepare_step()
        saved: dict[int, Any] = {}
        outputs: list[Any] = []
        try:
            order = self._order(stage.stage_index, stage.num_stages, m) if train else (
                ("F", mb) for mb in range(m))
            for action, mb in order:
                if action == "F":
                    out = await self._forward(stage, mb, step, arg_mbs[mb], target_mbs,
                                              losses, saved, train)
                    if stage.is_last:
                        outputs.append(out)
                else:
                    await self._backward(stage, mb, step, saved)
            await stage.finish_step()
        except BaseException as exc:
            await stage.fail_step(exc)
            raise
        if train and self.scale_grads and m > 1:
            for p in stage.submod.parameters():
                if p.grad is not None:
                    p.grad.div_(m)
        return _merge(outputs) if stage.is_last else None

    async def _forward(self, stage: StageSteps, mb: int, step: int, args: tuple[Any, ...],
                 target_mbs: list[Any] | None, losses: list[Any] | None,
                 saved: dict[int, Any], train: bool) -> Any:
        inputs, wants, received = await stage.forward_inputs(mb, step, args)
        for i, x in enumerate(inputs):
            if x is None:
                raise UsageError(f"stage {stage.stage_index} got no input {i} for micro-batch "
                                 f"{mb}")
        if train:
            inputs = [_leaf(x, grad) for x, grad in zip(inputs, wants, strict=True)]
        with torch.set_grad_enabled(train):
            out = stage.submod(*inputs)
        outputs = list(out) if isinstance(out, (tuple, list)) else [out]
        loss = None
        if stage.is_last:
            if target_mbs is not None and self._loss_fn is not None:
                with torch.set_grad_enabled(train):
                    loss = self._loss_fn(out, target_mbs[mb])
                if losses is not None:
                    losses.append(loss.detach())
            sent: list[Any] = []
        else:
            sent = await stage.send_outputs(mb, outputs, train)
        if train:
            saved[mb] = (inputs, received, outputs, sent, loss)
        else:
            stage.release(received)
        return out.detach() if isinstance(out, torch.Tensor) else out

    async def _backward(self, stage: StageSteps, mb: int, step: int,
                        saved: dict[int, Any]) -> None:
        inputs, received, outputs, sent, loss = saved.pop(mb)
        if stage.is_last:
            if loss is not None and loss.requires_grad:
                torch.autograd.backward(loss)
        else:
            grads, got = await stage.grads_of_outputs(mb, step, sent, outputs)
            pairs = [(o, g) for o, g in zip(outputs, grads, strict=True)
                     if g is not None and isinstance(o, torch.Tensor) and o.requires_grad]
            if pairs:
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
            stage.release(got)
        await stage.send_grads(mb, received, inputs)

    @property
    def stage(self) -> PipelineStage:
        return self._stage


class ScheduleGPipe(PipelineScheduleSingle):
    """Every micro-batch's forward, then every backward (GPipe)."""

    def _order(self, stage: int, stages: int, m: int) -> Iterator[tuple[str, int]]:
        yield from (("F", mb) for mb in range(m))
        yield from (("B", mb) for mb in range(m))


class Schedule1F1B(PipelineScheduleSingle):
    """One forward, one backward, after a warm-up of ``num_stages - stage_index - 1``
    forwards: at most ``num_stages - stage_index`` micro-batches in flight per stage (its
    activation slots). Works with fewer micro-batches than stages."""

    def _order(self, stage: int, stages: int, m: int) -> Iterator[tuple[str, int]]:
        warmup = min(m, stages - stage - 1)
        yield from (("F", mb) for mb in range(warmup))
        for i in range(m - warmup):
            yield "F", warmup + i
            yield "B", i
        yield from (("B", mb) for mb in range(m - warmup, m))


def _leaf(x: Any, grad: bool) -> Any:
    if not isinstance(x, torch.Tensor):
        return x
    if grad and (x.is_floating_point() or x.is_complex()):
        return x.detach().requires_grad_(True)
    return x


def _split_args(args: Sequence[Any], m: int) -> list[tuple[Any, ...]]:
    columns = [_split(a, m, f"input {i}") for i, a in enumerate(args)]
    return [tuple(col[mb] for col in columns) for mb in range(m)]


def _split(value: Any, m: int, what: str) -> list[Any]:
    """``value`` as ``m`` micro-batches: a list of ``m`` taken as it is, a tensor split
    along dim 0."""
    if isinstance(value, (list, tuple)):
        if len(value) != m:
            raise UsageError(f"{what} is a list of {len(value)} micro-batches; the schedule "
                             f"has n_microbatches={m}")
        return list(value)
    if not isinstance(value, torch.Tensor):
        return [value] * m
    if value.dim() == 0 or value.shape[0] < m:
        raise UsageError(f"{what} of shape {list(value.shape)} cannot be split into {m} "
                         "micro-batches along dimension 0")
    return list(torch.tensor_split(value, m, 0))


def _merge(outputs: list[Any]) -> Any:
    if outputs and all(isinstance(o, torch.Tensor) and o.dim() > 0 for o in outputs):
        try:
            return torch.cat(outputs, 0)
        except RuntimeError:
            return outputs
    return outputs


_ = TensorxError
