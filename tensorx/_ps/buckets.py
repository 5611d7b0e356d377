"""Overlap: push each gradient bucket as soon as autograd has finished every tensor in it.

The plan lays a shard's entries out in gradient-ready order, so a bucket is a contiguous
byte range of the gradient arena. A ``register_post_accumulate_grad_hook`` on each
parameter marks it done; the bucket's write to the shard starts when its last parameter is
done, while backward is still running (truly in parallel when the worker's loop runs on
another thread, as under :class:`tensorx.worker.RemoteOptimizer`). At ``step`` whatever was
not written yet (unused parameters, gradients accumulated over several backward passes) is
written before the push notification, which is therefore still ordered after every byte.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Bucket", "BucketPusher", "make_buckets", "merge_adjacent"]

Write = Callable[["Bucket"], Coroutine[Any, Any, None]]


@dataclass(frozen=True)
class Bucket:
    shard: int
    offset: int
    nbytes: int
    names: frozenset[str]
    # only dense entries (and alignment padding) lie between this bucket and the one
    # before it in the same shard: the two may travel as one write
    joins_previous: bool = False


def make_buckets(plan: Any, bucket_bytes: int) -> list[Bucket]:
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
                 loop: asyncio.AbstractEventLoop, overlap: bool) -> None:
        self.buckets = buckets
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
        self._hooks: list[Any] = []
        self.early = 0  # buckets written before step(): instrumentation
        if overlap and len(buckets) > 0:
            for name, p in model.named_parameters():
                if name in self._of:
                    hook = p.register_post_accumulate_grad_hook(  # type: ignore[no-untyped-call]
                        self._hook(name))
                    self._hooks.append(hook)

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
                self._start(self.buckets[b])

    def _start(self, bucket: Bucket) -> None:
        self.early += 1
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self._loop:
            self._inflight.append(self._loop.create_task(self._write(bucket)))
        else:
            self._inflight.append(asyncio.run_coroutine_threadsafe(self._write(bucket),
                                                                   self._loop))

    def invalidate(self) -> None:
        """Something replaced gradients behind autograd's back: rewrite every bucket."""
        self._dirty.update(self._written)

    async def settle(self) -> list[Bucket]:
        """Wait for the early writes; return what is still to be written (missing or stale,
        adjacent buckets merged) for the caller to write; reset for the next step."""
        inflight, self._inflight = self._inflight, []
        try:
            await asyncio.gather(*(asyncio.wrap_future(f)
                                   if isinstance(f, concurrent.futures.Future) else f
                                   for f in inflight))
            rest = [i for i in range(len(self.buckets))
                    if i not in self._written or i in self._dirty]
            return merge_adjacent(self.buckets, rest)
        finally:
            self._fired.clear()
            self._written.clear()
            self._dirty.clear()

    def reset(self) -> None:
        """Forget this step's progress (``zero_grad``): nothing pending stays valid."""
        self._fired.clear()
        self._written.clear()
        self._dirty.clear()

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
