"""The whole tensorx error tree, sorted by what the caller can do about it, and the one
registry of the codes under which an error crosses the wire.

Backend exceptions (OSError, UCX errors) are translated into these at the transport
boundary with ``raise New(...) from exc``; callers never need to catch a backend type.

An error sent to a peer (a TCP owner's ERROR frame, a parameter server's "error"
message) travels as ``(code, message)``: :func:`error_code` names the class with a stable
short code, :func:`error_from_code` makes the receiving side's exception back, escaping the
peer's message. A code this process does not know (a newer peer's) becomes the base
:class:`TensorxError`: still an error the caller catches, never a crash.
"""

from __future__ import annotations

import builtins

from tensorx._text import printable

__all__ = [
    "CODES",
    "AuthError",
    "BrokenError",
    "ClosedError",
    "OptimizerError",
    "PlanMismatchError",
    "ProtocolError",
    "RankTakenError",
    "RegionError",
    "TensorxError",
    "TimeoutError",
    "TransportUnavailableError",
    "UsageError",
    "error_code",
    "error_from_code",
]


class TensorxError(Exception):
    """Base class of every error tensorx raises on purpose."""


class ClosedError(TensorxError):
    """You closed this resource (node, endpoint, region) and then used it."""


class BrokenError(TensorxError):
    """The peer or the link broke the endpoint; reconnect to go on."""


class ProtocolError(TensorxError):
    """A malformed, oversized or unexpected frame, or a protocol version mismatch."""


class UsageError(TensorxError, ValueError):
    """A bad call: wrong argument, unsupported object, out-of-range request made locally."""


class AuthError(TensorxError):
    """The peer refused our credentials, or presented wrong ones."""


class RegionError(TensorxError):
    """The remote region is gone, unknown, out of range, or lacks the access right asked for."""


class TimeoutError(TensorxError, builtins.TimeoutError):
    """An operation did not finish within its timeout."""


class TransportUnavailableError(TensorxError):
    """The transport asked for (``require="rdma"``, ``transport="ucx"``) cannot be used here."""


class PlanMismatchError(UsageError):
    """Two processes planned different tensors; the message names the first difference."""


class OptimizerError(UsageError):
    """The parameter server's optimizer refused an update (say, Adam given a table's sparse
    gradient); the message names the tensor. Fix the optimizer the server was given."""


class RankTakenError(UsageError):
    """A live worker already holds this rank on the parameter server (two workers launched
    with the same rank); the rank passes to another connection only once its holder is gone."""


# The stable wire code of each class. Never change or reuse one: peers of other versions
# read them ("region", "protocol", "auth", "usage" and "broken" are what the TCP owner sent
# before the registry; keep them).
CODES: dict[str, type[TensorxError]] = {
    "error": TensorxError,
    "closed": ClosedError,
    "broken": BrokenError,
    "protocol": ProtocolError,
    "usage": UsageError,
    "auth": AuthError,
    "region": RegionError,
    "timeout": TimeoutError,
    "unavailable": TransportUnavailableError,
    "plan_mismatch": PlanMismatchError,
    "optimizer": OptimizerError,
    "rank_taken": RankTakenError,
}
_CODE_OF = {cls: code for code, cls in CODES.items()}
# Parameter servers before the registry sent the class name as the code: still understood.
_LEGACY = {cls.__name__: cls for cls in CODES.values()}
MESSAGE_LIMIT = 2000  # characters of a peer's error message kept (the rest is cut, counted)


def error_code(exc: BaseException) -> str:
    """The wire code of ``exc``: its class's, or its nearest registered base's (a
    subclass defined elsewhere travels as what its callers catch). Anything that is not a
    :class:`TensorxError` is ``"error"`` (the base)."""
    for cls in type(exc).__mro__:
        code = _CODE_OF.get(cls)
        if code is not None:
            return code
    return "error"


def error_from_code(code: object, message: object, prefix: str = "") -> TensorxError:
    """The exception a peer's ``(code, message)`` stands for, its message escaped (one
    printable line, at most :data:`MESSAGE_LIMIT` characters) after our own ``prefix``;
    an unknown code gives the base :class:`TensorxError`."""
    cls = CODES.get(code, _LEGACY.get(code, TensorxError)) if isinstance(code, str) \
        else TensorxError
    return cls(prefix + printable(message, MESSAGE_LIMIT))
