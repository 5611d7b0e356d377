"""Where shards are cut: dense bytes balanced to within one cut step of the mean.

The dense tensors (everything but sparse tables), in gradient-ready order, are laid end to
end, each padded to the alignment; shard ``k`` gets the bytes between cut ``k`` and cut
``k+1``, so every shard is one contiguous run of that sequence and a tensor cut between
shards is a slice of whole rows on each. The ideal cut ``k`` lies at ``k/n`` of the total
``D``. The real cut is the boundary between two tensors nearest the ideal when one lies
within :data:`SLACK` of the mean shard (``D / n / 200``: tensors stay whole where balance
allows, which matters to optimizers that treat a tensor as a whole, say LAMB or a rule by
size); else the nearest place inside the tensor there after a whole number of its *steps*.
A tensor's step is its smallest run of whole rows whose bytes are a multiple of the
alignment, ``lcm(row bytes, alignment)`` (rows are elements for a 1-D tensor), or its
padded size when that is smaller.

The bound. Each cut is within ``max(D/n/200, G/2)`` of its ideal place, ``G`` the largest
step, so every shard holds ``D/n +- max(D/n/100, G)`` dense bytes and ``imbalance =
max/mean - 1 <= max(1%, n*G/D)``: at most 2% for any model with ``D >= 50*n*G`` (ResNet-50
on 8 shards: ``G`` = 18 KiB, one row of a 512x512x3x3 convolution, against 102 MB), and a
smaller model is within one step of the mean. Balance finer than a step would need a cut
that is not whole rows, which the server's optimizer could not see as a shaped parameter.

Sparse tables take no part: their gradients travel as rows on the dynamic path, so they
add no fixed bytes to a round. Each stays whole and goes, largest first, to the shard that
holds the fewest sparse bytes so far (spreading their memory), among the shards that no
tensor crosses (a cut tensor's pieces must meet at the arenas' edges).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from typing import Protocol

from tensorx._analyzer.layout import align_up, numel_of

__all__ = ["SLACK", "cut_step", "dense_cuts", "place_sparse", "row_numel"]

SLACK = 200  # a cut may move to a tensor boundary up to mean / SLACK from its ideal place


class Tensor(Protocol):
    @property
    def shape(self) -> tuple[int, ...]: ...

    @property
    def itemsize(self) -> int: ...

    @property
    def numel(self) -> int: ...


def row_numel(t: Tensor) -> int:
    """Elements in one row: a slice along the first dimension (an element for 1-D and 0-D)."""
    return numel_of(t.shape[1:]) if len(t.shape) > 1 else 1


def padded(t: Tensor, alignment: int) -> int:
    return align_up(t.numel * t.itemsize, alignment)


def cut_step(t: Tensor, alignment: int) -> int:
    """Bytes between two places a tensor may be cut: ``lcm(row bytes, alignment)``, or its
    padded size when that is smaller (0 for an empty tensor)."""
    row_bytes = row_numel(t) * t.itemsize
    if row_bytes == 0:
        return 0
    return min(padded(t, alignment), math.lcm(row_bytes, alignment))


def dense_cuts(tensors: Sequence[Tensor], num_shards: int, alignment: int) -> list[int]:
    """``num_shards + 1`` byte positions in the padded sequence of ``tensors``: shard ``k``
    holds ``[cuts[k], cuts[k+1])``. Integer arithmetic only, so every process agrees."""
    starts = [0]
    for t in tensors:
        starts.append(starts[-1] + padded(t, alignment))
    total = starts[-1]
    if total == 0:
        return [0] * (num_shards + 1)
    scaled = [s * num_shards for s in starts]  # compare n*position with k*total: exact
    cuts = [0]
    for k in range(1, num_shards):
        goal = k * total
        i = bisect.bisect_right(scaled, goal) - 1  # the tensor that holds the ideal cut
        edge = min(starts[i:i + 2], key=lambda b: abs(b * num_shards - goal))
        if abs(edge * num_shards - goal) * SLACK <= total:  # within mean / SLACK
            cuts.append(edge)
        else:
            cuts.append(_nearest(starts[i], starts[i + 1], tensors[i], goal, num_shards,
                                 alignment))
    return [*cuts, total]


def _nearest(start: int, end: int, t: Tensor, goal: int, n: int, alignment: int) -> int:
    """The allowed cut in ``[start, end]`` nearest ``goal / n`` (the lower one on a tie)."""
    step = math.lcm(row_numel(t) * t.itemsize, alignment)
    lo = start + (goal - n * start) // (n * step) * step
    hi = min(lo + step, end)
    return lo if goal - n * lo <= n * hi - goal else hi


def shard_of(cuts: Sequence[int], position: int) -> int:
    """The shard a piece starting at ``position`` belongs to (the last of several empty
    shards whose cuts coincide there)."""
    return bisect.bisect_right(cuts, position, 1, len(cuts) - 1) - 1


def place_sparse(sizes: Sequence[int], eligible: Sequence[int], num_shards: int) -> list[int]:
    """A shard for each sparse table (``sizes`` in bytes): largest first (earlier on a
    tie), to the eligible shard holding the fewest sparse bytes (the lowest on a tie)."""
    load = [0] * num_shards
    out = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        shard = min(eligible, key=lambda s: (load[s], s))
        out[i] = shard
        load[shard] += sizes[i]
    return out
