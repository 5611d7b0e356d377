"""Worker: binds a model to a transfer plan and trains it against parameter-server shards.

The model's parameters and gradients are rebound as views into registered arenas (one pair
per shard), so autograd writes gradients straight into the memory that is pushed, and the
shards write fresh parameters straight into the module::

    async with Worker(model, ps=["tcp://h:7000"], rank=0, num_workers=2) as worker:
        loss.backward(); await worker.step()       # push, wait as the mode says, pull

On the shards' own host, in sync mode, the arenas are the shards' memory itself (mapped
from /dev/shm, see :mod:`tensorx._ps.worker.samehost`) and a step only exchanges notifications.

:class:`tensorx.RemoteOptimizer` (:mod:`tensorx.remote_optimizer`) is the blocking
``torch.optim.Optimizer`` facade for ordinary PyTorch loops.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import zlib
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import torch

from tensorx._backoff import Backoff
from tensorx._deadline import Deadline, wait_for
from tensorx._ps.common.gather import windowed
from tensorx._ps.common.rendezvous import Store, connect_store, lookup
from tensorx._ps.common.stats import WorkerTimings
from tensorx._ps.rows.sparse import SparseSender
from tensorx._ps.state.shard_layout import dynamic_path_ok
from tensorx._ps.update.parts import check_parts, split_ops
from tensorx._ps.wire import optim_state, protocol
from tensorx._ps.wire.checksum import checksum
from tensorx._ps.wire.hyper import heard as hyper_heard
from tensorx._ps.wire.hyper import snapshot as hyper_snapshot
from tensorx._ps.worker.buckets import Bucket, BucketPusher, make_buckets
from tensorx._ps.worker.links import ShardLinks
from tensorx._ps.worker.optim_client import OptimStates
from tensorx._ps.worker.samehost import SharedArenas
from tensorx.endpoint import Endpoint
from tensorx.errors import (
    BrokenError,
    ClosedError,
    ProtocolError,
    TimeoutError,
    UsageError,
)
from tensorx.graph_analyzer import GraphAnalyzer
from tensorx.memregion import MemoryRegion, RegionDescriptor
from tensorx.node import Node

__all__ = ["Worker", "ps_addresses"]

logger = logging.getLogger(__name__)

# A pipelined push's part writes in flight at once: two keep a TCP stream full while the
# first waits for its acknowledgement, and a same-host lane's two copy threads land them
# nearly in order (all at once, they landed in any order: the shard waited for the first)
PARTS_IN_FLIGHT = 2


class Worker:
    """One training process's link to every parameter-server shard.

    ``ps``: shard addresses, in shard order. ``rank`` in ``0..num_workers-1``; rank 0's
    initial parameters seed the shards unless they resumed from a checkpoint. ``verify``:
    check every pull against the checksum the shard stamped on its update.
    ``plan_options``: passed to :class:`tensorx.GraphAnalyzer` (every worker must agree).
    ``overlap``: start writing a gradient bucket (about ``bucket_bytes``) to its shard as
    soon as autograd has finished it, during backward; ``None`` (default): measure steps
    with and without it and keep the faster (:mod:`tensorx._ps.worker.buckets`). ``timeout``:
    seconds for every wait, including a sync step's wait for the slowest worker. When a
    shard goes away (killed, restarted, cut off), :meth:`step` raises
    :class:`~tensorx.errors.BrokenError` naming the shard and its address
    (:class:`~tensorx.errors.TimeoutError` if it fell silent without closing the
    connection), unless ``reconnect`` is set: then the worker keeps trying this many seconds
    to rejoin every shard, with exponential backoff (0.1 s doubling to 2 s, with jitter); a
    restarted server resumes from its checkpoint, the step in flight is dropped and the
    model takes the server's parameters.
    ``share_memory``: where a shard on this host offers it (sync mode), bind the model
    straight into the shard's parameter arena and this worker's gradient slot, mapped from
    /dev/shm, so that no step copies anything (CPU models; see :attr:`mapped`).
    ``node_options``: further :class:`tensorx.Node` options (``ucx_options``,
    ``require``).
    """

    def __init__(self, model: torch.nn.Module, ps: str | Sequence[str], rank: int = 0,  # noqa: PLR0913 (the public constructor's keyword options)
                 num_workers: int = 1, *, token: str | bytes | None = None,
                 transport: str = "auto", timeout: float | None = 60.0, verify: bool = False,
                 plan_options: dict[str, Any] | None = None, overlap: bool | None = None,
                 bucket_bytes: int = 1 << 20, reconnect: float | None = None,
                 share_memory: bool = True, node_options: dict[str, Any] | None = None) -> None:
        self.model = model
        self.addresses = [ps] if isinstance(ps, str) else list(ps)
        if not self.addresses:
            raise UsageError("ps must name at least one parameter-server shard")
        if not 0 <= rank < num_workers:
            raise UsageError(f"rank {rank} is not one of 0..{num_workers - 1} "
                             f"(num_workers={num_workers}; ranks count from 0)")
        self.rank = rank
        self.num_workers = num_workers
        self.timeout = timeout
        self.verify = verify
        self.node = Node(None, transport=transport, token=token, timeout=timeout,
                         **(node_options or {}))
        self._plan_options = dict(plan_options or {})
        self.plan: Any = None
        self.binding: Any = None
        self.steps = 0
        self.mode = ""
        # per shard: our endpoint, what it told us, and the replies on it
        self._links = ShardLinks(self.node, rank, self.addresses)
        self._states = OptimStates(self._links, self.node)  # RemoteOptimizer's state dicts
        self._overlap = overlap
        self.reconnect = reconnect
        self._bucket_bytes = bucket_bytes
        self.share_memory = share_memory
        self._shared: SharedArenas | None = None
        self._dense_cache: dict[int, list[tuple[int, int]]] = {}
        self._pusher: BucketPusher | None = None
        self._sparse: SparseSender | None = None
        # the step in progress (self.steps), for a retry after a timeout: the shards that
        # have its push, and those whose answer we took
        self._sent: set[int] = set()
        self._answered: set[int] = set()
        self._closed = False
        self.stats: dict[str, float] = {"push_s": 0.0, "wait_s": 0.0, "steps": 0,
                                        "rejoins": 0, "rejoin_s": 0.0}
        self.timings = WorkerTimings()  # per-step histograms (tensorx.metrics.Timing)

    @property
    def num_shards(self) -> int:
        return len(self.addresses)

    @property
    def version(self) -> list[int]:
        """Per shard: the version of the parameters we last took from it."""
        return [link.version for link in self._links.shards]

    @property
    def optim(self) -> list[dict[str, Any]]:
        """Per shard: its optimizer, as it described it when it welcomed us ([] before)."""
        return [link.optim for link in self._links.shards if link.optim is not None]

    @property
    def hyper(self) -> list[list[dict[str, Any]]]:
        """Per shard: its optimizer's group values as it last told us ([] before it
        welcomed us; [] for a shard whose optimizer has no groups)."""
        return [link.hyper for link in self._links.shards if link.optim is not None]

    @property
    def _eps(self) -> list[Endpoint]:
        """Our endpoint to each shard, in shard order (the links own them)."""
        return self._links.eps

    @property
    def mapped(self) -> list[bool]:
        """Per shard: is the model bound straight into that shard's (shared) memory?"""
        return list(self._shared.mapped) if self._shared else [False] * self.num_shards

    # -- lifecycle ------------------------------------------------------------------------
    async def start(self) -> Worker:
        self.plan = GraphAnalyzer(self.model, num_shards=self.num_shards,
                                  **self._plan_options).plan()
        dynamic = dynamic_path_ok(self.plan)
        self.binding = self.plan.bind(self.model, densify_sparse=not dynamic)
        self._shared = SharedArenas(self.plan, self.rank, self.share_memory,
                                    self._region(0, "params").device)
        await self.node.start()
        if dynamic:
            self._sparse = SparseSender(self.binding, self.model, self.node)
        try:
            await self._handshake(await self._first_connect())
        except BaseException:
            await self.aclose()
            raise
        return self

    async def _first_connect(self) -> list[Endpoint]:
        """Connect to every shard, waiting for shards that do not listen yet (processes
        start in any order), with backoff, for up to ``timeout`` seconds; one INFO line."""
        backoff = Backoff(Deadline(self.timeout))
        while True:
            try:
                return await self._connect_all(backoff.deadline.left())
            # nothing listens there yet (refused, unreachable), or the budget ran out
            # during the last attempt
            except (BrokenError, TimeoutError) as exc:
                if not backoff.failed(exc):
                    raise BrokenError(f"worker rank {self.rank}: no ps shard of "
                                      f"{self.addresses} answered within {self.timeout:g} s "
                                      f"({backoff.attempts} attempts): {backoff.error}") from exc
                if backoff.attempts == 1:
                    logger.info("worker rank %d: waiting for the ps shard(s) at %s (%s); "
                                "retrying with backoff for up to %s", self.rank, self.addresses,
                                exc, "ever (timeout=None)" if self.timeout is None
                                else f"{self.timeout:g} s")
                await asyncio.sleep(backoff.next_pause())

    async def _handshake(self, eps: list[Endpoint] | None = None) -> None:
        self._sent.clear()  # new connections: no shard holds anything of ours
        self._answered.clear()
        self._links.use(eps if eps is not None else await self._connect_all(self.timeout))
        await asyncio.gather(*(self._hello(s) for s in range(self.num_shards)))
        welcomes = await asyncio.gather(*(self._expect(s, "welcome")
                                          for s in range(self.num_shards)))
        for s, (link, w) in enumerate(zip(self._links.shards, welcomes, strict=True)):
            optim = protocol.optim_info(w)
            link.welcomed(RegionDescriptor.from_bytes(w["slot"]), w["headers"],
                          check_parts(w["parts"], self.plan.arena_bytes(s)), optim,
                          hyper_snapshot([g["hp"] for g in optim["groups"]]))
        if self._pusher is None:
            self._pusher = BucketPusher(make_buckets(self.plan, self._bucket_bytes),
                                        self.model, self._write_bucket,
                                        asyncio.get_running_loop(), self._overlap,
                                        self._bucket_fingerprint, f"worker rank {self.rank}")
        self.mode = welcomes[0]["mode"]
        for s, w in enumerate(welcomes):
            self._accept_params(s, w)
        assert self._shared is not None
        self.binding = self._shared.map(self.binding, welcomes, self.node)
        self._pusher.keyed(self.plan.fingerprint, self._moved())
        if self._sparse is not None:
            self._sparse.rebind(self.binding)
        logger.info("worker rank %d/%d joined %d shard(s), mode=%s, version=%s", self.rank,
                    self.num_workers, self.num_shards, self.mode, self.version)

    def _moved(self) -> str:
        """How this worker's steps move their bytes, for remembered choices: per shard,
        mapped or the lanes of its endpoint; and how many workers the barrier waits for."""
        lanes = []
        for ep, mapped in zip(self._eps, self.mapped, strict=True):
            host = str(ep.info.get("host", ""))
            lanes.append("mapped" if mapped else str(ep.info.get("transport"))
                         + ("+" + host.split(" ", 1)[0] if host else ""))
        return f"{self.mode} workers {self.num_workers} " + ",".join(lanes)

    async def _connect_all(self, timeout: float | None) -> list[Endpoint]:
        """One endpoint per shard, or none: a partial set is closed before raising."""
        return await self._links.connect_all(self.addresses, timeout)

    async def _rejoin(self, why: BaseException, budget: float) -> None:
        """Drop every endpoint and handshake again, with exponential backoff and jitter,
        until ``budget`` seconds are spent."""
        logger.warning("worker rank %d: %s; rejoining for up to %g s", self.rank, why, budget)
        started, backoff = time.monotonic(), Backoff(Deadline(budget))
        self._unmap()  # the next hello offers our own arena again; the shard may be new
        while True:
            await self._drop_endpoints()
            try:
                await self._attempt_handshake(backoff.deadline)
                break
            except (BrokenError, ClosedError, TimeoutError, OSError) as exc:
                if not backoff.failed(exc):
                    raise BrokenError(f"worker rank {self.rank} could not rejoin "
                                      f"{self.addresses} within {budget:g} s "
                                      f"({backoff.attempts} attempts): {backoff.error}") from exc
                pause = backoff.next_pause()
                logger.info("worker rank %d: rejoin attempt %d failed (%s); next in %.2f s",
                            self.rank, backoff.attempts, exc, pause)
                await asyncio.sleep(pause)
        assert self._pusher is not None
        self._pusher.reset()
        self.stats["rejoins"] += 1
        self.stats["rejoin_s"] = time.monotonic() - started
        logger.warning("worker rank %d rejoined after %.2f s (%d attempts) at version %s",
                       self.rank, self.stats["rejoin_s"], backoff.attempts + 1, self.version)

    async def _attempt_handshake(self, deadline: Deadline) -> None:
        """One handshake, cut short where the rejoin budget ends."""
        try:
            await wait_for(self._handshake(), deadline.left())
        except asyncio.TimeoutError:
            raise TimeoutError("the rejoin budget ran out during a handshake") from None

    async def _drop_endpoints(self) -> None:
        await self._links.drop()
        if self._sparse is not None:
            self._sparse.forget_exports()

    async def _hello(self, shard: int) -> None:
        desc = self.node.export(self._region(shard, "params"), access="rw")
        await self._eps[shard].notify(protocol.encode(
            "hello", proto=protocol.PROTOCOL, rank=self.rank, num_workers=self.num_workers,
            shard=shard, num_shards=self.num_shards, fingerprint=self.plan.fingerprint,
            plan=self.plan.to_bytes(), params=desc.to_bytes(), verify=self.verify,
            share=self._shared is not None and self._shared.wanted, shards=self.addresses))

    async def aclose(self) -> None:
        """Say goodbye to every shard and close the node. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._pusher is not None:
            self._pusher.close()
        self._unmap()  # before bye: the model keeps the parameters, in its own memory
        await self._links.bye()
        await self.node.aclose()
        if self._sparse is not None:
            self._sparse.close()

    async def __aenter__(self) -> Worker:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # -- steps ----------------------------------------------------------------------------
    async def step(self, hyper: list[dict[str, Any]] | None = None) -> None:
        """Push this step's gradients, wait as the mode requires, pull fresh parameters.
        ``hyper``: per param group, hyperparameters to change before this step's update (see
        :mod:`tensorx._ps.wire.hyper`; :class:`RemoteOptimizer` computes them).

        A step that raised :class:`~tensorx.errors.TimeoutError` may be retried as it is
        (``await worker.step()`` again, no ``zero_grad``/``backward`` in between): the
        retry pushes only to the shards that did not get the push, waits for the answers
        not yet taken, and returns with the parameters of that step's update. A shard
        that got the push twice takes it once."""
        t0 = time.perf_counter()
        try:
            await self.push(hyper)
            t1 = time.perf_counter()
            await self.pull()
        except (BrokenError, TimeoutError) as exc:
            if not self.reconnect:
                raise
            await self._rejoin(exc, self.reconnect)
            return
        self.stats["push_s"] += t1 - t0
        self.stats["wait_s"] += time.perf_counter() - t1
        self.stats["steps"] += 1
        self.timings.step_done(t0, t1)

    async def push(self, hyper: list[dict[str, Any]] | None = None) -> None:
        """Write every gradient bucket not yet written into our slots, then notify."""
        if self._pusher is None:
            raise UsageError("the worker is not started; use 'async with Worker(...)'")
        self._pusher.measure(time.perf_counter())
        copied = self.binding.ensure_bound()
        if copied:
            self._pusher.invalidate()
            if logger.isEnabledFor(logging.DEBUG):
                logger.debug("re-bound %s to the arenas (copied once)", ", ".join(copied))
        rest = await self._pusher.settle()
        await self._each([s for s in range(self.num_shards) if s not in self._sent],
                         lambda s: self._push(s, [b for b in rest if b.shard == s], hyper or []))

    def _mapped(self, shard: int) -> bool:
        return self._shared is not None and self._shared.mapped[shard]

    def _bucket_op(self, bucket: Bucket) -> tuple[Any, ...]:
        return (self._region(bucket.shard, "grads"), self._links.shards[bucket.shard].slot,
                bucket.offset, bucket.offset, bucket.nbytes)

    def _bucket_fingerprint(self, bucket: Bucket) -> int | None:
        """CRC-32 of a bucket's gradient bytes; None where an edit reaches the shard
        anyway (its arena is mapped) or the bytes are not in host memory."""
        region = self._region(bucket.shard, "grads")
        if self._mapped(bucket.shard) or region.device != "cpu":
            return None
        return zlib.crc32(region.buffer()[bucket.offset:bucket.offset + bucket.nbytes])

    async def _write_bucket(self, bucket: Bucket) -> None:
        if self._mapped(bucket.shard):
            return  # autograd wrote the gradient into the shard's slot itself
        with self._links.naming(bucket.shard):
            await self._eps[bucket.shard].write_many([self._bucket_op(bucket)],
                                                     timeout=self.timeout)

    async def _push(self, shard: int, rest: list[Bucket], hyper: list[dict[str, Any]]) -> None:
        """Write what is left of this step's gradient for ``shard`` and tell it, in one go:
        the push notification travels with the data (never ahead of it). A pipelined shard
        gets the push first, then each part with its own notification (see
        :mod:`tensorx._ps.service.round`), so it can apply the first parts while later ones land."""
        link = self._links.shards[shard]
        assert link.optim is not None  # it welcomed us
        ops = [] if self._mapped(shard) else [self._bucket_op(b) for b in rest]
        staging: dict[str, bytes] = {}
        inbox = b""
        if self._sparse is not None and link.header:
            staging = self._sparse.stage(shard)
            inbox = b"" if self._mapped(shard) else self._sparse.inbox(shard)
            ops.append((self._sparse.headers(shard), link.header))
        by_part = split_ops(ops, link.parts) if link.parts else None
        msg = protocol.encode("push", step=self.steps, version=link.version,
                              staging=staging, mapped=self._mapped(shard),
                              hyper=hyper if link.optim["groups"] else [],
                              inbox=inbox, parts=[k for k in range(len(link.parts))
                                     if by_part is not None and k not in by_part])
        ep = self._eps[shard]
        with self._links.naming(shard):
            if by_part is None:
                await ep.write_many(ops, notify=msg, timeout=self.timeout)
            else:
                await ep.notify(msg, timeout=self.timeout)
                await windowed([functools.partial(ep.write_many, part_ops,
                                                  timeout=self.timeout,
                                                  notify=protocol.encode("part", k=k))
                                for k, part_ops in sorted(by_part.items())], PARTS_IN_FLIGHT)
        self._sent.add(shard)

    async def _each(self, shards: list[int], call: Callable[[int], Awaitable[None]]) -> None:
        """``call(s)`` for each of ``shards``, every one run to its end (a retry then goes
        on where each stopped), then the first error raised; one shard is called in place
        (no task, as :func:`tensorx._ps.common.gather.together`)."""
        if len(shards) == 1:
            await call(shards[0])
            return
        for result in await asyncio.gather(*(call(s) for s in shards), return_exceptions=True):
            if isinstance(result, BaseException):
                raise result

    async def pull(self) -> None:
        """Wait until every shard has written its answer to our push into our arenas. A
        mapped arena drops our edits in place first, while the shards work (a walk of its
        page tables: 0.5-0.8 ms at 132 MB, 7-11 ms at 1.3 GB on this project's VM; once done
        after the answer came)."""
        if self._shared is not None:
            for s in range(self.num_shards):
                if self._shared.mapped[s]:
                    self._shared.refresh(s)
        await self._each([s for s in range(self.num_shards) if s not in self._answered],
                         self._pull)
        self.steps += 1
        self._sent.clear()
        self._answered.clear()

    async def _pull(self, shard: int) -> None:
        self._accept_params(shard, await self._expect(shard, "params"))
        self._answered.add(shard)

    def zero_grad(self) -> None:
        """Zero the gradient arenas in place (keeps ``param.grad`` bound to them); not the
        parts of sparse tables, whose gradients are rows outside the arenas (an arena of
        large tables would otherwise be cleared whole at every step)."""
        for s in range(self.num_shards):
            grads = self._region(s, "grads").view(torch.uint8)
            for start, end in self._dense_ranges(s):
                grads[start:end].zero_()
        if self._pusher is not None:
            self._pusher.reset()
        for p in self.model.parameters():
            if p.grad is not None and p.grad.is_sparse:
                p.grad = None  # sparse gradients live outside the arenas; start afresh

    # -- helpers --------------------------------------------------------------------------
    def _dense_ranges(self, shard: int) -> list[tuple[int, int]]:
        """Byte ranges of ``shard``'s gradient arena that autograd may write: all of it but
        the sparse tables on the dynamic path (cached per shard)."""
        cached = self._dense_cache.get(shard)
        if cached is not None:
            return cached
        size = self.plan.arena_bytes(shard)
        skip = sorted((e.offset, e.offset + e.nbytes) for e in self.plan.entries
                      if self._sparse is not None and e.kind == "dynamic"
                      and e.shard == shard)  # the grads arena has the params' layout
        ranges, at = [], 0
        for start, end in skip:
            if start > at:
                ranges.append((at, start))
            at = max(at, end)
        if at < size:
            ranges.append((at, size))
        self._dense_cache[shard] = ranges
        return ranges

    def _unmap(self) -> None:
        if self._shared is not None and self.binding is not None:
            self.binding = self._shared.unmap(self.binding)
            if self._sparse is not None:
                self._sparse.rebind(self.binding)
            if self._pusher is not None:
                self._pusher.reset()

    async def _expect(self, shard: int, kind: str) -> dict[str, Any]:
        return await self._links.expect(shard, kind, self.timeout)

    def _region(self, shard: int, arena: str) -> MemoryRegion:
        region: MemoryRegion = self.binding.regions[(shard, arena)]
        return region

    def _accept_params(self, shard: int, msg: dict[str, Any]) -> None:
        if msg["t"] == "params" and self._sparse is not None:
            self._sparse.accept(shard, msg)  # rows the shard wrote into our inbox
        link = self._links.shards[shard]
        link.version = msg["version"]
        if msg.get("hyper"):
            link.hyper = hyper_heard(shard, link.hyper, msg["hyper"])
        expected = msg["checksum"]
        if self.verify and expected is not None:
            got = checksum(self._region(shard, "params"))  # on the arena's device
            if got != expected:
                raise ProtocolError(f"shard {shard}: parameters of version {msg['version']} "
                                    f"fail their checksum ({got:#x} != {expected:#x})")

    # -- optimizer state (RemoteOptimizer.state_dict / load_state_dict) -------------------
    async def fetch_optimizer_state(self) -> list[tuple[dict[str, Any], optim_state.State]]:
        """Every shard's optimizer state: (manifest, state by entry label) per shard."""
        return await self._states.fetch(self.num_shards, self.plan, self.timeout)

    async def load_optimizer_state(self, hps: list[dict[str, Any]],
                                   states: list[optim_state.State]) -> None:
        """Load ``states[s]`` (by entry label) into shard ``s``'s optimizer, with the groups'
        hyperparameters ``hps``: into every shard, or (the first shard's error) into none.
        Every rank loads the same state between the same two steps (see
        :mod:`tensorx._ps.service.optim_load`)."""
        await self._states.load(self.num_shards, hps, states, self.timeout)


def ps_addresses(num_shards: int = 1, timeout: float = 300.0, store: Store | None = None
                 ) -> list[str]:
    """The shard addresses that ``tensorx ps --rendezvous`` (or ``ParameterServer.publish``)
    put in the launcher's store (under torchrun: ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
    ``MASTER_PORT``); waits until every shard is there. Blocking."""
    return lookup(store if store is not None else connect_store(timeout), num_shards, timeout)


def __getattr__(name: str) -> Any:
    if name == "RemoteOptimizer":  # served here once; its module imports this one
        raise AttributeError("tensorx.worker.RemoteOptimizer is gone: use "
                             "tensorx.RemoteOptimizer (from tensorx import RemoteOptimizer)")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
