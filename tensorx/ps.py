"""ParameterServer: one shard of parameters served over one-sided writes.

Each shard is one process (or one object) that owns its part of the parameters, one
gradient slot per worker and a real ``torch.optim`` optimizer over views of its arena. At
handshake a worker exports its parameter arena and gets its slot's descriptor; from then
on a step is::

    worker: write(grads -> its slot on the shard); notify(push)
    shard:  average/apply as the mode says; write(params -> worker's arena); notify(params)

Same host, sync mode (``share_memory=True``, the default): the parameter arena and the
slots live in /dev/shm, a worker on this host maps them and its model's tensors are views
of them, so neither write happens; a step is ``notify(push)``, apply, ``notify(params)``.

The shard handles one event at a time, so an update never runs while parameters are being
written out of the arena: a worker never sees a half-applied update, and since a push
notification is ordered after its gradient write, a partial gradient is never applied.

A worker that goes away (killed mid-push, crashed, cut off) loses what it had pushed for
the barrier in progress, and its gradient slot is replaced by fresh memory with a fresh
descriptor (the old one is revoked, its /dev/shm file unlinked): nothing a dead connection
wrote can ever be applied, and a restarted worker re-handshakes into a clean slot. How long
a sync barrier waits for it, and what then, is ``on_worker_loss`` (see
:mod:`tensorx._ps.losses`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from typing import TYPE_CHECKING, Any

from tensorx._ps import observe, protocol
from tensorx._ps.admission import PROBE_S, holder_alive, rank_taken
from tensorx._ps.answer import Peer, apply_in_parts, send_params
from tensorx._ps.checkpoint import check_schedule
from tensorx._ps.grads import GradHook, GradProcessing
from tensorx._ps.inbox import Event as _Event
from tensorx._ps.inbox import Inbox
from tensorx._ps.losses import LossWatch
from tensorx._ps.nonfinite import NonFiniteGuard
from tensorx._ps.normx import NormExchange
from tensorx._ps.optim_service import OptimService
from tensorx._ps.rendezvous import connect_store as launcher_store
from tensorx._ps.rendezvous import publish as _publish
from tensorx._ps.schedule import MODES, Decision, Scheduler
from tensorx._ps.shard import (
    OptimizerFactory,
    SchedulerFactory,
    ShardLayout,
    ShardState,
    checkpoint_path,
    load_checkpoint,
)
from tensorx._ps.sharing import Sharing
from tensorx._ps.sparse import SparseReceiver, dynamic_path_ok
from tensorx._ps.stats import ShardTimings
from tensorx.endpoint import Endpoint
from tensorx.errors import (
    PlanMismatchError,
    ProtocolError,
    TensorxError,
    UsageError,
)
from tensorx.memregion import RegionDescriptor
from tensorx.node import Node

if TYPE_CHECKING:
    from tensorx.graph_analyzer import TransferPlan

__all__ = ["UNTIL", "ParameterServer", "launcher_store"]

logger = logging.getLogger(__name__)

UNTIL = (None, "workers_done")  # what serve() may wait for besides stop()




def _default_optimizer(params: list[Any]) -> Any:
    import torch

    return torch.optim.SGD(params, lr=0.1)


class ParameterServer:
    """One parameter-server shard. ``async with ParameterServer(...) as ps: await ps.serve()``.

    ``mode``: ``"sync"``, ``"async"`` or ``"bounded"`` (with ``staleness``).
    ``optimizer``: ``lambda params: torch.optim.X(params, ...)``, called once on tensors that
    view the shard's arena; ``lr_scheduler``: ``lambda opt: ...``, stepped after each update.
    Initial parameters come from the checkpoint in ``checkpoint_dir`` when there is one, else
    from worker rank 0. ``checkpoint_every``: also checkpoint every N updates;
    ``checkpoint_keep``: checkpoints kept (a damaged newest one falls back to the one before;
    see :mod:`tensorx._ps.checkpoint` for durability and permissions). A checkpoint that
    fails (disk full) is logged and counted; training goes on.
    ``token`` (default ``$TENSORX_TOKEN``) is required to listen beyond loopback, unless
    ``insecure=True``. ``log_every``: seconds between throughput log lines (None: never).
    ``flat``: the optimizer sees a few flat parameters per shard (parts of at most 16 MiB)
    instead of one per tensor: much faster on a CPU server, and the update is applied part
    by part while finished parts are already being written back to the workers (right for
    elementwise optimizers only, see ShardState).
    ``share_memory``: in sync mode, offer workers on this host (same :func:`host_id`: same
    kernel, /dev/shm and network namespace) to map the parameter arena and their gradient
    slot, so that a step copies nothing; ``False`` always copies.
    ``on_worker_loss`` (``"wait"``, the default, or ``"continue"``) and
    ``worker_loss_timeout`` (seconds, default 30; None: no timer, wait silently): in sync
    mode, once a worker has been disconnected that long, keep waiting for it to rejoin (one
    WARNING) or complete barriers with the ranks still connected until it rejoins (one
    WARNING). See :mod:`tensorx._ps.losses`; async and bounded modes never wait for a
    departed worker. A departed worker's pushed gradient for the barrier in progress is
    dropped, never applied. A worker that *said goodbye* (``aclose()``) is finished, not
    lost: sync barriers go on without it at once (uneven step counts just work: the last
    rounds average over the ranks still training) until it joins again. A worker held at
    the barrier by an absent rank is told which and why, and its TimeoutError says so.
    ``clip_grad_norm`` (sync mode): clip the averaged gradient to this global 2-norm, over
    all shards, as ``torch.nn.utils.clip_grad_norm_`` would on one process (the shards
    exchange their partial sums of squares, see :mod:`tensorx._ps.normx`).
    ``grad_hook``: ``callable(named_grads)`` run on this shard's averaged gradient before
    clipping and the step (see :mod:`tensorx._ps.grads`).
    ``send_timeout`` (seconds, default 10; None: no limit): how long writing a worker its
    parameters (or its welcome, or an error) may take. A worker that misses it (stopped,
    hung, or on a link too slow for it) is dropped at once, its connection aborted, and
    treated as departed: async and bounded modes go on without it, sync mode per
    ``on_worker_loss``; with ``reconnect`` it rejoins when it can. So a stopped worker
    holds the others up for at most this long, once.
    ``on_nonfinite`` (``"skip"``, the default, or ``"refuse"``): what to do with a pushed
    gradient that holds NaN or Inf (never applied; logged with its rank, counted in
    ``stats["nonfinite"]``); see :mod:`tensorx._ps.nonfinite`.
    ``node_options``: further :class:`tensorx.Node` options, e.g.
    ``{"ucx_options": {"error_handling": False}}`` or ``{"require": "rdma"}``.
    ``metrics_port``: serve this shard's step timings and endpoint counters for Prometheus
    at ``http://metrics_addr:PORT/metrics`` (0: any free port; :attr:`metrics_port` then
    says which). None (the default): nothing listens. Timings are always kept, in
    :attr:`stats` (totals) and :attr:`timings` (histograms, see ``tensorx._ps.stats``).
    """

    def __init__(self, listen: str = "tcp://127.0.0.1:0", *, num_workers: int,
                 mode: str = "sync", optimizer: OptimizerFactory | None = None,
                 lr_scheduler: SchedulerFactory | None = None, staleness: int = 0,
                 shard: int = 0, num_shards: int = 1,
                 checkpoint_dir: str | os.PathLike[str] | None = None,
                 checkpoint_every: int | None = None, checkpoint_keep: int = 2,
                 token: str | bytes | None = None,
                 transport: str = "auto", timeout: float | None = 30.0,
                 insecure: bool = False, log_every: float | None = 60.0,
                 flat: bool = False, share_memory: bool = True,
                 on_worker_loss: str = "wait", worker_loss_timeout: float | None = 30.0,
                 on_nonfinite: str = "skip", send_timeout: float | None = 10.0,
                 node_options: dict[str, Any] | None = None,
                 metrics_port: int | None = None, metrics_addr: str = "127.0.0.1",
                 clip_grad_norm: float | None = None,
                 grad_hook: GradHook | None = None) -> None:
        if mode not in MODES:
            raise UsageError(f"mode must be one of {MODES}, got {mode!r}")
        if clip_grad_norm is not None and mode != "sync":
            raise UsageError(f"clip_grad_norm clips the averaged gradient of a sync update; "
                             f"in mode={mode!r} each push is applied alone, so clip it on "
                             "the worker (torch.nn.utils.clip_grad_norm_ before step())")
        if not 0 <= shard < num_shards:
            raise UsageError(f"shard {shard} outside 0..{num_shards - 1}")
        check_schedule(checkpoint_every, checkpoint_keep)
        if log_every is not None and not log_every >= 0:
            raise UsageError(f"log_every must be >= 0 seconds or None, got {log_every}")
        self.mode = mode
        self.num_workers = num_workers
        self.shard = shard
        self.num_shards = num_shards
        self.timeout = timeout
        if send_timeout is not None and not send_timeout > 0:
            raise UsageError(f"send_timeout must be > 0 seconds or None, got {send_timeout!r}")
        self.send_timeout = send_timeout
        self.checkpoint_dir = checkpoint_dir
        self.checkpoint_every = checkpoint_every
        self.checkpoint_keep = checkpoint_keep
        self._saved_version: int | None = None  # the version the newest checkpoint holds
        self.log_every = log_every
        self.flat = flat
        self.share_memory = share_memory
        self._optimizer = optimizer or _default_optimizer
        self._lr_scheduler = lr_scheduler
        self.scheduler = Scheduler(mode, num_workers, staleness)
        self.losses = LossWatch(shard, on_worker_loss, worker_loss_timeout, self._post_lost)
        self.nonfinite = NonFiniteGuard(shard, on_nonfinite)
        self.node = Node(listen, transport=transport, token=token, timeout=timeout,
                         insecure=insecure, **(node_options or {}))
        self._norms = NormExchange(self.node, shard, num_shards, timeout) \
            if clip_grad_norm is not None and num_shards > 1 else None
        self.grads = GradProcessing(clip_grad_norm, grad_hook, self._norms)
        self.state: ShardState | None = None
        self._plan: TransferPlan | None = None
        self._plan_bytes = b""
        self._peers: dict[Endpoint, Peer] = {}
        self._waiting: list[Peer] = []    # said hello before the parameters were initialised
        self._finished: set[int] = set()  # ranks that said goodbye (until they join again)
        self._until: str | None = None     # serve(until=...)
        self._slot_descs: dict[int, RegionDescriptor] = {}
        self._header_descs: dict[int, bytes] = {}
        self._sparse: SparseReceiver | None = None
        self.sharing = Sharing(shard, mode, share_memory)  # same-host mapping offers
        self.optim = OptimService(shard, self.node)  # RemoteOptimizer's requests
        self._events = Inbox(f"ps shard {shard}")  # bounded per peer
        self._tasks: list[asyncio.Task[None]] = []
        self._stopped = asyncio.Event()
        self._closed = False
        self._initialised = False  # parameters came from rank 0 or a checkpoint
        self._resumed = False      # ... from a checkpoint: the plan is never released
        self.stats: dict[str, Any] = {"updates": 0, "pushes": 0, "max_gap": 0,
                                      "max_version_lag": 0, "apply_s": 0.0,
                                      "barrier_s": 0.0, "send_s": 0.0, "sparse_rows": 0,
                                      "worker_losses": 0, "nonfinite": 0,
                                      "checkpoint_failures": 0}
        self.timings = ShardTimings(sync=mode == "sync")
        self.metrics_port = metrics_port
        self.metrics_addr = metrics_addr
        self._metrics: Any = None  # the HTTP server, once started

    # -- lifecycle ------------------------------------------------------------------------
    async def start(self) -> ParameterServer:
        """Listen and start serving in the background. Starting a started server is a no-op."""
        if self._tasks:
            return self
        await self.node.start()
        try:
            self._restore()
            self._metrics = observe.start_exporter(self.metrics_port, self.metrics_addr,
                                                   self.node, self)
            if self._metrics is not None:
                self.metrics_port = self._metrics.server_port
        except BaseException:
            await self.node.aclose()
            raise
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._pump_notifications()),
                       loop.create_task(self._pump_disconnects()),
                       loop.create_task(self._run())]
        if self.log_every:
            self._tasks.append(loop.create_task(
                observe.report(self, self.log_every, lambda: len(self._peers))))
        if self._initialised and self.mode == "sync":
            # resumed from a checkpoint: every rank is expected back, and one that does not
            # come back is a loss like any other (a fresh server waits for its first workers)
            for rank in range(self.num_workers):
                self.losses.gone(rank)
        logger.info("ps shard %d/%d listening on %s: mode=%s workers=%d", self.shard,
                    self.num_shards, self.node.address, self.mode, self.num_workers)
        return self

    @property
    def address(self) -> str:
        return self.node.address

    @property
    def version(self) -> int:
        return self.state.version if self.state is not None else 0

    async def serve(self, until: str | None = None) -> None:
        """Serve until :meth:`stop` (or SIGTERM in the CLI); then checkpoint and close.

        ``until="workers_done"``: also return once every rank ``0..num_workers-1`` has said
        goodbye (a worker's ``aclose()``, leaving its ``async with`` block, closing a
        :class:`~tensorx.worker.RemoteOptimizer`). A worker that crashed has not: the
        server keeps waiting for it to rejoin."""
        if until not in UNTIL:
            raise UsageError(f"until must be one of {UNTIL}, got {until!r}")
        self._until = until
        if not self._tasks:
            await self.start()
        self._check_done()
        try:
            await self._stopped.wait()
        finally:
            await self.aclose()

    def publish(self, store: Any = None) -> Any:
        """Publish this shard's address in the launcher's TCPStore (default: the torchrun
        one, see :func:`launcher_store`) for :func:`tensorx.worker.ps_addresses`; blocking.
        Returns the store: keep it referenced while serving, it may be hosted here."""
        store = store if store is not None else launcher_store()
        _publish(store, self.shard, self.address)
        return store

    def stop(self) -> None:
        """Ask :meth:`serve` to return (it checkpoints first). Safe from signal handlers."""
        self._stopped.set()

    async def aclose(self) -> None:
        """Checkpoint (if a directory was given), close the node and free memory. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stopped.set()
        self.losses.close()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        exporter, self._metrics = self._metrics, None
        await observe.stop_exporter(exporter)
        try:
            self.checkpoint()
        finally:
            if self._norms is not None:
                await self._norms.aclose()
            await self.node.aclose()
            if self.state is not None:
                self.state.close()
            if self._sparse is not None:
                self._sparse.close()

    async def __aenter__(self) -> ParameterServer:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # -- checkpoints ----------------------------------------------------------------------
    def checkpoint(self) -> bool:
        """Checkpoint now (when a directory was given); whether one was written. A failure
        (disk full, ...) is an ERROR line and counts in ``stats["checkpoint_failures"]``;
        training goes on and the previous checkpoints stay as they were."""
        if self.checkpoint_dir is None or self.state is None:
            return False
        if self.state.version == self._saved_version:
            return False  # nothing new: the one there stays, and so does the one before it
        path = checkpoint_path(self.checkpoint_dir, self.shard, self.num_shards)
        try:
            self.state.save(path, self._plan_bytes, self.checkpoint_keep)
        except (OSError, RuntimeError, UsageError) as exc:
            self.stats["checkpoint_failures"] += 1
            logger.error("ps shard %d: checkpoint of version %d to %s failed, the previous "
                         "one stays: %s: %s", self.shard, self.state.version, path,
                         type(exc).__name__, exc)
            return False
        self._saved_version = self.state.version
        return True

    def _restore(self) -> None:
        if self.checkpoint_dir is None:
            return
        path = checkpoint_path(self.checkpoint_dir, self.shard, self.num_shards)
        saved = load_checkpoint(path, self.checkpoint_keep)
        if saved is None:
            return
        self._adopt_plan(bytes(saved["plan"]))
        assert self.state is not None
        self.state.load_state_dict(saved)
        self._initialised = self._resumed = True
        self._saved_version = self.state.version
        logger.info("ps shard %d resumed from %s at version %d", self.shard, path,
                    self.state.version)

    def _adopt_plan(self, plan_bytes: bytes) -> TransferPlan:
        from tensorx.graph_analyzer import TransferPlan

        plan = TransferPlan.from_bytes(plan_bytes)
        if plan.num_shards != self.num_shards:
            raise UsageError(f"plan has {plan.num_shards} shards, this server "
                             f"{self.num_shards}")
        layout = ShardLayout.from_plan(plan, self.shard)
        # the optimizer factory runs here: if it raises (a foreign optimizer is a
        # UsageError), the plan is not adopted and the next hello tries again
        try:
            state = ShardState(layout, self.num_workers, self._optimizer,
                               self._lr_scheduler, flat=self.flat,
                               shared=self.share_memory and self.mode == "sync")
        except (OSError, MemoryError, RuntimeError, OverflowError) as exc:
            raise UsageError(f"cannot build this shard's state for the plan ({layout.nbytes} B "
                             f"per arena, {self.num_workers + 2} arenas): {exc}") from exc
        try:
            sparse = SparseReceiver(plan, self.shard, self.num_workers) \
                if dynamic_path_ok(plan) and plan.header_bytes(self.shard) else None
        except BaseException:
            state.close()
            raise
        self.state, self._sparse = state, sparse
        self._plan, self._plan_bytes = plan, plan_bytes
        return plan

    def _release_plan_if_idle(self) -> None:
        """No worker left before the first update: forget the plan, so that the next hello
        sets it (a worker of another model that said hello and left must not lock it)."""
        if self._peers or self._plan is None or self._resumed or self.version:
            return
        logger.info("ps shard %d: every worker left before the first update; plan %s "
                    "released (the next hello sets it)", self.shard, self._plan.fingerprint)
        state, sparse = self.state, self._sparse
        self._plan, self._plan_bytes, self.state, self._sparse = None, b"", None, None
        self._initialised = False
        self._slot_descs.clear()
        self._header_descs.clear()
        for rank in range(self.num_workers):
            self.losses.back(rank)  # a fresh shard waits for its first workers silently
        if state is not None:
            state.close()
        if sparse is not None:
            sparse.close()

    # -- event loop -----------------------------------------------------------------------
    async def _pump_notifications(self) -> None:
        while True:
            ep, payload = await self.node.notifications.get()
            # a peer shard's gradient norm is taken here: the service loop may wait for it
            if self._norms is None or ep in self._peers or not self._norms.take(ep, payload):
                self._events.offer(ep, payload)

    async def _pump_disconnects(self) -> None:
        while True:
            ep = await self.node.disconnected.get()
            if self._norms is not None and self._norms.owns(ep):
                self._norms.lost(ep)
            else:
                self._events.post(_Event("gone", ep))

    def _post_lost(self, rank: int) -> None:
        self._events.post(_Event("lost", None, rank=rank))

    async def _run(self) -> None:
        """The one consumer of events: updates and writes out of the arena never interleave."""
        while True:
            event = await self._events.get()
            try:
                try:
                    await self._dispatch(event)
                except TensorxError as exc:
                    if event.ep is None:
                        raise
                    await self._refuse(event.ep, exc)
            except Exception:  # one bad peer or bug must not stop the service
                logger.exception("ps shard %d: failed handling a message", self.shard)

    async def _dispatch(self, event: _Event) -> None:
        if event.kind == "lost":
            decision = self.losses.declare(event.rank, self.scheduler, self._connected())
            self.stats["worker_losses"] = self.losses.declared
            await self._act(decision)
        elif event.ep is not None and event.kind == "gone":
            await self._leave(event.ep, "disconnected")
        elif event.ep is not None:
            await self._handle(event.ep, event.payload)

    def _connected(self) -> list[int]:
        return sorted(p.rank for p in self._peers.values())

    async def _handle(self, ep: Endpoint, payload: bytes) -> None:
        msg = protocol.decode(payload)
        kind = msg["t"]
        if kind == "hello":
            await self._hello(ep, msg)
        elif kind == "push":
            await self._push(ep, msg)
        elif kind == "bye":
            await self._goodbye(ep)
        elif kind in ("state_get", "state_done", "state_put"):
            self._saved_version = None  # a loaded optimizer state is worth a checkpoint
            await self._optim_request(ep, kind, msg)
        else:
            raise ProtocolError(f"unexpected {kind!r} message from a worker")

    async def _refuse(self, ep: Endpoint, exc: TensorxError) -> None:
        logger.warning("ps shard %d refused %s: %s", self.shard, ep.peer, exc)
        with contextlib.suppress(TensorxError):
            await ep.notify(protocol.encode("error", code=type(exc).__name__, msg=str(exc)),
                            timeout=self.send_timeout)
        if ep in self._peers:
            await self._leave(ep, f"refused ({type(exc).__name__})")

    async def _optim_request(self, ep: Endpoint, kind: str, msg: dict[str, Any]) -> None:
        if ep not in self._peers or self.state is None or not self._initialised:
            raise ProtocolError(f"{kind} before a completed handshake")
        if kind == "state_get":
            await self.optim.lend(ep, self.state, self.timeout)
        elif kind == "state_done":
            self.optim.returned(ep)
        else:
            await self.optim.load(ep, msg, self.state, self.timeout)

    # -- handshake ------------------------------------------------------------------------
    async def _hello(self, ep: Endpoint, msg: dict[str, Any]) -> None:
        protocol.check_hello(msg, self.shard, self.num_shards, self.num_workers)
        if ep in self._peers:
            raise ProtocolError("a second hello on one connection")
        await self._claim(msg["rank"])
        if self._norms is not None:
            self._norms.learn(msg.get("shards"))
        self._check_plan(msg)
        try:
            await self._admit(ep, msg)
        except BaseException:
            if ep in self._peers:  # undo the admission; _refuse still answers on ep
                await self._leave(ep, "refused at hello", close=False)
            self._release_plan_if_idle()
            raise

    async def _claim(self, rank: int) -> None:
        """Take ``rank`` from a holder that is gone; RankTakenError while it is alive."""
        for old in [e for e, p in self._peers.items() if p.rank == rank]:
            probe = PROBE_S if self.timeout is None else min(PROBE_S, self.timeout)
            if await holder_alive(old, probe):
                raise rank_taken(rank, old)
            await self._leave(old, "gone (a new connection claims its rank)")

    async def _admit(self, ep: Endpoint, msg: dict[str, Any]) -> None:
        assert self.state is not None
        rank = msg["rank"]
        peer = Peer(rank, ep, RegionDescriptor.from_bytes(msg["params"]))
        self._peers[ep] = peer
        self.state.verify = self.state.verify or msg["verify"]
        if rank not in self._slot_descs:
            self._slot_descs[rank] = self.node.export(self.state.slot_region(rank), access="w")
            self._header_descs[rank] = b"" if self._sparse is None else self.node.export(
                self._sparse.headers[rank], access="w").to_bytes()
        peer.offered = self.sharing.offer(self.state, rank, msg["share"])
        self.scheduler.join(rank)
        self._finished.discard(rank)
        away = self.losses.back(rank)
        logger.info("ps shard %d: worker rank %d joined from %s%s", self.shard, rank, ep.peer,
                    "" if away is None else f" (back after {away:.1f} s; fresh gradient slot)")
        if self._initialised or rank == 0:
            if not self._initialised:
                await ep.read(self.state.params_region, peer.params, timeout=self.timeout)
                self._initialised = True
                logger.info("ps shard %d: initial parameters from rank 0", self.shard)
            waiting, self._waiting = [*self._waiting, peer], []
            await asyncio.gather(*(self._welcome(p) for p in waiting))
        else:
            self._waiting.append(peer)

    def _check_plan(self, msg: dict[str, Any]) -> None:
        if self._plan is None:
            plan = self._adopt_plan(msg["plan"])
            logger.info("ps shard %d: %s", self.shard, plan.summary())
            return
        if msg["fingerprint"] != self._plan.fingerprint:
            self._plan.check_same(msg["plan"])
            raise PlanMismatchError(f"plan fingerprint {msg['fingerprint']} differs from "
                                    f"{self._plan.fingerprint}")

    async def _welcome(self, peer: Peer) -> None:
        assert self.state is not None
        try:
            # Written even when mapping is offered: the worker may yet fail to map and copy.
            await peer.ep.write(self.state.params_region, peer.params, notify=protocol.encode(
                "welcome", slot=self._slot_descs[peer.rank].to_bytes(),
                headers=self._header_descs[peer.rank], version=self.state.version,
                mode=self.mode, checksum=self.state.checksum(),
                share=self.sharing.offer_message(self.state, peer),
                optim=self.optim.welcome(peer.ep, self.state)),
                timeout=self.send_timeout)
        except TensorxError as exc:
            self._drop(peer, "at welcome", exc)

    # -- steps ----------------------------------------------------------------------------
    async def _push(self, ep: Endpoint, msg: dict[str, Any]) -> None:
        peer = self._peers.get(ep)
        if peer is None and ep.closed:
            return  # the last words of a connection that has left: never applied
        if peer is None or self.state is None or not self._initialised:
            raise ProtocolError("push before a completed handshake")
        self.sharing.check_mapped(peer, msg["mapped"])
        self.optim.pushed(peer.rank, msg["hyper"], self.state)
        peer.step = msg["step"]
        self.stats["pushes"] += 1
        lag = self.state.version - msg["version"]
        self.stats["max_version_lag"] = max(self.stats["max_version_lag"], lag)
        self.timings.pushed(peer.rank, peer.step, lag)
        if self._sparse is not None:
            self._sparse.announce(peer.rank, msg["staging"])
            self.stats["sparse_rows"] += await self._sparse.receive(
                ep, peer.rank, self.state.slot_region(peer.rank), self.timeout)
        await self._act(self.scheduler.push(peer.rank))
        if self.mode == "sync" and peer.rank in self.scheduler.pending:
            await self._tell_waiting([peer])

    async def _act(self, decision: Decision) -> None:
        assert self.state is not None
        by_rank = {p.rank: p for p in self._peers.values()}
        if decision.apply:
            decision = await self._drop_nonfinite(decision, by_rank)
            if self.state is None:
                return  # the refused rank was the last one: the plan was released
        targets = [by_rank[r] for r in decision.release if r in by_rank]
        sending: dict[int, list[asyncio.Future[None]]] = {}
        if decision.apply:
            self.stats["barrier_s"] += self.timings.barrier_done()
            t0 = time.perf_counter()
            if self.grads.active and not await self._process_grads(decision.apply, targets):
                return
            self.optim.before_update(decision.apply, self.state)
            copies = [p for p in targets if not p.mapped]
            if copies and self.state.num_parts > 1:
                sending = await apply_in_parts(self.state, decision.apply, copies,
                                               self.send_timeout)
            else:
                self.state.apply(decision.apply)
            self.stats["apply_s"] += self.timings.apply.since(t0)
            self.stats["updates"] += 1
            if self.checkpoint_every and self.state.version % self.checkpoint_every == 0:
                self.checkpoint()
        self.stats["max_gap"] = self.scheduler.max_gap
        t0 = time.perf_counter()
        await asyncio.gather(*(self._send_params(p, sending.get(p.rank)) for p in targets))
        self.stats["send_s"] += self.timings.sent(t0, len(targets))

    async def _process_grads(self, ranks: list[int], targets: list[Peer]) -> bool:
        """Hook and clip the averaged gradient, if asked; False (and the error to the
        workers) if a peer shard's norm is missing or the hook failed: no update then."""
        try:
            await self.grads.run(self.state, ranks)
        except Exception as exc:
            logger.error("ps shard %d: update %d not applied: %s", self.shard,
                         self.version + 1, exc)
            error = protocol.encode("error", code=type(exc).__name__, msg=str(exc))
            await asyncio.gather(*(p.ep.notify(error, timeout=self.timeout) for p in targets),
                                 return_exceptions=True)
            return False
        self.stats.update(grad_norm=self.grads.last_norm, norm_exchange_s=self.grads.exchange_s)
        return True
    async def _drop_nonfinite(self, decision: Decision, by_rank: dict[int, Peer]) -> Decision:
        """Leave out gradients holding NaN or Inf, per ``on_nonfinite``."""
        assert self.state is not None
        steps = {r: p.step for r, p in by_rank.items()}
        bad = self.nonfinite.check(self.state, decision.apply, steps)
        if not bad:
            return decision
        self.stats["nonfinite"] = self.nonfinite.count
        if self.nonfinite.policy == "refuse":
            for rank in bad:
                if rank in by_rank:
                    await self._refuse(by_rank[rank].ep,
                                       self.nonfinite.error(rank, steps[rank]))
        return self.nonfinite.decide(decision, bad)

    async def _send_params(self, peer: Peer,
                           sent: list[asyncio.Future[None]] | None = None) -> None:
        assert self.state is not None
        msg = protocol.encode("params", version=self.state.version, step=peer.step,
                              checksum=self.state.checksum(),
                              hyper=self.optim.answer(peer.ep, self.state))
        try:
            await send_params(self.state, peer, msg, sent, self.send_timeout)
        except TensorxError as exc:
            self._drop(peer, "", exc)

    def _drop(self, peer: Peer, when: str, exc: TensorxError) -> None:
        """A send to ``peer`` failed or missed ``send_timeout``: abort its connection at
        once (nothing of it may still read the arena, which the next update changes) and
        let the loop handle it as a departure."""
        logger.warning("ps shard %d: lost rank %d%s: %s", self.shard, peer.rank,
                       f" {when}" if when else "", exc)
        peer.ep.abort()
        self._events.post(_Event("gone", peer.ep))

    async def _leave(self, ep: Endpoint, why: str, close: bool = True) -> None:
        peer = self._peers.pop(ep, None)
        self.optim.forget(ep, None if peer is None else peer.rank)
        if peer is None:
            with contextlib.suppress(TensorxError):
                await ep.aclose()  # a refused or half-joined peer: release its connection
            return
        self._waiting = [p for p in self._waiting if p.ep is not ep]
        rank = peer.rank
        self._log_departure(rank, why)
        if close:
            with contextlib.suppress(TensorxError):
                await ep.aclose()
        self._retire_slot(rank)
        finished = rank in self._finished
        if self.mode == "sync" and not finished:
            self.losses.gone(rank)
        await self._act(self.scheduler.leave(rank))
        if self.mode == "sync" and finished:
            # a rank that said goodbye pushes no more: later barriers go on without it
            await self._act(self.scheduler.excuse(rank))
        elif self.mode == "sync":
            held = [p for p in self._peers.values() if p.rank in self.scheduler.pending]
            await self._tell_waiting(held)
        self._release_plan_if_idle()

    async def _goodbye(self, ep: Endpoint) -> None:
        peer = self._peers.get(ep)
        if peer is not None:
            self._finished.add(peer.rank)
        await self._leave(ep, "finished (said goodbye)")
        self._check_done()

    def _check_done(self) -> None:
        if self._until == "workers_done" and len(self._finished) == self.num_workers:
            if not self._stopped.is_set():
                logger.info("ps shard %d: every worker said goodbye; stopping", self.shard)
            self._stopped.set()

    async def _tell_waiting(self, held: list[Peer]) -> None:
        """Tell ranks held at the sync barrier which absent ranks it waits for and why, so
        that a worker that gives up names the cause, not just a timeout."""
        connected = self._connected()
        away = [r for r in self.scheduler.waiting_for() if r not in connected]
        if not away or not held:
            return
        note = protocol.encode("waiting", why=self.losses.explain(away))
        for peer in held:
            with contextlib.suppress(TensorxError):
                await peer.ep.notify(note, timeout=self.timeout)

    def _log_departure(self, rank: int, why: str) -> None:
        level, text = self.losses.departure(rank, why, rank in self.scheduler.pending,
                                            rank in self._finished, self.mode == "sync")
        logger.log(level, "ps shard %d: worker rank %d %s", self.shard, rank, text)

    def _retire_slot(self, rank: int) -> None:
        """Give ``rank`` fresh gradient memory. The old slot is closed: its descriptor is
        revoked at every peer and its /dev/shm file unlinked, so nothing a departed connection
        wrote (or might still write) there is ever applied; the next hello exports the new
        slot under a new descriptor."""
        if self.state is None or rank not in self._slot_descs:
            return
        del self._slot_descs[rank], self._header_descs[rank]
        self.state.renew_slot(rank)
        if self._sparse is not None:
            self._sparse.renew(rank)
