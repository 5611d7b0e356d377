"""The plan users get: :class:`TransferPlan`, a layout that also decodes, checks, compares,
prints and binds itself. Pure planning: no I/O.

It sits above the modules it calls (layout < wire < sparse, binding < here), so every
import among them goes one way: nothing below knows this class exists.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from tensorx._analyzer.binding import Binding, allocate_regions
from tensorx._analyzer.layout import Layout, PlanEntry
from tensorx._analyzer.wire import (
    decode_plan,
    describe_plan,
    first_difference,
    layout_problems,
    summarize_plan,
)
from tensorx.errors import PlanMismatchError
from tensorx.memregion import MemoryRegion

__all__ = ["SAME_PLAN", "TransferPlan"]

SAME_PLAN = ("Every process must plan the same model (the same tensors, shapes and dtypes) "
             "with the same plan options and number of shards; compare plan.describe() "
             "on both sides")


class TransferPlan(Layout):
    """Where every tensor that crosses the worker/PS boundary lives, per shard and arena."""

    @classmethod
    def from_bytes(cls, data: bytes) -> TransferPlan:
        """Rebuild a plan sent by a peer; raise ProtocolError if it is malformed or corrupt."""
        return decode_plan(cls, data)

    def problems(self) -> list[str]:
        """Layout invariants that do not hold (empty for a sound plan)."""
        return layout_problems(self)

    def check_same(self, other: TransferPlan | bytes | str | tuple[str, bytes], *,
                   ours: str = "ours", theirs: str = "theirs") -> None:
        """Raise PlanMismatchError naming the first tensor (in model order) where ``other``
        differs, and the first field that does (``shape (1,) in ours vs (4,) in theirs``;
        ``ours`` and ``theirs`` name the two plans), and what to do.

        ``other`` is a plan, its ``to_bytes()``, a ``(fingerprint, to_bytes())`` pair (the
        bytes are decoded only when the fingerprints differ), or just a fingerprint (then the
        error can only say that the fingerprints differ).
        """
        if isinstance(other, tuple):
            fingerprint, data = other
            other = fingerprint if fingerprint == self.fingerprint else data
        if isinstance(other, str):
            if other != self.fingerprint:
                raise PlanMismatchError(
                    f"plan fingerprint {other} ({theirs}) differs from {self.fingerprint} "
                    f"({ours}); exchange to_bytes() to see which tensor differs. {SAME_PLAN}")
            return
        if isinstance(other, (bytes, bytearray, memoryview)):
            other = TransferPlan.from_bytes(bytes(other))
        diff = first_difference(self, other, ours, theirs)
        if diff is not None:
            raise PlanMismatchError(f"{diff}. {SAME_PLAN}")

    # -- presentation -------------------------------------------------------------------
    def describe(self, max_rows: int | None = None) -> str:
        """A readable table of the layout, then one summary line per shard."""
        return describe_plan(self, max_rows)

    def summary(self) -> str:
        """One line per shard: entries, bytes, sparse tables."""
        return summarize_plan(self)

    def __repr__(self) -> str:
        return (f"<TransferPlan {len(self.entries)} entries, {self.num_shards} shards, "
                f"{self.total_bytes} B, {self.fingerprint}>")

    # -- memory -------------------------------------------------------------------------
    def bind(self, model: torch.nn.Module,
             regions: Mapping[tuple[int, str], MemoryRegion] | None = None,
             device: str | None = None, densify_sparse: bool = True) -> Binding:
        """Rebind the model's parameters (and gradients) as views into registered arenas.

        ``regions`` maps ``(shard, "params"|"grads")`` to regions of at least
        ``arena_bytes(shard)``; by default they are allocated on ``device`` (the model's).
        """
        return Binding(self, model, regions=regions, device=device,
                       densify_sparse=densify_sparse)

    def allocate_regions(self, device: str = "cpu") -> dict[tuple[int, str], MemoryRegion]:
        """Per-shard ``params``/``grads`` regions carved from one block per arena kind.

        Carving keeps shard arenas adjacent, so a tensor split across two shards can still
        be a single view: pass the result to :meth:`bind` or use it on the PS.
        """
        return allocate_regions(self, device)

    @staticmethod
    def views(plan_entries: Iterable[PlanEntry],
              region: MemoryRegion) -> dict[str | tuple[str, int], torch.Tensor]:
        """1-D torch views of each entry inside ``region`` (one shard's arena); no copy.

        Keys are the tensor name for whole tensors and ``(name, chunk)`` for chunks.
        """
        return {e.key: region.view(getattr(torch, e.dtype), (e.numel,), e.offset)
                for e in plan_entries}
