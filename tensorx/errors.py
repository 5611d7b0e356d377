"""The whole tensorx error tree, sorted by what the caller can do about it.

Backend exceptions (OSError, UCX errors) are translated into these at the transport
boundary with ``raise New(...) from exc``; callers never need to catch a backend type.
"""

from __future__ import annotations

import builtins

__all__ = [
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
