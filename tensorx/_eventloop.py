"""Which event loop tensorx's own processes run on: uvloop where installed, by choice.

tensorx never installs a loop policy when imported: a library user runs their own loop
(``uvloop.run(main())`` to opt in). tensorx's own entry points (``tensorx ps``, the
examples, the benchmarks) call :func:`run`, which takes uvloop when it is installed
(``pip install 'tensorx-rdma[uvloop]'``): it cuts the CPU time of every small op over the
TCP lane by about a third (``docs/performance.md``). ``TENSORX_LOOP=asyncio`` turns it off,
``TENSORX_LOOP=uvloop`` insists on it.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Coroutine
from typing import Any, TypeVar

from tensorx.errors import UsageError

__all__ = ["ENV", "LOOPS", "run", "use_uvloop"]

ENV = "TENSORX_LOOP"
LOOPS = ("auto", "asyncio", "uvloop")

T = TypeVar("T")


def use_uvloop(choice: str | None = None, default: str = "auto") -> bool:
    """Whether ``choice`` (else ``$TENSORX_LOOP``, else ``default``) means uvloop:
    ``uvloop`` (which must be installed) or ``auto`` where it is installed."""
    name = choice or os.environ.get(ENV) or default
    if name not in LOOPS:
        raise UsageError(f"event loop {name!r}: expected one of {', '.join(LOOPS)}")
    if name == "asyncio":
        return False
    try:
        import uvloop  # noqa: F401, PLC0415 (optional dependency)
    except ImportError:
        if name == "uvloop":
            raise UsageError("event loop 'uvloop' asked for, but uvloop is not installed "
                             "(pip install 'tensorx-rdma[uvloop]')") from None
        return False
    return True


def run(main: Coroutine[Any, Any, T], choice: str | None = None, default: str = "auto") -> T:
    """``asyncio.run(main)`` on the loop :func:`use_uvloop` picks."""
    if not use_uvloop(choice, default):
        return asyncio.run(main)
    import uvloop  # noqa: PLC0415 (optional dependency)

    result: T = uvloop.run(main)
    return result
