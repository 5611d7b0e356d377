"""Sparse rows staged by a worker for shard 0 (four tables of three row shapes and two
dtypes), the receiver that gathers them, and an endpoint whose reads copy out of regions:
a shard's receipt of a push without a lane."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tensorx._ps.rows.sparse import SparseReceiver
from tensorx._ps.rows.staging import SparseStaging
from tensorx.graph_analyzer import GraphAnalyzer
from tensorx.memregion import MemoryRegion, RegionDescriptor

# name -> (rows, row width, dtype): two float32 tables of 16-float rows (one kind), 3-float
# rows (12 B: rows start on any 4-byte boundary of the payload), float64 rows
TABLES = {"a": (300, 16, torch.float32), "b": (200, 16, torch.float32),
          "c": (100, 3, torch.float32), "d": (50, 8, torch.float64)}


class Tables(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        for name, (n, dim, dtype) in TABLES.items():
            self.add_module(name, nn.Embedding(n, dim, sparse=True, dtype=dtype))


class Copying:
    """An endpoint whose reads copy out of the regions it was given."""

    def __init__(self, regions: list[MemoryRegion]) -> None:
        self.regions = {r.region_id: r for r in regions}
        self.reads = 0

    async def read(self, local: MemoryRegion, desc: RegionDescriptor, offset: int = 0,
                   remote_offset: int = 0, nbytes: int = 0,
                   timeout: float | None = None) -> None:
        self.reads += 1
        src = self.regions[desc.region_id].buffer()
        local.buffer()[offset:offset + nbytes] = src[remote_offset:remote_offset + nbytes]


def grads(seed: int, skip: str = "") -> dict[str, torch.Tensor]:
    """Uncoalesced sparse gradients (ids repeat), as autograd makes them; ``skip``: none."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, (n, dim, dtype) in TABLES.items():
        count = 0 if name == skip else 60
        ids = torch.randint(0, n, (count,), generator=gen)
        values = torch.randn(count, dim, generator=gen).to(dtype)
        out[f"{name}.weight"] = torch.sparse_coo_tensor(ids[None], values, (n, dim),
                                                        check_invariants=True)
    return out


def setup(seed: int, skip: str = "") -> tuple[Any, SparseStaging, SparseReceiver,
                                                dict[str, torch.Tensor]]:
    plan = GraphAnalyzer(Tables()).plan()
    staging, receiver = SparseStaging(plan), SparseReceiver(plan, 0, 1)
    staged = grads(seed, skip)
    staging.stage(0, staged)
    receiver.headers[0].buffer()[:] = staging.headers(0).buffer()
    return plan, staging, receiver, staged
