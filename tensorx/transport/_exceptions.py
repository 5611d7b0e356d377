"""The transport edge: backend exceptions (``OSError`` from sockets and syscalls, errors
of ucxx and libucp) become :mod:`tensorx.errors` types here and nowhere else, chained with
``raise New(...) from exc`` so the backend's reason stays in the traceback.

The one translator is :class:`map_exceptions`; every place that calls into a backend wraps
the call in it instead of catching and re-raising by hand.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import TracebackType

from tensorx.errors import BrokenError, TensorxError, TransportUnavailableError

__all__ = ["OS_ERRORS", "TORCH_ERRORS", "UCX_ERRORS", "map_exceptions"]

OS_ERRORS: Mapping[type[BaseException], type[TensorxError]] = {OSError: BrokenError}
"""A socket or syscall that failed: the peer or the link broke it."""

UCX_ERRORS: Mapping[type[BaseException], type[TensorxError]] = {
    Exception: TransportUnavailableError}
"""Loading or starting UCX (libucx, ucxx, its context) failed: no UCX lane here. ucxx
raises its own exception types and plain ones alike, so every one of them counts."""

TORCH_ERRORS: Mapping[type[BaseException], type[TensorxError]] = {
    ImportError: TransportUnavailableError, RuntimeError: TransportUnavailableError,
    AssertionError: TransportUnavailableError}
"""torch cannot reach a GPU here (not installed, no CUDA, no such device)."""

# Ours already; and "not ready yet" on a non-blocking socket, which is flow control.
_PASS: tuple[type[BaseException], ...] = (TensorxError, BlockingIOError, InterruptedError)


class map_exceptions:
    """``with map_exceptions("peer: connection lost"):`` raises ``BrokenError("peer:
    connection lost: <the OSError>")`` from an ``OSError`` raised in the block (and lets
    ``BlockingIOError`` and tensorx's own errors through).

    ``mapping``: backend type -> tensorx type, first match wins. A plain class (no
    generator): it sits on the per-frame paths of the TCP control channel, and an instance
    holds no state, so one can be made once and entered any number of times.
    """

    __slots__ = ("mapping", "what")

    def __init__(self, what: str,
                 mapping: Mapping[type[BaseException], type[TensorxError]] = OS_ERRORS) -> None:
        self.what = what
        self.mapping = mapping

    def __enter__(self) -> None:
        return None

    def __exit__(self, typ: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc is None or isinstance(exc, _PASS):
            return
        for source, target in self.mapping.items():
            if isinstance(exc, source):
                raise target(f"{self.what}: {exc}") from exc
