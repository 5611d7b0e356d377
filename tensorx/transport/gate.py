"""The accepting side's limits on peers that have proved nothing yet: each handshake within
``handshake_timeout`` (a limit on what an unauthenticated peer may hold, not a caller's
budget), at most ``max_handshakes`` at once (a new one pushes out the oldest, which a real
peer, done in milliseconds, never is), and refusals logged without flooding."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Callable
from typing import Any

from tensorx._deadline import Deadline
from tensorx.errors import TimeoutError
from tensorx.transport import handshake
from tensorx.transport.control import ControlChannel

__all__ = ["Gate"]


class Gate:
    """Admits the connections a node accepts, one handshake each (see the module)."""

    def __init__(self, node_id: str, handshake_timeout: float, max_handshakes: int) -> None:
        self._id = node_id
        self.credential = "its token"  # what the node proves with, in words (its log lines)
        self.handshake_timeout = handshake_timeout
        self.max_handshakes = max_handshakes
        self._handshaking: dict[ControlChannel, str] = {}  # unauthenticated, oldest first
        self._dropped: set[ControlChannel] = set()  # pushed out by newer ones, not yet gone
        self._failures = handshake.FailureLog()

    async def admit(self, channel: ControlChannel, peer: str, token: bytes,
                    caps: Callable[[bytes], dict[str, Any]],
                    deadline: Deadline) -> handshake.Hello:
        """The handshake of ``channel``, accepted from ``peer`` (``host:port``)."""
        if len(self._handshaking) >= self.max_handshakes:
            self._drop_oldest()
        self._handshaking[channel] = peer
        timeout = deadline.least(self.handshake_timeout)
        try:
            return await handshake.accept(channel, self._id, token, caps, timeout,
                                          self.credential)
        finally:
            self._handshaking.pop(channel, None)

    def refused(self, channel: ControlChannel, peer: str, exc: BaseException) -> None:
        """Log that ``channel`` failed (unless it was dropped, which was logged then)."""
        if channel not in self._dropped:
            self._failures.failed(peer.rsplit(":", 1)[0], exc)

    def done(self, channel: ControlChannel) -> None:
        """``channel`` is admitted or gone."""
        self._dropped.discard(channel)

    def _drop_oldest(self) -> None:
        """Push out the oldest unauthenticated connection. Shutting its socket down ends
        its handshake with an ordinary error (its task then ends and everything it held is
        freed at once); cancelling the task instead left each one reachable for a while,
        about 15 KiB apiece, through the cancelled tasks' tracebacks."""
        oldest, who = next(iter(self._handshaking.items()))
        del self._handshaking[oldest]
        self._dropped.add(oldest)
        why = TimeoutError(f"{self.max_handshakes} unauthenticated connections at once: "
                           "dropped the oldest (raise Node(max_handshakes=) if real peers "
                           "need more)")
        oldest.refuse_now(why)
        with contextlib.suppress(OSError):
            oldest.sock.shutdown(socket.SHUT_RDWR)
        self._failures.failed(who.rsplit(":", 1)[0], why)
