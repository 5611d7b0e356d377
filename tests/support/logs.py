"""Checks on what the tensorx loggers said (through pytest's ``caplog``)."""

from __future__ import annotations

import logging

import pytest


def only_warning(caplog: pytest.LogCaptureFixture) -> str:
    """The one line logged at WARNING or above (asserted to be the only one)."""
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1, warnings
    return warnings[0]


async def retried(caplog: pytest.LogCaptureFixture, attempts: int = 1) -> None:
    """Wait until a worker logged ``attempts`` failed rejoin attempts (``caplog`` set to
    INFO for ``tensorx.worker``): a server restarted after that is met by a retry."""
    from tensorx.testing import wait_until

    await wait_until(lambda: any(f"rejoin attempt {attempts} failed" in r.getMessage()
                                 for r in caplog.records), 30, what="a failed rejoin attempt")
