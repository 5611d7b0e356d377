"""What a shard's optimizer sees: the model's parameters, named, shaped, in model order.

Each parameter of the model that the plan put on this shard is one ``torch.nn.Parameter``
named as in ``model.named_parameters()``, shaped as in the model, and a view of the shard's
parameter arena; its ``.grad`` is a view of the averaged gradient. The list is in model
order. A tensor the plan split across shards is, on each of them, the slice of whole rows
(``t[a:b]``) that shard holds, under the tensor's own name and with its number of
dimensions, so rules by name or by ``dim()`` group it as the model's tensor.

The factory is called with the parameters (``factory(params)``), or, when it has a
parameter called ``named_params``, with ``(name, parameter)`` pairs as
``model.named_parameters()`` gives them (``factory(named_params=...)``). The optimizer it
returns must optimize exactly these parameters: one built over other tensors (say, the
worker's model) would train nothing, so it is refused at once. Pure: no I/O.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from tensorx.errors import UsageError

if TYPE_CHECKING:
    from tensorx._analyzer.plan import TransferPlan

__all__ = ["ParamSpec", "build_optimizer", "param_specs", "plan_params", "step_failure"]

NAMED = "named_params"


@dataclass(frozen=True)
class ParamSpec:
    """One optimizer parameter: a model tensor's part on this shard, where it lives."""

    name: str
    offset: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    start: int = 0  # first element of the model's tensor this part holds
    whole: bool = True
    shard: int = 0
    chunk: int = 0  # the plan's first chunk of it
    sparse: bool = False  # a table whose gradient arrives as rows (see tensorx._ps.rows.tables)

    @property
    def label(self) -> str:
        """Unique over all shards: the name, and for part of a split tensor its first
        chunk's plan label (``name[k]``)."""
        return self.name if self.whole else f"{self.name}[{self.chunk}]"

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


def param_specs(entries: Sequence[Any], to_dtype: Callable[[Any], torch.dtype],
                rows: bool = False) -> tuple[ParamSpec, ...]:
    """One spec per tensor among a shard's plan ``entries`` (its chunks on this shard are
    adjacent in the arena), in model order; with ``rows`` (the plan's sparse gradients take
    the dynamic path), its dynamic entries are sparse."""
    runs: dict[str, list[Any]] = {}
    for e in sorted(entries, key=lambda e: e.offset):
        runs.setdefault(e.name, []).append(e)
    ordered = sorted(runs.values(), key=lambda run: (getattr(run[0], "index", -1), run[0].name))
    return tuple(_spec(run, to_dtype, rows) for run in ordered)


def _spec(run: list[Any], to_dtype: Callable[[Any], torch.dtype], rows: bool) -> ParamSpec:
    first, shape = run[0], tuple(run[0].shape)
    numel = sum(e.numel for e in run)
    whole = first.start == 0 and numel == _numel(shape)
    row = _numel(shape[1:]) if len(shape) > 1 else 1
    if not whole:
        shape = (numel // row, *shape[1:]) if row and numel % row == 0 else (numel,)
    return ParamSpec(first.name, first.offset, shape, to_dtype(first.dtype), first.start, whole,
                     first.shard, first.chunk,
                     rows and whole and getattr(first, "kind", "") == "dynamic")


def plan_params(plan: TransferPlan) -> list[ParamSpec]:
    """What every shard's optimizer sees, shard after shard (as a worker can work it out)."""
    return [spec for shard in range(plan.num_shards)
            for spec in param_specs(plan.shard_entries(shard), _dtype)]


def _dtype(name: Any) -> torch.dtype:
    found = getattr(torch, str(name).removeprefix("torch."))
    assert isinstance(found, torch.dtype)
    return found


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def build_optimizer(factory: Callable[..., Any],
                    named: list[tuple[str, torch.nn.Parameter]]) -> torch.optim.Optimizer:
    """Call ``factory`` in the form it asks for; refuse an optimizer that does not optimize
    exactly the shard's parameters."""
    if _wants_names(factory):
        optimizer = factory(**{NAMED: list(named)})
    else:
        optimizer = factory([p for _, p in named])
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise UsageError(f"the optimizer factory returned {type(optimizer).__name__}, "
                         "not a torch.optim.Optimizer")
    check_params(optimizer, named)
    return optimizer


def _wants_names(factory: Callable[..., Any]) -> bool:
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):  # some builtins and extension types have none
        return False
    found = params.get(NAMED)
    return found is not None and found.kind is not inspect.Parameter.POSITIONAL_ONLY


def check_params(optimizer: torch.optim.Optimizer,
                 named: list[tuple[str, torch.nn.Parameter]]) -> None:
    ours = {id(p): name for name, p in named}
    seen: set[int] = set()
    foreign = 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) in seen:
                raise UsageError(f"the optimizer lists parameter {ours.get(id(p), '?')!r} twice")
            seen.add(id(p))
            foreign += id(p) not in ours
    missing = [name for i, name in ours.items() if i not in seen]
    if not foreign and not missing:
        return
    what = []
    if foreign:
        what.append(f"optimizes {foreign} tensor(s) that are not this shard's parameters")
    if missing:
        shown = ", ".join(repr(n) for n in missing[:5]) + (", ..." if len(missing) > 5 else "")
        what.append(f"leaves out {len(missing)} of them ({shown})")
    raise UsageError(
        f"the server's optimizer {' and '.join(what)}: it would not train the model. Build it "
        "over the tensors the factory is given: optimizer=lambda params: "
        "torch.optim.AdamW(params, ...), or, for rules by name or shape (weight decay, "
        "per-layer LR), optimizer=lambda named_params: torch.optim.AdamW([...groups built "
        "from named_params...], ...), where named_params is [(name, parameter), ...] as "
        "model.named_parameters() gives them")


def step_failure(optimizer: object, named: list[tuple[str, torch.nn.Parameter]],
                 exc: Exception) -> str:
    """Why a step of ``optimizer`` over ``named`` failed, naming the tensors whose kind of
    gradient (sparse or dense) torch's message refuses, else every tensor that had one."""
    text = str(exc).lower()
    refused = [k for k in ("sparse", "dense") if f" {k} grad" in text]
    stepped = [(n, p.grad.is_sparse) for n, p in named if p.grad is not None]
    kind = refused[0] if len(refused) == 1 else None
    names = [n for n, sparse in stepped if kind is None or sparse == (kind == "sparse")]
    shown = ", ".join(repr(n) for n in names[:4]) + (", ..." if len(names) > 4 else "")
    what = f"the {kind} gradient of " if kind else ""
    return (f"the server's optimizer ({type(optimizer).__name__}) failed on {what}{shown}: "
            f"{type(exc).__name__}: {exc}")
