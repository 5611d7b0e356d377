"""A load of optimizer state on a shard: who has sent it, whether they agree, who has
committed. Pure: no I/O.

A load replaces what every rank trains with, so one rank must not do it for the others
silently. The rule is DDP's (every rank loads the same checkpoint): **every rank loads
the same state between the same two steps**. A shard loads only once every rank it
counts (see :meth:`tensorx._ps.service.schedule.Scheduler`: not those finished or excused) has
sent it the same state, the same manifest and the same bytes (a digest of the packed
region, checked against the bytes read), while no rank is in the middle of a step; until
then it tells the ranks that sent theirs which ranks it waits for. A rank that steps
instead (pushes), ranks that send different states, a rank that leaves, or a rank loading
while another is in a step: the load is refused with a UsageError to every rank that
sent it, and nothing is loaded.

Two phases, so that a state one shard refuses is loaded by none::

    worker: state_put to every shard     shard: every rank's put, all the same -> read
                                                one (the lowest rank's), check, keep ->
                                                state_checked (or an error, to all)
    worker: state_commit(load = every shard said state_checked)
                                         shard: every rank's commit -> load if all say so
                                                -> state_loaded (else an error, to all)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tensorx._ps.wire.optim_state import State
    from tensorx.endpoint import Endpoint

__all__ = ["RULE", "LoadRound", "Put"]

RULE = ("every rank loads the same optimizer state_dict between the same two steps (as "
        "every DDP rank loads the same checkpoint); nothing was loaded")


@dataclass
class Put:
    """One rank's ``state_put``: where it came from and what it describes."""

    ep: Endpoint
    manifest: dict[str, Any]
    region: bytes
    digest: bytes


@dataclass
class LoadRound:
    """The load in progress on one shard (none while :attr:`puts` is empty)."""

    puts: dict[int, Put] = field(default_factory=dict)
    # what to load, once read and checked (phase two): the groups' hyperparameters and the
    # per-label state (both empty on a shard without an optimizer); None until then
    staged: tuple[list[dict[str, Any]], State] | None = None
    commits: dict[int, bool] = field(default_factory=dict)

    @property
    def open(self) -> bool:
        return bool(self.puts)

    def missing(self, counted: set[int]) -> list[int]:
        """The counted ranks whose put has not come yet."""
        return sorted(counted - set(self.puts))

    def disagreement(self) -> str | None:
        """Why the puts do not describe one state (naming two ranks), or None."""
        ranks = sorted(self.puts)
        first = self.puts[ranks[0]]
        for rank in ranks[1:]:
            put = self.puts[rank]
            if put.manifest.get("groups") != first.manifest.get("groups"):
                what = "param groups"
            elif (put.manifest, put.digest) != (first.manifest, first.digest):
                what = "state"
            else:
                continue
            return (f"ranks {ranks[0]} and {rank} loaded different optimizer states (their "
                    f"{what} differ): {RULE}")
        return None

    def first(self) -> Put:
        """The put whose region is read (the lowest rank's)."""
        return self.puts[min(self.puts)]

    def commit(self, rank: int, load: bool) -> bool | None:
        """Record ``rank``'s commit; once every rank that put has committed, whether all
        of them said load (else None)."""
        self.commits[rank] = load
        if set(self.commits) != set(self.puts):
            return None
        return all(self.commits.values())

    def eps(self) -> list[Endpoint]:
        return [self.puts[r].ep for r in sorted(self.puts)]
