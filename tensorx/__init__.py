"""tensorx: one-sided (RDMA-style) tensor exchange for parameter-server training.

The public surface lives here; everything else may move between releases.
"""

from __future__ import annotations

# Errors
from tensorx.errors import (
    AuthError,
    BrokenError,
    ClosedError,
    PlanMismatchError,
    ProtocolError,
    RegionError,
    TensorxError,
    TimeoutError,
    TransportUnavailableError,
    UsageError,
)

# Memory
from tensorx.memregion import MemoryRegion, RegionDescriptor

# Nodes and endpoints
from tensorx.endpoint import Endpoint  # isort: skip
from tensorx.node import Node  # isort: skip

__version__ = "0.1.0"

__all__ = [
    "AuthError",
    "BrokenError",
    "ClosedError",
    "Endpoint",
    "MemoryRegion",
    "Node",
    "PlanMismatchError",
    "ProtocolError",
    "RegionDescriptor",
    "RegionError",
    "TensorxError",
    "TimeoutError",
    "TransportUnavailableError",
    "UsageError",
    "__version__",
]
