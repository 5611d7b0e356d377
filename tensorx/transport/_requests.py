"""Our requests to the peer over the control channel: one-sided ops on its memory (WRITE,
READ for the TCP lane), VALIDATE and QUERY, each a request id with a future, and the
handlers of their answers (WRITE_ACK, READ_DATA landing straight in the caller's memory,
VALID, ANSWER, ERROR).

Their timeouts share one timer per connection, set for the earliest deadline of the
requests in flight (a timer per request cost each small op a few microseconds to arm and
cancel).

Owned by one :class:`~tensorx.transport.control.ControlChannel`, which reads the frames
and hands the answers here; :mod:`~tensorx.transport.owner` serves the peer's requests.
"""

from __future__ import annotations

import asyncio
import itertools
import math
from collections.abc import Sequence
from typing import Any

from tensorx import _wire
from tensorx._deadline import Deadline
from tensorx._wire import Kind
from tensorx.errors import BrokenError, ProtocolError, TensorxError, TimeoutError, error_from_code
from tensorx.transport._futures import fresh_copy, set_once
from tensorx.transport._sendq import SendQueue
from tensorx.transport._sock import FrameReader
from tensorx.transport._staging import Land, StagedRange

__all__ = ["Pending", "Requests"]


class Pending:
    """A request in flight: its future, where its answer's payload lands (a read), its
    deadline on the loop's clock (``math.inf``: none) and what its timeout says."""

    __slots__ = ("at", "dest", "future", "timeout", "what")

    def __init__(self, future: asyncio.Future[Any], dest: memoryview | StagedRange | None,
                 at: float, what: str, timeout: float | None) -> None:
        self.future = future
        self.dest = dest
        self.at = at
        self.what = what
        self.timeout = timeout


class Requests:
    """Our requests in flight on one control channel, by id, and what completes them:
    frames go out through ``out``; answers are read from ``reader``, their payloads
    received with ``land``."""

    def __init__(self, label: str, reader: FrameReader, out: SendQueue, land: Land) -> None:
        self.label = label
        self._loop = asyncio.get_running_loop()
        self._reader = reader
        self._out = out
        self._land = land
        self._pending: dict[int, Pending] = {}
        self._req_ids = itertools.count(1)
        self._timer: asyncio.TimerHandle | None = None  # for the earliest deadline or sooner
        self._timer_at = math.inf

    def fail(self, exc: TensorxError) -> None:
        """The channel ended: every request in flight fails with (a copy of) ``exc``."""
        for pending in self._pending.values():
            set_once(pending.future, fresh_copy(exc))
        self._pending.clear()
        self._disarm()

    def _new_request(self, timeout: float | None, what: str,
                     dest: memoryview | StagedRange | None = None) -> tuple[int, Pending]:
        """A request starting now, filed by its id (its deadline armed)."""
        req = next(self._req_ids)
        at = math.inf if timeout is None else self._loop.time() + timeout
        if at < self._timer_at:
            self._arm(at)
        pending = self._pending[req] = Pending(self._loop.create_future(), dest, at, what,
                                               timeout)
        return req, pending

    async def _await(self, req: int, pending: Pending) -> Any:
        """Wait for the reply (the connection's timer enforces the timeout)."""
        try:
            return await pending.future
        finally:
            self._pending.pop(req, None)

    def _unsent(self, req: int, pending: Pending) -> None:
        """Forget a request whose frame could not be sent. A send that finds the peer
        gone (EPIPE: it died and our loop has not read its end yet) fails the channel, and
        with it every request in flight, this one included, while the caller gets the
        send's error raised: mark this one's as seen, or asyncio logs it (an ERROR with a
        traceback) once the future is collected, which the channel's error delays: its
        traceback holds the caller's frame."""
        self._pending.pop(req, None)
        if pending.future.done() and not pending.future.cancelled():
            pending.future.exception()

    def _arm(self, at: float) -> None:
        self._disarm()
        self._timer = self._loop.call_at(at, self._expire)
        self._timer_at = at

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer, self._timer_at = None, math.inf

    def _expire(self) -> None:
        """The timer is due: time out every request whose deadline has come (the timer's
        own: the loop runs it at its time, give or take the clock's resolution), then set
        it for the earliest deadline left."""
        due, self._timer, self._timer_at = self._timer_at, None, math.inf
        earliest = math.inf
        for pending in self._pending.values():
            if pending.at <= due:
                set_once(pending.future, TimeoutError(
                    f"{self.label}: {pending.what} timed out after {pending.timeout} s"))
                pending.at = math.inf
            elif pending.at < earliest:
                earliest = pending.at
        if earliest < math.inf:
            self._arm(earliest)

    async def write(self, ops: Sequence[tuple[memoryview | StagedRange, int, int, int]],
                            timeout: float | None, imm: bytes | None = None) -> None:
        """Send WRITE frames for (src, region_id, cookie, offset); one ACK covers them all.
        ``imm``: a notification carried by the last frame, which the owner delivers once
        every frame of the write has landed (and not at all if one was refused)."""
        req, pending = self._new_request(timeout, "write")
        try:
            last = len(ops) - 1
            for i, (src, rid, ck, off) in enumerate(ops):
                frame = _wire.write_frame(req, rid, ck, off, len(src), i == last,
                                          imm if i == last else None)
                self._out.enqueue([frame, src])
        except BaseException:
            self._unsent(req, pending)
            raise
        await self._await(req, pending)

    async def write_one(self, src: memoryview | StagedRange, rid: int, ck: int, off: int,
                        timeout: float | None) -> None:
        """:meth:`write` of one frame without a notification (the small op's path: one
        coroutine frame from the call to the answer)."""
        req, pending = self._new_request(timeout, "write")
        try:
            frame = _wire.write_frame(req, rid, ck, off, len(src), True)
            try:
                if isinstance(src, StagedRange):
                    self._out.enqueue([frame, src])
                else:
                    self._out.send_host([frame, src])
            except BaseException:
                self._unsent(req, pending)
                raise
            await pending.future
        finally:
            self._pending.pop(req, None)

    async def _ask(self, kind: Kind, fields: dict[str, Any], timeout: float | None,
                   what: str) -> Any:
        """Send one request frame (a map header) and wait for its answer."""
        req, pending = self._new_request(timeout, what)
        try:
            self._out.enqueue([_wire.encode(kind, {"req": req, **fields})])
        except BaseException:
            self._unsent(req, pending)
            raise
        return await self._await(req, pending)

    async def read(self, dest: memoryview | StagedRange, rid: int, ck: int, off: int,
                   timeout: float | None) -> None:
        """READ ``len(dest)`` bytes at ``off`` of the peer's region into ``dest`` (one
        coroutine frame from the call to the answer, as :meth:`write_one`)."""
        req, pending = self._new_request(timeout, "read", dest)
        try:
            try:
                self._out.send_host([_wire.read_frame(req, rid, ck, off, len(dest))])
            except BaseException:
                self._unsent(req, pending)
                raise
            await pending.future
        finally:
            self._pending.pop(req, None)

    async def validate(self, rid: int, ck: int, timeout: float | None) -> tuple[int, str]:
        n, access, _ = await self._validate({"rid": rid, "ck": ck}, timeout)
        return n, access

    async def address(self, rid: int, ck: int, timeout: float | None
                              ) -> tuple[int, str, int | None]:
        """(nbytes, access, address) of the owner's region: the address of host memory
        (None for GPU memory), for a same-host lane. Only a peer that offered such a lane
        is asked (an older owner would not answer with one)."""
        return await self._validate({"rid": rid, "ck": ck, "addr": True}, timeout)

    async def _validate(self, fields: dict[str, Any], timeout: float | None
                        ) -> tuple[int, str, int | None]:
        result: tuple[int, str, int | None] = await self._ask(Kind.VALIDATE, fields, timeout,
                                                              "descriptor check")
        return result

    async def query(self, what: str, timeout: float | None,
                    name: str | None = None) -> dict[str, Any]:
        """The peer's answer to ``what``: a lookup's (``name``: the export it asks for) in
        one answer, any other's every page of it (see :func:`_wire.page`) within one
        ``timeout``, its lists joined."""
        if name is not None or what == "lookup":
            fields = {"what": what} if name is None else {"what": what, "name": name}
            found: dict[str, Any] = await self._ask(Kind.QUERY, fields, timeout, "lookup")
            return found
        deadline = Deadline(timeout)
        answer: dict[str, Any] = {}
        start = 0
        while True:
            got = await self._ask(Kind.QUERY, {"what": what, "from": start}, deadline.left(),
                                  "query")
            if not isinstance(got, dict):
                raise ProtocolError(f"{self.label}: answer to a query is not a map")
            for key, value in got.items():
                if isinstance(value, list) and isinstance(answer.get(key), list):
                    answer[key] += value
                else:
                    answer[key] = value
            nxt = answer.pop("next", None)
            if nxt is None:
                return answer
            if not isinstance(nxt, int) or nxt <= start:
                raise ProtocolError(f"{self.label}: answer to a query pages backwards")
            start = nxt

    def _landing(self, req: int, payload_len: int) -> Pending | None:
        """The read that READ_DATA answers, if its data should land (else it is dropped:
        the read timed out or was cancelled meanwhile, or the size is wrong)."""
        pending = self._pending.get(req)
        if pending is None or pending.dest is None or pending.future.done():
            return None
        if len(pending.dest) != payload_len:
            set_once(pending.future, ProtocolError(
                f"{self.label}: read of {len(pending.dest)} B answered with {payload_len} B"))
            return None
        return pending

    # READ_DATA's and WRITE_ACK's headers are rows: (req,)
    def read_data_now(self, h: tuple[int], payload_len: int) -> bool:
        """READ_DATA whose payload is buffered, for host memory: lands right here."""
        if payload_len > self._reader.buffered:
            return False
        pending = self._landing(h[0], payload_len)
        if pending is None:
            self._reader.skip(payload_len)
            return True
        if not isinstance(pending.dest, memoryview):
            return False
        self._reader.take_into(pending.dest)
        pending.future.set_result(None)
        return True

    async def on_read_data(self, h: tuple[int], payload_len: int) -> None:
        pending = self._landing(h[0], payload_len)
        if pending is None or pending.dest is None:
            await self._reader.discard(payload_len)
            return
        # The read may time out or be cancelled while its reply streams in: from then on
        # the rest is dropped, never written to the caller's memory.
        if await self._land(pending.dest, live=lambda: not pending.future.done()):
            set_once(pending.future)

    def on_ack(self, h: tuple[int], payload_len: int) -> None:
        self._resolve(h[0], None)

    def on_valid(self, h: dict[str, Any], payload_len: int) -> None:
        addr = h.get("addr")
        if addr is not None and (not isinstance(addr, int) or isinstance(addr, bool)
                                 or not 0 <= addr < 2**64):
            raise ProtocolError("VALID carries a malformed address")
        self._resolve(h["req"], (h["n"], h["access"], addr))

    def on_error(self, h: dict[str, Any], payload_len: int) -> None:
        exc = error_from_code(h["code"], h["msg"], f"{self.label}: peer says: ")
        if h["req"] == 0:
            raise BrokenError(str(exc)) from exc
        pending = self._pending.get(h["req"])
        if pending is not None and not pending.future.done():
            pending.future.set_exception(exc)

    def on_answer(self, h: dict[str, Any], payload_len: int) -> None:
        self._resolve(h["req"], h["data"])

    def _resolve(self, req: int, value: Any) -> None:
        pending = self._pending.get(req)
        if pending is not None and not pending.future.done():
            pending.future.set_result(value)
