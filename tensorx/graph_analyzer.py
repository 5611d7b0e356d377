"""Pure planning: from a model (or an fx graph and a placement) to a transfer layout.

No I/O happens here: no sockets, no asyncio. The output is plain data (:class:`TransferPlan`,
:class:`BoundaryPlan`) plus, for the worker, a :class:`Binding` that makes a model's
parameters and gradients live inside registered arenas.

* :class:`GraphAnalyzer` plans the parameters (and optionally buffers) that cross the
  worker/parameter-server boundary: per-shard ``params`` and ``grads`` arenas with the same
  layout, entries aligned and in gradient-ready order, large tensors split into chunks,
  bytes balanced across shards, sparse gradients on a dynamic path (a header slot each; the
  worker stages their rows itself).
* :meth:`TransferPlan.bind` rebinds ``param.data`` / ``param.grad`` as views into the arenas.
* :class:`BoundaryAnalyzer` finds the tensors that cross device/process boundaries in a
  ``torch.fx``-traceable model and plans pre-registered receive buffers for them.
"""

from __future__ import annotations

from typing import Any

from tensorx._analyzer.binding import Binding, allocate_regions
from tensorx._analyzer.boundary import BoundaryAnalyzer, BoundaryEdge, BoundaryPlan
from tensorx._analyzer.layout import (
    HEADER_BYTES,
    DynamicEntry,
    PlanEntry,
    PlanOptions,
)
from tensorx._analyzer.plan import TransferPlan
from tensorx._analyzer.planner import GraphAnalyzer, TensorInfo

__all__ = [
    "HEADER_BYTES",
    "Binding",
    "BoundaryAnalyzer",
    "BoundaryEdge",
    "BoundaryPlan",
    "DynamicEntry",
    "GraphAnalyzer",
    "PlanEntry",
    "PlanOptions",
    "TensorInfo",
    "TransferPlan",
    "allocate_regions",
]

# Names this module served once: the parameter server's sparse path at run time.
_GONE = ("SparseHeader", "SparseStaging", "StagedSparse", "payload_views", "read_header")


def __getattr__(name: str) -> Any:
    if name in _GONE:  # an ImportError: `from ... import` would drop an AttributeError's text
        raise ImportError(
            f"tensorx.graph_analyzer.{name} is gone: it was an internal runtime piece of the "
            "parameter server's sparse path and is no longer public. tensorx.Worker stages "
            "sparse gradients itself (with tensorx.ParameterServer), and plan.bind() no "
            "longer allocates sparse staging or header regions", name=__name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
