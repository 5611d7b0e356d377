"""A checkpoint's optimizer state, judged against the optimizer a resuming shard built, before
anything is replaced. Pure: no I/O.

The rule is torch's ``optimizer.load_state_dict``: an optimizer's state comes with its
param groups' hyperparameters, so **the checkpoint wins**: the ``lr`` a run had reached
(set by an LR scheduler, a :class:`~tensorx.RemoteOptimizer`, or the command line it was
started with) is the ``lr`` it resumes with, whatever the optimizer factory (``tensorx ps
--optimizer``) gives now. What the factory gives differently from what the checkpoint's run
was started with is named in one line each (:func:`check` returns them; the shard logs them
once loaded), with how to use the new value instead. A key the factory's groups hold and the
checkpoint's do not (a newer torch's option) keeps the factory's value.

Refused, each in one :class:`~tensorx.errors.UsageError` line and before anything is
replaced: an optimizer of another class than the checkpoint's (SGD's momentum buffers are
no state for Adam), other param groups (as many, with as many parameters each), state that
does not fit (:func:`tensorx._ps.update.optim_check.check_state`: the keys and shapes the
optimizer keeps, finite values) and hyperparameters the optimizer's own constructor refuses
(:func:`tensorx._ps.update.optim_check.check_hyper`). Each names the way out: the optimizer the
checkpoint was written with, or the parameters alone with a fresh optimizer
(``resume_optimizer=False``, ``tensorx ps --no-resume-optimizer``).

An LR scheduler's state goes with the optimizer's, as torch's ``scheduler.load_state_dict``
after ``optimizer.load_state_dict``: the schedule resumes at the step it had reached, with
the checkpoint's settings (:func:`check_scheduler`). Another scheduler class than the
checkpoint's (or, in a checkpoint that did not record it, other settings in its state) is
refused like another optimizer. A schedule the checkpoint has and the server lacks (the lr
stays where it left it), one the server has and the checkpoint lacks (it starts at the
resume), and a setting the factory gives differently are each named in one line, as
torch would run them.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import torch

from tensorx._ps.update import optim_check
from tensorx._ps.wire import hyper
from tensorx._text import printable
from tensorx.errors import UsageError

__all__ = ["FRESH", "check", "check_scheduler", "given", "kind", "scheduler_given"]

FRESH = ("resume the parameters alone with a fresh optimizer (resume_optimizer=False; "
         "tensorx ps --no-resume-optimizer)")


def kind(optimizer: Any) -> str:
    """The optimizer's (or LR scheduler's) class, as a checkpoint records it."""
    return type(optimizer).__qualname__


def given(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """The groups' hyperparameters as the factory built them (taken before an LR scheduler
    or an update changes them), as a checkpoint records them."""
    return hyper.snapshot(optimizer.param_groups)


def scheduler_given(scheduler: Any) -> dict[str, Any]:
    """The scheduler's settings as the factory built it (counters and the lrs it derives
    from the optimizer left out), as a checkpoint records them."""
    return copy.deepcopy({k: v for k, v in scheduler.state_dict().items()
                          if not k.startswith("_") and k not in _COUNTERS})


def check_scheduler(scheduler: Any, saved: Any, saved_kind: str | None,
                    saved_given: Mapping[str, Any] | None,
                    now_given: Mapping[str, Any]) -> tuple[dict[str, Any] | None, list[str]]:
    """The checkpoint's scheduler ``state_dict`` to load into ``scheduler`` (None: nothing
    to load) and the lines to log; or UsageError. ``scheduler`` is None when the server has
    none; ``saved`` when the checkpoint's run had none; ``saved_kind`` and ``saved_given``
    when the checkpoint did not record them."""
    if saved is None:
        return None, [] if scheduler is None else [
            f"the checkpoint was written without an LR scheduler: this server's "
            f"{kind(scheduler)} starts its schedule here, at the resume (as a scheduler built "
            "after torch's optimizer.load_state_dict)"]
    if not isinstance(saved, dict):
        raise UsageError("the checkpoint's LR scheduler state is not a scheduler state_dict")
    was = printable(saved_kind, 60) if saved_kind is not None else "an LR scheduler"
    if scheduler is None:
        step = printable(repr(saved.get("last_epoch")), 20)
        return None, [
            f"the checkpoint's run had {was} (at step {step}) "
            "and this server has no lr_scheduler: the lr stays where that schedule left it. "
            "To continue the schedule, start the server with the same lr_scheduler (tensorx "
            "ps --lr-scheduler)"]
    if (saved_kind is not None and saved_kind != kind(scheduler)) \
            or _settings(saved) != _settings(scheduler.state_dict()):
        raise UsageError(
            f"the checkpoint's LR scheduler state is {was}'s (settings "
            f"{printable(', '.join(sorted(_settings(saved))), 80)}) and this server's "
            f"lr_scheduler is {kind(scheduler)}: one cannot resume the other's schedule. "
            f"Start with the lr_scheduler the checkpoint was written with, or {FRESH}")
    return saved, _rescheduled(saved_given, now_given)


def check(optimizer: torch.optim.Optimizer, label_of: Mapping[int, str],
          saved: Mapping[str, Any], saved_kind: str | None,
          saved_given: list[dict[str, Any]] | None,
          now_given: list[dict[str, Any]]) -> tuple[dict[str, Any], list[str]]:
    """The ``state_dict`` to load into ``optimizer`` (the checkpoint's, its groups over the
    factory's), and one line per hyperparameter the factory now gives differently; or
    UsageError. ``saved_kind`` and ``saved_given`` are what the checkpoint recorded
    (None: written before tensorx recorded them; its state is judged all the same)."""
    name = type(optimizer).__name__
    if saved_kind is not None and saved_kind != kind(optimizer):
        raise UsageError(
            f"the checkpoint's optimizer state is {printable(saved_kind, 60)}'s and this "
            f"server's optimizer is {name}: one cannot resume the other's state. Start with "
            f"the optimizer the checkpoint was written with, or {FRESH}")
    params = [p for g in optimizer.param_groups for p in g["params"]]
    saved_groups = _groups(optimizer, saved)
    hps = [{k: v for k, v in g.items() if k not in hyper.SKIP} for g in saved_groups]
    changes = [{k: v for k, v in hp.items() if k not in now or not hyper.same(now[k], v)}
               for hp, now in zip(hps, _values(optimizer), strict=True)]
    try:
        _check_hyper(optimizer, changes)
        optim_check.check_state(optimizer, label_of, hps, _by_label(saved, params, label_of))
    except UsageError as exc:
        raise UsageError(f"the checkpoint's optimizer state does not fit this server's "
                         f"{name}: {exc}. Start with the optimizer the checkpoint was written "
                         f"with, or {FRESH}") from exc
    groups = [{**now, **hp, "params": g["params"]}
              for now, hp, g in zip(_values(optimizer), hps, saved_groups, strict=True)]
    notes = _overridden(hps, saved_given, now_given)
    return {"state": saved["state"], "param_groups": groups}, notes


_COUNTERS = frozenset({"last_epoch", "base_lrs", "verbose"})


def _settings(state: Mapping[str, Any]) -> set[str]:
    """A scheduler state's settings (what its class keeps, whichever torch wrote it)."""
    return {k for k in state if isinstance(k, str) and not k.startswith("_")} - _COUNTERS


def _rescheduled(started: Mapping[str, Any] | None, now: Mapping[str, Any]) -> list[str]:
    """One line per scheduler setting the factory now gives differently from the one the
    checkpoint's run started with (and resumes with)."""
    if started is None:
        return []
    return [f"resuming with the checkpoint's LR scheduler setting {printable(key, 40)} = "
            f"{printable(repr(started[key]), hyper.SHOWN)}, not the "
            f"{printable(repr(value), hyper.SHOWN)} the lr_scheduler factory gives: a "
            "scheduler's state holds its settings, as with torch's load_state_dict. To "
            f"train with the new value, {FRESH}"
            for key, value in now.items() if key in started and not _same(started[key], value)]


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # values that do not compare (tensors of other shapes): not judged
        return True


def _values(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    return [{k: v for k, v in g.items() if k not in hyper.SKIP} for g in optimizer.param_groups]


def _groups(optimizer: torch.optim.Optimizer, saved: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The checkpoint's param groups, if they match the optimizer's in number and size."""
    groups = saved.get("param_groups")
    state = saved.get("state")
    if not isinstance(groups, list) or not isinstance(state, dict) \
            or not all(isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups):
        raise UsageError("the checkpoint's optimizer state is not an optimizer state_dict")
    sizes = [len(g["params"]) for g in groups]
    want = [len(g["params"]) for g in optimizer.param_groups]
    if sizes != want:
        raise UsageError(
            f"the checkpoint's optimizer has param groups of {sizes} parameters, this "
            f"server's {type(optimizer).__name__} {want}: build the groups the checkpoint was "
            f"written with, or {FRESH}")
    return groups


def _check_hyper(optimizer: torch.optim.Optimizer, changes: list[dict[str, Any]]) -> None:
    """The checkpoint's values where they differ from the factory's: of a kind the group
    holds, finite, and accepted by the optimizer's own constructor."""
    for i, (change, now) in enumerate(zip(changes, _values(optimizer), strict=True)):
        for key, value in change.items():
            why = hyper.refusal(now.get(key, hyper.MISSING), value)
            if why:
                raise UsageError(f"{hyper.shown(i, key, value)} refused: {why}")
    optim_check.check_hyper(optimizer, changes)


def _by_label(saved: Mapping[str, Any], params: list[torch.Tensor],
              label_of: Mapping[int, str]) -> dict[str, Any]:
    """The checkpoint's per-parameter state (by position over the groups, as torch numbers
    it) by label."""
    out: dict[str, Any] = {}
    for index, entry in saved["state"].items():
        if not isinstance(index, int) or not 0 <= index < len(params):
            raise UsageError(f"state for parameter {printable(repr(index), 60)}, which this "
                             "shard's optimizer does not hold")
        if not isinstance(entry, dict):
            raise UsageError(f"state for parameter {index} is not a dict")
        out[label_of[id(params[index])]] = entry
    return out


def _overridden(hps: list[dict[str, Any]], started: list[dict[str, Any]] | None,
                now_given: list[dict[str, Any]]) -> list[str]:
    """One line per hyperparameter the factory now gives differently from the value the
    shard resumes with, saying that the checkpoint's is used and how to use the new one;
    not when the factory gives what the checkpoint's run was started with (``started``):
    then the run itself changed it (an LR schedule, a RemoteOptimizer), and keeps it."""
    notes = []
    for i, (hp, now) in enumerate(zip(hps, now_given, strict=False)):
        was = started[i] if started is not None and i < len(started) else {}
        for key, value in now.items():
            if key not in hp or hyper.same(hp[key], value) \
                    or (key in was and hyper.same(was[key], value)):
                continue
            notes.append(
                f"resuming with the checkpoint's {hyper.shown(i, key, hp[key])}, not the "
                f"{printable(repr(value), hyper.SHOWN)} the optimizer factory (tensorx ps "
                "--optimizer) gives: an optimizer state holds its hyperparameters, as with "
                "torch's load_state_dict. To train with the new value, set it in a "
                f"RemoteOptimizer's param_groups after resuming, or {FRESH}")
    return notes
