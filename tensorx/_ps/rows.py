"""Sparse tables on a shard: the rows each worker pushed, and the gradient the optimizer sees.

A parameter the plan sends on the dynamic path (``nn.Embedding(sparse=True)``,
``nn.EmbeddingBag(sparse=True)``) gets no dense gradient on the shard. The rows a worker
pushed are kept per rank, whole (a push that failed half-way hands over nothing), until the
next push of that rank replaces them. For an update of ``ranks`` the table's ``.grad`` is a
coalesced sparse COO tensor: every rank's rows summed by row id, divided by the number of
ranks. That is the mean the dense gradients get, and what torch gives one process training
on the union of the ranks' batches (its uncoalesced gradient, coalesced; up to summation
order). So ``torch.optim.SGD``, ``Adagrad`` and ``SparseAdam`` take their sparse paths, a
row-wise optimizer sees rows, and the work is O(rows touched), not O(table). A table no rank
touched gets no gradient (``None``), as in one process where it took no part in the step.
Pure: no I/O.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

__all__ = ["Rows", "SparseRows", "no_invariant_checks"]

Rows = tuple[torch.Tensor, torch.Tensor]  # (row ids int64 [n], values [n, *row_shape])


def no_invariant_checks() -> contextlib.AbstractContextManager[Any]:
    """Say that sparse tensors go unchecked (our row ids are checked on arrival): torch's
    sparse optimizers build sparse tensors and otherwise warn that checks are implicitly off."""
    return torch.sparse.check_sparse_tensor_invariants(enable=False)  # type: ignore[no-untyped-call]


class SparseRows:
    """The sparse tables among a shard's optimizer parameters (``specs``, in their order)."""

    def __init__(self, specs: Sequence[Any], device: str = "cpu") -> None:
        self.device = device
        self._specs = {i: s for i, s in enumerate(specs) if getattr(s, "sparse", False)}
        self._index = {s.name: i for i, s in self._specs.items()}
        self._rows: dict[int, dict[int, Rows]] = {}
        self._gathered: dict[int, torch.Tensor | None] | None = None

    def __contains__(self, i: object) -> bool:
        return i in self._specs

    def __bool__(self) -> bool:
        return bool(self._specs)

    def __iter__(self) -> Iterator[int]:
        return iter(self._specs)

    def __len__(self) -> int:
        return len(self._specs)

    def names(self) -> list[str]:
        return [s.name for s in self._specs.values()]

    def index(self, name: str) -> int:
        """Table ``name``'s index among the shard's parameters."""
        return self._index[name]

    def views(self, region: Any, tables: Sequence[int]) -> list[torch.Tensor]:
        """Tables ``tables``, shaped, in ``region`` (an arena of this shard's layout)."""
        u8 = region.view(torch.uint8)
        out = []
        for i in tables:
            s = self._specs[i]
            part = u8[s.offset:s.offset + s.numel * s.dtype.itemsize]
            out.append(part.view(s.dtype).view(s.shape))
        return out

    def span(self, i: int) -> tuple[int, int]:
        """(offset, nbytes) of table ``i`` in the arena."""
        s = self._specs[i]
        return s.offset, s.numel * s.dtype.itemsize

    def put(self, rank: int, rows: Mapping[str, Rows]) -> None:
        """``rank``'s rows of its latest push, by table name (tables it sent none of: none)."""
        self._rows[rank] = {self._index[name]: r for name, r in rows.items() if r[0].numel()}

    def drop(self, rank: int) -> None:
        self._rows.pop(rank, None)

    def finite(self, rank: int) -> bool:
        """Is every value ``rank`` pushed finite? (as :func:`tensorx._ps.nonfinite.finite`)"""
        with torch.no_grad():
            for _, values in self._rows.get(rank, {}).values():
                acc = torch.float64 if values.dtype == torch.float64 else torch.float32
                if values.is_floating_point() and not torch.isfinite(values.sum(dtype=acc)):
                    return False
        return True

    def grad(self, ranks: Sequence[int], i: int) -> torch.Tensor | None:
        """Table ``i``'s gradient for an update of ``ranks`` (see the module docstring), or
        the one :meth:`gather` made."""
        if self._gathered is not None:
            return self._gathered.get(i)
        parts = [self._rows[r][i] for r in ranks if i in self._rows.get(r, {})]
        if not parts:
            return None
        with torch.no_grad():
            ids, values = _sum_rows(parts)
            if len(ranks) > 1:
                values.div_(len(ranks))
        with no_invariant_checks():
            return torch.sparse_coo_tensor(ids.unsqueeze(0), values, self._specs[i].shape,
                                           is_coalesced=True)

    def gather(self, ranks: Sequence[int]) -> None:
        """Make every table's gradient now (it may be changed in place before the step)."""
        self._gathered = None
        self._gathered = {i: self.grad(ranks, i) for i in self._specs}

    def ungather(self) -> None:
        self._gathered = None


def _sum_rows(parts: Sequence[Rows]) -> Rows:
    """The rows of ``parts`` summed by row id: (sorted unique ids, fresh values), as
    ``coalesce()`` gives them. One part of sorted unique ids (what a worker stages) is
    taken as it is (its values copied: the gradient may be changed in place, the rows a
    rank pushed may not); else one sort and one scatter-add, in rank order."""
    if len(parts) == 1:
        ids, values = parts[0]
        if ids.numel() < 2 or bool((ids[1:] > ids[:-1]).all()):
            return ids, values.clone()
    ids = torch.cat([p[0] for p in parts])
    values = torch.cat([p[1] for p in parts])
    unique, inverse = torch.unique(ids, sorted=True, return_inverse=True)
    summed = values.new_zeros((int(unique.numel()), *values.shape[1:]))
    return unique, summed.index_add_(0, inverse, values)
