"""Binding a model to a plan: parameters and gradients become views into registered arenas.

What is zero-copy, exactly:

* Every dense parameter's ``.data`` is a view into its shard's ``params`` arena, and its
  ``.grad`` a view into the ``grads`` arena at the same offset. Autograd accumulates into
  ``.grad`` in place, optimizers update ``.data`` in place, and a pull into the arena lands
  in the module: no copy at any step.
* A tensor split across two shards is still one view when the shard arenas are adjacent
  slices of one block (what :func:`allocate_regions` and ``bind(regions=None)`` give). With
  user-supplied, non-adjacent regions such a tensor cannot be one view and binding refuses.
* After ``zero_grad(set_to_none=True)`` a hook that runs before autograd accumulates puts
  the (zeroed) arena view back as ``.grad``, so the next backward still writes in place. A
  parameter that got no gradient in a step keeps ``.grad = None``: call
  :meth:`Binding.ensure_bound` before pushing (it zeroes such slots, and copies, reporting
  the name, only if someone replaced ``.grad`` or ``.data`` with a private tensor).
* Sparse (dynamic) gradients cannot be views: the parameter server's worker copies their
  rows into staging memory of its own, once per step (a binding allocates none). Their
  dense *values* are bound like any other. Until a receiver reads the dynamic path,
  ``ensure_bound`` (with ``densify_sparse=True``, the default) also scatters the rows into
  the tensor's slot in the ``grads`` arena, so a dense-only parameter server still trains
  correctly (a copy, reported by name).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from tensorx._analyzer.layout import Layout, PlanEntry
from tensorx.errors import PlanMismatchError, UsageError
from tensorx.memregion import MemoryRegion

if TYPE_CHECKING:
    from torch.utils.hooks import RemovableHandle

__all__ = ["Binding", "allocate_regions"]

ARENAS = ("params", "grads")


def allocate_regions(plan: Layout,
                     device: str = "cpu") -> dict[tuple[int, str], MemoryRegion]:
    """One block per arena kind, carved into adjacent per-shard regions."""
    sizes = [plan.arena_bytes(s) for s in range(plan.num_shards)]
    out = {}
    for arena in ARENAS:
        block = _as_u8(MemoryRegion.allocate(sum(sizes), device=device))
        start = 0
        for shard, size in enumerate(sizes):
            out[(shard, arena)] = MemoryRegion.register(block[start:start + size])
            start += size
    return out


def _as_u8(region: MemoryRegion) -> torch.Tensor:
    obj = region.obj
    if isinstance(obj, torch.Tensor):
        return obj.detach().reshape(-1).view(torch.uint8)
    u8: torch.Tensor = region.view(torch.uint8)
    return u8


def _adjacent(a: torch.Tensor, b: torch.Tensor) -> bool:
    same = a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    return same and a.storage_offset() + a.numel() == b.storage_offset()


def _model_device(model: nn.Module) -> str:
    for t in model.parameters():
        return str(t.device)
    return "cpu"


class Binding:
    """The live link between a model and its plan's arenas; see the module docstring.

    ``init="tensor"`` (the default) copies each tensor's values into the arena as it binds;
    ``init="arena"`` keeps what the ``params`` regions hold (memory a parameter server
    shares with this process already holds the parameters) and copies nothing.
    """

    def __init__(self, plan: Layout, model: nn.Module,
                 regions: Mapping[tuple[int, str], MemoryRegion] | None = None,
                 device: str | None = None, densify_sparse: bool = True,
                 init: str = "tensor") -> None:
        if init not in ("tensor", "arena"):
            raise UsageError(f"init must be 'tensor' or 'arena', got {init!r}")
        self.init = init
        self.plan = plan
        self.densify_sparse = densify_sparse
        self.model = model
        device = device or _model_device(model)
        self._owns_regions = regions is None
        self.regions: dict[tuple[int, str], MemoryRegion] = dict(
            allocate_regions(plan, device) if regions is None else regions)
        self._u8 = {key: _as_u8(self._region(*key)) for key in self._arena_keys()}
        self._tensors = _named_tensors(model)
        self._chunks = plan.tensors()
        self._views: dict[tuple[str, str], torch.Tensor] = {}
        self._hooks: list[RemovableHandle] = []
        self.bound = False
        # what ensure_bound() last left in place: (tensor, data pointer, .grad object)
        self._settled: list[tuple[torch.Tensor, int, Any]] | None = None
        self._densify_each_step = densify_sparse and any(
            c[0].kind == "dynamic" and c[0].role == "param" for c in self._chunks.values())
        self._bind()

    # -- views --------------------------------------------------------------------------
    def _arena_keys(self) -> list[tuple[int, str]]:
        return [(s, a) for s in range(self.plan.num_shards) for a in ARENAS]

    def _region(self, shard: int, arena: str) -> MemoryRegion:
        region = self.regions.get((shard, arena))
        if region is None:
            raise UsageError(f"regions lacks ({shard}, {arena!r})")
        if region.nbytes < self.plan.arena_bytes(shard):
            raise UsageError(f"region ({shard}, {arena!r}) has {region.nbytes} B; "
                             f"the plan needs {self.plan.arena_bytes(shard)} B")
        return region

    def entry_view(self, entry: PlanEntry, arena: str) -> torch.Tensor:
        """1-D view (``entry.numel`` elements) of ``entry`` inside ``arena``; no copy."""
        u8 = self._u8[(entry.shard, arena)]
        out: torch.Tensor = u8[entry.offset:entry.end].view(getattr(torch, entry.dtype))
        return out

    def tensor_view(self, name: str, arena: str) -> torch.Tensor:
        """The whole tensor ``name``, shaped, inside ``arena`` (spanning shards if split)."""
        key = (name, arena)
        if key not in self._views:
            chunks = self._chunks.get(name)
            if chunks is None:
                raise UsageError(f"{name!r} is not in the plan")
            self._views[key] = self._span(chunks, arena).view(chunks[0].shape)
        return self._views[key]

    def _span(self, chunks: list[PlanEntry], arena: str) -> torch.Tensor:
        first = chunks[0]
        for a, b in itertools.pairwise(chunks):
            self._check_follows(a, b, arena)
        if first.shard == chunks[-1].shard:
            u8 = self._u8[(first.shard, arena)]
            same: torch.Tensor = u8[first.offset:chunks[-1].end].view(getattr(torch, first.dtype))
            return same
        base = self._u8[(first.shard, arena)]
        nbytes = sum(c.nbytes for c in chunks)
        raw = base.new_empty(0).set_(base.untyped_storage(), base.storage_offset() + first.offset,
                                     (nbytes,), (1,))
        out: torch.Tensor = raw.view(getattr(torch, first.dtype))
        return out

    def _check_follows(self, a: PlanEntry, b: PlanEntry, arena: str) -> None:
        if b.shard == a.shard and b.offset == a.end:
            return
        edge = a.end == self.plan.arena_bytes(a.shard) and b.offset == 0
        # shards the plan left empty in between take no room in memory
        skipped_empty = b.shard > a.shard and all(
            self.plan.arena_bytes(s) == 0 for s in range(a.shard + 1, b.shard))
        if skipped_empty and edge and _adjacent(self._u8[(a.shard, arena)],
                                                         self._u8[(b.shard, arena)]):
            return
        raise UsageError(
            f"{a.name} is split across shards {a.shard} and {b.shard} whose {arena} regions "
            "are not adjacent in memory; bind with regions=None or plan.allocate_regions()"
        )

    # -- binding ------------------------------------------------------------------------
    def _bind(self) -> None:
        # Check every tensor before touching any, so a mismatch leaves the model as it was.
        tensors = {name: self._tensor(name, chunks[0]) for name, chunks in self._chunks.items()}
        for name, tensor in tensors.items():
            self._bind_data(name, tensor)
            if _grad_is_dense(self._chunks[name][0]):
                self._bind_grad(name, tensor)
        self.bound = True

    def _tensor(self, name: str, entry: PlanEntry) -> torch.Tensor:
        tensor = self._tensors.get(name)
        if tensor is None:
            raise PlanMismatchError(f"tensor {name!r} is in the plan but not in the model: "
                                    f"{_REPLAN}")
        dtype = str(tensor.dtype).removeprefix("torch.")
        if tuple(tensor.shape) != entry.shape:
            raise PlanMismatchError(f"tensor {name!r} differs in shape: {tuple(tensor.shape)} "
                                    f"in the model vs {entry.shape} in the plan: {_REPLAN}")
        if dtype != entry.dtype:
            raise PlanMismatchError(f"tensor {name!r} differs in dtype: {dtype} in the model "
                                    f"vs {entry.dtype} in the plan: {_REPLAN}")
        if tensor.device != self.tensor_view(name, "params").device:
            raise UsageError(f"{name} is on {tensor.device} but the arenas are not; "
                             "pass device= or regions on the model's device")
        return tensor

    def _bind_data(self, name: str, tensor: torch.Tensor) -> None:
        view = self.tensor_view(name, "params")
        if self.init == "tensor":
            with torch.no_grad():
                view.copy_(tensor.detach())
        tensor.data = view

    def _bind_grad(self, name: str, param: torch.Tensor) -> None:
        view = self.tensor_view(name, "grads")
        view.zero_()
        param.grad = view
        self._hooks.append(param.register_hook(_regrad(param, view)))  # type: ignore[no-untyped-call]

    def ensure_bound(self) -> list[str]:
        """Put every tensor and gradient back in the arenas; return the names that needed a copy.

        Call before a push: it also zeroes the gradient slot of a parameter that received
        no gradient this step (``.grad is None``), so stale bytes are never sent.

        Cheap when nothing changed (the usual step): one pointer and one identity check per
        tensor against the state the last full pass left; any difference takes the full pass.
        """
        if self._settled is not None and all(
                t.data_ptr() == ptr and t.grad is g for t, ptr, g in self._settled):
            return []
        copied = self._full_pass()
        if not self._densify_each_step:
            self._settled = [(t, t.data_ptr(), t.grad) for t in self._tensors.values()]
        return copied

    def _full_pass(self) -> list[str]:
        copied = []
        for name, chunks in self._chunks.items():
            tensor = self._tensors[name]
            if _rebind_data(tensor, self.tensor_view(name, "params")):
                copied.append(name)
            if chunks[0].role != "param":
                continue
            view = self.tensor_view(name, "grads")
            if _grad_is_dense(chunks[0]) and _rebind_grad(tensor, view):
                copied.append(name)
            if chunks[0].kind == "dynamic" and self.densify_sparse:
                _densify(tensor.grad, view)
                copied.append(name)
        return copied

    def unbind(self, close_regions: bool | None = None) -> None:
        """Give every tensor private storage again (a copy) and drop the hooks. Idempotent.

        The ``params``/``grads`` regions are closed if the binding allocated them (or if
        ``close_regions=True``).
        """
        if not self.bound:
            return
        self.bound = False
        self._settled = None
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        for name in self._chunks:
            _privatize(self._tensors[name])
        if close_regions if close_regions is not None else self._owns_regions:
            for key in self._arena_keys():
                self.regions[key].close()

    def __enter__(self) -> Binding:
        return self

    def __exit__(self, *exc: object) -> None:
        self.unbind()


_REPLAN = "bind the model the plan was made from, or plan this one (GraphAnalyzer(model))"


def _grad_is_dense(entry: PlanEntry) -> bool:
    return entry.role == "param" and entry.kind == "static"


def _named_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = dict(model.named_parameters())
    out.update(model.named_buffers())
    return out


def _regrad(param: torch.Tensor, view: torch.Tensor) -> Callable[[torch.Tensor], None]:
    # Runs before AccumulateGrad reads .grad: a defined .grad makes autograd add in place.
    def hook(grad: torch.Tensor) -> None:
        if param.grad is None:
            view.zero_()
            param.grad = view

    return hook


def _rebind_data(tensor: torch.Tensor, view: torch.Tensor) -> bool:
    if tensor.data_ptr() == view.data_ptr():
        return False
    with torch.no_grad():
        view.copy_(tensor.detach())
    tensor.data = view
    return True


def _rebind_grad(param: torch.Tensor, view: torch.Tensor) -> bool:
    grad: Any = param.grad
    if grad is not None and grad.data_ptr() == view.data_ptr():
        return False
    if grad is None:
        view.zero_()
    else:
        view.copy_(grad)
    param.grad = view
    return grad is not None


def _densify(grad: torch.Tensor | None, view: torch.Tensor) -> None:
    view.zero_()
    if grad is None:
        return
    if not grad.is_sparse:
        view.copy_(grad)
        return
    g = grad.coalesce()
    view.index_add_(0, g.indices()[0], g.values())


def _privatize(tensor: torch.Tensor) -> None:
    tensor.data = tensor.data.clone()
    if tensor.grad is not None:
        tensor.grad = tensor.grad.clone()
