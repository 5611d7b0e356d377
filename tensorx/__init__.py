"""tensorx: one-sided (RDMA-style) tensor exchange for parameter-server training.

The public surface lives here; everything else may move between releases. A public name is
in ``__all__`` (and in ``_LAZY`` when its module is imported on first use); the module's own
helpers are private (``_importlib``), so ``dir(tensorx)`` lists the public names alone.
"""

from __future__ import annotations

import importlib as _importlib
import typing as _typing

# Errors
from tensorx.errors import (
    AuthError,
    BrokenError,
    ClosedError,
    OptimizerError,
    PlanMismatchError,
    ProtocolError,
    RankTakenError,
    RegionError,
    TensorxError,
    TimeoutError,
    TransportUnavailableError,
    UsageError,
)

# Memory
from tensorx.memregion import MemoryRegion, RegionDescriptor

# Nodes and endpoints
from tensorx._queues import MessageStream  # isort: skip  # what ep.messages is
from tensorx.endpoint import Endpoint  # isort: skip
from tensorx.node import Node  # isort: skip

# Planning and parameter-server training need torch: imported on first use, so that the
# transport layer works (and imports fast) without it. A name maps to the module that defines
# it, or a subpackage's name to the subpackage itself.
_LAZY = {
    "GraphAnalyzer": "tensorx.graph_analyzer",
    "PlanEntry": "tensorx.graph_analyzer",
    "TransferPlan": "tensorx.graph_analyzer",
    "ParameterServer": "tensorx.ps",
    "RemoteOptimizer": "tensorx.remote_optimizer",
    "Worker": "tensorx.worker",
    # launchers (torchrun): the store the shards publish their addresses in, and the lookup
    "launcher_store": "tensorx.ps",
    "ps_addresses": "tensorx.worker",
    # pipeline (model-parallel) training: a subpackage of its own
    "pipelining": "tensorx.pipelining",
}

if _typing.TYPE_CHECKING:
    from tensorx import pipelining
    from tensorx.graph_analyzer import GraphAnalyzer, PlanEntry, TransferPlan
    from tensorx.ps import ParameterServer, launcher_store
    from tensorx.remote_optimizer import RemoteOptimizer
    from tensorx.worker import Worker, ps_addresses


def __getattr__(name: str) -> _typing.Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'tensorx' has no attribute {name!r}")
    module = _importlib.import_module(_LAZY[name])
    return module if module.__name__ == f"{__name__}.{name}" else getattr(module, name)


def __dir__() -> list[str]:
    """The public names and the module's dunders: no helpers, no submodules imported above."""
    return sorted({*__all__, *(name for name in globals() if name.startswith("__"))})


__version__ = "0.1.0"

__all__ = [
    "AuthError",
    "BrokenError",
    "ClosedError",
    "Endpoint",
    "GraphAnalyzer",
    "MemoryRegion",
    "MessageStream",
    "Node",
    "OptimizerError",
    "ParameterServer",
    "PlanEntry",
    "PlanMismatchError",
    "ProtocolError",
    "RankTakenError",
    "RegionDescriptor",
    "RegionError",
    "RemoteOptimizer",
    "TensorxError",
    "TimeoutError",
    "TransferPlan",
    "TransportUnavailableError",
    "UsageError",
    "Worker",
    "__version__",
    "launcher_store",
    "pipelining",
    "ps_addresses",
]
