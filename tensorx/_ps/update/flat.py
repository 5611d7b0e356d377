"""The flat update: one optimizer pass over each contiguous range of a shard's arena.

For an *elementwise* optimizer (each element's new value depends only on that element's
parameter, gradient and state, and on per-parameter scalars such as Adam's ``step``, equal
in every parameter of a PS shard since all of them step together), stepping a few flat
ranges gives the same parameters as stepping each tensor: far fewer kernel launches, and
torch's fused or ``foreach`` kernels over long runs of memory.

The optimizer the user's factory built (the *face*) is kept as it is: it still sees the
model's named, shaped parameters, its ``param_groups`` are what LR schedulers and
:class:`tensorx.RemoteOptimizer` change, and its ``state_dict()`` is per parameter. A second
optimizer of the same class (the *engine*) steps one flat parameter per range, with the
hyperparameters of the face's group that range belongs to (copied before every step). The
face's per-element state is views of the engine's flat state, and its per-parameter
scalars are copied from the engine's whenever the state is read (``state_dict()``, or
:meth:`FlatUpdate.expose`); a state loaded into the face (``load_state_dict``) is loaded
into the engine. Pure: no I/O.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

from tensorx._ps.update.optim import ParamSpec

if TYPE_CHECKING:
    from tensorx.memregion import MemoryRegion

__all__ = ["ELEMENTWISE", "FlatUpdate", "Range", "elementwise", "ranges"]

logger = logging.getLogger(__name__)

# torch.optim classes whose dense update is elementwise (checked against torch 2.x's code:
# every option of theirs, amsgrad, maximize, nesterov, centered, ..., is elementwise too).
# Exact classes only: a subclass may override step().
ELEMENTWISE: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.RMSprop,
    torch.optim.Adagrad, torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam,
    torch.optim.Adadelta, torch.optim.ASGD, torch.optim.Rprop)
# classes with a fused kernel (torch 2.4+: on CPU too)
FUSED: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad)
# per-parameter scalar state (the rest of an elementwise optimizer's state is per element)
SCALARS = frozenset({"step", "mu_product", "eta", "mu"})
KERNEL_KEYS = frozenset({"params", "foreach", "fused"})  # not copied from the face


def elementwise(optimizer: torch.optim.Optimizer) -> str | None:
    """None when a flat update of ``optimizer`` gives the same result as its own step;
    else why not (for the log line)."""
    name = type(optimizer).__name__
    if type(optimizer) not in ELEMENTWISE:
        return f"{name} is not known to be elementwise"
    if any(g.get("differentiable") for g in optimizer.param_groups):
        return f"{name} with differentiable=True"
    if optimizer._optimizer_step_pre_hooks or optimizer._optimizer_step_post_hooks:  # noqa: SLF001 (torch.optim keeps its hooks private)
        return f"{name} has step hooks"
    return None


@dataclass
class Range:
    """A contiguous run of parameters of one group and dtype: ``[start, start + nbytes)``
    of the arena. ``members`` are (index into the parameter list, first element in the
    range, first element of the parameter, elements): a parameter larger than a range is
    cut into several, each holding ``elements`` of it from ``first element of the
    parameter`` on; any other lies whole in one."""

    group: int
    dtype: torch.dtype
    start: int
    nbytes: int = 0
    members: list[tuple[int, int, int, int]] = field(default_factory=list)

    @property
    def numel(self) -> int:
        return self.nbytes // self.dtype.itemsize


def ranges(specs: Sequence[ParamSpec], group_of: Sequence[int],
           part_bytes: int) -> list[Range]:
    """Maximal runs of parameters adjacent in the arena (padding between them included: it
    is zero in every arena) with the same group and dtype, of at most ``part_bytes`` each;
    a parameter larger than that is cut into ranges of ``part_bytes`` (the last one
    shorter), so that no range (no part of a pipelined round) is larger. A parameter whose
    group is negative is left out, and no range spans it."""
    out: list[Range] = []
    order = sorted(range(len(specs)), key=lambda i: specs[i].offset)
    cut = False
    for i in order:
        if group_of[i] < 0:
            cut = True
            continue
        s, size = specs[i], specs[i].dtype.itemsize
        last = out[-1] if out else None
        end = s.offset + s.numel * size
        if (cut or last is None or last.group != group_of[i] or last.dtype != s.dtype
                or (s.offset - last.start) % size or end - last.start > part_bytes):
            last = Range(group_of[i], s.dtype, s.offset)
            out.append(last)
            cut = False
        per = max(1, part_bytes // size)  # elements a range holds
        for skip in range(0, s.numel, per) if s.numel > per else (0,):
            if skip:
                last = Range(group_of[i], s.dtype, s.offset + skip * size)
                out.append(last)
            count = min(per, s.numel - skip) if s.numel > per else s.numel
            last.members.append((i, (s.offset + skip * size - last.start) // size, skip,
                                 count))
            last.nbytes = s.offset + (skip + count) * size - last.start
    return out


def _kernel(optimizer: torch.optim.Optimizer, device: torch.device,
            dtypes: set[torch.dtype]) -> dict[str, Any]:
    """foreach/fused for the engine: the user's choice when the factory made one; on a GPU
    the foreach kernels, which torch steps each tensor with there by default (the same
    arithmetic: its fused kernels round differently, e.g. SGD with dampening, Adam); else
    the fused kernel where torch has it for this class, device and dtypes, else foreach."""
    d = optimizer.defaults
    if d.get("foreach") is not None or d.get("fused") is not None:
        return {k: d[k] for k in ("foreach", "fused") if k in d}
    if device.type == "cuda":
        return {"foreach": True}
    if (type(optimizer) in FUSED and device.type in _get_fused_kernels_supported_devices()
            and all(t.is_floating_point for t in dtypes)):
        return {"fused": True}
    return {"foreach": True}


class FlatUpdate:
    """Steps ``optimizer`` (the face over ``params``, which view ``region``) as flat ranges;
    see the module docstring."""

    def __init__(self, optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor],
                 specs: Sequence[ParamSpec], region: MemoryRegion, part_bytes: int) -> None:
        self.face = optimizer
        self.params = list(params)
        group_index = {id(p): g for g, group in enumerate(optimizer.param_groups)
                       for p in group["params"]}
        # sparse tables step on their own, with sparse gradients (see tensorx._ps.rows.tables)
        self.left_out = sum(bool(getattr(s, "sparse", False)) for s in specs)
        self.ranges = ranges(specs, [-1 if getattr(s, "sparse", False) else group_index[id(p)]
                                     for p, s in zip(params, specs, strict=True)], part_bytes)
        self.flat = [torch.nn.Parameter(t, requires_grad=True) for t in self.views(region)]
        kernel = _kernel(optimizer, self.flat[0].device, {r.dtype for r in self.ranges})
        groups = [{**self._hp(r), **kernel, "params": [p]}
                  for r, p in zip(self.ranges, self.flat, strict=True)]
        # the groups carry every hyperparameter; the constructor gets those it takes (the
        # defaults' keys are not always its arguments: AdamW's decoupled_weight_decay)
        takes = inspect.signature(type(optimizer)).parameters
        defaults = {k: v for k, v in optimizer.defaults.items()
                    if k in takes and k not in KERNEL_KEYS}
        self.engine = type(optimizer)(groups, **defaults, **kernel)
        d = self.engine.defaults
        self.kernel = "fused" if d.get("fused") else "foreach" if d.get("foreach") \
            else "single-tensor"
        self.active = True
        optimizer.register_state_dict_pre_hook(lambda _opt: self.expose())
        optimizer.register_load_state_dict_post_hook(lambda _opt: self.adopt())
        if optimizer.state:  # e.g. Adagrad's, made by its constructor
            self.adopt()

    def describe(self) -> str:
        groups = len({r.group for r in self.ranges})
        sparse = f"; {self.left_out} sparse table(s) per tensor" if self.left_out else ""
        return (f"flat over {len(self.ranges)} range(s) ({type(self.face).__name__}, "
                f"elementwise, {groups} group(s), {self.kernel}){sparse}")

    def views(self, region: MemoryRegion) -> list[torch.Tensor]:
        """One flat tensor per range of ``region`` (a gradient slot, the accumulator)."""
        return [region.view(r.dtype, (r.numel,), r.start) for r in self.ranges]

    def _hp(self, r: Range) -> dict[str, Any]:
        return {k: v for k, v in self.face.param_groups[r.group].items()
                if k not in KERNEL_KEYS}

    def step(self, grads: Sequence[torch.Tensor | None]) -> None:
        """One step of the ranges whose gradient is given (None: that range is skipped).
        The engine sees only those ranges' groups: stepping one part of many (a pipelined
        round) does not walk the groups of all the others."""
        groups = self.engine.param_groups
        active = []
        for r, p, g, eg in zip(self.ranges, self.flat, grads, groups, strict=True):
            p.grad = g
            if g is not None:
                eg.update(self._hp(r))  # the face's values: schedules, RemoteOptimizer
                active.append(eg)
        self.engine.param_groups = active
        try:
            self.engine.step()
        finally:
            self.engine.param_groups = groups
        self.face._opt_called = True  # type: ignore[attr-defined]  # for LR schedulers  # noqa: SLF001 (torch's LR schedulers read it)

    # -- the face's state -----------------------------------------------------------------
    def expose(self) -> None:
        """Make the face's state per parameter, as its own steps would have left it."""
        if not self.active:
            return
        pieces: dict[int, list[tuple[int, dict[str, Any]]]] = {}  # cut parameters
        for r, flat in zip(self.ranges, self.flat, strict=True):
            whole = self.engine.state.get(flat)
            for i, first, skip, n in r.members:
                p = self.params[i]
                if not whole:
                    self.face.state.pop(p, None)
                elif n == p.numel():  # whole in this range: views of the engine's state
                    self.face.state[p] = {
                        k: v[first:first + n].view(p.shape) if _per_element(v, r)
                        else v.clone() for k, v in whole.items()}
                else:
                    pieces.setdefault(i, []).append((skip, {
                        k: (v[first:first + n], True) if _per_element(v, r) else (v, False)
                        for k, v in whole.items()}))
        for i, got in pieces.items():  # a cut parameter's state: a copy, put together
            p = self.params[i]
            got.sort(key=lambda piece: piece[0])
            self.face.state[p] = {
                k: torch.cat([part[k][0] for _, part in got]).view(p.shape) if split
                else _copy(v) for k, (v, split) in got[0][1].items()}

    def adopt(self) -> None:
        """Load the face's state (per parameter) into the engine; a state the flat update
        cannot hold (per-parameter scalars that differ) turns it off for good."""
        if not self.active:
            return
        state: dict[int, dict[str, Any]] = {}
        for k, (r, flat) in enumerate(zip(self.ranges, self.flat, strict=True)):
            whole = self._gather(r, flat)
            if whole is None:
                self.active = False
                logger.warning("update: per-tensor from now on (the optimizer state loaded "
                               "differs between parameters where a flat update needs it "
                               "equal)")
                return
            if whole:
                state[k] = whole
        self.engine.load_state_dict({"state": state,
                                     "param_groups": self.engine.state_dict()["param_groups"]})
        self.expose()

    def _gather(self, r: Range, flat: torch.Tensor) -> dict[str, Any] | None:
        per = [self.face.state.get(self.params[m[0]]) or {} for m in r.members]
        keys = set(per[0])
        if any(set(s) != keys for s in per):
            return None
        whole: dict[str, Any] = {}
        for key in keys:
            values = [s[key] for s in per]
            p0 = self.params[r.members[0][0]]
            if _element_of(key, values[0], p0):
                buf = torch.zeros(flat.shape, dtype=values[0].dtype, device=flat.device)
                for (_, first, skip, n), v in zip(r.members, values, strict=True):
                    buf[first:first + n] = v.reshape(-1)[skip:skip + n]
                whole[key] = buf
            elif all(_same(v, values[0]) for v in values):
                whole[key] = _copy(values[0])
            else:
                return None
        return whole


def _per_element(value: Any, r: Range) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == r.numel


def _element_of(key: str, value: Any, p: torch.Tensor) -> bool:
    if not isinstance(value, torch.Tensor) or value.shape != p.shape:
        return False
    return value.dim() > 0 or key not in SCALARS


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and bool(torch.equal(a, b))
    return bool(a == b)


def _copy(value: Any) -> Any:
    return value.clone() if isinstance(value, torch.Tensor) else value
