"""Optimizer hyperparameters between workers and shards: what travels, and the rule.

A worker's :class:`tensorx.RemoteOptimizer` mirrors the shards' ``param_groups``. The
hyperparameters of each group (every key but ``params``/``param_names`` whose value is a
scalar: ``None``, bool, int, float, str, or a short tuple of numbers such as Adam's
``betas``) travel as plain msgpack values, never pickled:

* at handshake (welcome ``optim``), the shard's groups as they are;
* on each push (``hyper``), the keys the worker changed since the shard last told it
  their values: one dict per group, ``[]`` when nothing changed;
* on each answer (params ``hyper``), the shard's values after the update, when they differ
  from what it last told that worker (``[]`` otherwise).

The rule: a change made on any rank before its ``step()`` is applied by every shard before
that step's update. When several ranks' pushes in one update (a sync barrier) change the
same key to different values, the lowest rank wins (logged as a WARNING); every worker's
``param_groups`` show the winning values once its step returns.

What a value may be (:func:`refusal`; the worker checks it before sending, the shard again
on arrival, then against the optimizer's own constructor, see
:mod:`tensorx._ps.update.optim_check`): the kind of value the group holds (a number where
it has a number, a tuple of as many numbers, None only where it has None or a flag), and a
finite number. Pure: no I/O.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from tensorx._text import printable
from tensorx.errors import ProtocolError, UsageError

__all__ = ["MAX_KEYS", "Pending", "changes", "check", "encodable", "heard", "refusal", "same",
           "shown", "snapshot"]

logger = logging.getLogger(__name__)

MAX_KEYS = 64       # hyperparameters per group a peer may set
MAX_KEY_LEN = 128
MAX_TUPLE = 8
SKIP = frozenset({"params", "param_names"})
SHOWN = 60  # characters of a value (or key) quoted in an error
MISSING = object()  # a key the group does not have (yet)


def _scalar(value: Any) -> bool:
    if isinstance(value, int) and not isinstance(value, bool):
        return -(2**63) <= value < 2**63
    return value is None or isinstance(value, bool | float | str)


def encodable(value: Any) -> bool:
    """Can this hyperparameter value travel (a scalar or a short tuple of numbers)?"""
    if isinstance(value, tuple | list):
        return len(value) <= MAX_TUPLE and all(
            isinstance(v, int | float) and not isinstance(v, bool) and _scalar(v)
            for v in value)
    return _scalar(value) and not (isinstance(value, str) and len(value) > MAX_KEY_LEN)


def normal(value: Any) -> Any:
    """msgpack gives lists back: a sequence hyperparameter is a tuple, as torch has it."""
    return tuple(value) if isinstance(value, list) else value


def snapshot(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The travelling hyperparameters of each group (others stay where they are)."""
    return [{k: normal(v) for k, v in g.items() if k not in SKIP and encodable(v)}
            for g in groups]


def same(a: Any, b: Any) -> bool:
    """One hyperparameter value as another (NaN as NaN; a bool only as a bool)."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, int | float) and isinstance(b, int | float):
        return a == b or (math.isnan(a) and math.isnan(b))
    return type(a) is type(b) and bool(a == b)


def changes(groups: list[dict[str, Any]], known: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Worker side: per group, the keys whose value differs from what the shards last said
    (``[]`` when nothing changed). UsageError for what cannot travel."""
    if len(groups) != len(known):
        raise UsageError(f"param_groups has {len(groups)} groups; the server's optimizer has "
                         f"{len(known)} (add_param_group and removing groups are not "
                         "supported by RemoteOptimizer)")
    out: list[dict[str, Any]] = []
    for i, (group, was) in enumerate(zip(groups, known, strict=True)):
        gone = [k for k in was if k not in group]
        if gone:
            raise UsageError(f"param_groups[{i}] lost key(s) {gone}: hyperparameters cannot "
                             "be removed from a RemoteOptimizer group")
        diff = {k: v for k, v in group.items()
                if k not in SKIP and (k not in was or not same(normal(v), was[k]))}
        bad = [k for k, v in diff.items() if not encodable(v) or not isinstance(k, str)]
        if bad:
            raise UsageError(f"{shown(i, bad[0], diff[bad[0]])} cannot be "
                             "sent to the server (RemoteOptimizer hyperparameters are None, "
                             "bool, int, float, str or a short tuple of numbers)")
        for k, v in diff.items():
            why = refusal(was.get(k, MISSING), normal(v))
            if why:
                raise UsageError(f"{shown(i, k, v)} cannot be used: {why}")
        out.append({k: normal(v) for k, v in diff.items()})
    return out if any(out) else []


def heard(shard: int, known: list[dict[str, Any]], values: Any) -> list[dict[str, Any]]:
    """Worker side: the values ``shard`` reports for its groups (an answer's or a load's
    ``hyper``), for the ``known`` groups; ProtocolError when they do not match."""
    if not isinstance(values, list) or len(values) != len(known) or \
            not all(isinstance(g, dict) for g in values):
        raise ProtocolError(f"shard {shard} sent hyperparameters for {len(values)} groups; "
                            f"its optimizer has {len(known)}")
    return snapshot(values)


def check(sent: Any, current: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Shard side: a peer's ``hyper`` field, validated against this shard's groups;
    ProtocolError for a malformed field, UsageError naming the key and the value for a
    value the group cannot take (:func:`refusal`)."""
    if not isinstance(sent, list):
        raise ProtocolError("push message: hyper is not a list")
    if not sent:
        return []
    if len(sent) != len(current):
        raise ProtocolError(f"push message: hyper has {len(sent)} groups, this shard's "
                            f"optimizer {len(current)}")
    for i, group in enumerate(sent):
        if not isinstance(group, dict) or len(group) > MAX_KEYS:
            raise ProtocolError(f"push message: hyper[{i}] is not a map of at most "
                                f"{MAX_KEYS} keys")
        for key, value in group.items():
            if not isinstance(key, str) or len(key) > MAX_KEY_LEN or key in SKIP \
                    or not encodable(value):
                raise ProtocolError(f"push message: hyper[{i}] has a bad key or value")
    for i, (group, now) in enumerate(zip(sent, current, strict=True)):
        for key, value in group.items():
            why = refusal(now.get(key, MISSING), normal(value))
            if why:
                raise UsageError(f"{shown(i, key, value)} refused: {why}")
    return [{k: normal(v) for k, v in g.items()} for g in sent]


def shown(group: int, key: Any, value: Any) -> str:
    """``param_groups[i]['key'] = value``, escaped and cut for an error message or a log."""
    return (f"param_groups[{group}][{printable(repr(key), SHOWN)}] = "
            f"{printable(repr(value), SHOWN)}")


def refusal(old: Any, new: Any) -> str | None:
    """Why ``new`` cannot replace ``old`` (:data:`MISSING`: a new key), or None. An
    unchanged value always may stay."""
    if old is not MISSING and same(old, new):
        return None
    if not _finite(new):
        return "not a finite number"
    if old is MISSING or _compatible(old, new):
        return None
    if new is None:
        return f"None where the optimizer has {printable(repr(old), SHOWN)}"
    return (f"{type(new).__name__} where the optimizer has {type(old).__name__} "
            f"({printable(repr(old), SHOWN)})")


def _finite(value: Any) -> bool:
    if isinstance(value, tuple | list):
        return all(_finite(v) for v in value)
    return not isinstance(value, float) or math.isfinite(value)


def _compatible(old: Any, new: Any) -> bool:
    """A new value the optimizer can use where the old one was. None only where None or
    a flag was (``foreach``, ``fused``: None is their default): an optimizer that
    computes with ``lr`` fails on None."""
    if old is None:
        return True
    if new is None:
        return isinstance(old, bool)
    if isinstance(old, bool) or isinstance(new, bool):
        return isinstance(old, bool) and isinstance(new, bool)
    if isinstance(old, int | float):
        return isinstance(new, int | float)
    if isinstance(old, tuple):
        return isinstance(new, tuple) and len(new) == len(old)
    return type(old) is type(new)


class Pending:
    """Shard side: the hyperparameter changes pushed for the update in progress, by rank."""

    def __init__(self, shard: int) -> None:
        self.shard = shard
        self._by_rank: dict[int, list[dict[str, Any]]] = {}

    def pushed(self, rank: int, changes: list[dict[str, Any]]) -> None:
        if changes:
            self._by_rank[rank] = changes
        else:
            self._by_rank.pop(rank, None)

    def drop(self, rank: int) -> None:
        """``rank`` left: what it pushed for the update in progress is dropped with its
        gradient."""
        self._by_rank.pop(rank, None)

    def apply(self, ranks: list[int], groups: list[dict[str, Any]]) -> None:
        """Set the changes of ``ranks`` (this update's pushes) in ``groups`` (the optimizer's
        ``param_groups``): the lowest rank's value wins a conflict."""
        winners: dict[tuple[int, str], tuple[int, Any]] = {}
        for rank in sorted(ranks):
            for i, group in enumerate(self._by_rank.pop(rank, [])):
                for key, value in group.items():
                    won = winners.setdefault((i, key), (rank, value))
                    if won[0] != rank and not same(won[1], value):
                        logger.warning("ps shard %d: ranks %d and %d set param_groups[%d][%r] "
                                       "to %r and %r in the same update; rank %d wins",
                                       self.shard, won[0], rank, i, key, won[1], value,
                                       won[0])
        for (i, key), (_, value) in winners.items():
            groups[i][key] = value
