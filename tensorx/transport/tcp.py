"""The TCP data lane: one-sided ops as WRITE/READ frames on the control channel's socket.

Host memory goes straight between the region and the socket; GPU memory is staged through
pinned host buffers (``_staging.py``) on whichever side holds it. Every pair of nodes can
use it, and it carries every op: it is the last lane of every endpoint, the one an op goes
to when no faster lane takes it.
"""

from __future__ import annotations

import logging
from collections.abc import Coroutine, Sequence
from typing import Any

from tensorx import _cuda
from tensorx._loud import fallback
from tensorx.transport import _staging
from tensorx.transport._staging import StagedRange, stage_host, staged_range
from tensorx.transport.base import CUDA, HOST, Capabilities, DataLane, LaneFactory, Link, Op
from tensorx.transport.control import MAX_IMM, ControlChannel

__all__ = ["TcpFactory", "TcpLane"]

logger = logging.getLogger(__name__)


class TcpFactory(LaneFactory):
    """Opens a :class:`TcpLane` over the control channel: nothing to register or offer."""

    name = "tcp"
    caps = Capabilities(memory=frozenset({HOST, CUDA}), one_sided=False, peer_death=True,
                        same_host=False, rank=0)

    async def open_lane(self, link: Link, *, timeout: float | None) -> TcpLane:
        return TcpLane(link.channel)


class TcpLane(DataLane):
    """The fallback data lane: WRITE/READ frames on the control channel's socket, served
    by the owner's :class:`~tensorx.transport.owner.OwnerService`."""

    name = "tcp"

    def __init__(self, channel: ControlChannel, why: str = "tensorx's own TCP lane") -> None:
        self._requests = channel.requests
        self._why = why
        self._stage_host = stage_host()  # read once per connection, not per op
        self._gpu = _cuda.available()  # whether this process has a GPU path at all
        # said: the first op on GPU memory was (staged and) said, or there can be none
        self._said = not self._gpu

    @property
    def info(self) -> dict[str, Any]:
        info = {"transport": "tcp", "lanes": ["tcp/socket"], "why": self._why}
        if self._gpu:  # only a path that exists: a torch without CUDA has none
            info["gpu"] = _staging.describe()
        return info

    def _gpu_op(self, op: Op) -> None:
        """If ``op`` is on GPU memory (ours or the owner's), the first of this lane: that
        is a fallback from a device-to-device path, said once per process."""
        if op.local.is_cuda or op.remote.device.startswith("cuda"):
            self._said = True
            fallback(logger, "gpu", "GPU memory goes over TCP, staged through pinned host "
                     "buffers (a copy on each side, socket speed): this peer has no CUDA IPC "
                     "lane (same host, both using CUDA) and no UCX with CUDA transports "
                     "(ucx-cu12/ucx-cu13). ep.info['gpu'] and ep.info['skipped'] say why; "
                     "`tensorx info` lists this host's GPU paths")

    # write and read hand over the request's coroutine itself (as the router does): the
    # small op's path has no frame of its own here
    def write(self, op: Op, *, timeout: float | None) -> Coroutine[Any, Any, None]:
        if not self._said:
            self._gpu_op(op)
        src = staged_range(op.local, op.local_offset, op.nbytes, self._stage_host)
        return self._requests.write_one(src, op.remote.region_id, op.remote.cookie,
                                        op.remote_offset, timeout)

    def read(self, op: Op, *, timeout: float | None) -> Coroutine[Any, Any, None]:
        if not self._said:
            self._gpu_op(op)
        dest = staged_range(op.local, op.local_offset, op.nbytes, self._stage_host)
        if isinstance(dest, StagedRange):
            return self._read_staged(dest, op, timeout)
        return self._requests.read(dest, op.remote.region_id, op.remote.cookie,
                                   op.remote_offset, timeout)

    async def _read_staged(self, dest: StagedRange, op: Op, timeout: float | None) -> None:
        try:
            await self._requests.read(dest, op.remote.region_id, op.remote.cookie,
                                      op.remote_offset, timeout)
        except BaseException:
            dest.quiesce()  # no copy lands in our memory after we raise
            raise

    async def write_many(self, ops: Sequence[Op], *, timeout: float | None) -> None:
        await self._requests.write(self._frames(ops), timeout)

    async def write_notify(self, ops: Sequence[Op], payload: bytes, *,
                           timeout: float | None) -> bool:
        """The notification rides in the last WRITE frame: no wait between the two."""
        if not ops or len(payload) > MAX_IMM:
            return False
        await self._requests.write(self._frames(ops), timeout, imm=bytes(payload))
        return True

    async def flush(self, *, timeout: float | None) -> None:
        """Nothing to do: the owner lands each WRITE (GPU copies included) before it
        parses the next frame."""

    async def aclose(self) -> None:
        """The control channel owns the socket; the endpoint closes it."""

    def abort(self) -> None:
        """See :meth:`aclose`."""

    def _frames(self, ops: Sequence[Op]) -> list[tuple[memoryview | StagedRange, int, int, int]]:
        if not self._said:
            for op in ops:
                self._gpu_op(op)
        return [(staged_range(op.local, op.local_offset, op.nbytes, self._stage_host),
                 op.remote.region_id, op.remote.cookie, op.remote_offset) for op in ops]
