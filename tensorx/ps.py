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

The shard handles one message at a time (a session per peer, taking turns: see
:mod:`tensorx._ps.service.loop`), and an update never runs on an arena that
parameters are being written out of (async and bounded answers in flight keep theirs, see
:mod:`tensorx._ps.service.outbox`): a worker never sees a half-applied update, and since a push
notification is ordered after its gradient write, a partial gradient is never applied. In
sync mode a shard with a flat update in several parts applies each part as soon as every
worker's part has landed and writes it back at once, while later parts still arrive; a
part applied early is backed up, and restored if the push does not complete (see
:mod:`tensorx._ps.service.round`), so this holds there too.

A worker that goes away (killed mid-push, crashed, cut off) loses what it had pushed for
the barrier in progress, and its gradient slot is replaced by fresh memory with a fresh
descriptor (the old one is revoked, its /dev/shm file unlinked): nothing a dead connection
wrote can ever be applied, and a restarted worker re-handshakes into a clean slot. How long
a sync barrier waits for it, and what then, is ``on_worker_loss`` (see
:mod:`tensorx._ps.service.losses`).

This module is the server's public face (its settings, lifecycle and checkpoints) and
where its parts are built and wired, each with what it needs (its settings come grouped
in :class:`~tensorx._ps.service.options.ShardOptions`): :mod:`~tensorx._ps.service.plan`
(the plan and the state built from it), :mod:`~tensorx._ps.service.answer` (what an
update's workers are answered), :mod:`~tensorx._ps.service.pipelined` (a sync update
applied part by part), :mod:`~tensorx._ps.service.steps` (a push and the update it
completes), :mod:`~tensorx._ps.service.session` (a worker's hello, welcome and departure)
and :mod:`~tensorx._ps.service.loop` (a session per peer, taking turns). Each is built
after those it calls; the few calls that go the other way (a round welcomes the workers
it deferred, an update refuses a gradient, the node hands over a connection) are callables
given at construction, which the server forwards to the part built later.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any, Generic, NoReturn, TypeVar, overload

from tensorx._ps.common.device import resolve as resolve_device
from tensorx._ps.common.rendezvous import connect_store as launcher_store
from tensorx._ps.common.rendezvous import publish as _publish
from tensorx._ps.common.stats import ShardTimings
from tensorx._ps.service import observe
from tensorx._ps.service.answer import Answers, Peer
from tensorx._ps.service.applier import Applier
from tensorx._ps.service.grads import GradHook, GradProcessing
from tensorx._ps.service.loop import ServiceLoop
from tensorx._ps.service.losses import LossWatch
from tensorx._ps.service.nonfinite import NonFiniteGuard
from tensorx._ps.service.norm_exchange import NormExchange
from tensorx._ps.service.optim_service import OptimService
from tensorx._ps.service.options import ShardOptions
from tensorx._ps.service.outbox import Outbox
from tensorx._ps.service.pipelined import PipelinedRounds
from tensorx._ps.service.plan import PlanHolder
from tensorx._ps.service.samehost import Sharing
from tensorx._ps.service.schedule import MODES, Scheduler
from tensorx._ps.service.session import Sessions
from tensorx._ps.service.steps import Updates
from tensorx._ps.state.checkpoint import check_schedule
from tensorx._ps.state.shard import OptimizerFactory, SchedulerFactory, ShardState, checkpoint_path
from tensorx.endpoint import Endpoint
from tensorx.errors import TensorxError, UsageError
from tensorx.node import Node

__all__ = ["UNTIL", "ParameterServer", "launcher_store"]

logger = logging.getLogger(__name__)
T = TypeVar("T")

UNTIL = (None, "workers_done")  # what serve() may wait for besides stop()


def _default_optimizer(params: list[Any]) -> Any:
    import torch  # noqa: PLC0415 (optional dependency)

    return torch.optim.SGD(params, lr=0.1)


class _Setting(Generic[T]):
    """A setting of the server as its constructor took it, read from its options: fixed
    (its parts were built with it), so assigning one is a UsageError, never ignored."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, obj: None, objtype: type | None = None) -> _Setting[T]: ...

    @overload
    def __get__(self, obj: ParameterServer, objtype: type | None = None) -> T: ...

    def __get__(self, obj: ParameterServer | None, objtype: type | None = None) -> Any:
        return self if obj is None else getattr(obj._options, self.name)  # noqa: SLF001 (its own server)

    def __set__(self, obj: ParameterServer, value: object) -> NoReturn:
        raise UsageError(f"ParameterServer.{self.name} is fixed once the server is built "
                         f"(its parts use it): pass {self.name}= to ParameterServer(...)")


class ParameterServer:
    """One parameter-server shard. ``async with ParameterServer(...) as ps: await ps.serve()``.

    ``mode``: ``"sync"``, ``"async"`` or ``"bounded"`` (with ``staleness``).
    ``optimizer``: ``lambda params: torch.optim.X(params, ...)``, called once on tensors that
    view the shard's arena; ``lr_scheduler``: ``lambda opt: ...``, stepped after each update.
    A sparse table (``nn.Embedding(sparse=True)``, ``EmbeddingBag``) gets a sparse gradient,
    as in one process: the rows the update's workers touched, averaged (see
    :mod:`tensorx._ps.rows.tables`), so ``SGD``, ``Adagrad`` and ``SparseAdam`` step O(rows
    touched). A step the optimizer refuses (Adam given a sparse gradient) is not applied,
    and every worker of that update gets :class:`~tensorx.errors.OptimizerError` naming the
    tensor.
    Initial parameters come from the checkpoint in ``checkpoint_dir`` when there is one, else
    from worker rank 0. ``checkpoint_every``: also checkpoint every N updates;
    ``checkpoint_keep``: checkpoints kept (a damaged newest one falls back to the one before;
    see :mod:`tensorx._ps.state.checkpoint` for durability and permissions). A checkpoint that
    fails (disk full) is logged and counted; training goes on. Resuming restores the
    optimizer's state with its hyperparameters, as torch's ``load_state_dict`` does: the
    checkpoint's ``lr`` wins over the factory's (one WARNING per value the factory gives
    differently), and an optimizer of another class, or one the state does not fit, is
    refused (UsageError) before anything is replaced; so is the LR scheduler's state (an
    uninterrupted run's lr; another scheduler class refused, one missing on either side
    named in a WARNING: docs/faults.md). ``resume_optimizer=False`` resumes
    the parameters (and version) alone, with a fresh optimizer and LR schedule from the
    factories. See :mod:`tensorx._ps.state.resume`.
    ``token`` (default ``$TENSORX_TOKEN``) is required to listen beyond loopback, unless
    ``insecure=True``. ``log_every``: seconds between throughput log lines (None: never).
    ``flat``: how the update runs. ``None`` (the default): when the optimizer is
    elementwise (SGD, Adam, AdamW, RMSprop, Adagrad, Adamax, NAdam, RAdam, Adadelta, ASGD,
    Rprop; not a user-defined one nor a subclass, nor one that looks at whole tensors), as
    one fused or ``foreach`` pass over each contiguous range of the arena (one or more per
    param group, of at most 16 MiB), which gives the same parameters as stepping each
    tensor, many times faster for many small tensors, and is applied range by range while
    finished ranges are already being written back to the workers (sparse tables are left
    out and step first, per tensor, with their sparse gradients); otherwise per tensor.
    Either way the optimizer sees the model's named, shaped parameters, and its
    ``state_dict``, checkpoints, LR schedulers and :class:`~tensorx.RemoteOptimizer` work
    as with ``flat=False``. One INFO line per shard says which update runs and why. On
    a GPU shard (``device="cuda"``) the flat update is applied whole (a few fused kernel
    launches), not range by range.
    ``False``: always per tensor. ``True``: the optimizer itself sees a few flat parameters
    per shard (``flat.0``, ...) instead of one per tensor (elementwise optimizers only; no
    optimizer state transfer; see ShardState).
    ``share_memory``: in sync mode, offer workers on this host (same :func:`host_id`: same
    kernel, /dev/shm and network namespace) to map the parameter arena and their gradient
    slot, so that a step copies nothing; ``False`` always copies. Host memory only: a
    server on a GPU offers nothing (one INFO line says so).
    ``device``: ``"cpu"`` (the default), ``"cuda"`` (the current CUDA device) or
    ``"cuda:N"``: where the shard's parameter arena, gradient slots, optimizer state and
    every other per-shard tensor live and where the update runs. Workers write gradients
    straight into its GPU slots and read parameters straight out of its GPU arena (UCX
    reaches GPU memory directly; TCP stages it through host). Checkpoints hold CPU tensors
    either way, so one written by a CPU server resumes on a GPU server and vice versa.
    See :mod:`tensorx._ps.common.device`.
    ``on_worker_loss`` (``"wait"``, the default, or ``"continue"``) and
    ``worker_loss_timeout`` (seconds, default 30; None: no timer, wait silently): in sync
    mode, once a worker has been disconnected that long, keep waiting for it to rejoin (one
    WARNING) or complete barriers with the ranks still connected until it rejoins (one
    WARNING). Under ``"continue"`` a rank that stays connected but has not pushed that long
    after a barrier's first push is lost too (one WARNING): the barrier goes on without it,
    and its late push is refused (:class:`~tensorx.errors.BrokenError`, its connection
    closed; with ``reconnect`` it rejoins). See :mod:`tensorx._ps.service.losses`; async and
    bounded modes never wait for a departed worker. A worker retrying a step that timed out
    is taken once (:mod:`tensorx._ps.service.schedule`). A departed worker's pushed gradient for the
    barrier in progress is dropped, never applied. A worker that *said goodbye*
    (``aclose()``) is finished, not lost: sync barriers go on without it at once (uneven
    step counts just work: the last rounds average over the ranks still training) until it
    joins again. A worker held at the barrier by an absent rank is told which and why, and
    its TimeoutError says so.
    ``clip_grad_norm`` (sync mode): clip the averaged gradient to this global 2-norm, over
    all shards, as ``torch.nn.utils.clip_grad_norm_`` would on one process (the shards
    exchange their partial sums of squares, see :mod:`tensorx._ps.service.norm_exchange`).
    ``grad_hook``: ``callable(named_grads)`` run on this shard's averaged gradient before
    clipping and the step (see :mod:`tensorx._ps.service.grads`).
    ``send_timeout`` (seconds, default 10; None: no limit): how long writing a worker its
    parameters (or its welcome, or an error) may take. A worker that misses it (stopped,
    hung, or on a link too slow for it) is dropped at once, its connection aborted, and
    treated as departed: async and bounded modes go on without it, sync mode per
    ``on_worker_loss``; with ``reconnect`` it rejoins when it can. In async and bounded
    modes a slow worker holds nobody up meanwhile (each answer is sent on its own; an update
    due while one is in flight goes to a copy of the arena: :mod:`tensorx._ps.service.outbox`); a
    sync round waits for it at most this long, once.
    ``on_nonfinite`` (``"skip"``, the default, or ``"refuse"``): what to do with a pushed
    gradient that holds NaN or Inf (never applied; logged with its rank, counted in
    ``stats["nonfinite"]``); see :mod:`tensorx._ps.service.nonfinite`.
    ``pipeline`` (sync mode, a flat update in several parts; see docs/architecture.md, "A
    pipelined round"): ``None`` (the default): the shard measures its first rounds both
    ways (parts applied as soon as every worker's has landed, with a backup each, or once
    the whole gradient is in) and keeps the faster, measuring again every 500 rounds (one
    INFO line says which and the medians); ``True`` / ``False`` force one. Either way a
    worker's push that does not complete leaves no trace, and a version is whole.
    ``node_options``: further :class:`tensorx.Node` options, e.g.
    ``{"ucx_options": {"error_handling": False}}`` or ``{"require": "rdma"}``.
    ``metrics_port``: serve this shard's step timings and endpoint counters for Prometheus
    at ``http://metrics_addr:PORT/metrics`` (0: any free port; :attr:`metrics_port` then
    says which). None (the default): nothing listens. Timings are always kept, in
    :attr:`stats` (totals) and :attr:`timings` (histograms, see ``tensorx._ps.common.stats``).
    """

    # the settings the constructor took, fixed from then on (see _Setting)
    mode = _Setting[str]()
    num_workers = _Setting[int]()
    shard = _Setting[int]()
    num_shards = _Setting[int]()
    timeout = _Setting["float | None"]()
    send_timeout = _Setting["float | None"]()
    checkpoint_dir = _Setting["str | os.PathLike[str] | None"]()
    checkpoint_every = _Setting["int | None"]()
    checkpoint_keep = _Setting[int]()
    resume_optimizer = _Setting[bool]()
    flat = _Setting["bool | None"]()
    share_memory = _Setting[bool]()
    device = _Setting[str]()

    def __init__(self, listen: str = "tcp://127.0.0.1:0", *, num_workers: int,  # noqa: PLR0913 (the public constructor's keyword options)
                 mode: str = "sync", optimizer: OptimizerFactory | None = None,
                 lr_scheduler: SchedulerFactory | None = None, staleness: int = 0,
                 shard: int = 0, num_shards: int = 1,
                 checkpoint_dir: str | os.PathLike[str] | None = None,
                 checkpoint_every: int | None = None, checkpoint_keep: int = 2,
                 resume_optimizer: bool = True,
                 token: str | bytes | None = None,
                 transport: str = "auto", timeout: float | None = 30.0,
                 insecure: bool = False, log_every: float | None = 60.0,
                 flat: bool | None = None, share_memory: bool = True,
                 on_worker_loss: str = "wait", worker_loss_timeout: float | None = 30.0,
                 on_nonfinite: str = "skip", send_timeout: float | None = 10.0,
                 node_options: dict[str, Any] | None = None,
                 metrics_port: int | None = None, metrics_addr: str = "127.0.0.1",
                 clip_grad_norm: float | None = None,
                 grad_hook: GradHook | None = None, device: str = "cpu",
                 pipeline: bool | None = None) -> None:
        device = resolve_device(device)
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
        if send_timeout is not None and not send_timeout > 0:
            raise UsageError(f"send_timeout must be > 0 seconds or None, got {send_timeout!r}")
        self._saved_version: int | None = None  # the version the newest checkpoint holds
        self.log_every = log_every
        self._options = ShardOptions(
            mode=mode, num_workers=num_workers, shard=shard, num_shards=num_shards,
            timeout=timeout, send_timeout=send_timeout, checkpoint_dir=checkpoint_dir,
            checkpoint_every=checkpoint_every, checkpoint_keep=checkpoint_keep,
            resume_optimizer=resume_optimizer, flat=flat, share_memory=share_memory,
            device=device, optimizer=optimizer or _default_optimizer,
            lr_scheduler=lr_scheduler, pipeline=pipeline)
        self.scheduler = Scheduler(mode, num_workers, staleness)
        self.losses = LossWatch(shard, on_worker_loss, worker_loss_timeout, self._post_lost,
                                self._post_overdue)
        self.nonfinite = NonFiniteGuard(shard, on_nonfinite)
        self.node = Node(listen, transport=transport, token=token, timeout=timeout,
                         insecure=insecure, handler=self._session, **(node_options or {}))
        self._norms = NormExchange(self.node, shard, num_shards, timeout) \
            if clip_grad_norm is not None and num_shards > 1 else None
        self.grads = GradProcessing(clip_grad_norm, grad_hook, self._norms)
        self._until: str | None = None  # serve(until=...)
        self.sharing = Sharing(shard, mode, share_memory, self.device)  # same-host mapping
        self.optim = OptimService(shard, self.node)  # RemoteOptimizer's requests
        self._applier = Applier()  # the apply thread: see tensorx._ps.service.applier
        # async and bounded modes: answers in flight, and the arenas they read
        self.outbox = Outbox(shard, limit=max(1, num_workers - 1))
        self.plans = PlanHolder(self._options, self.sharing.wanted, self.losses, self.outbox,
                                self._forget_slots)  # the plan, and the state built from it
        self._tasks: list[asyncio.Task[None]] = []
        self._started = False
        self._stopped = asyncio.Event()
        self._closed = False
        self.stats: dict[str, Any] = {
            "updates": 0, "pushes": 0, "max_gap": 0, "max_version_lag": 0, "apply_s": 0.0,
            "barrier_s": 0.0, "send_s": 0.0, "sparse_rows": 0, "worker_losses": 0,
            "nonfinite": 0, "checkpoint_failures": 0, "arena_moves": 0, "parts_early": 0,
            "rollbacks": 0}
        self.timings = ShardTimings(sync=mode == "sync")
        peers: dict[Endpoint, Peer] = {}  # the workers admitted, kept by self.sessions
        answers = Answers(self._options, self.plans, peers, self.optim)
        self.rounds = PipelinedRounds(
            self._options, self.plans, peers, scheduler=self.scheduler, optim=self.optim,
            nonfinite=self.nonfinite, grads=self.grads, timings=self.timings, stats=self.stats,
            applier=self._applier, answer=answers.sender, fail=answers.fail,
            welcome=self._welcome, refuse=self._refuse, checkpoint=self.checkpoint)
        self.updates = Updates(
            self._options, self.plans, peers, scheduler=self.scheduler,
            losses=self.losses, sharing=self.sharing, optim=self.optim, outbox=self.outbox,
            grads=self.grads, nonfinite=self.nonfinite, timings=self.timings, stats=self.stats,
            applier=self._applier, rounds=self.rounds, answers=answers, refuse=self._refuse,
            tell_waiting=self._tell_waiting, checkpoint=self.checkpoint)
        self.sessions = Sessions(
            self._options, peers, node=self.node, plans=self.plans, sharing=self.sharing,
            optim=self.optim, losses=self.losses, scheduler=self.scheduler, outbox=self.outbox,
            norms=self._norms, rounds=self.rounds, updates=self.updates,
            closed=lambda: self._closed)
        self.service = ServiceLoop(
            self._options, sessions=self.sessions, updates=self.updates, rounds=self.rounds,
            plans=self.plans, optim=self.optim, losses=self.losses, scheduler=self.scheduler,
            norms=self._norms, stats=self.stats, closed=lambda: self._closed,
            goodbye_done=self._check_done, optim_touched=self._optim_touched)
        self.metrics_port = metrics_port
        self.metrics_addr = metrics_addr
        self._metrics: Any = None  # the HTTP server, once started

    # -- lifecycle ------------------------------------------------------------------------
    async def start(self) -> ParameterServer:
        """Listen and start serving in the background. Starting a started server is a no-op."""
        if self._started:
            return self
        self._started = True
        async with self.service.turn:  # a session handles nothing before the checkpoint is loaded
            await self.node.start()
            try:
                resumed = self.plans.restore()
                if resumed is not None:
                    self._saved_version = resumed
                self._metrics = observe.start_exporter(self.metrics_port, self.metrics_addr,
                                                       self.node, self)
                if self._metrics is not None:
                    self.metrics_port = self._metrics.server_port
            except BaseException:
                await self.node.aclose()
                raise
        loop = asyncio.get_running_loop()
        if self.log_every:
            self._tasks.append(loop.create_task(
                observe.report(self, self.log_every, lambda: len(self.sessions.peers))))
        if self.plans.initialised and self.mode == "sync":
            # resumed from a checkpoint: every rank is expected back, and one that does not
            # come back is a loss like any other (a fresh server waits for its first workers)
            for rank in range(self.num_workers):
                self.losses.gone(rank)
        logger.info("ps shard %d/%d listening on %s: mode=%s workers=%d device=%s",
                    self.shard, self.num_shards, self.node.address, self.mode,
                    self.num_workers, self.device)
        return self

    @property
    def address(self) -> str:
        return self.node.address

    @property
    def version(self) -> int:
        return self.plans.version

    @property
    def state(self) -> ShardState | None:
        """This shard's memory (arenas, optimizer), once a plan is adopted."""
        return self.plans.state

    async def serve(self, until: str | None = None) -> None:
        """Serve until :meth:`stop` (or SIGTERM in the CLI); then checkpoint and close.

        ``until="workers_done"``: also return once every rank ``0..num_workers-1`` has said
        goodbye (a worker's ``aclose()``, leaving its ``async with`` block, closing a
        :class:`~tensorx.RemoteOptimizer`). A worker that crashed has not: the
        server keeps waiting for it to rejoin."""
        if until not in UNTIL:
            raise UsageError(f"until must be one of {UNTIL}, got {until!r}")
        self._until = until
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
        tasks = [*self._tasks, *self.service.tasks]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        exporter, self._metrics = self._metrics, None
        await observe.stop_exporter(exporter)
        await self.rounds.abandon()  # a checkpoint never holds part of an update
        try:
            self.checkpoint()
        finally:
            if self._norms is not None:
                await self._norms.aclose()
            await self.outbox.aclose(None if self.state is None
                                     else self.state.params_region)
            await self.node.aclose()
            self.plans.close()

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
            self.state.save(path, self.plans.plan_bytes, self.checkpoint_keep)
        except (OSError, RuntimeError, UsageError) as exc:
            self.stats["checkpoint_failures"] += 1
            logger.error("ps shard %d: checkpoint of version %d to %s failed, the previous "
                         "one stays: %s: %s", self.shard, self.state.version, path,
                         type(exc).__name__, exc)
            return False
        self._saved_version = self.state.version
        return True

    def _check_done(self) -> None:
        """``serve(until="workers_done")``: stop once every rank has said goodbye."""
        if self._until == "workers_done" and \
                len(self.sessions.finished) == self.num_workers:
            if not self._stopped.is_set():
                logger.info("ps shard %d: every worker said goodbye; stopping", self.shard)
            self._stopped.set()

    def _optim_touched(self) -> None:
        self._saved_version = None  # a loaded optimizer state is worth a checkpoint

    # -- calls forwarded to the parts built after the ones that make them ------------------
    async def _session(self, ep: Endpoint) -> None:
        await self.service.session(ep)

    def _post_lost(self, rank: int) -> None:
        self.service.post_lost(rank)

    def _post_overdue(self, barrier: int) -> None:
        self.service.post_overdue(barrier)

    async def _refuse(self, ep: Endpoint, exc: TensorxError) -> None:
        await self.service.refuse(ep, exc)

    def _forget_slots(self) -> None:
        self.sessions.forget_slots()

    async def _welcome(self, peer: Peer) -> None:
        await self.sessions.welcome(peer)

    async def _tell_waiting(self, held: list[Peer]) -> None:
        await self.sessions.tell_waiting(held)
