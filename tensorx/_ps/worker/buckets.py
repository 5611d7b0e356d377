"""Overlap: push each gradient bucket as soon as autograd has finished every tensor in it.

The plan lays a shard's entries out in gradient-ready order, so a bucket is a contiguous
byte range of the gradient arena. A ``register_post_accumulate_grad_hook`` on each
parameter marks it done; the bucket's write to the shard starts when its last parameter is
done, while backward is still running (truly in parallel when the worker's loop runs on
another thread, as under :class:`tensorx.RemoteOptimizer`). At ``step`` whatever was
not written yet (unused parameters, gradients accumulated over several backward passes) is
written before the push notification, which is therefore still ordered after every byte.

A bucket written early no longer sees what the trainer does to its gradient between
``backward()`` and ``step()`` (``clip_grad_norm_``, manual scaling). For the first
:data:`WATCH_STEPS` steps each early bucket is fingerprinted as it leaves and again at
``step``; a bucket that changed is written again, overlap is turned off for good (the
edit is evidently part of the loop) and one WARNING says why and what keeps the overlap.

Whether overlap pays depends on the host: where the cores that compute the backward also
move the bytes (kernel TCP on a small host), sending during backward only slows the
backward (two namespaces on this project's 2-core VM, wide MLP: 1.35x the RPC PS with it,
1.56x without). ``overlap=None`` (the worker's default) measures: the time from one step's
push to the next, with and without, as a shard chooses its pipelined round
(:class:`tensorx._ps.common.abtimer.EarlyChooser`), and keeps the faster; one INFO line says which.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from tensorx import _cuda
from tensorx._ps.common.abtimer import EarlyChooser
from tensorx._ps.common.remembered import Memory

if TYPE_CHECKING:
    from tensorx._analyzer.plan import TransferPlan

__all__ = ["WATCH_STEPS", "Bucket", "BucketPusher", "make_buckets", "merge_adjacent"]

logger = logging.getLogger(__name__)

Write = Callable[["Bucket"], Coroutine[Any, Any, None]]
# A bucket's bytes as they are now, or None where an edit would reach the shard anyway
# (a mapped arena) or cannot be read from the host (GPU memory).
Fingerprint = Callable[["Bucket"], "int | None"]
WATCH_STEPS = 3  # steps during which early buckets are checked for later in-place edits


@dataclass(frozen=True)
class Bucket:
    shard: int
    offset: int
    nbytes: int
    names: frozenset[str]
    # only dense entries (and alignment padding) lie between this bucket and the one
    # before it in the same shard: the two may travel as one write
    joins_previous: bool = False


OVERLAP_LABELS = ("gradients sent during backward", "all sent at step()", "during backward",
                  "at step()", "steps")


def make_buckets(plan: TransferPlan, bucket_bytes: int) -> list[Bucket]:
    """Runs of dense entries per shard, cut every ``bucket_bytes`` and at sparse entries."""
    out: list[Bucket] = []
    for shard in range(plan.num_shards):
        run: list[Any] = []
        joins = False
        for e in [*plan.shard_entries(shard), None]:
            if run and (e is None or e.kind == "dynamic"
                        or e.end - run[0].offset > bucket_bytes):
                out.append(Bucket(shard, run[0].offset, run[-1].end - run[0].offset,
                                  frozenset(x.name for x in run), joins))
                run = []
                joins = e is not None and e.kind == "static"
            if e is not None and e.kind == "static":
                run.append(e)
            elif e is not None:
                joins = False
    return out


def merge_adjacent(buckets: list[Bucket], picked: list[int]) -> list[Bucket]:
    """``buckets[i]`` for ``i`` in ``picked`` (ascending), with every run of consecutive,
    joinable buckets (see ``Bucket.joins_previous``) as one bucket: what is left for
    ``step`` goes out in as few writes as possible. Alignment padding between them travels
    too; nothing reads it."""
    out: list[Bucket] = []
    last_index = -2
    for i in picked:
        b = buckets[i]
        if out and i == last_index + 1 and b.joins_previous:
            head = out[-1]
            out[-1] = Bucket(b.shard, head.offset, b.offset + b.nbytes - head.offset,
                             head.names | b.names, head.joins_previous)
        else:
            out.append(b)
        last_index = i
    return out


class BucketPusher:
    """Tracks which parameters autograd finished and writes complete buckets early."""

    def __init__(self, buckets: list[Bucket], model: torch.nn.Module, write: Write,
                 loop: asyncio.AbstractEventLoop, overlap: bool | None,
                 fingerprint: Fingerprint | None = None, who: str = "worker") -> None:
        self.buckets = buckets
        self._model = model
        self.choice = EarlyChooser(overlap, OVERLAP_LABELS)  # None: measured
        self.memory = Memory("overlap", self.choice)  # ... or remembered (keyed())
        self._on = False
        self._since: float | None = None  # when the last push began (the period measured)
        self._fingerprint = fingerprint
        self._sent_as: dict[int, int] = {}  # bucket -> fingerprint when it left
        self._watch = WATCH_STEPS if fingerprint is not None else 0
        self._who = who
        self.edited_after_send = 0  # buckets written again: instrumentation
        self._write = write
        self._loop = loop
        self._of: dict[str, list[int]] = {}
        for i, b in enumerate(buckets):
            for name in b.names:
                self._of.setdefault(name, []).append(i)
        self._fired: set[str] = set()
        self._written: set[int] = set()
        self._dirty: set[int] = set()
        self._inflight: list[Any] = []
        self._merged: tuple[tuple[int, ...], list[Bucket]] = ((), [])  # the last merge
        self._hooks: list[Any] = []
        # gradients on a GPU: a bucket leaves only once the kernels that wrote it finished
        self._device = next((p.device for p in model.parameters() if p.is_cuda), None)
        self.early = 0  # buckets written before step(): instrumentation
        self._switch(self.choice.early())

    def _switch(self, on: bool) -> None:
        """Send buckets during the coming backward passes, or leave them all for step()."""
        self._on = on and len(self.buckets) > 0
        if self._on and not self._hooks:
            for name, p in self._model.named_parameters():
                if name in self._of:
                    hook = p.register_post_accumulate_grad_hook(  # type: ignore[no-untyped-call]
                        self._hook(name))
                    self._hooks.append(hook)
        elif not self._on:
            self.close()

    def measure(self, now: float) -> None:
        """A push begins at ``now``: the time since the last one is a step done with or
        without overlap; choose the way of the next (see the module docstring)."""
        if self._since is not None and self.choice.forced is None:
            before = self.choice.decided
            self.choice.observe(self._on, now - self._since)
            if self.choice.decided != before:
                logger.info("%s: overlap: %s", self._who, self.choice.decided)
                self.memory.decided()
            self._switch(self.choice.early())
        self._since = now

    def keyed(self, fingerprint: str, how: str) -> None:
        """Steps of the plan ``fingerprint`` now move their bytes ``how``: a choice measured
        for that before (:mod:`tensorx._ps.common.remembered`) is taken, without probing."""
        if self.memory.keyed((fingerprint, how), lambda: (fingerprint, how)):
            logger.info("%s: overlap: %s, as measured before on this host", self._who,
                        "on" if self.choice.choice else "off")
            self._switch(self.choice.early())

    def _hook(self, name: str) -> Callable[[torch.Tensor], None]:
        def done(_: torch.Tensor) -> None:
            self._mark(name)

        return done

    def _mark(self, name: str) -> None:
        if name in self._fired:  # accumulated again: a bucket already sent is stale now
            self._dirty.update(b for b in self._of[name] if b in self._written)
            return
        self._fired.add(name)
        for b in self._of[name]:
            if b not in self._written and self.buckets[b].names <= self._fired:
                self._written.add(b)
                if self._watch:
                    mark = self._fingerprint(self.buckets[b])  # type: ignore[misc]
                    if mark is not None:
                        self._sent_as[b] = mark
                self._start(self.buckets[b])

    def _start(self, bucket: Bucket) -> None:
        self.early += 1
        write = self._write(bucket)
        if self._device is not None:  # recorded here, on the backward's own stream
            write = self._after(_cuda.record(self._device), write)
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self._loop:
            self._inflight.append(self._loop.create_task(write))
        else:
            self._inflight.append(asyncio.run_coroutine_threadsafe(write, self._loop))

    @staticmethod
    async def _after(events: list[Any], write: Coroutine[Any, Any, None]) -> None:
        try:
            await _cuda.wait(events)
        except BaseException:
            write.close()
            raise
        await write

    def invalidate(self) -> None:
        """Something replaced gradients behind autograd's back: rewrite every bucket."""
        self._dirty.update(self._written)

    async def settle(self) -> list[Bucket]:
        """Wait for the early writes; return what is still to be written (missing or stale,
        adjacent buckets merged) for the caller to write; reset for the next step."""
        inflight, self._inflight = self._inflight, []
        try:
            if inflight:
                await asyncio.gather(*(asyncio.wrap_future(f)
                                       if isinstance(f, concurrent.futures.Future) else f
                                       for f in inflight))
            self._dirty.update(self._edited())
            rest = tuple(i for i in range(len(self.buckets))
                         if i not in self._written or i in self._dirty)
            return self._merge(rest)
        finally:
            self.reset()

    def _merge(self, rest: tuple[int, ...]) -> list[Bucket]:
        """:func:`merge_adjacent`, remembered for the next step (mostly the same: all of
        them, or none; a merge unites the buckets' names, 2000 of many-small's in 60 us)."""
        if self._merged[0] != rest:
            self._merged = (rest, merge_adjacent(self.buckets, list(rest)))
        return list(self._merged[1])

    def _edited(self) -> list[int]:
        """Early buckets whose bytes changed after they left (watched steps only); on the
        first, overlap is turned off and the trainer told why."""
        if not self._sent_as:
            return []
        self._watch -= 1
        edited = [b for b, mark in self._sent_as.items()
                  if b not in self._dirty and self._fingerprint(self.buckets[b]) != mark]  # type: ignore[misc]
        if edited:
            self.edited_after_send += len(edited)
            names = sorted(set().union(*(self.buckets[b].names for b in edited)))
            logger.warning(
                "%s: gradients of %s changed after backward() had already sent them "
                "(an edit between backward() and step(), e.g. clip_grad_norm_ or scaling); "
                "with overlap such edits never reach the server, so tensorx wrote them "
                "again and turns overlap off. To keep the overlap, clip on the server "
                "(ParameterServer(clip_grad_norm=...), tensorx ps --clip-grad-norm); "
                "overlap=False silences this", self._who,
                ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else ""))
            self._watch = 0
            self.choice.forced = False
            self._switch(False)
        return edited

    def reset(self) -> None:
        """Forget this step's progress (``zero_grad``): nothing pending stays valid."""
        self._fired.clear()
        self._written.clear()
        self._dirty.clear()
        self._sent_as.clear()

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
