"""What a stage keeps per boundary (:class:`Edge`), which boundaries a stage has
(:class:`Routes`), what it registered (:class:`StagePlan`), and the small helpers its loop
uses. No I/O here but the futures on the stage's loop."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from tensorx.errors import ProtocolError, TensorxError, UsageError
from tensorx.memregion import RegionDescriptor
from tensorx.pipelining._protocol import DTYPES, TensorMeta
from tensorx.pipelining._rings import Layout, Ring

__all__ = ["STAGING", "BoundaryRow", "Edge", "Routes", "StagePlan"]

STAGING = 2  # staging slots per boundary and direction on the sending side


@dataclass
class BoundaryRow:
    """One boundary as planned: who sends, what, how many slots, how many bytes."""

    src: int
    dst: int
    tensors: list[TensorMeta]
    slots: int
    grad_slots: int
    slot_bytes: int

    @property
    def activation_bytes(self) -> int:
        return self.slots * self.slot_bytes

    @property
    def gradient_bytes(self) -> int:
        return self.grad_slots * self.slot_bytes if any(t.grad for t in self.tensors) else 0


@dataclass
class StagePlan:
    """The boundaries of one stage, as registered: ``rows`` (one per boundary it shares),
    ``registered_bytes`` (receive rings this stage registered: activations it receives and
    gradients it gets back) and :meth:`describe`."""

    stage: int
    rows: list[BoundaryRow] = field(default_factory=list)

    @property
    def registered_bytes(self) -> int:
        own = sum(r.activation_bytes for r in self.rows if r.dst == self.stage)
        return own + sum(r.gradient_bytes for r in self.rows if r.src == self.stage)

    def describe(self) -> str:
        lines = [f"stage {self.stage}: {len(self.rows)} boundaries, "
                 f"{self.registered_bytes} B of receive slots registered here"]
        for r in self.rows:
            shapes = ", ".join(f"{t.dtype}{list(t.shape)}" for t in r.tensors)
            lines.append(f"  {r.src} -> {r.dst}: {shapes}; {r.slots} activation slots, "
                         f"{r.grad_slots} gradient slots of {r.slot_bytes} B")
        return "\n".join(lines)


class Edge:
    """A boundary as one of its two stages sees it (state lives on the stage's loop)."""

    def __init__(self, src: int, dst: int, me: int) -> None:
        self.src, self.dst = src, dst
        self.sending = src == me  # we send activations (and get gradients back)
        self.peer = dst if self.sending else src
        self.layout: Layout | None = None
        self.slots = 0
        self.grad_slots = 0
        self.mine: Ring | None = None  # the ring we receive into (activations or grads)
        self.staging: Ring | None = None  # where what we send is copied first
        self.theirs: RegionDescriptor | None = None  # the peer's receive ring
        self.planned = asyncio.Event()  # layout, rings and the peer's descriptor known
        self.meta_msg: dict[str, Any] | None = None  # receiver: the sender's meta, pending
        self.sent = 0  # transfers we issued (F if sending, else B)
        self.credits = 0  # transfers the peer handed back
        self.inbox: dict[int, dict[str, Any]] = {}  # F (receiver) or B (sender) by n
        self.waiting: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self.credit_waits: list[tuple[int, asyncio.Future[None]]] = []
        self.expect = 0  # next transfer we expect from the peer
        self.done: set[int] = set()  # transfers we are done with, not yet handed back
        self.handed = 0  # transfers we are done with (all below it)
        self.told = 0  # ... and the peer has been told about
        self.arrived = 0  # transfers that arrived from the peer (all below it, at least)
        self.flush_due = False
        self.pending: list[asyncio.Task[None] | None] = [None] * STAGING
        self.taken = 0  # receiver: transfers the schedule took (caller's thread)
        self.shapes: dict[int, list[tuple[int, ...]]] = {}  # sender: shapes of transfer n
        self.bytes = 0

    @property
    def name(self) -> str:
        return f"boundary {self.src} -> {self.dst}"

    def fail(self, exc: BaseException) -> None:
        futures: list[asyncio.Future[Any]] = [*self.waiting.values()]
        futures += [f for _, f in self.credit_waits]
        for fut in futures:
            if not fut.done():
                fut.set_exception(exc)
        self.waiting.clear()
        self.credit_waits.clear()

    def close(self) -> None:
        for ring in (self.mine, self.staging):
            if ring is not None:
                ring.close()

    # -- credits: slots handed back --------------------------------------------------------
    def hand_back(self, n: int) -> None:
        """We are done with transfer ``n`` (in any order): every slot below the first
        transfer still in use can go back to the peer."""
        self.done.add(n)
        while self.handed in self.done:
            self.done.discard(self.handed)
            self.handed += 1

    def flush_needed(self) -> bool:
        """Whether the peer must be told about slots handed back now, on their own: its
        next transfer into our ring (the one after the last that arrived) needs one we have
        not told it about. (Else the credit goes with the next message we send it.)"""
        if self.handed <= self.told or self.flush_due:
            return False
        slots = self.grad_slots if self.sending else self.slots  # of our ring it writes
        return self.arrived + 1 - slots > self.told

    def credit_due(self) -> int | None:
        """The credit to carry on a message being sent now, if any is due."""
        if self.handed <= self.told:
            return None
        self.told = self.handed
        return self.handed

    def credited(self, n: int, who: str) -> None:
        """The peer handed back every transfer below ``n``."""
        if n > self.sent:
            raise ProtocolError(f"{who} handed back {n} transfers on {self.name}, "
                                f"{self.sent} were sent")
        self.credits = max(self.credits, n)
        for need, fut in list(self.credit_waits):
            if self.credits >= need and not fut.done():
                fut.set_result(None)
        self.credit_waits = [(k, f) for k, f in self.credit_waits if not f.done()]


class Routes:
    """Which stages a stage exchanges with, and which of its inputs and outputs each
    boundary carries. The manual frontend chains stage i to i + 1 with every output."""

    def __init__(self, incoming: Mapping[int, Mapping[int, list[int] | None]],
                 outgoing: Mapping[int, Mapping[int, list[int] | None]]) -> None:
        # incoming[stage][src] = input positions (None: all, in order)
        # outgoing[stage][dst] = output indices (None: all, in order)
        self.incoming = {s: dict(v) for s, v in incoming.items()}
        self.outgoing = {s: dict(v) for s, v in outgoing.items()}
        self.stage = -1
        self.neighbours: list[int] = []

    @classmethod
    def chain(cls, stage: int, num_stages: int) -> Routes:
        routes = cls({s: {s - 1: None} for s in range(1, num_stages)},
                     {s: {s + 1: None} for s in range(num_stages - 1)})
        return routes.at(stage)

    def at(self, stage: int) -> Routes:
        self.stage = stage
        self.neighbours = sorted({*self.incoming.get(stage, {}), *self.outgoing.get(stage, {})})
        return self

    def pairs(self, stage: int) -> Iterator[tuple[int, int]]:
        for src in self.incoming.get(stage, {}):
            yield src, stage
        for dst in self.outgoing.get(stage, {}):
            yield stage, dst

    def inputs_from(self, src: int, count: int) -> list[int]:
        given = self.incoming.get(self.stage, {}).get(src)
        return list(range(count)) if given is None else list(given)

    def outputs_to(self, dst: int, count: int) -> list[int]:
        given = self.outgoing.get(self.stage, {}).get(dst)
        return list(range(count)) if given is None else list(given)


def meta_of(t: Any, what: str) -> TensorMeta:
    if not isinstance(t, torch.Tensor):
        raise UsageError(f"{what} is a {type(t).__name__}; a stage passes tensors to the next "
                         "(return a tensor or a tuple of tensors)")
    dtype = str(t.dtype).removeprefix("torch.")
    if dtype not in DTYPES:
        raise UsageError(f"{what} has dtype {dtype}, which cannot cross a stage boundary")
    return TensorMeta(dtype, tuple(t.shape), bool(t.requires_grad))


def descriptor_of(msg: dict[str, Any], who: str) -> RegionDescriptor:
    ring = msg.get("ring")
    if not isinstance(ring, bytes):
        raise ProtocolError(f"{who} sent {msg['t']!r} without a ring descriptor")
    try:
        return RegionDescriptor.from_bytes(ring)
    except TensorxError as exc:
        raise ProtocolError(f"{who} sent a malformed ring descriptor: {exc}") from None


def retrieved_future(loop: asyncio.AbstractEventLoop) -> asyncio.Future[Any]:
    """A future on ``loop`` whose exception counts as retrieved: a wait that timed out
    leaves it behind, and a failure later sets one on it."""
    fut = loop.create_future()
    fut.add_done_callback(lambda f: f.cancelled() or f.exception())
    return fut


def expire(fut: asyncio.Future[Any]) -> None:
    if not fut.done():
        fut.set_exception(asyncio.TimeoutError())


async def quietly(aw: Any) -> None:
    try:
        await aw
    except (TensorxError, OSError):
        pass


async def either(a: Coroutine[Any, Any, Any], b: Coroutine[Any, Any, Any]) -> None:
    tasks = [asyncio.ensure_future(a), asyncio.ensure_future(b)]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in tasks:
            t.cancel()
