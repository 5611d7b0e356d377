"""One pipeline stage: its module, its node, and the boundaries it shares with other stages.

Threads: the stage's node runs on an event loop of its own (a daemon thread), so that the
lanes keep moving bytes while the caller's thread computes; every boundary's state lives on
that loop. The caller's thread (the schedule) computes and, per micro-batch, asks the loop
for what it needs: the activations of transfer ``n`` (a wait), to send its outputs (not a
wait: the write is issued on the loop while the next micro-batch computes).

Per boundary (a pair of stages, the lower one the sender of activations):

* the receiver registers a ring of activation slots (the schedule's in-flight bound) and
  the sender a ring of gradient slots; each learns the other's descriptor once, at the
  first step, with the boundary's tensors (``meta``/``accept``/``grads``);
* transfer ``n`` (the ``n``-th micro-batch to cross, counted over every step) goes into
  slot ``n % slots`` of the peer's ring, written one-sided from a registered staging slot
  with the ``F``/``B`` mark ordered after the data;
* the receiver uses the slot in place until it is done with it (after the micro-batch's
  backward; right away in ``eval``), then hands it back (``FR``/``BR``); a sender waits for
  that credit only when every slot is taken.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine, Mapping, Sequence
from typing import Any, TypeVar

import torch
from torch import nn

from tensorx._deadline import Deadline, wait_for
from tensorx._ps.common.rendezvous import Store
from tensorx.endpoint import Endpoint
from tensorx.errors import BrokenError, ClosedError, ProtocolError, TensorxError, UsageError
from tensorx.memregion import RegionDescriptor
from tensorx.pipelining._boundary import (
    STAGING,
    BoundaryRow,
    Edge,
    Routes,
    StagePlan,
    descriptor_of,
    either,
    meta_of,
)
from tensorx.pipelining._loopthread import LoopThread
from tensorx.pipelining._meeting import Meeting
from tensorx.pipelining._planning import accepted, capacities, check_fits, offered, slot_counts
from tensorx.pipelining._protocol import TensorMeta, encode, integer, text
from tensorx.pipelining._rings import Layout, Ring
from tensorx.pipelining._transfers import Transfers

__all__ = ["PipelineStage", "StagePlan"]

logger = logging.getLogger("tensorx.pipelining")

T = TypeVar("T")


class PipelineStage:
    """One stage of a model split across processes, as ``torch.distributed.pipelining``'s
    ``PipelineStage`` (the same positional arguments), without a process group.

    ``submodule`` runs this stage's part of the model (its own ``Parameter`` objects are
    trained in place: an optimizer over ``stage.submod.parameters()`` steps what the stage
    trains); ``stage_index`` of ``num_stages``; ``device`` holds the module and the receive
    slots. The first stage's forward takes the micro-batch; every other stage's takes what
    the previous stage's forward returned (a tensor or a tuple of tensors), positionally.

    ``input_args``: an example micro-batch input of this stage, whose shapes size the
    receive slots (default: the first micro-batch's). ``peers``: ``{stage_index:
    address}`` of every stage (this one's is where it listens); default: the torchrun
    environment, meeting through the launcher's store (``tx.launcher_store()``), in any
    launch order. ``transport``, ``require``, ``token``: as :class:`tensorx.Node`.
    ``dynamic``: the dimensions of this stage's inputs that may differ per micro-batch
    (e.g. ``(1,)`` for a sequence length), up to ``max_shapes`` (one shape per input).
    Without them only dimension 0 may shrink (an uneven last micro-batch). ``slots``:
    activation slots per incoming boundary (default: the schedule's in-flight bound).
    ``timeout``: seconds any wait on another stage may take before a
    :class:`~tensorx.errors.TimeoutError` naming whom it waits for.
    """

    def __init__(self, submodule: nn.Module, stage_index: int, num_stages: int,  # noqa: PLR0913 (torch's PipelineStage signature)
                 device: torch.device | str | int, input_args: Any = None, *,
                 peers: Mapping[int, str] | None = None, transport: str = "auto",
                 require: str | None = None, token: str | bytes | None = None,
                 dynamic: Sequence[int] | None = None,
                 max_shapes: Sequence[Sequence[int]] | None = None,
                 slots: int | None = None, timeout: float = 60.0,
                 listen: str | None = None, store: Store | None = None) -> None:
        self._setup(submodule, stage_index, num_stages, device, input_args, peers=peers,
                    transport=transport, require=require, token=token, dynamic=dynamic,
                    max_shapes=max_shapes, slots=slots, timeout=timeout, listen=listen,
                    store=store, routes=None)

    @classmethod
    def _routed(cls, routes: Routes, submodule: nn.Module, stage_index: int,
                num_stages: int, device: torch.device | str | int, **options: Any
                ) -> PipelineStage:
        """A stage whose boundaries are ``routes`` (the split frontend's), not a chain."""
        stage = cls.__new__(cls)
        stage._setup(submodule, stage_index, num_stages, device,  # noqa: SLF001 (same class: the alternate constructor)
                     options.pop("input_args", None), routes=routes, **options)
        return stage

    def _setup(self, submodule: nn.Module, stage_index: int, num_stages: int,  # noqa: PLR0913 (the constructor's arguments, passed on)
               device: torch.device | str | int, input_args: Any = None, *,
               peers: Mapping[int, str] | None = None, transport: str = "auto",
               require: str | None = None, token: str | bytes | None = None,
               dynamic: Sequence[int] | None = None,
               max_shapes: Sequence[Sequence[int]] | None = None,
               slots: int | None = None, timeout: float = 60.0,
               listen: str | None = None, store: Store | None = None,
               routes: Routes | None = None) -> None:
        if not isinstance(num_stages, int) or num_stages < 1:
            raise UsageError(f"num_stages must be an int >= 1, got {num_stages!r}")
        if not isinstance(stage_index, int) or not 0 <= stage_index < num_stages:
            raise UsageError(f"stage_index must be an int in [0, {num_stages}), got "
                             f"{stage_index!r}")
        if slots is not None and (not isinstance(slots, int) or slots < 1):
            raise UsageError(f"slots must be an int >= 1, got {slots!r}")
        if timeout is None or timeout <= 0:
            raise UsageError(f"timeout must be a number of seconds > 0, got {timeout!r}")
        self.submod = submodule
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.device = torch.device(device if not isinstance(device, int) else f"cuda:{device}")
        self.is_first = stage_index == 0
        self.is_last = stage_index == num_stages - 1
        self.timeout = float(timeout)
        self.dynamic = tuple(dynamic or ())
        self.max_shapes = [tuple(int(d) for d in s) for s in max_shapes] if max_shapes else None
        if self.dynamic and self.max_shapes is None and input_args is None:
            raise UsageError("dynamic dimensions need max_shapes (one shape per input of this "
                             "stage: the largest each may be) or input_args at that size")
        self.example = _as_tuple(input_args) if input_args is not None else None
        self.slots_override = slots
        # routes: which stages this one receives from and sends to, and which of its inputs
        # and outputs each boundary carries (None: all, in order: the manual frontend)
        self._routes: Routes = routes or Routes.chain(stage_index, num_stages)
        if peers is not None:
            missing = [s for s in self._routes.neighbours if s not in peers]
            if missing or (listen is None and stage_index not in peers):
                raise UsageError(f"peers must give the address of stage {stage_index} (this "
                                 f"one) and of stages {self._routes.neighbours}; missing "
                                 f"{sorted({*missing, stage_index} - set(peers))}")
        self._closed = False
        self._failure: BaseException | None = None
        self._failed: asyncio.Event | None = None  # made on the loop
        self._schedule: tuple[str, int] | None = None  # (name, n_microbatches) once known
        self._edges: dict[tuple[int, int], Edge] = {}
        self._stats = {"transfers_sent": 0, "transfers_received": 0, "bytes_sent": 0,
                       "bytes_received": 0, "wait_s": 0.0, "credit_wait_s": 0.0, "steps": 0}
        self._runner = LoopThread(f"tensorx-pp-stage{stage_index}", f"stage {stage_index}")
        self._loop = self._runner.loop
        events = _Events(self)
        self._meeting = Meeting(stage_index, num_stages, self._routes, self.timeout,
                                events, self._loop, peers, store)
        self._transfers = Transfers(stage_index, self._loop, self._meeting, self._stats,
                                    self.timeout, events)
        try:
            self.node = self._call(self._meeting.start(listen, transport, require, token))
            self._meeting.publish()
        except BaseException:
            self._runner.stop()
            raise
        for src, dst in self._routes.pairs(stage_index):
            self._edges[(src, dst)] = self._call(self._make_edge(src, dst))

    # -- the loop thread ------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed or not self._runner.alive:
            raise ClosedError(f"stage {self.stage_index} is closed")

    def _call(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        return self._runner.call(coro, timeout)

    async def _make_edge(self, src: int, dst: int) -> Edge:
        return Edge(src, dst, self.stage_index)

    def _lost(self, stage: int, address: str, how: str) -> None:
        self._set_failure(BrokenError(
            f"stage {stage} at {address} is gone (its connection {how}); stage "
            f"{self.stage_index} stops: restart every stage"), stage,
            f"it is gone (its connection to stage {self.stage_index} {how})")

    def _on_message(self, stage: int, msg: dict[str, Any], who: str) -> None:
        kind = msg["t"]
        if kind == "abort":
            origin = integer(msg, "origin", who, 0, self.num_stages - 1)
            why = text(msg, "why", who)
            self._set_failure(BrokenError(f"stage {origin} failed: {why}"), origin, why)
            return
        key = (stage, self.stage_index) if stage < self.stage_index else (self.stage_index,
                                                                          stage)
        edge = self._edges.get(key)
        if edge is None:
            raise ProtocolError(f"{who} sent {kind!r} but stage {self.stage_index} shares "
                                "no boundary with it")
        if kind == "meta" and not edge.sending and edge.meta_msg is None \
                and edge.layout is None:
            edge.meta_msg = msg
            self._maybe_accept(edge)
        elif kind == "accept" and edge.sending and edge.layout is None:
            self._on_accept(edge, msg, who)
        elif kind == "grads" and not edge.sending and edge.theirs is None \
                and edge.layout is not None:
            edge.theirs = descriptor_of(msg, who)
            edge.planned.set()
        elif (kind == "F" and not edge.sending) or (kind == "B" and edge.sending):
            n = integer(msg, "n", who)
            if n < edge.expect or n in edge.inbox or n >= edge.expect + 4 * max(edge.slots,
                                                                                edge.grad_slots):
                raise ProtocolError(f"{who} sent {kind!r} for transfer {n}, which is not "
                                    f"in flight on {edge.name}")
            if "c" in msg:
                edge.credited(integer(msg, "c", who), who)
            edge.arrived = max(edge.arrived, n + 1)
            self._transfers.maybe_flush(edge)
            waiter = edge.waiting.pop(n, None)
            if waiter is not None and not waiter.done():
                waiter.set_result(msg)
            else:
                edge.inbox[n] = msg
        elif (kind == "FR" and edge.sending) or (kind == "BR" and not edge.sending):
            edge.credited(integer(msg, "n", who), who)
        else:
            raise ProtocolError(f"{who} sent {kind!r}, unexpected on {edge.name} now")

    def _set_failure(self, exc: BaseException, origin: int | None = None,
                     why: str | None = None) -> None:
        """Fail every wait of this stage with ``exc`` and tell the other stages (``why``:
        what to tell them, by default ``exc`` itself; ``origin``: the stage that failed
        first)."""
        if self._failure is not None:
            return
        self._failure = exc
        if self._failed is not None:
            self._failed.set()
        for edge in self._edges.values():
            edge.fail(exc)
        origin = self.stage_index if origin is None else origin
        self._meeting.fail(exc, origin, why or f"{type(exc).__name__}: {exc}")

    def _check_failed(self) -> None:
        if self._failure is not None:
            raise type(self._failure)(str(self._failure))
        if self._closed:
            raise ClosedError(f"stage {self.stage_index} is closed")

    # -- planning a boundary (first step) ----------------------------------------------------
    def attach_schedule(self, name: str, n_microbatches: int) -> None:
        """(For the schedules only.) The schedule that drives this stage (one per stage:
        its receive slots are sized for it)."""
        if self._schedule is not None and self._schedule != (name, n_microbatches):
            raise UsageError(f"stage {self.stage_index} already runs {self._schedule[0]} with "
                             f"{self._schedule[1]} micro-batches: one schedule per stage (its "
                             "receive slots are sized for it)")
        self._schedule = (name, n_microbatches)
        self._call(self._schedule_known())

    async def _schedule_known(self) -> None:
        for edge in self._edges.values():
            if edge.meta_msg is not None:
                self._maybe_accept(edge)

    def _maybe_accept(self, edge: Edge) -> None:
        msg = edge.meta_msg
        if msg is None or self._schedule is None:
            return
        who = f"stage {edge.src}"
        try:
            metas = offered(msg, who, self._schedule, edge.src, self.stage_index)
            capacity = capacities(edge, metas, self._routes, self.stage_index,
                                  self.max_shapes, self.example)
            edge.layout = Layout(capacity)
            edge.slots, edge.grad_slots = slot_counts(self._schedule, self.num_stages,
                                                      edge.src, edge.dst, self.slots_override)
            edge.mine = Ring(edge.layout, edge.slots, self.device)
            if any(m.grad for m in capacity):
                edge.staging = Ring(edge.layout, STAGING, self.device)
            desc = self.node.export(edge.mine.region, access="w")
        except TensorxError as exc:
            self._set_failure(exc)
            return
        ep = self._meeting.links[edge.src]
        self._meeting.watch(self._send_accept(ep, edge, capacity, desc))

    async def _send_accept(self, ep: Endpoint, edge: Edge, capacity: list[TensorMeta],
                           desc: RegionDescriptor) -> None:
        try:
            await ep.notify(encode("accept", tensors=[m.pack() for m in capacity],
                                   slots=edge.slots, grad_slots=edge.grad_slots,
                                   ring=desc.to_bytes()))
        except TensorxError as exc:
            self._set_failure(exc)
        if not any(m.grad for m in capacity):
            edge.planned.set()

    def _on_accept(self, edge: Edge, msg: dict[str, Any], who: str) -> None:
        capacity, edge.slots, edge.grad_slots = accepted(edge, msg, who)
        edge.layout = Layout(capacity)
        edge.theirs = descriptor_of(msg, who)
        try:
            edge.staging = Ring(edge.layout, STAGING, self.device)
            grads = any(m.grad for m in capacity)
            if grads:
                edge.mine = Ring(edge.layout, edge.grad_slots, self.device)
                desc = self.node.export(edge.mine.region, access="w")
                self._meeting.watch(_failing(self, self._meeting.links[edge.dst].notify(
                    encode("grads", ring=desc.to_bytes()))))
        except TensorxError as exc:
            self._set_failure(exc)
            return
        edge.planned.set()

    async def _offer(self, edge: Edge, metas: list[TensorMeta]) -> None:
        """Sender, first transfer: offer the boundary's tensors, wait for the slots."""
        assert self._schedule is not None
        deadline = Deadline(self.timeout)
        ep = await self._meeting.link(edge.dst, deadline, f"to plan {edge.name}")
        edge.meta_msg = {"metas": metas}
        await ep.notify(encode("meta", tensors=[m.pack() for m in metas],
                               schedule=self._schedule[0], microbatches=self._schedule[1]))
        await self._planned(edge, deadline, "to accept the boundary's tensors")

    async def _planned(self, edge: Edge, deadline: Deadline, what: str) -> None:
        self._check_failed()
        try:
            await wait_for(either(edge.planned.wait(), self._failed_event()), deadline.left())
        except asyncio.TimeoutError:
            raise self._transfers.timed_out(edge.peer, what, edge) from None
        self._check_failed()

    def _failed_event(self) -> Coroutine[Any, Any, bool]:
        if self._failed is None:
            self._failed = asyncio.Event()
            if self._failure is not None:
                self._failed.set()
        return self._failed.wait()

    # -- what a schedule runs (a step is a coroutine on the stage's loop) ------------------
    # For the schedules only (``StageSteps`` in _schedules.py names them), not user API: not
    # in docs/reference.md, and free to change with the schedules.
    def run_step(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run a step on the stage's loop, from the caller's thread; its result."""
        return self._call(coro)

    async def arun_step(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run a step on the stage's loop from another loop, which keeps running."""
        try:
            self._check_open()
        except ClosedError:
            coro.close()
            raise
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self._loop))

    async def prepare_step(self) -> None:
        """Link this stage to the others (once)."""
        self._check_failed()
        await self._meeting.connect()

    async def forward_inputs(self, mb: int, step: int, args: tuple[Any, ...]
                              ) -> tuple[list[Any], list[bool], list[tuple[Edge, int]]]:
        """This micro-batch's positional inputs: the user's (first stage) and each
        incoming boundary's, in place; whether the sender wants each one's gradient; and
        the transfers they came in."""
        inputs: list[Any] = list(args)
        grads = [False] * len(inputs)
        received = []
        for edge in self._incoming():
            n = edge.taken
            edge.taken += 1
            if not edge.planned.is_set():
                deadline = Deadline(self.timeout)
                await self._meeting.link(edge.src, deadline, f"to send {edge.name}")
                await self._planned(edge, deadline, "to offer its tensors")
            tensors = await self._transfers.receive(edge, n,
                                                    f" for micro-batch {mb} of step {step}")
            assert edge.layout is not None
            positions = self._routes.inputs_from(edge.src, len(tensors))
            width = max(positions, default=-1) + 1
            if len(inputs) < width:
                inputs += [None] * (width - len(inputs))
                grads += [False] * (width - len(grads))
            for pos, t, meta in zip(positions, tensors, edge.layout.metas, strict=True):
                inputs[pos] = t
                grads[pos] = meta.grad
            received.append((edge, n))
        return inputs, grads, received

    def _incoming(self) -> list[Edge]:
        return sorted((e for e in self._edges.values() if not e.sending), key=lambda e: e.src)

    def _outgoing(self) -> list[Edge]:
        return sorted((e for e in self._edges.values() if e.sending), key=lambda e: e.dst)

    async def send_outputs(self, mb: int, outputs: Sequence[torch.Tensor], train: bool
                            ) -> list[tuple[Edge, int]]:
        """Send this micro-batch's outputs over each outgoing boundary; the transfers."""
        sent = []
        for edge in self._outgoing():
            picked = self._routes.outputs_to(edge.dst, len(outputs))
            tensors = [outputs[i] for i in picked]
            if not edge.planned.is_set():
                metas = [meta_of(t, f"output {i} of stage {self.stage_index}")
                         for i, t in zip(picked, tensors, strict=True)]
                await self._offer(edge, metas)
            assert edge.layout is not None
            assert edge.staging is not None
            check_fits(edge, tensors, mb, self.stage_index)
            n = edge.sent
            edge.sent += 1
            await self._transfers.staging_free(edge, n)
            ops = edge.staging.fill(n, tensors)  # (CUDA: write_many waits for the copy)
            if train:
                edge.shapes[n] = [tuple(t.shape) for t in tensors]
            header = {"shapes": [list(t.shape) for t in tensors], "mb": mb, "train": train}
            credit = edge.credit_due()
            if credit is not None:
                header["c"] = credit
            await self._transfers.dispatch(edge, "F", n, ops, header)
            sent.append((edge, n))
        return sent

    async def send_grads(self, mb: int, received: Sequence[tuple[Edge, int]],
                          inputs: Sequence[Any]) -> None:
        """Send the gradients of the inputs that came in ``received`` back to their
        senders (and hand those slots back)."""
        for edge, n in received:
            positions = self._routes.inputs_from(edge.src, len(edge.layout.metas)
                                                 if edge.layout else 0)
            grads = []
            for pos in positions:
                x = inputs[pos]
                g = x.grad if isinstance(x, torch.Tensor) and x.requires_grad else None
                grads.append(g)
            await self._transfers.staging_free(edge, n)
            ops: list[tuple[int, int]] = []
            if edge.staging is not None:
                ops = edge.staging.fill(n, grads)
            self._transfers.hand_back(edge, n)  # (its credit goes with the gradients)
            header: dict[str, Any] = {"has": [g is not None for g in grads], "mb": mb}
            credit = edge.credit_due()
            if credit is not None:
                header["c"] = credit
            edge.sent = max(edge.sent, n + 1)
            await self._transfers.dispatch(edge, "B", n, ops, header)

    async def grads_of_outputs(self, mb: int, step: int, sent: Sequence[tuple[Edge, int]],
                                outputs: Sequence[torch.Tensor]
                                ) -> tuple[list[torch.Tensor | None], list[tuple[Edge, int]]]:
        """The gradients of the outputs ``sent`` (summed where one went to several
        stages), and the transfers they came in."""
        grads: list[torch.Tensor | None] = [None] * len(outputs)
        got = []
        for edge, n in sent:
            views = await self._transfers.receive_grads(edge, n,
                                                        f" for micro-batch {mb} of step {step}")
            for i, g in zip(self._routes.outputs_to(edge.dst, len(outputs)), views,
                            strict=True):
                if g is not None:
                    prior = grads[i]
                    grads[i] = g if prior is None else prior + g
            got.append((edge, n))
        return grads, got

    def release(self, transfers: Sequence[tuple[Edge, int]]) -> None:
        """Hand the slots of ``transfers`` back to their senders: done with them."""
        for edge, n in transfers:
            self._transfers.hand_back(edge, n)

    async def finish_step(self) -> None:
        """Every send of this step has landed (or raised); one more step in :meth:`stats`."""
        await self._transfers.flush(self._edges.values())
        self._stats["steps"] += 1

    async def fail_step(self, exc: BaseException) -> None:
        """A step failed here: tell every other stage, once."""
        if self._failure is None:
            message = f"{type(exc).__name__}: {exc}"
            self._set_failure(exc if isinstance(exc, TensorxError) else BrokenError(message))
            await asyncio.sleep(0)  # let the abort notifications go out

    # -- public ---------------------------------------------------------------------------
    @property
    def plan(self) -> StagePlan:
        """The boundaries of this stage as planned (filled in at the first step)."""
        plan = StagePlan(self.stage_index)
        for edge in sorted(self._edges.values(), key=lambda e: (e.src, e.dst)):
            if edge.layout is not None:
                plan.rows.append(BoundaryRow(edge.src, edge.dst, edge.layout.metas, edge.slots,
                                             edge.grad_slots, edge.layout.slot_bytes))
        return plan

    @property
    def info(self) -> dict[str, Any]:
        """``{"stage", "address", "peers": {stage: {"address", "transport", "host",
        "lanes"}}}``: the lane every other stage is reached over."""
        peers = {stage: dict(lane) for stage, lane in sorted(self._meeting.lanes.items())}
        return {"stage": self.stage_index, "num_stages": self.num_stages,
                "address": self.node.address, "peers": peers}

    def stats(self) -> dict[str, Any]:
        """Transfers and bytes sent and received, seconds waited for other stages'
        activations or gradients (``wait_s``) and for free slots (``credit_wait_s``)."""
        return dict(self._stats)

    def close(self) -> None:
        """Say goodbye to the other stages and release the node and the slots; idempotent."""
        if self._closed:
            return
        self._closed = True
        self._meeting.closing = True  # a link that ends from now on is no failure
        if self._runner.alive:
            try:
                self._call(self._aclose(), timeout=10.0)
            except TensorxError as exc:
                logger.debug("stage %d: closing: %s", self.stage_index, exc)
        self._runner.stop()

    async def _aclose(self) -> None:
        await self._meeting.aclose()
        for edge in self._edges.values():
            edge.fail(ClosedError(f"stage {self.stage_index} is closed"))
            edge.close()

    def __enter__(self) -> PipelineStage:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    async def __aenter__(self) -> PipelineStage:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await asyncio.to_thread(self.close)

    def __repr__(self) -> str:
        return (f"<PipelineStage {self.stage_index}/{self.num_stages} "
                f"{'closed' if self._closed else self.node.address}>")


class _Events:
    """What a stage's :class:`Meeting` and :class:`Transfers` tell it."""

    def __init__(self, stage: PipelineStage) -> None:
        self._stage = stage

    def message(self, stage: int, msg: dict[str, Any], who: str) -> None:
        self._stage._on_message(stage, msg, who)  # noqa: SLF001 (the stage's own event adapter)

    def lost(self, stage: int, address: str, how: str) -> None:
        self._stage._lost(stage, address, how)  # noqa: SLF001 (the stage's own event adapter)

    def failed(self, exc: BaseException, origin: int | None = None,
               why: str | None = None) -> None:
        self._stage._set_failure(exc, origin, why)  # noqa: SLF001 (the stage's own event adapter)

    def check_failed(self) -> None:
        self._stage._check_failed()  # noqa: SLF001 (the stage's own event adapter)

    def failure(self) -> BaseException | None:
        return self._stage._failure  # noqa: SLF001 (the stage's own event adapter)


def _as_tuple(value: Any) -> tuple[Any, ...]:
    return tuple(value) if isinstance(value, (tuple, list)) else (value,)


async def _failing(stage: PipelineStage, aw: Any) -> None:
    try:
        await aw
    except TensorxError as exc:
        stage._set_failure(exc)  # noqa: SLF001 (the stage module's own helper)
