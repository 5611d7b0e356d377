"""The split frontend: trace a model, cut it into stages, plan every edge between them.

``split(model, split_points=[...])`` starts a new stage at the first node of each module
path named (in graph order); ``placement={module_path: stage}`` places modules by the
longest matching prefix, as :class:`~tensorx._analyzer.boundary.BoundaryAnalyzer` does.
Every value a later stage needs crosses straight from the stage that computes it to each
stage that uses it (a skip connection from stage 0 to stage 2 does not pass through stage
1), and the model's inputs enter at the first stage. Each stage's module is an
``fx.GraphModule`` over the model's own submodules: its ``Parameter`` objects are the
model's, so an optimizer over them trains the model.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn
from torch.fx.passes.shape_prop import TensorMetadata

from tensorx._analyzer.boundary import BoundaryAnalyzer, _propagate_shapes, _scope, _trace
from tensorx.errors import UsageError
from tensorx.pipelining._boundary import Routes
from tensorx.pipelining._stage import PipelineStage

__all__ = ["Pipe", "build_stage", "split"]


@dataclass(frozen=True)
class Crossing:
    """One value crossing from stage ``src`` to stage ``dst``."""

    name: str
    src: int
    dst: int
    shape: tuple[int, ...] | None
    dtype: str | None


class Pipe:
    """A model cut into ``num_stages`` stages: :meth:`get_stage_module`, :attr:`crossings`
    (every value that crosses, with its shape where ``example_args`` gave one),
    :meth:`describe` and :meth:`build_stage`."""

    def __init__(self, gm: fx.GraphModule, stages: list[fx.GraphModule],
                 routes: Routes, crossings: list[Crossing],
                 examples: list[tuple[Any, ...] | None]) -> None:
        self.split_gm = gm
        self._stages = stages
        self._routes = routes
        self.crossings = crossings
        self._examples = examples

    @property
    def num_stages(self) -> int:
        return len(self._stages)

    def get_stage_module(self, stage_index: int) -> fx.GraphModule:
        return self._stages[stage_index]

    def describe(self) -> str:
        lines = [f"{self.num_stages} stages, {len(self.crossings)} crossings"]
        for c in self.crossings:
            shape = "x".join(map(str, c.shape)) if c.shape is not None else "?"
            lines.append(f"  {c.name}: stage {c.src} -> {c.dst}, {c.dtype or '?'} {shape}")
        return "\n".join(lines)

    def build_stage(self, stage_index: int, device: torch.device | str | int,
                    **options: Any) -> PipelineStage:
        """This process's stage (``options`` as :class:`PipelineStage`'s keywords)."""
        if not isinstance(stage_index, int) or not 0 <= stage_index < self.num_stages:
            raise UsageError(f"stage_index must be in [0, {self.num_stages}), got "
                             f"{stage_index!r}")
        module = self._stages[stage_index].to(device)
        if options.get("input_args") is None and self._examples[stage_index] is not None:
            options["input_args"] = self._examples[stage_index]
        routes = Routes(self._routes.incoming, self._routes.outgoing).at(stage_index)
        return PipelineStage._routed(routes, module, stage_index, self.num_stages, device,  # noqa: SLF001 (the split frontend's private constructor of a stage)
                                     **options)


def build_stage(pipe: Pipe, stage_index: int, device: torch.device | str | int,
                **options: Any) -> PipelineStage:
    """``pipe.build_stage(stage_index, device, **options)``."""
    return pipe.build_stage(stage_index, device, **options)


def split(model: nn.Module, split_points: Sequence[str] | None = None, *,
          placement: Mapping[str, int] | None = None, example_args: Sequence[Any] | None = None,
          leaf_modules: tuple[type[nn.Module], ...] = ()) -> Pipe:
    """Cut ``model`` (``torch.fx``-traceable; ``leaf_modules`` stay single calls) into stages
    at ``split_points`` (module paths, each beginning a stage) or by ``placement``
    (``{module_path: stage_index}``). ``example_args``: one micro-batch's inputs, whose
    shapes size every stage's receive slots."""
    if (split_points is None) == (placement is None):
        raise UsageError("give split_points=[module paths] or placement={path: stage}, "
                         "not both")
    gm = _trace(model, leaf_modules)
    if example_args is not None:
        _propagate_shapes(gm, tuple(example_args))
    nodes = list(gm.graph.nodes)
    if split_points is not None:
        stage_of = _by_split_points(gm, nodes, list(split_points))
    else:
        assert placement is not None
        stage_of = _by_placement(gm, placement)
    count = max(stage_of.values(), default=0) + 1
    for node in nodes:
        if node.op == "placeholder":
            stage_of[node] = 0
        elif node.op == "output":
            stage_of[node] = count - 1
        elif node.op == "get_attr":
            users = {stage_of.get(u, -1) for u in node.users}
            if len(users) > 1:
                raise UsageError(f"{node.target} is used by stages {sorted(users)}: a tensor "
                                 "shared by two stages (tied weights) would train as two "
                                 "copies; place its users in one stage")
    for node in nodes:
        for arg in node.all_input_nodes:
            if arg.op != "get_attr" and stage_of[arg] > stage_of[node]:
                raise UsageError(f"{node.name} (stage {stage_of[node]}) uses {arg.name} "
                                 f"from the later stage {stage_of[arg]}: stages must run in "
                                 "order; move the split points")
    used = sorted(set(stage_of.values()))
    if used != list(range(count)):
        raise UsageError(f"stages {sorted(set(range(count)) - set(used))} would be empty")
    return _build(gm, nodes, stage_of, count)


def _by_split_points(gm: fx.GraphModule, nodes: list[fx.Node], points: list[str]
                     ) -> dict[fx.Node, int]:
    known = {name for name, _ in gm.named_modules()}
    for p in points:
        if p not in known:
            raise UsageError(f"split point {p!r} is not a module path of the model "
                             f"(e.g. {sorted(known - {''})[:6]})")
    stage_of: dict[fx.Node, int] = {}
    current = 0
    for node in nodes:
        path = _scope(node)
        if (path is not None and current < len(points)
                and (path == points[current] or path.startswith(points[current] + "."))):
            current += 1
        inputs = [stage_of[a] for a in node.all_input_nodes
                  if a in stage_of and a.op not in ("placeholder", "get_attr")]
        stage_of[node] = max([current, *inputs])
    if current < len(points):
        raise UsageError(f"split point {points[current]!r} never runs after "
                         f"{points[current - 1] if current else 'the start'!r}: list the "
                         "split points in the order the model runs them")
    return stage_of


def _by_placement(gm: fx.GraphModule, placement: Mapping[str, int]) -> dict[fx.Node, int]:
    if not all(isinstance(v, int) and v >= 0 for v in placement.values()):
        raise UsageError("placement maps module paths to stage indices (ints >= 0)")
    analyzer = BoundaryAnalyzer(gm, {k: str(v) for k, v in placement.items()}, default="0")
    places = analyzer.node_places()
    return {n: int(places.get(n.name, "0")) for n in gm.graph.nodes}


def _build(gm: fx.GraphModule, nodes: list[fx.Node], stage_of: dict[fx.Node, int],
           count: int) -> Pipe:
    inputs = [n for n in nodes if n.op == "placeholder"]
    output = next(n for n in nodes if n.op == "output")
    # what each stage sends: values used by a later stage, in graph order
    sends: dict[int, list[fx.Node]] = {s: [] for s in range(count)}
    needs: dict[int, list[fx.Node]] = {s: [] for s in range(count)}
    for node in nodes:
        if node.op in ("output", "get_attr"):
            continue
        dsts = sorted({stage_of[u] for u in node.users} - {stage_of[node]})
        if dsts:
            sends[stage_of[node]].append(node)
        for d in dsts:
            needs[d].append(node)
    incoming: dict[int, dict[int, list[int]]] = {}
    outgoing: dict[int, dict[int, list[int]]] = {}
    crossings: list[Crossing] = []
    stages: list[fx.GraphModule] = []
    examples: list[tuple[Any, ...] | None] = []
    for s in range(count):
        graph = _stage_graph(s, nodes, inputs, needs, stage_of, count, output, sends,
                             incoming, outgoing, crossings)
        stages.append(fx.GraphModule(gm, graph, f"Stage{s}"))
        examples.append(_example(needs_sorted(needs[s], stage_of, nodes)) if s > 0 else None)
    return Pipe(gm, stages, Routes(incoming, outgoing), crossings, examples)


def needs_sorted(needed: list[fx.Node], stage_of: dict[fx.Node, int], nodes: list[fx.Node]
                 ) -> list[fx.Node]:
    return sorted(needed, key=lambda n: (stage_of[n], nodes.index(n)))


def _stage_graph(s: int, nodes: list[fx.Node], inputs: list[fx.Node],  # noqa: PLR0913 (one stage's slice of the split's tables)
                 needs: dict[int, list[fx.Node]], stage_of: dict[fx.Node, int], count: int,
                 output: fx.Node, sends: dict[int, list[fx.Node]],
                 incoming: dict[int, dict[int, list[int]]],
                 outgoing: dict[int, dict[int, list[int]]], crossings: list[Crossing]
                 ) -> fx.Graph:
    """Stage ``s``'s graph: its inputs (the model's, or what earlier stages send it), its
    nodes, and what it sends on (the model's output at the last stage)."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    own_inputs = inputs if s == 0 else []
    received = needs_sorted(needs[s], stage_of, nodes)
    for n in [*own_inputs, *received]:
        env[n] = graph.placeholder(n.name)
        env[n].meta = dict(n.meta)
    for src in sorted({stage_of[n] for n in received}):
        incoming.setdefault(s, {})[src] = [
            len(own_inputs) + i for i, n in enumerate(received) if stage_of[n] == src]
    for node in nodes:
        if stage_of[node] != s and node.op == "get_attr" and any(
                stage_of[u] == s for u in node.users):
            env[node] = graph.node_copy(node, lambda a: env[a])
        elif stage_of[node] == s and node.op not in ("placeholder", "output"):
            env[node] = graph.node_copy(node, lambda a: env[a])
    if s == count - 1:
        graph.output(fx.node.map_arg(output.args[0], lambda a: env[a]))
    else:
        outs = sends[s]
        graph.output(tuple(env[n] for n in outs))
        for dst in sorted({stage_of[u] for n in outs for u in n.users} - {s}):
            picked = [i for i, n in enumerate(outs) if dst in {stage_of[u] for u in n.users}]
            outgoing.setdefault(s, {})[dst] = picked
            for i in picked:
                crossings.append(_crossing(outs[i], s, dst))
    graph.lint()
    return graph


def _crossing(node: fx.Node, src: int, dst: int) -> Crossing:
    meta = node.meta.get("tensor_meta")
    if isinstance(meta, TensorMetadata):
        return Crossing(node.name, src, dst, tuple(int(d) for d in meta.shape),
                        str(meta.dtype).removeprefix("torch."))
    return Crossing(node.name, src, dst, None, None)


def _example(received: list[fx.Node]) -> tuple[Any, ...] | None:
    """Tensors shaped like a stage's inputs (from the shapes ``example_args`` gave), to size
    its slots; None if any is unknown."""
    out = []
    for n in received:
        meta = n.meta.get("tensor_meta")
        if not isinstance(meta, TensorMetadata):
            return None
        out.append(torch.empty(tuple(meta.shape), dtype=meta.dtype, device="meta"))
    return tuple(out)
