"""A shard's answer to its workers: the new parameters, and the notification with them.

A worker that copies gets the parameter arena written into its own (one-sided); one that
mapped the shard's arena (same host) only gets the notification. With a flat shard in
several parts (:mod:`tensorx._ps.update.parts`) the update is applied part by part, in the shard's
apply thread (:mod:`tensorx._ps.service.applier`; torch releases the GIL), and each finished part is
already on its way while the next is computed; the notification travels with the last part,
so a worker never sees it before every part has landed.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tensorx._ps.rows.changed import runs
from tensorx._ps.service.applier import Applier
from tensorx._ps.wire import protocol
from tensorx.endpoint import Endpoint
from tensorx.errors import OptimizerError, TensorxError, error_code
from tensorx.memregion import MemoryRegion, RegionDescriptor

if TYPE_CHECKING:
    import torch

    from tensorx._ps.rows.sparse import SparseReceiver
    from tensorx._ps.service.optim_service import OptimService
    from tensorx._ps.service.options import ShardOptions
    from tensorx._ps.service.plan import PlanHolder
    from tensorx._ps.state.shard import ShardState

__all__ = ["Answers", "Peer", "RowsAnswer", "apply_in_parts", "drop", "last_part",
           "send_params"]

logger = logging.getLogger("tensorx.ps")  # one logger name for the whole server


GAP_BYTES = 64 << 10  # unchanged table bytes worth resending to save an op (changed.runs)


@dataclass
class Peer:
    """A worker as one shard sees it."""

    rank: int
    ep: Endpoint
    params: RegionDescriptor
    step: int = 0
    held: int = -1  # the version its latest push says its arena holds (-1: unknown)
    retried: int = -1  # the latest step it pushed again (logged once)
    offered: bool = False  # we offered it our arenas in /dev/shm
    mapped: bool = False   # it said it mapped them: its arena is ours, nothing to write


@dataclass(frozen=True)
class RowsAnswer:
    """Whether an answer's changed sparse-table rows go packed into the worker's inbox
    (see :mod:`tensorx._ps.rows.pull`): ``nbytes`` of them (0: no, they go in runs), and
    the inbox size to ask the worker for (``want``)."""

    nbytes: int = 0
    want: int = 0
    sparse: SparseReceiver | None = None
    changed: dict[int, Any] | None = None

    @classmethod
    def plan(cls, sparse: SparseReceiver | None, rank: int, state: ShardState,
             changed: dict[int, Any] | None) -> RowsAnswer:
        if sparse is None or changed is None:
            return cls()
        nbytes, want = sparse.rows_plan(rank, state, changed)
        return cls(nbytes, want, sparse, changed)

    def op(self, rank: int, state: ShardState, region: MemoryRegion) -> tuple[Any, ...]:
        """Gather the rows of ``region`` (the arena answered from) and write them."""
        assert self.changed is not None
        assert self.sparse is not None  # plan() made an answer with rows only with one
        return self.sparse.rows_op(rank, state, region, self.changed)


async def apply_in_parts(applier: Applier, state: ShardState, ranks: list[int], copies: list[Peer],
                         timeout: float | None, sparse: SparseReceiver | None = None
                         ) -> dict[int, list[asyncio.Future[None]]]:
    """Apply ``state``'s update part by part in ``applier``'s thread and start writing each
    finished part to ``copies``; all but the last part, which :func:`send_params` sends
    with the notification. The sparse tables' changed rows go packed into a worker's inbox where
    :meth:`RowsAnswer.plan` says so (``sparse``: the shard's SparseReceiver). Returns the
    writes in flight, by rank."""
    sending: dict[int, list[asyncio.Future[None]]] = {p.rank: [] for p in copies}
    last = state.num_parts - 1
    # the sparse tables (the first parts, if any) are stepped together: one thread hop
    tables = [k for k in range(last) if state.part_table(k) is not None]
    groups = [tables] if tables else []
    groups += [[k] for k in range(len(tables), last + 1)]
    for group in groups:
        try:
            await applier.run(_apply_parts, state, ranks, group)
        except BaseException:  # the parts on their way are waited for, their errors dropped
            await asyncio.gather(*(f for fs in sending.values() for f in fs),
                                 return_exceptions=True)
            raise
        if group[-1] == last:
            break
        for peer in copies:
            ops = _part_ops(state, peer, group, group is tables, sparse)
            if ops:
                sending[peer.rank].append(asyncio.ensure_future(
                    peer.ep.write_many(ops, timeout=timeout)))
    state.finish_update()
    return sending


def _part_ops(state: ShardState, peer: Peer, group: list[int], tables: bool,
              sparse: SparseReceiver | None) -> list[tuple[Any, ...]]:
    """The writes of the finished parts ``group`` (``tables``: the sparse tables) to
    ``peer``: whole parts, or of the tables the rows changed since the worker's version."""
    changed = state.changed.since(peer.held, state.version, current=True) if tables else None
    rows = RowsAnswer.plan(sparse, peer.rank, state, changed)
    if rows.nbytes:  # the same plan as the answer's (steps._params_sender)
        return [rows.op(peer.rank, state, state.params_region)]
    ops: list[tuple[Any, ...]] = []
    for k in group:
        table = state.part_table(k)
        if changed is None or table is None:
            off, nbytes = state.part_bytes(k)
            ops.append((state.params_region, peer.params, off, off, nbytes))
        else:  # a sparse table: the rows changed since the worker's version, in runs
            ops += table_ops(state, state.params_region, peer.params, table,
                             changed.get(table))
    return ops


def _apply_parts(state: ShardState, ranks: list[int], parts: list[int]) -> None:
    if len(parts) > 1:
        state.apply_tables(ranks, parts)
    else:
        state.apply_part(ranks, parts[0])


def last_part(state: ShardState) -> tuple[int, int]:
    """(offset, nbytes) of the part :func:`send_params` sends after :func:`apply_in_parts`."""
    return state.part_bytes(state.num_parts - 1)  # type: ignore[no-any-return]


def table_ops(state: ShardState, region: MemoryRegion, desc: RegionDescriptor, table: int,
              ids: torch.Tensor | None) -> list[tuple[Any, ...]]:
    """Writes of sparse table ``table``'s rows ``ids`` (sorted unique row ids; None: none
    changed), in runs (see :func:`tensorx._ps.rows.changed.runs`)."""
    if ids is None or not ids.numel():
        return []
    off, nbytes = state.rows.span(table)
    row_bytes = nbytes // max(1, state.params[table].shape[0])
    return [(region, desc, off + first * row_bytes, off + first * row_bytes,
             count * row_bytes) for first, count in runs(ids, row_bytes, GAP_BYTES)]


def delta_ops(state: ShardState, region: MemoryRegion, desc: RegionDescriptor,
              changed: dict[int, Any]) -> list[tuple[Any, ...]]:
    """Writes of what differs between the worker's version and ``region``'s: every byte
    outside the sparse tables, and of each table the rows in ``changed``."""
    ops: list[tuple[Any, ...]] = []
    at = 0
    for off, nbytes, table in sorted((*state.rows.span(i), i) for i in state.rows):
        if off > at:
            ops.append((region, desc, at, at, off - at))
        ops += table_ops(state, region, desc, table, changed.get(table))
        at = max(at, off + nbytes)
    if at < state.layout.nbytes:
        ops.append((region, desc, at, at, state.layout.nbytes - at))
    return ops


async def send_params(region: MemoryRegion, peer: Peer, msg: bytes,  # noqa: PLR0913 (one answer's parts; until the server is composed (issue 29 item 1))
                      sent: list[asyncio.Future[None]] | None, last: tuple[int, int],
                      timeout: float | None, changed: dict[int, Any] | None = None,
                      state: ShardState | None = None, rows: RowsAnswer | None = None) -> None:
    """The new parameters in ``region`` (or, after :func:`apply_in_parts`, their ``last``
    part; nothing for a mapped worker) with ``msg`` as the notification, ordered after every
    part sent before. ``changed`` (with ``state``): the worker holds a recent version and
    needs, of the sparse tables, only these rows (see :mod:`tensorx._ps.rows.changed`), packed
    into its inbox where ``rows`` says so. Raises the first error of any of the writes."""
    ops: list[tuple[Any, ...]] = []
    if sent is not None:
        off, nbytes = last
        ops = [(region, peer.params, off, off, nbytes)]
    elif not peer.mapped and changed is not None and state is not None and \
            rows is not None and rows.nbytes:
        ops = [*delta_ops(state, region, peer.params, {}), rows.op(peer.rank, state, region)]
    elif not peer.mapped and changed is not None and state is not None:
        ops = delta_ops(state, region, peer.params, changed)
    elif not peer.mapped:
        ops = [(region, peer.params)]
    if not sent:  # the usual answer: one write, awaited in place
        await peer.ep.write_many(ops, notify=msg, timeout=timeout)
        return
    results = await asyncio.gather(peer.ep.write_many(ops, notify=msg, timeout=timeout),
                                   *sent, return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result


def drop(shard: int, peer: Peer, when: str, exc: TensorxError) -> None:
    """A send to ``peer`` failed or missed ``send_timeout``: abort its connection at
    once (nothing of it may still read the arena, which the next update changes) and
    let the loop handle it as a departure."""
    logger.warning("ps shard %d: lost rank %d%s: %s", shard, peer.rank,
                   f" {when}" if when else "", exc)
    peer.ep.abort()  # its session then handles the departure, in its turn


class Answers:
    """What a shard answers the workers of an update: the parameters as of now, or the
    error that failed it. It reads the state from ``plans``, the workers still here from
    ``peers`` (by endpoint, kept by the server's sessions) and the hyperparameters to send
    from ``optim``."""

    def __init__(self, options: ShardOptions, plans: PlanHolder,
                 peers: Mapping[Endpoint, Peer], optim: OptimService) -> None:
        self._options = options
        self._plans = plans
        self._peers = peers
        self._optim = optim

    def sender(self, peer: Peer, sent: list[asyncio.Future[None]] | None,
               last: tuple[int, int] | None = None) -> Callable[[], Awaitable[None]]:
        """The answer to ``peer`` as of now (arena, version, checksum, hyperparameters),
        to be sent by awaiting the result; a failed or late send drops ``peer``. With
        ``sent`` (parts on their way), the notification travels with part ``last``
        ((offset, nbytes); default: the state's last part)."""
        state = self._plans.state
        assert state is not None
        region, last = state.params_region, last or last_part(state)
        # a worker that holds a recent version gets, of the sparse tables, the changed rows
        changed = None if peer.mapped or not state.rows else \
            state.changed.since(peer.held, state.version)
        rows = RowsAnswer.plan(self._plans.sparse, peer.rank, state, changed)
        msg = protocol.encode("params", version=state.version, step=peer.step,
                              checksum=state.checksum(), hyper=self._optim.answer(peer.ep, state),
                              rows=rows.nbytes, rows_want=rows.want)
        timeout = self._options.send_timeout

        async def send() -> None:
            try:
                await send_params(region, peer, msg, sent, last, timeout, changed, state, rows)
            except TensorxError as exc:
                if self._peers.get(peer.ep) is peer:  # else it has left already
                    drop(self._options.shard, peer, "", exc)

        return send

    async def fail(self, exc: Exception, targets: list[Peer]) -> None:
        """Tell every worker waiting for this update that it failed, and why, at once."""
        if isinstance(exc, OptimizerError):
            logger.error("ps shard %d: %s", self._options.shard, exc)
        error = protocol.encode("error", code=error_code(exc), msg=str(exc))
        await asyncio.gather(*(p.ep.notify(error, timeout=self._options.timeout)
                               for p in targets), return_exceptions=True)
