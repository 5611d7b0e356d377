"""Decoding, checking, comparing and printing plans (no torch, no I/O)."""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import fields
from typing import Any, TypeVar

import msgpack

from tensorx._analyzer.layout import (
    HEADER_BYTES,
    ITEMSIZE,
    KINDS,
    PLAN_VERSION,
    ROLES,
    DynamicEntry,
    Layout,
    PlanEntry,
    PlanOptions,
    numel_of,
)
from tensorx.errors import ProtocolError, UsageError

MAX_ARENA_BYTES = 1 << 48  # bounds what a forged plan could make a receiver allocate

__all__ = ["decode_plan", "describe_plan", "first_difference", "layout_problems",
           "summarize_plan"]

L = TypeVar("L", bound=Layout)


# -- decoding ------------------------------------------------------------------------------
def decode_plan(cls: type[L], data: bytes) -> L:
    try:
        fields_ = msgpack.unpackb(data, raw=False, strict_map_key=False, use_list=True)
    except Exception as exc:
        raise ProtocolError(f"not a transfer plan: {exc}") from exc
    if not isinstance(fields_, list) or len(fields_) != 5:
        raise ProtocolError("not a transfer plan: wrong shape")
    version, opts, entries, dynamic, fingerprint = fields_
    if version != PLAN_VERSION:
        older = isinstance(version, int) and version < PLAN_VERSION
        raise ProtocolError(
            f"plan version {version!r}; this tensorx reads {PLAN_VERSION}"
            + (" (the plan was made by an older tensorx, which shards and chunks tensors "
               "differently: plan with one tensorx version everywhere; a checkpoint that "
               "holds such a plan can only be resumed by the tensorx that wrote it)"
               if older else ""))
    plan = cls([_entry(r) for r in _rows(entries)], _options(opts),
               [_dynamic(r) for r in _rows(dynamic)])
    if plan.fingerprint != fingerprint:
        raise ProtocolError(f"plan fingerprint {fingerprint!r} does not match its contents")
    problems = layout_problems(plan)
    if problems:
        raise ProtocolError(f"unsound plan: {problems[0]}")
    return plan


def _rows(value: object) -> list[list[Any]]:
    if not isinstance(value, list) or not all(isinstance(r, list) for r in value):
        raise ProtocolError("not a transfer plan: rows must be lists")
    return value


def _options(value: object) -> PlanOptions:
    names = [f.name for f in fields(PlanOptions)]
    if not isinstance(value, list) or [p[0] if isinstance(p, list) else None
                                       for p in value] != names:
        raise ProtocolError("not a transfer plan: bad options")
    try:
        opts = PlanOptions(**{p[0]: p[1] for p in value})
        opts.validate()
    except (TypeError, UsageError) as exc:
        raise ProtocolError(f"bad plan options: {exc}") from exc
    return opts


_ENTRY_TYPES = (str, int, int, int, list, str, int, str, int, str, int, str, int)
_DYNAMIC_TYPES = (str, int, int, int, list, str, int, int, bool)


def _typed(row: list[Any], types: tuple[type, ...], what: str) -> list[Any]:
    ok = len(row) == len(types) and all(
        isinstance(v, t) and (t is bool or not isinstance(v, bool))
        for v, t in zip(row, types, strict=True)
    )
    if not ok:
        raise ProtocolError(f"malformed {what}: {row!r}")
    return row


def _shape(value: list[Any], what: str) -> tuple[int, ...]:
    if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in value):
        raise ProtocolError(f"malformed shape in {what}: {value!r}")
    return tuple(value)


def _entry(row: list[Any]) -> PlanEntry:
    row = _typed(row, _ENTRY_TYPES, "plan entry")
    row[4] = _shape(row[4], "plan entry")
    entry = PlanEntry(*row)
    if entry.dtype not in ITEMSIZE or entry.kind not in KINDS or entry.role not in ROLES:
        raise ProtocolError(f"malformed plan entry: {entry!r}")
    return entry


def _dynamic(row: list[Any]) -> DynamicEntry:
    row = _typed(row, _DYNAMIC_TYPES, "dynamic entry")
    row[4] = _shape(row[4], "dynamic entry")
    entry = DynamicEntry(*row)
    if entry.dtype not in ITEMSIZE:
        raise ProtocolError(f"malformed dynamic entry: {entry!r}")
    return entry


# -- invariants ----------------------------------------------------------------------------
def layout_problems(plan: Layout) -> list[str]:
    """Each broken invariant, in words: alignment, overlap, bounds, coverage."""
    out: list[str] = []
    for e in plan.entries:
        out += _entry_problems(plan, e)
    by_shard: dict[int, list[PlanEntry]] = {}
    for e in plan.entries:
        by_shard.setdefault(e.shard, []).append(e)
    for entries in by_shard.values():
        out += _overlaps(sorted(entries, key=lambda e: e.offset))
    for name, chunks in plan.tensors().items():
        out += _coverage(name, chunks)
    out += _dynamic_problems(plan)
    return out


def _entry_problems(plan: Layout, e: PlanEntry) -> list[str]:
    out = []
    if not 0 <= e.shard < plan.num_shards:
        out.append(f"{e.label}: shard {e.shard} out of range")
    if e.offset + e.nbytes > MAX_ARENA_BYTES:
        out.append(f"{e.label}: ends past {MAX_ARENA_BYTES} B, more than any arena may hold")
    if e.offset < 0 or e.offset % plan.alignment:
        out.append(f"{e.label}: offset {e.offset} not aligned to {plan.alignment}")
    if e.nbytes != e.numel * ITEMSIZE[e.dtype] or e.numel < 0:
        out.append(f"{e.label}: nbytes {e.nbytes} != numel {e.numel} x {e.dtype}")
    if e.arena != "params":
        out.append(f"{e.label}: arena {e.arena!r} is not 'params'")
    return out


def _overlaps(entries: list[PlanEntry]) -> list[str]:
    live = [e for e in entries if e.nbytes]
    return [f"{b.label} overlaps {a.label} in shard {a.shard}"
            for a, b in itertools.pairwise(live) if b.offset < a.end]


def _coverage(name: str, chunks: list[PlanEntry]) -> list[str]:
    first = chunks[0]
    pos = 0
    for i, c in enumerate(chunks):
        same = (c.shape, c.dtype, c.kind, c.role) == (first.shape, first.dtype, first.kind,
                                                      first.role)
        if c.chunk != i or c.start != pos or not same:
            return [f"{name}: chunk {c.chunk} does not continue chunk {i - 1}"]
        pos += c.numel
    if pos != numel_of(first.shape):
        return [f"{name}: chunks cover {pos} of {numel_of(first.shape)} elements"]
    return []


def _dynamic_problems(plan: Layout) -> list[str]:
    out = []
    names = {e.name for e in plan.entries if e.kind == "dynamic"}
    slots = sorted((d.shard, d.header_offset) for d in plan.dynamic_entries)
    if len(set(slots)) != len(slots) or any(o % HEADER_BYTES for _, o in slots):
        out.append("dynamic header slots overlap or are misaligned")
    for d in plan.dynamic_entries:
        if d.name not in names or d.capacity_rows > d.budget_rows or d.capacity_rows < 1:
            out.append(f"{d.name}: inconsistent dynamic entry")
    return out


# -- comparison ----------------------------------------------------------------------------
# The fields of an entry: what the model decides (a tensor's shape, dtype, role), then how
# the plan laid it out. A difference in the first kind shifts the layout of tensors before
# it in model order too, so the message names the first tensor whose own fields differ.
_MODEL_FIELDS = ("shape", "dtype", "kind", "role")
_LAYOUT_FIELDS = ("numel", "start", "chunk", "nbytes", "shard", "arena", "offset", "index")


def first_difference(mine: Layout, theirs: Layout, ours: str = "ours",
                     other: str = "theirs") -> str | None:
    """A sentence naming where two plans differ (None if they do not): an option, else the
    first tensor in model order that only one has or whose shape, dtype or role differs,
    else the first whose layout does; and the field, ``ours`` vs ``other`` (how the
    sentence names each plan)."""
    for f in fields(mine.options):
        a, b = getattr(mine.options, f.name), getattr(theirs.options, f.name)
        if a != b:
            return f"the plan option {f.name} differs: {a!r} in {ours} vs {b!r} in {other}"
    mine_by, theirs_by = _by_tensor(mine.entries), _by_tensor(theirs.entries)
    names = sorted(mine_by.keys() | theirs_by.keys(),
                   key=lambda n: _order(n, mine_by, theirs_by))
    for checked in (_MODEL_FIELDS, _MODEL_FIELDS + _LAYOUT_FIELDS):
        for name in names:
            a_entries, b_entries = mine_by.get(name), theirs_by.get(name)
            if a_entries is None or b_entries is None:
                return f"tensor {name!r} is only in {ours if b_entries is None else other}"
            why = _field_difference(a_entries, b_entries, checked, ours, other)
            if why is not None:
                return f"tensor {name!r} differs in {why}"
    for x, y in zip(mine.dynamic_entries, theirs.dynamic_entries, strict=False):
        if x != y:
            field = next(f.name for f in fields(x) if getattr(x, f.name) != getattr(y, f.name))
            return (f"sparse tensor {x.name!r} differs in {field}: {getattr(x, field)} in "
                    f"{ours} vs {getattr(y, field)} in {other}")
    if len(mine.dynamic_entries) != len(theirs.dynamic_entries):
        return "the plans have different sparse tensors"
    return None


def _by_tensor(entries: Iterable[PlanEntry]) -> dict[str, list[PlanEntry]]:
    """Each tensor's entries (its chunks, in order)."""
    by: dict[str, list[PlanEntry]] = {}
    for e in entries:
        by.setdefault(e.name, []).append(e)
    for chunks in by.values():
        chunks.sort(key=lambda e: e.chunk)
    return by


def _order(name: str, *plans: dict[str, list[PlanEntry]]) -> tuple[int, str]:
    """A tensor's position in the model (from whichever plan has it)."""
    index = next((p[name][0].index for p in plans if name in p), -1)
    return (index if index >= 0 else 1 << 62), name


def _field_difference(a: list[PlanEntry], b: list[PlanEntry], checked: tuple[str, ...],
                      ours: str, other: str) -> str | None:
    """The first of the ``checked`` fields where a tensor's entries differ, in words."""
    for x, y in zip(a, b, strict=False):
        for name in checked:
            if getattr(x, name) != getattr(y, name):
                chunk = "" if x.whole and y.whole else f" (chunk {x.chunk})"
                return (f"{name}{chunk}: {getattr(x, name)} in {ours} vs {getattr(y, name)} "
                        f"in {other}")
    if len(a) != len(b) and len(checked) > len(_MODEL_FIELDS):
        return f"chunks: {len(a)} in {ours} vs {len(b)} in {other}"
    return None


# -- presentation --------------------------------------------------------------------------
_COLUMNS = ("shard", "offset", "nbytes", "kind", "dtype", "shape", "tensor")


def describe_plan(plan: Layout, max_rows: int | None) -> str:
    rows: list[tuple[str, ...]] = [_COLUMNS]
    ordered = [e for s in range(plan.num_shards) for e in plan.shard_entries(s)]
    shown = ordered if max_rows is None else ordered[:max_rows]
    rows += [(str(e.shard), str(e.offset), str(e.nbytes), e.kind, e.dtype,
              "x".join(map(str, e.shape)) or "()", e.label) for e in shown]
    lines = table(rows)
    if len(shown) < len(ordered):
        lines.append(f"... {len(ordered) - len(shown)} more entries")
    lines += _dynamic_lines(plan)
    return "\n".join([*lines, "", summarize_plan(plan)])


def _dynamic_lines(plan: Layout) -> list[str]:
    if not plan.dynamic_entries:
        return []
    lines = ["", "dynamic (sparse) gradients: tensor, shard, header slot, staging rows/budget"]
    for d in plan.dynamic_entries:
        grow = "grows on demand" if d.growable else "fixed"
        lines.append(f"  {d.name}  shard {d.shard}  header @{d.header_offset}  "
                     f"{d.capacity_rows}/{d.budget_rows} rows of {d.row_bytes} B ({grow})")
    return lines


def table(rows: list[tuple[str, ...]]) -> list[str]:
    """Left-aligned columns, two spaces apart."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]


def summarize_plan(plan: Layout) -> str:
    tensors = len(plan.tensors())
    numel = sum(e.numel for e in plan.entries)
    lines = [f"plan {plan.fingerprint}: {len(plan.entries)} entries, {tensors} tensors, "
             f"{numel} elements, {plan.num_shards} shard(s), "
             f"alignment {plan.alignment} B, chunk {plan.options.chunk_bytes} B"]
    for s in range(plan.num_shards):
        n = len(plan.shard_entries(s))
        lines.append(f"  shard {s}: {n} entries, dense {plan.dense_bytes(s)} B, "
                     f"params arena {plan.arena_bytes(s)} B, "
                     f"grads arena {plan.arena_bytes(s)} B, headers {plan.header_bytes(s)} B")
    lines.append(f"  imbalance {plan.imbalance * 100:.2f}% (dense bytes: largest shard over mean, "
                 "minus 1)")
    return "\n".join(lines)
