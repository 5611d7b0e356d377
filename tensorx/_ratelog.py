"""Log lines a peer can cause, without letting it flood the log: the first at once, then
at most one summary line per interval (and a last one when asked to flush)."""

from __future__ import annotations

import logging
import time

__all__ = ["RefusalLog"]

SUMMARY_EVERY_S = 60.0


class RefusalLog:
    """The requests of one peer that were refused: the first logged at once, the rest
    counted and summed up in at most one line per ``interval`` seconds, and in a last line
    at :meth:`flush` (the connection closed). Holds a count and one message: bounded."""

    def __init__(self, logger: logging.Logger, label: str,
                 interval: float = SUMMARY_EVERY_S) -> None:
        self._logger = logger
        self._label = label
        self.interval = interval
        self._since: float | None = None  # when the last line was logged
        self._unreported = 0
        self._latest = ""

    def refused(self, req: int, why: BaseException) -> None:
        now = time.monotonic()
        if self._since is None:
            self._logger.info("%s: refused request %d: %s", self._label, req, why)
            self._since = now
            return
        self._unreported += 1
        self._latest = str(why)
        if now - self._since >= self.interval:
            self.flush(now)

    def flush(self, now: float | None = None) -> None:
        if not self._unreported or self._since is None:
            return
        now = time.monotonic() if now is None else now
        self._logger.info("%s: refused %d more request(s) in the last %.0f s (latest: %s)",
                          self._label, self._unreported, now - self._since, self._latest)
        self._unreported, self._since = 0, now
