"""The owner service: how this node serves a peer's requests on the control channel
against its export table (WRITE lands in the region, READ answers straight out of it,
VALIDATE, QUERY), with every op checked against the export first. These are the TCP lane's
one-sided ops seen from the owner's side, and the descriptor checks of every other lane.

One per endpoint; the endpoint's :class:`~tensorx.transport.control.ControlChannel` reads
the frames and hands the peer's requests here, and sends the replies.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from tensorx._exports import ExportTable
from tensorx._ratelog import RefusalLog
from tensorx._wire import Kind, reply_frame
from tensorx.errors import ProtocolError, TensorxError, error_code
from tensorx.transport._sendq import SendQueue
from tensorx.transport._sock import FrameReader
from tensorx.transport._staging import StagedRange, stage_host, staged_range

__all__ = ["OwnerService"]

logger = logging.getLogger("tensorx.transport.control")

MAX_REFUSED = 4096  # writes with a refused frame whose last frame has not come yet


class Wire(Protocol):
    """What the owner service needs of the channel it serves (a ControlChannel)."""

    @property
    def label(self) -> str: ...

    @property
    def reader(self) -> FrameReader: ...

    @property
    def out(self) -> SendQueue: ...

    def land(self, dest: memoryview | StagedRange,
             live: Callable[[], bool] = ...) -> Awaitable[bool]: ...


class OwnerService:
    """Serves the peer's requests that arrive on one control channel against ``exports``.

    The channel hands each request frame here: :meth:`land_now` and the plain handlers run
    in the socket's readiness callback (``land_now`` says when the frame has to wait: GPU
    memory), the ``on_*`` ones run in the channel's task. Payloads are read
    from ``wire`` (its ``reader`` and ``land``), replies go out with its ``out.post``;
    ``answer(what, name, start)`` answers a QUERY (``Endpoint.lookup`` on the peer's side
    names an export; ``Endpoint.query`` asks for every page, each from item ``start``).
    ``addresses``: whether a descriptor check that asks for the region's address gets it
    (for a same-host lane, see :meth:`LaneFactory.tells_addresses`); else it is answered
    without one, as for GPU memory."""

    def __init__(self, wire: Wire, exports: ExportTable,
                 answer: Callable[[str, str | None, int], dict[str, Any]],
                 addresses: bool = False) -> None:
        self._exports = exports
        self._answer = answer
        self._addresses = addresses
        self._reader = wire.reader
        self._land = wire.land
        self._post = wire.out.post
        self._send = wire.out.enqueue
        self._send_host = wire.out.send_host
        self._refused: set[int] = set()  # the peer's write requests with a refused frame
        self._refusals = RefusalLog(logger, wire.label)
        self._stage_host = stage_host()  # read once per connection, not per op

    def close(self) -> None:
        """The channel ended: log what was refused and not reported yet."""
        self._refusals.flush()

    # The op frames' headers are rows (tensorx._wire.PACKED): a WRITE's is
    # (req, rid, ck, off, last, imm), a READ's (req, rid, ck, off, n).
    def land_now(self, h: tuple[Any, ...], payload_len: int) -> bool | None:
        """Land a WRITE frame whose payload is buffered: whether the write was acknowledged
        (False: not its last frame, or refused, now or at an earlier frame: then its
        notification is dropped); None, with nothing done, where it has to wait (GPU
        memory, staged)."""
        req, rid, ck, off, last, _ = h
        try:
            region = self._exports.resolve(rid, ck, off, payload_len, "w")
            dest = staged_range(region, off, payload_len, self._stage_host)
        except TensorxError as exc:
            self._reader.skip(payload_len)
            self._refuse_write(req, last, exc)
            return False
        if isinstance(dest, StagedRange):
            return None
        self._reader.take_into(dest)
        return self._written(req, last)

    async def on_write(self, h: tuple[Any, ...], payload_len: int) -> bytes | None:
        """Land a WRITE frame; the notification it carries once the whole write has landed
        (None if it carries none, or a frame of the write was refused)."""
        req, rid, ck, off, last, imm = h
        try:
            region = self._exports.resolve(rid, ck, off, payload_len, "w")
            dest = staged_range(region, off, payload_len, self._stage_host)
        except TensorxError as exc:
            await self._reader.discard(payload_len)
            self._refuse_write(req, last, exc)
            return None
        await self._land(dest)  # into GPU memory: every copy has completed
        written = self._written(req, last)
        return imm if written else None

    def _written(self, req: int, last: bool) -> bool:
        """A WRITE frame has landed: acknowledge the write after its last frame, unless
        an earlier frame of it was refused. Returns whether it was acknowledged."""
        if not last:
            return False
        if req in self._refused:
            self._refused.discard(req)
            return False
        self._send_host([reply_frame(Kind.WRITE_ACK, req)])
        return True

    def _refuse_write(self, req: int, last: bool, exc: TensorxError) -> None:
        """Refuse a WRITE frame; remember the write until its last frame (so that a
        notification it carries is dropped)."""
        self._reply_error(req, exc)
        if last:
            self._refused.discard(req)
            return
        if len(self._refused) > MAX_REFUSED:  # a peer that never finishes its writes
            raise ProtocolError("too many unfinished refused writes")
        self._refused.add(req)

    def on_read(self, h: tuple[Any, ...], payload_len: int) -> None:
        req, rid, ck, off, n = h
        try:
            region = self._exports.resolve(rid, ck, off, n, "r")
            src = staged_range(region, off, n, self._stage_host)
        except TensorxError as exc:
            self._reply_error(req, exc)
            return
        head = reply_frame(Kind.READ_DATA, req, n)
        if not n:
            self._send_host([head])
        elif isinstance(src, StagedRange):  # GPU memory: streamed through staging
            self._send([head, src])
        else:
            self._send_host([head, src])

    def on_validate(self, h: dict[str, Any], payload_len: int) -> None:
        try:
            export = self._exports.lookup(h["rid"], h["ck"])
        except TensorxError as exc:
            self._reply_error(h["req"], exc)
            return
        desc = export.descriptor
        reply = {"req": h["req"], "n": desc.nbytes, "access": desc.access}
        if h.get("addr") is True and self._addresses and not export.region.is_cuda:
            reply["addr"] = export.region.address  # for a same-host lane
        self._post(Kind.VALID, reply)

    def on_query(self, h: dict[str, Any], payload_len: int) -> None:
        try:
            data = self._answer(h["what"], h.get("name"), h.get("from") or 0)
        except TensorxError as exc:
            self._reply_error(h["req"], exc)
            return
        self._post(Kind.ANSWER, {"req": h["req"], "data": data})

    def _reply_error(self, req: int, exc: TensorxError) -> None:
        self._refusals.refused(req, exc)  # the first, then a summary at most once a minute
        self._post(Kind.ERROR, {"req": req, "code": error_code(exc), "msg": str(exc)})
