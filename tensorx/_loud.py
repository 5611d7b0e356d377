"""Fallbacks from the lane a user would expect, said once.

The first fallback of each kind in a process (UCX installed but not used, no same-host lane
where the peer is on this host, GPU memory staged through host memory) is one WARNING line
saying why and how to change it; later ones of that kind are INFO, so a process that opens
a hundred endpoints the same way says it once. ``ep.info`` has the details every time."""

from __future__ import annotations

import logging

__all__ = ["KINDS", "fallback"]

KINDS = ("ucx", "cma", "gpu")
_said: set[str] = set()  # the kinds this process has warned about


def fallback(logger: logging.Logger, kind: str, msg: str, *args: object) -> None:
    """Log ``msg % args`` as this process's WARNING for ``kind``, or as INFO after the
    first."""
    level = logging.INFO if kind in _said else logging.WARNING
    _said.add(kind)
    logger.log(level, msg, *args)

