"""What a peer may put into a shard's optimizer, judged by the optimizer's own rules before
anything is replaced. Pure: no I/O.

One rank's values reach every rank's training: a NaN learning rate, or an ``exp_avg_sq``
below zero, makes every parameter NaN for everyone, for good; a state tensor of the wrong
size fails (or crashes) every later update. So:

* **Hyperparameters** (a push's changes, a loaded state's groups), past
  :func:`tensorx._ps.wire.hyper.refusal` (kind of value, finite): a throwaway optimizer of the
  same class is built with the group's values, the change applied, over a one-element
  stand-in of the group's dtype and device, so the constructor's own checks judge them
  (torch's ``Invalid learning rate``, ``Invalid beta parameter``, ``nesterov`` without
  momentum, ...; a custom optimizer's too). A change is refused only when the constructor
  accepts the group's current values; a class that cannot be built from its group alone (a
  constructor argument its groups do not hold) is judged by the value rules only.
* **State**: each entry against its parameter and against what the optimizer keeps for
  one like it: a throwaway optimizer (same class, the group's new values) stepped once with
  a zero gradient over a small stand-in with the parameter's number of dimensions (sizes
  2, 3, 4, ...; a dense gradient, or, when that fails or keeps nothing, one sparse over
  rows, as a table's arrives), whose state gives the keys to expect and each tensor's shape as a
  function of the parameter's (``exp_avg``: the parameter's shape; ``step``: a scalar;
  Adafactor's ``row_var``: the parameter's with its last dimension 1; a tensor of the
  parameter's shape may come flat, as RemoteOptimizer sends a split tensor's chunk) and
  kind of dtype
  (floating state may be any float dtype: torch casts it to the parameter's). Every
  number and floating tensor must be finite; for torch's own optimizers, ``step`` is a
  whole number >= 0 and second moments (``exp_avg_sq``, ``max_exp_avg_sq``, RMSprop's and
  Adadelta's ``square_avg``, ``acc_delta``, Adagrad's ``sum``, Adamax's ``exp_inf``,
  Adafactor's variances, Rprop's ``step_size``) are >= 0. An optimizer that cannot be
  stepped that way (LBFGS needs a closure) gets these value checks and the shape rule "a
  scalar or the parameter's shape".

Each refusal is a :class:`~tensorx.errors.UsageError` naming the group and key, or the
entry and key, with the value escaped and cut.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from tensorx._ps.wire import hyper
from tensorx._text import printable
from tensorx.errors import UsageError

__all__ = ["check_hyper", "check_state"]

NONNEGATIVE = frozenset({"exp_avg_sq", "max_exp_avg_sq", "square_avg", "acc_delta", "sum",
                         "exp_inf", "row_var", "col_var", "variance", "step_size"})
COUNTERS = frozenset({"step"})
SHOWN = 60


@dataclass(frozen=True)
class Kept:
    """A state tensor as the optimizer keeps it: each dimension an index into the
    parameter's shape (that dimension of it) or a fixed size (a 1-tuple), and its dtype."""

    pattern: tuple[int | tuple[int], ...]
    dtype: torch.dtype


class _Unbuildable(Exception):
    """The class needs constructor arguments that its groups do not hold."""


# -- hyperparameters ------------------------------------------------------------------------
def check_hyper(optimizer: torch.optim.Optimizer, changes: list[dict[str, Any]]) -> None:
    """Refuse ``changes`` (per group, past :func:`tensorx._ps.wire.hyper.check`) that the
    optimizer's constructor refuses where it accepts the group's current values."""
    for i, change in enumerate(changes):
        if not change:
            continue
        group = optimizer.param_groups[i]
        why = _constructor_refusal(type(optimizer), _values(group), change, _like(optimizer, i))
        if why:
            shown = ", ".join(hyper.shown(i, k, v) for k, v in change.items())
            raise UsageError(f"{shown} refused by the server's optimizer "
                             f"({type(optimizer).__name__}): {printable(why)}")


def _values(group: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k not in hyper.SKIP}


def _like(optimizer: torch.optim.Optimizer, i: int) -> torch.Tensor:
    """A tensor of the dtype and device of group ``i``'s parameters (any group's when it
    has none)."""
    for group in (optimizer.param_groups[i], *optimizer.param_groups):
        if group["params"]:
            p: torch.Tensor = group["params"][0]
            return p
    return torch.zeros(())


def _constructor_refusal(cls: type[torch.optim.Optimizer], current: dict[str, Any],
                         change: dict[str, Any], like: torch.Tensor) -> str | None:
    try:
        _build(cls, {**current, **change}, _stand_in(like))
        return None
    except _Unbuildable:
        return None
    except Exception as exc:
        try:
            _build(cls, current, _stand_in(like))
        except Exception:
            return None  # its own values do not pass either: nothing to judge by
        return f"{type(exc).__name__}: {exc}"


def _stand_in(like: torch.Tensor) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.zeros(1, dtype=like.dtype, device=like.device))


def _build(cls: type[torch.optim.Optimizer], values: dict[str, Any],
           stand_in: torch.Tensor) -> torch.optim.Optimizer:
    """An optimizer of ``cls`` over ``stand_in``, built with ``values``: as constructor
    arguments where it takes them (its checks run on them), the rest set in its group."""
    takes = _arguments(cls)
    if takes is None or not takes[1] <= values.keys():
        raise _Unbuildable
    named = takes[0]
    built = cls([stand_in], **{k: v for k, v in values.items() if k in named})
    built.param_groups[0].update({k: v for k, v in values.items() if k not in named})
    return built


Arguments = tuple[frozenset[str], frozenset[str]] | None
_ARGUMENTS: dict[type[torch.optim.Optimizer], Arguments] = {}  # a few classes per process


def _arguments(cls: type[torch.optim.Optimizer]) -> Arguments:
    """The keyword arguments ``cls`` takes after the parameters, and those it requires;
    None when its signature cannot be read. (Cached: reading it costs more than the
    construction.)"""
    if cls not in _ARGUMENTS:
        if len(_ARGUMENTS) >= 64:
            _ARGUMENTS.clear()
        try:
            takes = list(inspect.signature(cls).parameters.values())[1:]  # after the params
        except (TypeError, ValueError):
            _ARGUMENTS[cls] = None
            return None
        named = [p for p in takes if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        _ARGUMENTS[cls] = (frozenset(p.name for p in named),
                           frozenset(p.name for p in named if p.default is p.empty))
    return _ARGUMENTS[cls]


# -- state ----------------------------------------------------------------------------------
def check_state(optimizer: torch.optim.Optimizer, label_of: Mapping[int, str],
                hps: list[dict[str, Any]], state: Mapping[str, Mapping[str, Any]]) -> None:
    """Refuse a per-label ``state`` that, with the groups' new values ``hps`` (already
    checked), the optimizer could not step with, or that breaks its invariants."""
    where = {label_of[id(p)]: (i, p) for i, g in enumerate(optimizer.param_groups)
             for p in g["params"]}
    builtin = _from_torch(optimizer)
    templates: dict[tuple[Any, ...], dict[str, Any] | None] = {}
    for label, entry in state.items():
        if not entry:
            continue
        if label not in where:
            raise UsageError(f"optimizer state for {printable(repr(label), SHOWN)}, which "
                             "this shard's optimizer does not hold")
        i, p = where[label]
        key = (i, p.dim(), p.dtype, p.device)
        if key not in templates:
            templates[key] = _template(optimizer, {**_values(optimizer.param_groups[i]),
                                                   **(hps[i] if i < len(hps) else {})}, p)
        _check_entry(type(optimizer).__name__, label, entry, p, templates[key], builtin)


def _from_torch(optimizer: torch.optim.Optimizer) -> bool:
    """One of torch's optimizers (or a subclass): its state keys mean what torch's do."""
    return any((c.__module__ + ".").startswith("torch.optim.")
               and c is not torch.optim.Optimizer for c in type(optimizer).__mro__)


def _template(optimizer: torch.optim.Optimizer, values: dict[str, Any],
              p: torch.Tensor) -> dict[str, Any] | None:
    """What ``optimizer``'s class keeps for a tensor like ``p``, by key: :class:`Kept`
    for a tensor, else the value; None when a throwaway one cannot be built and stepped."""
    sizes = tuple(range(2, 2 + p.dim()))
    grads = [torch.zeros(sizes, dtype=p.dtype, device=p.device)]
    if p.dim():  # a table's: sparse over rows, as the shard gives it (SparseAdam takes
        # nothing else); one row, so that a step over the rows it names has one to step
        index = torch.zeros((1, 1), dtype=torch.long, device=p.device)
        grads.append(torch.sparse_coo_tensor(index, grads[0][:1], sizes, check_invariants=True))
    found: dict[str, Any] | None = None
    for grad in grads:
        stand_in = torch.nn.Parameter(torch.zeros(sizes, dtype=p.dtype, device=p.device))
        try:
            built = _build(type(optimizer), values, stand_in)
            stand_in.grad = grad
            with torch.no_grad():
                built.step()
        except Exception:
            continue
        found = {k: _pattern(v, sizes) for k, v in built.state.get(stand_in, {}).items()}
        if found:  # none kept: a table's optimizer may keep state for sparse steps alone
            return found
    return found


def _pattern(value: Any, sizes: tuple[int, ...]) -> Any:
    if not isinstance(value, torch.Tensor):
        return value
    return Kept(tuple(sizes.index(d) if d in sizes else (d,) for d in value.shape),
                value.dtype)


def _check_entry(kind: str, label: str, entry: Mapping[str, Any], p: torch.Tensor,
                 template: dict[str, Any] | None, builtin: bool) -> None:
    def refuse(key: str, why: str) -> UsageError:
        return UsageError(f"optimizer state of {label!r}[{printable(repr(key), SHOWN)}] "
                          f"refused: {why}; nothing was loaded")

    if template is not None:
        missing = sorted(set(template) - set(entry))
        if missing:
            raise refuse(missing[0], f"missing ({kind} keeps {sorted(template)} for it)")
        extra = sorted(set(entry) - set(template))
        if extra:
            raise refuse(extra[0], f"not a key {kind} keeps ({sorted(template)})")
    for key, value in entry.items():
        why = _shape_refusal(value, p, None if template is None else template[key], kind)
        why = why or _value_refusal(key, value, builtin)
        if why:
            raise refuse(key, why)


def _shape_refusal(value: Any, p: torch.Tensor, kept: Any, kind: str) -> str | None:
    if not isinstance(kept, Kept):  # no template, or a value kept
        if isinstance(value, torch.Tensor) and value.dim() and value.numel() != p.numel():
            return (f"a tensor of shape {list(value.shape)} for a parameter of shape "
                    f"{list(p.shape)}")
        return None
    dtype = kept.dtype
    want = [p.shape[d] if isinstance(d, int) else d[0] for d in kept.pattern]
    if not isinstance(value, torch.Tensor):
        if not want and _number(value):
            return None  # a scalar kept as a number (an old checkpoint's step)
        return f"a {type(value).__name__} where {kind} keeps a tensor of shape {want}"
    if list(value.shape) != want and not (want == list(p.shape) and value.dim() == 1
                                          and value.numel() == p.numel()):
        return f"shape {list(value.shape)}, {kind} keeps {want} for this parameter"
    if not _same_kind(value.dtype, dtype, scalar=not want):
        return f"dtype {value.dtype}, {kind} keeps {dtype}"
    return None


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _same_kind(got: torch.dtype, want: torch.dtype, scalar: bool) -> bool:
    """Floating state may be any float dtype (torch casts it to the parameter's); a scalar
    any real one."""
    if got == want:
        return True
    if scalar and got != torch.bool and not got.is_complex and not want.is_complex:
        return True
    return got.is_floating_point and want.is_floating_point


def _value_refusal(key: str, value: Any, builtin: bool) -> str | None:
    if isinstance(value, torch.Tensor):
        if value.dtype == torch.bool:
            return None
        t = value.detach()
        if (t.is_floating_point() or t.is_complex()) and not bool(torch.isfinite(t).all()):
            return "not finite (NaN or Inf)"
        if builtin and key in COUNTERS and t.numel() == 1:
            return _count_refusal(float(t.reshape(()).item()))
        if builtin and key in NONNEGATIVE and not t.is_complex() and bool((t < 0).any()):
            return "has elements below zero"
        return None
    if isinstance(value, float) and not math.isfinite(value):
        return "not finite (NaN or Inf)"
    if builtin and _number(value):
        if key in COUNTERS:
            return _count_refusal(float(value))
        if key in NONNEGATIVE and value < 0:
            return "below zero"
    return None


def _count_refusal(step: float) -> str | None:
    if step < 0 or step != math.floor(step):
        return f"{step!r} is not a whole number >= 0"
    return None
