"""Who may join a shard: one live holder per rank, and a plan only once it is really in use.

A rank belongs to one connection at a time. A hello for a rank that another connection
holds is answered by probing the holder (a transport-level query its node answers without
any user code): if the holder's connection is closed or broken, it is gone and the
newcomer takes the rank over (a restarted or rejoining worker); if it answers, or is alive
but silent (stopped, overloaded), the newcomer is refused with
:class:`~tensorx.errors.RankTakenError` naming the rank. Two workers launched with the same
rank therefore never evict each other: the first keeps training, the second fails at once.

The shard's plan (the layout of its arenas) is adopted from the first hello, but only once
the state for it is built and the worker admitted: a plan too big to allocate is refused
with a :class:`~tensorx.errors.UsageError` and leaves the shard without a plan, and a plan
whose workers have all gone before the first update (a worker of another model that said
hello and left) is released, so that the next hello sets it afresh.
"""

from __future__ import annotations

from tensorx.endpoint import Endpoint
from tensorx.errors import RankTakenError, TensorxError, TimeoutError

__all__ = ["PROBE_S", "holder_alive", "rank_taken"]

PROBE_S = 2.0  # how long a holder may take to answer the probe before it counts as silent


async def holder_alive(ep: Endpoint, timeout: float) -> bool:
    """Does the connection ``ep`` still have a live peer? A silent one counts as alive."""
    if ep.closed:
        return False
    try:
        await ep.query("exports", timeout=timeout)
    except TimeoutError:
        return True  # alive but not answering: stopped or overloaded, it still holds the rank
    except TensorxError:
        return False
    return True


def rank_taken(rank: int, holder: Endpoint) -> RankTakenError:
    return RankTakenError(
        f"rank {rank} is taken: a live worker at {holder.peer} holds it (two workers "
        f"launched with the same rank?); rank {rank} passes to a new connection only once "
        "its holder is gone")
