"""Retrying within one budget, with exponential backoff and jitter: the worker's first
connect and its rejoin (``Worker(reconnect=)``), and an endpoint's reconnect
(``Node.connect(reconnect=)``) all wait the same way. Pure asyncio, nothing else of
tensorx but its deadline."""

from __future__ import annotations

import builtins
import random

from tensorx._deadline import Deadline

__all__ = ["FIRST", "LAST", "Backoff"]

FIRST = 0.1  # seconds before the second attempt; doubles up to LAST
LAST = 2.0


class Backoff:
    """Attempts within ``deadline``: :meth:`failed` after each failed one, then
    :meth:`next_pause` seconds (0.5 to 1 times 0.1 s, doubling to 2 s) before the next."""

    __slots__ = ("_delay", "attempts", "deadline", "error")

    def __init__(self, deadline: Deadline) -> None:
        self.deadline = deadline
        self.attempts = 0
        self._delay = FIRST
        self.error: BaseException | None = None  # the most telling failure so far

    def failed(self, exc: BaseException) -> bool:
        """Count a failed attempt; whether the budget allows another. The error kept to
        report is the latest, except that an attempt cut short by the budget running out
        (a timeout) does not hide why the ones before it failed (say, nothing listens
        there)."""
        self.attempts += 1
        cut = isinstance(exc, builtins.TimeoutError) and self.deadline.expired
        if not cut or self.error is None:
            self.error = exc
        return not self.deadline.expired

    def next_pause(self) -> float:
        """Seconds to wait before the next attempt (never past the deadline)."""
        pause = self.deadline.least(self._delay * random.uniform(0.5, 1.0))
        self._delay = min(2 * self._delay, LAST)
        return pause
