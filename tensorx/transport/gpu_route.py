"""GPU memory where UCX has no CUDA transport: routed to the TCP lane's staging.

A UCX built without CUDA (or whose CUDA transports are switched off) cannot register or move
GPU memory. A node whose UCX is like that exports its GPU regions without UCX keys, and on an
endpoint whose lane is such a UCX, or whose peer exported a GPU region without UCX keys,
this lane sends every op that touches GPU memory over the TCP lane of the same connection,
which stages it through pinned host buffers (see ``_staging.py``); host memory stays on UCX.
``ep.info["gpu"]`` says so.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from tensorx.transport.base import DataLane, Op

__all__ = ["GpuViaTcp", "needs_route"]


def needs_route(op: Op, ucx_gpu: bool) -> bool:
    """Whether ``op`` must leave UCX: it touches GPU memory that this side's UCX cannot
    move, or the peer exported its GPU region without UCX keys (its UCX cannot)."""
    if op.local.is_cuda and not ucx_gpu:
        return True
    if op.remote.device == "cuda":
        return not ucx_gpu or "ucx" not in op.remote.keys
    return False


class GpuViaTcp(DataLane):
    """A UCX lane whose GPU ops go to ``tcp`` (a TcpLane on the same connection)."""

    def __init__(self, ucx: DataLane, tcp: DataLane, ucx_gpu: bool) -> None:
        self.ucx = ucx
        self.tcp = tcp
        self.name = ucx.name
        self.bypasses_owner = ucx.bypasses_owner
        self._ucx_gpu = ucx_gpu

    @property
    def info(self) -> dict[str, Any]:
        why = ("UCX here has no CUDA transport" if not self._ucx_gpu else
               "for GPU regions the peer's UCX cannot move")
        return {**self.ucx.info, "gpu": f"{self.tcp.info.get('gpu')} ({why})"}

    def _split(self, ops: Sequence[Op]) -> tuple[list[Op], list[Op]]:
        routed = [op for op in ops if needs_route(op, self._ucx_gpu)]
        return routed, [op for op in ops if not needs_route(op, self._ucx_gpu)]

    async def write(self, op: Op, *, timeout: float | None) -> None:
        lane = self.tcp if needs_route(op, self._ucx_gpu) else self.ucx
        await lane.write(op, timeout=timeout)

    async def read(self, op: Op, *, timeout: float | None) -> None:
        lane = self.tcp if needs_route(op, self._ucx_gpu) else self.ucx
        await lane.read(op, timeout=timeout)

    async def write_many(self, ops: Sequence[Op], *, timeout: float | None) -> None:
        routed, rest = self._split(ops)
        if not routed:
            await self.ucx.write_many(ops, timeout=timeout)
        elif not rest:
            await self.tcp.write_many(ops, timeout=timeout)
        else:
            await asyncio.gather(self.tcp.write_many(routed, timeout=timeout),
                                 self.ucx.write_many(rest, timeout=timeout))

    async def write_notify(self, ops: Sequence[Op], payload: bytes, *,
                           timeout: float | None) -> bool:
        routed, _ = self._split(ops)
        if routed:
            return False  # the endpoint writes, flushes both and notifies
        return await self.ucx.write_notify(ops, payload, timeout=timeout)

    async def flush(self, *, timeout: float | None) -> None:
        await self.ucx.flush(timeout=timeout)
        await self.tcp.flush(timeout=timeout)

    async def aclose(self) -> None:
        try:
            await self.ucx.aclose()
        finally:
            await self.tcp.aclose()

    def abort(self) -> None:
        self.ucx.abort()
        self.tcp.abort()

    def peer_gone(self, why: str) -> None:
        self.ucx.peer_gone(why)
        self.tcp.peer_gone(why)
