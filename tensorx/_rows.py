"""Rows of a registered tensor as byte ranges: what :meth:`Endpoint.read_rows` and
:meth:`Endpoint.write_rows` move. The remote tensor's dtype and shape come from its
descriptor, the local one's from its region; rows that follow each other become one range.
Pure: numpy, no I/O."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np

from tensorx._opcheck import named
from tensorx.errors import UsageError
from tensorx.memregion import MemoryRegion, RegionDescriptor

__all__ = ["RowPlan", "plan"]

SHORT = 32  # rows given as a list up to this long are checked in plain Python


class RowPlan(NamedTuple):
    """The local region and the byte ranges ``(offset, remote_offset, nbytes)`` to move."""

    region: MemoryRegion
    ranges: list[tuple[int, int, int]]


def plan(local: Any, desc: RegionDescriptor, rows: Any, need: str) -> RowPlan:
    """The ranges that move rows ``rows`` of the tensor ``desc`` describes to (``need``
    "r") or from ("w") the consecutive rows of ``local``; UsageError for a row out of
    range, a dtype or row shape that differs, a row written twice."""
    row_shape, row_bytes, nrows = _layout(desc)
    index = _rows(rows, nrows, desc)
    if need == "w" and len(set(index) if isinstance(index, list) else np.unique(index)) \
            != len(index):
        raise UsageError(f"write_rows: a row appears twice in rows "
                         f"({_twice(np.asarray(index))}); which write lands last is not "
                         "defined")
    region = local if isinstance(local, MemoryRegion) else \
        MemoryRegion.register(local, writable=need == "r")
    _check_local(region, desc, len(index), row_shape, row_bytes, need)
    return RowPlan(region, [(i * row_bytes, row * row_bytes, count * row_bytes)
                            for i, row, count in _runs(index)])


def _layout(desc: RegionDescriptor) -> tuple[tuple[int, ...], int, int]:
    """(shape of a row, bytes per row, rows) of the tensor ``desc`` describes."""
    if desc.dtype is None or desc.shape is None:
        raise UsageError(f"region {named(desc)} was not registered from a tensor or array, "
                         "so its descriptor has no dtype or shape to index rows by: export "
                         "the tensor itself, or use read/write (offsets and sizes in bytes)")
    if not desc.shape:
        raise UsageError(f"region {named(desc)} holds a 0-d tensor: it has no rows")
    count = math.prod(desc.shape)
    itemsize = desc.nbytes // count if count else 0
    return desc.shape[1:], itemsize * math.prod(desc.shape[1:]), desc.shape[0]


def _rows(rows: Any, nrows: int, desc: RegionDescriptor) -> np.ndarray | list[int]:
    """``rows`` (a list, numpy array or torch tensor of ints) as a 1-D int64 array, or a
    short list of ints as it is (numpy's fixed cost would be most of a small read's)."""
    if type(rows) in (list, tuple) and len(rows) <= SHORT and all(
            type(r) is int and 0 <= r < nrows for r in rows):
        return list(rows)
    if type(rows).__module__.startswith("torch"):
        rows = rows.detach().cpu().numpy()
    index = np.asarray(rows)
    if index.size == 0:
        return np.zeros(0, np.int64)
    if index.ndim != 1 or index.dtype.kind not in "iu":
        raise UsageError(f"rows must be a 1-D sequence of ints, not {index.dtype} of shape "
                         f"{index.shape}")
    bad = np.flatnonzero((index < 0) | (index >= nrows))
    if bad.size:
        i = int(bad[0])
        raise UsageError(f"row {int(index[i])} (rows[{i}]) is outside the {nrows} rows of "
                         f"region {named(desc)} (0 to {nrows - 1})")
    return index.astype(np.int64, copy=False)


def _twice(index: np.ndarray) -> int:
    values, counts = np.unique(index, return_counts=True)
    return int(values[np.argmax(counts > 1)])


def _check_local(region: MemoryRegion, desc: RegionDescriptor, n: int,
                 row_shape: tuple[int, ...], row_bytes: int, need: str) -> None:
    """``region`` holds exactly ``n`` rows of ``desc``'s tensor (where it knows its
    dtype and shape; raw memory needs only room for them)."""
    what = "out" if need == "r" else "src"
    want = (n, *row_shape)
    if region.dtype is not None and region.dtype != desc.dtype:
        raise UsageError(f"{what} is {region.dtype} but region {named(desc)} holds "
                         f"{desc.dtype}: the bytes would be reinterpreted, not converted; "
                         f"use a {desc.dtype} tensor of shape {want}")
    if region.shape is not None and tuple(region.shape) != want:
        raise UsageError(f"{what} has shape {tuple(region.shape)}, but {n} row(s) of "
                         f"region {named(desc)} (each of shape {row_shape}) need shape {want}")
    if region.shape is None and region.nbytes < n * row_bytes:
        raise UsageError(f"{what} has {region.nbytes} B, but {n} row(s) of region "
                         f"{named(desc)} need {n * row_bytes} B")


def _runs(index: np.ndarray | list[int]) -> list[tuple[int, int, int]]:
    """``(position in index, first row, count)`` of each run of consecutive rows."""
    if isinstance(index, list):
        return _short_runs(index)
    if not index.size:
        return []
    breaks = np.flatnonzero(np.diff(index) != 1) + 1
    starts = np.concatenate(([0], breaks))
    counts = np.diff(np.concatenate((starts, [index.size])))
    return list(zip(starts.tolist(), index[starts].tolist(), counts.tolist(), strict=True))


def _short_runs(index: list[int]) -> list[tuple[int, int, int]]:
    """:func:`_runs` of a short list, in plain Python."""
    runs: list[tuple[int, int, int]] = []
    for i, row in enumerate(index):
        if runs and row == runs[-1][1] + runs[-1][2]:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((i, row, 1))
    return runs
