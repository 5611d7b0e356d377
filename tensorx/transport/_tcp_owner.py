"""The owner service: how a TCP connection serves its peer's one-sided ops against this
node's export table (WRITE lands in the region, READ answers straight out of it, VALIDATE
and QUERY), with every op checked against the export first.

A mixin of :class:`~tensorx.transport.tcp.Connection`, which owns the socket: the frame
reader, the send path, the staging buffers and the callbacks it sets up at construction.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from tensorx._ratelog import RefusalLog
from tensorx._wire import Kind
from tensorx.errors import ProtocolError, TensorxError, error_code
from tensorx.memregion import ExportTable
from tensorx.transport._sock import FrameReader
from tensorx.transport._staging import StagedRange, staged_range

__all__ = ["OwnerService"]

MAX_REFUSED = 4096  # writes with a refused frame whose last frame has not come yet


class OwnerService:
    """Frame handlers for the peer's requests; ``_now`` ones run in the readiness
    callback and say False when the frame has to wait (its payload is not all buffered,
    GPU memory, a notification to deliver), the ``_on`` ones run in a task."""

    label: str
    _exports: ExportTable
    _reader: FrameReader
    _refused: set[int]  # the peer's write requests with a refused frame
    _refusals: RefusalLog
    on_notify: Callable[[Any, bytes], Awaitable[None]]
    on_query: Callable[[str], dict[str, Any]]

    def _post(self, kind: Kind, header: dict[str, Any], payload: Any = None) -> None:
        raise NotImplementedError

    async def _land(self, dest: memoryview | StagedRange,
                    live: Callable[[], bool] = lambda: True) -> bool:
        raise NotImplementedError

    def _write_now(self, h: dict[str, Any], payload_len: int) -> bool:
        """A WRITE whose payload is buffered and has host memory to land in."""
        if payload_len > self._reader.buffered or "imm" in h:
            return False
        try:
            region = self._exports.resolve(h["rid"], h["ck"], h["off"], h["n"], "w")
            dest = staged_range(region, h["off"], h["n"])
        except TensorxError as exc:
            self._reader.skip(payload_len)
            self._refuse_write(h, exc)
            return True
        if isinstance(dest, StagedRange):
            return False
        self._reader.take_into(dest)
        self._written(h)
        return True

    async def _on_write(self, h: dict[str, Any], payload_len: int) -> None:
        imm = h.get("imm")
        if imm is not None and (not isinstance(imm, bytes) or not h["last"]):
            raise ProtocolError("WRITE carries a malformed notification")
        try:
            region = self._exports.resolve(h["rid"], h["ck"], h["off"], h["n"], "w")
            dest = staged_range(region, h["off"], h["n"])
        except TensorxError as exc:
            await self._reader.discard(payload_len)
            self._refuse_write(h, exc)
            return
        await self._land(dest)  # into GPU memory: every copy has completed
        if self._written(h) and imm is not None:
            await self.on_notify(self, imm)

    def _written(self, h: dict[str, Any]) -> bool:
        """A WRITE frame has landed: acknowledge the write after its last frame, unless
        an earlier frame of it was refused. Returns whether it was acknowledged."""
        if not h["last"]:
            return False
        if h["req"] in self._refused:
            self._refused.discard(h["req"])
            return False
        self._post(Kind.WRITE_ACK, {"req": h["req"]})
        return True

    def _refuse_write(self, h: dict[str, Any], exc: TensorxError) -> None:
        """Refuse a WRITE frame; remember the write until its last frame (so that a
        notification it carries is dropped)."""
        self._reply_error(h["req"], exc)
        if h["last"]:
            self._refused.discard(h["req"])
            return
        if len(self._refused) > MAX_REFUSED:  # a peer that never finishes its writes
            raise ProtocolError("too many unfinished refused writes")
        self._refused.add(h["req"])

    def _on_read(self, h: dict[str, Any], payload_len: int) -> None:
        try:
            region = self._exports.resolve(h["rid"], h["ck"], h["off"], h["n"], "r")
            src = staged_range(region, h["off"], h["n"])
        except TensorxError as exc:
            self._reply_error(h["req"], exc)
            return
        self._post(Kind.READ_DATA, {"req": h["req"]}, src if len(src) else None)

    def _on_validate(self, h: dict[str, Any], payload_len: int) -> None:
        try:
            export = self._exports.lookup(h["rid"], h["ck"])
        except TensorxError as exc:
            self._reply_error(h["req"], exc)
            return
        desc = export.descriptor
        reply = {"req": h["req"], "n": desc.nbytes, "access": desc.access}
        if h.get("addr") is True and not export.region.is_cuda:  # for a same-host lane
            reply["addr"] = export.region.address
        self._post(Kind.VALID, reply)

    def _on_query(self, h: dict[str, Any], payload_len: int) -> None:
        try:
            data = self.on_query(h["what"])
        except TensorxError as exc:
            self._reply_error(h["req"], exc)
            return
        self._post(Kind.ANSWER, {"req": h["req"], "data": data})

    async def _on_notify(self, h: dict[str, Any], payload_len: int) -> None:
        payload = bytearray(payload_len)
        await self._reader.read_into(memoryview(payload))
        await self.on_notify(self, bytes(payload))  # waits (we stop reading) while full

    def _reply_error(self, req: int, exc: TensorxError) -> None:
        self._refusals.refused(req, exc)  # the first, then a summary at most once a minute
        self._post(Kind.ERROR, {"req": req, "code": error_code(exc), "msg": str(exc)})
