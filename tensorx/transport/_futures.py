"""Small asyncio helpers of the TCP connection: completing a future once, one exception per
waiter, best-effort steps during shutdown."""

from __future__ import annotations

import asyncio
from typing import Any

from tensorx.errors import TensorxError

__all__ = ["best_effort", "fresh_copy", "set_once"]


def set_once(fut: asyncio.Future[Any], exc: BaseException | None = None) -> None:
    """Complete ``fut`` (with ``exc`` if given) unless it is done already."""
    if fut.done():
        return
    if exc is None:
        fut.set_result(None)
    else:
        fut.set_exception(exc)


def fresh_copy(exc: TensorxError) -> TensorxError:
    """A fresh exception per waiter, so tracebacks do not pile up on one shared object."""
    new = type(exc)(str(exc))
    new.__cause__ = exc.__cause__
    return new


class best_effort:
    """Swallow failures of best-effort steps during shutdown (and only there)."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, typ: type[BaseException] | None, exc: BaseException | None,
                 tb: object) -> bool:
        return typ is not None and issubclass(typ, Exception | asyncio.TimeoutError)
