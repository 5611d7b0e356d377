"""Boundary edges beyond the PS: tensors that cross devices or processes inside a model.

Given a ``torch.fx``-traceable model and a placement of its submodules (``{"stage0": "gpu0",
"stage1": "gpu1"}``, keys are module paths, the longest matching prefix wins), every node is
placed: a module call by its path, a function or method by the module it was traced in, and
anything else after its first placed input (the root's own code goes to the ``""`` key when
the placement has one). An edge is a node's value needed by a node on
another placement; each (tensor, destination) pair crosses once. Sample inputs give shapes
(static edges, exact bytes); without them, or for non-tensor values, an edge is dynamic: a
header slot plus ``dynamic_max_bytes`` of payload. Each destination gets one receive arena
with every incoming edge at an aligned offset, to be registered once.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import astuple, dataclass
from typing import Any

import msgpack
import torch
from torch import fx, nn
from torch.fx.passes.shape_prop import ShapeProp, TensorMetadata

from tensorx._analyzer.layout import HEADER_BYTES, ITEMSIZE, align_up, numel_of
from tensorx._analyzer.sample import traceless
from tensorx._analyzer.wire import table
from tensorx.errors import UsageError
from tensorx.memregion import MemoryRegion

__all__ = ["BoundaryAnalyzer", "BoundaryEdge", "BoundaryPlan"]


@dataclass(frozen=True)
class BoundaryEdge:
    """One value crossing from ``src`` to ``dst``, and its receive slot in ``dst``'s arena.

    For a dynamic edge the slot is a ``HEADER_BYTES`` header (rows, nbytes, version,
    capacity as in the sparse path) followed by ``nbytes`` of payload capacity.
    """

    tensor: str
    src: str
    dst: str
    shape: tuple[int, ...] | None
    dtype: str | None
    nbytes: int
    kind: str
    offset: int = 0

    @property
    def slot_bytes(self) -> int:
        return self.nbytes + (HEADER_BYTES if self.kind == "dynamic" else 0)

    @property
    def payload_offset(self) -> int:
        return self.offset + (HEADER_BYTES if self.kind == "dynamic" else 0)


class BoundaryPlan:
    """Receive buffers per destination for every boundary edge."""

    def __init__(self, edges: Sequence[BoundaryEdge], alignment: int) -> None:
        self.edges = list(edges)
        self.alignment = alignment

    @property
    def places(self) -> list[str]:
        return sorted({e.dst for e in self.edges} | {e.src for e in self.edges})

    def edges_into(self, place: str) -> list[BoundaryEdge]:
        return [e for e in self.edges if e.dst == place]

    def arena_bytes(self, place: str) -> int:
        ends = [e.offset + e.slot_bytes for e in self.edges_into(place)]
        return align_up(max(ends, default=0), self.alignment)

    def receive_views(self, place: str, region: MemoryRegion) -> dict[str, torch.Tensor]:
        """Per incoming tensor, its receive buffer inside ``place``'s registered ``region``.

        Static edges get a shaped view of their dtype; dynamic ones a ``uint8`` view of their
        payload capacity (the header slot precedes it at ``edge.offset``).
        """
        if region.nbytes < self.arena_bytes(place):
            raise UsageError(f"region of {region.nbytes} B is smaller than {place!r}'s "
                             f"receive arena of {self.arena_bytes(place)} B")
        return {e.tensor: _receive_view(e, region) for e in self.edges_into(place)}

    @property
    def fingerprint(self) -> str:
        rows = [[*astuple(e)[:3], list(e.shape or ()), *astuple(e)[4:]] for e in self.edges]
        packed = msgpack.packb([self.alignment, rows], use_bin_type=True)
        return "txb1-" + hashlib.sha256(packed).hexdigest()[:32]

    def describe(self) -> str:
        rows: list[tuple[str, ...]] = [("tensor", "from", "to", "bytes", "kind", "shape", "offset")]
        rows += [(e.tensor, e.src, e.dst, str(e.nbytes), e.kind, _shape_text(e), str(e.offset))
                 for e in self.edges]
        lines = table(rows)
        lines += [f"receive arena {p}: {self.arena_bytes(p)} B" for p in self.places
                  if self.edges_into(p)]
        return "\n".join([*lines, f"{len(self.edges)} boundary edges, {self.fingerprint}"])


def _receive_view(e: BoundaryEdge, region: MemoryRegion) -> torch.Tensor:
    if e.kind == "static" and e.shape is not None and e.dtype is not None:
        view: torch.Tensor = region.view(getattr(torch, e.dtype), e.shape, e.offset)
        return view
    raw: torch.Tensor = region.view(torch.uint8, (e.nbytes,), e.payload_offset)
    return raw


def _shape_text(e: BoundaryEdge) -> str:
    if e.shape is None:
        return "?"
    return "x".join(map(str, e.shape)) or "()"


class BoundaryAnalyzer:
    """Find and plan the edges of ``model`` that cross its ``placement``'s boundaries."""

    def __init__(self, model: nn.Module, placement: Mapping[str, str],
                 sample_inputs: Sequence[Any] | None = None, default: str | None = None,
                 dynamic_max_bytes: int = 1 << 20, alignment: int = 64,
                 leaf_modules: tuple[type[nn.Module], ...] = ()) -> None:
        if not placement:
            raise UsageError("placement must map at least one module path to a place")
        if not isinstance(dynamic_max_bytes, int) or dynamic_max_bytes < 0:
            raise UsageError(f"dynamic_max_bytes must be an int >= 0, got {dynamic_max_bytes!r}")
        self.gm = model if isinstance(model, fx.GraphModule) else _trace(model, leaf_modules)
        self.placement = dict(placement)
        self.default = default
        self.dynamic_max_bytes = dynamic_max_bytes
        self.alignment = alignment
        if sample_inputs is not None:
            _propagate_shapes(self.gm, tuple(sample_inputs))

    # -- placement ----------------------------------------------------------------------
    def node_places(self) -> dict[str, str]:
        """The place of every node that has one, by node name."""
        places: dict[fx.Node, str] = {}
        for node in self.gm.graph.nodes:
            place = self._own_place(node) or _first_input_place(node, places) or self.default
            if place is not None and node.op != "placeholder":
                places[node] = place
        for node in self.gm.graph.nodes:
            if node.op == "placeholder":
                users = [places[u] for u in node.users if u in places]
                place = users[0] if users else self.default
                if place is not None:
                    places[node] = place
        return {n.name: p for n, p in places.items()}

    def _own_place(self, node: fx.Node) -> str | None:
        path = _scope(node)
        if path is None:
            return None
        best = [k for k in self.placement
                if k == "" or path == k or path.startswith(k + ".")]
        return self.placement[max(best, key=len)] if best else None

    # -- edges --------------------------------------------------------------------------
    def edges(self) -> list[BoundaryEdge]:
        """Every (value, destination) crossing, in graph order, before layout."""
        places = self.node_places()
        out = []
        for node in self.gm.graph.nodes:
            src = places.get(node.name)
            dsts = {places[u.name] for u in node.users if u.name in places} - {src}
            out += [self._edge(node, src or "?", dst) for dst in sorted(dsts)]
        return out

    def _edge(self, node: fx.Node, src: str, dst: str) -> BoundaryEdge:
        meta = node.meta.get("tensor_meta")
        if isinstance(meta, TensorMetadata):
            shape = tuple(int(d) for d in meta.shape)
            dtype = str(meta.dtype).removeprefix("torch.")
            nbytes = numel_of(shape) * ITEMSIZE.get(dtype, 8)
            return BoundaryEdge(node.name, src, dst, shape, dtype, nbytes, "static")
        return BoundaryEdge(node.name, src, dst, None, None, self.dynamic_max_bytes, "dynamic")

    def plan(self) -> BoundaryPlan:
        laid, ends = [], dict[str, int]()
        for e in self.edges():
            offset = ends.get(e.dst, 0)
            laid.append(_with_offset(e, offset))
            ends[e.dst] = align_up(offset + laid[-1].slot_bytes, self.alignment)
        return BoundaryPlan(laid, self.alignment)


def _with_offset(e: BoundaryEdge, offset: int) -> BoundaryEdge:
    return BoundaryEdge(e.tensor, e.src, e.dst, e.shape, e.dtype, e.nbytes, e.kind, offset)


def _scope(node: fx.Node) -> str | None:
    """The module path a node runs in: "" for the root's own code, None if unknown."""
    if node.op in ("call_module", "get_attr"):
        return str(node.target)
    if node.op not in ("call_function", "call_method"):
        return None
    stack = node.meta.get("nn_module_stack")
    return str(next(reversed(stack.values()))[0]) if stack else ""


class _Tracer(fx.Tracer):
    def __init__(self, leaves: tuple[type[nn.Module], ...]) -> None:
        super().__init__()
        self.leaves = leaves

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return isinstance(m, self.leaves) or super().is_leaf_module(m, module_qualified_name)


def _trace(model: nn.Module, leaves: tuple[type[nn.Module], ...]) -> fx.GraphModule:
    """Symbolic tracing that keeps ``leaves`` (e.g. untraceable blocks) as single calls."""
    return fx.GraphModule(model, _Tracer(leaves).trace(model))


def _first_input_place(node: fx.Node, places: Mapping[fx.Node, str]) -> str | None:
    for arg in node.all_input_nodes:
        if arg in places:
            return places[arg]
    return None


def _propagate_shapes(gm: fx.GraphModule, inputs: tuple[Any, ...]) -> None:
    with traceless(gm, inputs):
        ShapeProp(gm).propagate(*inputs)
