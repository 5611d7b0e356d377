"""The TCP data lane: one-sided ops as WRITE/READ frames on the connection's own socket.

Host memory goes straight between the region and the socket; GPU memory is staged through
pinned host buffers (``_staging.py``) on whichever side holds it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tensorx.transport import _staging
from tensorx.transport._staging import StagedRange, staged_range
from tensorx.transport.base import DataLane, Op
from tensorx.transport.tcp import MAX_IMM, Connection

__all__ = ["TcpLane"]


class TcpLane(DataLane):
    """The fallback data lane: WRITE/READ frames on the connection's own socket."""

    name = "tcp"

    def __init__(self, conn: Connection, why: str) -> None:
        self._conn = conn
        self._why = why

    @property
    def info(self) -> dict[str, Any]:
        return {"transport": "tcp", "lanes": ["tcp/socket"], "why": self._why,
                "gpu": _staging.describe()}

    async def write(self, op: Op, *, timeout: float | None) -> None:
        await self.write_many([op], timeout=timeout)

    async def read(self, op: Op, *, timeout: float | None) -> None:
        dest = _payload(op)
        try:
            await self._conn.request_read(dest, op.remote.region_id, op.remote.cookie,
                                          op.remote_offset, timeout)
        except BaseException:
            if isinstance(dest, StagedRange):  # no copy lands in our memory after we raise
                dest.quiesce()
            raise

    async def write_many(self, ops: Sequence[Op], *, timeout: float | None) -> None:
        await self._conn.request_write(_frames(ops), timeout)

    async def write_notify(self, ops: Sequence[Op], payload: bytes, *,
                           timeout: float | None) -> bool:
        """The notification rides in the last WRITE frame: no wait between the two."""
        if not ops or len(payload) > MAX_IMM:
            return False
        await self._conn.request_write(_frames(ops), timeout, imm=bytes(payload))
        return True

    async def flush(self, *, timeout: float | None) -> None:
        """Nothing to do: the owner lands each WRITE (GPU copies included) before it
        parses the next frame."""

    async def aclose(self) -> None:
        """The connection owns the socket; the endpoint closes it."""

    def abort(self) -> None:
        """See :meth:`aclose`."""


def _payload(op: Op) -> memoryview | StagedRange:
    return staged_range(op.local, op.local_offset, op.nbytes)


def _frames(ops: Sequence[Op]) -> list[tuple[memoryview | StagedRange, int, int, int]]:
    return [(_payload(op), op.remote.region_id, op.remote.cookie, op.remote_offset)
            for op in ops]
