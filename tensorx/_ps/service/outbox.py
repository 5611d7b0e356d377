"""Answers that never hold up another worker (async and bounded modes).

In sync mode every worker waits for the same update, so a shard writes the answers and then
handles its next event. In async and bounded modes each worker goes at its own pace, and a
worker that is slow to take its answer (stopped, swapped out, on a slow link) must not
delay an update that another worker's push completes. So there each answer is a task of its
own: one at a time per worker and in order, each with its own deadline (``send_timeout``),
while the shard's loop goes on.

An answer reads the parameter arena while it is in flight, and the next update writes that
arena. When an update is due while answers still read the arena, :meth:`Outbox.make_room`
first moves the parameters to another arena (one copy, then the optimizer's parameters
point there: :meth:`ShardState.move_params`) and the update goes there; the old arena stays
exactly as it was until its last answer is done, and then it is the next spare. While no
answer is in flight (the common case) nothing is copied, and answers that finish within the
time the copy would take (timed at each move) are waited for instead: the update pays at
most a copy's time either way, and memory bandwidth is spent only on a slow answer. Each
worker has at most one answer in flight, so at most ``num_workers - 1`` old arenas are
ever held; ``limit`` bounds them further, and an update that finds the limit reached waits
for the oldest answers, each bounded by ``send_timeout`` (a worker that misses it is
dropped, and its answer's arena is released).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from tensorx.memregion import MemoryRegion

if TYPE_CHECKING:
    from tensorx._ps.state.shard import ShardState

__all__ = ["Outbox"]

COPY_GUESS = 4e9  # bytes/s a move is assumed to copy at, until one was timed

logger = logging.getLogger("tensorx.ps")


class Outbox:
    """A shard's answers in flight, by rank, and the arenas they read."""

    def __init__(self, shard: int, limit: int) -> None:
        self.shard = shard
        self.limit = max(1, limit)  # old arenas held at once
        self._last: dict[int, asyncio.Task[None]] = {}
        self._readers: dict[int, tuple[MemoryRegion, set[asyncio.Task[None]]]] = {}
        self._spares: list[MemoryRegion] = []
        self.moves = 0  # updates that had to move the parameters first
        self.waited = 0  # updates whose answers in flight finished within a copy's time
        self._copy_rate = COPY_GUESS  # bytes/s of the last move
        self._told = False
        self._retiring: set[asyncio.Task[None]] = set()

    def pending(self, rank: int) -> bool:
        """Is an answer to ``rank`` still in flight?"""
        task = self._last.get(rank)
        return task is not None and not task.done()

    def send(self, rank: int, region: MemoryRegion,
             answer: Callable[[], Awaitable[None]]) -> None:
        """Run ``answer()`` (which reads ``region``) after ``rank``'s earlier answers."""
        before = self._last.get(rank)
        task = asyncio.ensure_future(self._after(before, answer))
        self._last[rank] = task
        _, tasks = self._readers.setdefault(id(region), (region, set()))
        tasks.add(task)
        task.add_done_callback(lambda t: self._done(rank, region, t))

    @staticmethod
    async def _after(before: asyncio.Task[None] | None,
                     answer: Callable[[], Awaitable[None]]) -> None:
        if before is not None:
            with contextlib.suppress(BaseException):
                await asyncio.shield(before)
        await answer()

    def _done(self, rank: int, region: MemoryRegion, task: asyncio.Task[None]) -> None:
        if self._last.get(rank) is task:
            del self._last[rank]
        entry = self._readers.get(id(region))
        if entry is not None:
            entry[1].discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.error("ps shard %d: answer to rank %d failed", self.shard, rank,
                         exc_info=task.exception())

    def busy(self, region: MemoryRegion) -> bool:
        """Does an answer in flight still read ``region``?"""
        entry = self._readers.get(id(region))
        return entry is not None and bool(entry[1])

    async def make_room(self, state: ShardState) -> None:
        """Before an update: if answers still read ``state``'s arena, move the parameters
        to a free arena (see the module docstring); else nothing."""
        current = state.params_region
        self._collect(current)
        if not self.busy(current):
            return
        # answers about to finish cost less to wait for than a copy: wait as long as the
        # copy would take (what the update pays either way), then copy if still needed
        await asyncio.wait(set(self._readers[id(current)][1]), timeout=self._copy_s(state))
        self._collect(current)
        if not self.busy(current):
            self.waited += 1
            return
        while not self._spares and len(self._held(current)) >= self.limit:
            oldest = next(iter(self._held(current).values()))
            if oldest[1]:
                await asyncio.wait(set(oldest[1]))
            else:  # pinned by a transport: it lets go when UCX completes the op
                await asyncio.sleep(0.001)
            self._collect(current)
        spare = self._spares.pop() if self._spares else state.new_arena()
        t0 = time.perf_counter()
        old = state.move_params(spare)
        self._copy_rate = state.layout.nbytes / max(time.perf_counter() - t0, 1e-6)
        self._readers.setdefault(id(old), (old, set()))
        self.moves += 1
        if not self._told:
            self._told = True
            logger.info("ps shard %d: an answer was still in flight when update %d was "
                        "due; the update went to a copy of the parameters (%d B) so that "
                        "nobody waits for it (said once; counted in stats['arena_moves'])",
                        self.shard, state.version + 1, state.layout.nbytes)

    def _copy_s(self, state: ShardState) -> float:
        """How long moving ``state``'s parameters takes, by the last move (first: a guess)."""
        return float(state.layout.nbytes) / self._copy_rate

    def _held(self, current: MemoryRegion) -> dict[int, tuple[MemoryRegion,
                                                              set[asyncio.Task[None]]]]:
        return {k: v for k, v in self._readers.items() if v[0] is not current}

    def _collect(self, current: MemoryRegion) -> None:
        """Old arenas nobody reads any more become spares (one kept, the rest closed).
        An arena a transport still has an op on (pinned: an answer that raised while UCX
        owned its put) stays held until the transport lets go of it."""
        for key, (region, tasks) in list(self._held(current).items()):
            if tasks or region.backing.pinned:
                continue
            del self._readers[key]
            if self._spares:
                region.close()
            else:
                self._spares.append(region)
        for key, (region, tasks) in list(self._readers.items()):
            if region is current and not tasks:
                del self._readers[key]

    async def drain(self) -> None:
        """Wait for every answer in flight."""
        tasks = [t for _, ts in self._readers.values() for t in ts]
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    def release(self, current: MemoryRegion, then: Callable[[], None]) -> None:
        """The plan is released: once the answers in flight (to workers that have left)
        are done, close every arena but ``current`` and call ``then()`` (which closes the
        state); at once when none is in flight. The outbox is empty again at return."""
        readers, spares = self._readers, self._spares
        self._readers, self._spares, self._last = {}, [], {}
        tasks = [t for _, ts in readers.values() for t in ts]

        def close() -> None:
            for region, _ in readers.values():
                if region is not current:
                    region.close()
            for region in spares:
                region.close()
            then()

        if not tasks:
            close()
            return

        async def later() -> None:
            await asyncio.gather(*tasks, return_exceptions=True)
            close()

        retiring = asyncio.ensure_future(later())
        self._retiring.add(retiring)
        retiring.add_done_callback(self._retiring.discard)

    async def aclose(self, current: MemoryRegion | None) -> None:
        """Cancel the answers in flight and close every arena but ``current`` (the
        state's, which the state closes)."""
        tasks = [t for _, ts in self._readers.values() for t in ts]
        for task in tasks:
            task.cancel()
        if tasks or self._retiring:
            await asyncio.gather(*tasks, *self._retiring, return_exceptions=True)
        for region, _ in self._readers.values():
            if region is not current:
                region.close()
        for region in self._spares:
            region.close()
        self._readers.clear()
        self._spares.clear()
        self._last.clear()
