"""Awaiting several things at once, for either side of a step: the server answers every
worker of a round (:func:`together`), a worker writes a pipelined push's parts a few at a
time (:func:`windowed`)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

__all__ = ["together", "windowed"]

T = TypeVar("T")


async def together(aws: list[Awaitable[T]]) -> list[T]:
    """``asyncio.gather(*aws)``, with a single awaitable awaited in place: no task and no
    loop turns for it (with one shard, a step's push, pull and answer each paid ~20 us)."""
    if len(aws) == 1:
        return [await aws[0]]
    return list(await asyncio.gather(*aws))


# A pipelined push (see tensorx._ps.service.round) writes its parts this way, a few in flight.
async def windowed(calls: list[Callable[[], Awaitable[None]]], window: int) -> None:
    """Run ``calls`` in order with at most ``window`` of them in flight; the first error
    cancels the rest and is raised."""
    running: set[asyncio.Task[None]] = set()
    try:
        for call in calls:
            if len(running) >= window:
                done, running = await asyncio.wait(running,
                                                   return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    task.result()
            running.add(asyncio.ensure_future(call()))
        await asyncio.gather(*running)
    except BaseException:
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)
        raise
