"""One shard's memory and math: parameter arena, gradient slots, optimizer, checkpoints.

No I/O on the wire here; :mod:`tensorx.ps` moves the bytes. The parameter arena is the
memory the optimizer updates *and* the memory the shard writes to workers from, so the
service never applies an update while a write from the arena is in flight (sync mode: it
handles one message at a time; async and bounded: the update goes to a copy of the arena,
:meth:`ShardState.move_params`), and a worker never sees a half-applied update.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from tensorx._ps.common.device import allocate_arenas, fence
from tensorx._ps.rows.changed import ChangedRows
from tensorx._ps.rows.tables import Rows, SparseRows
from tensorx._ps.state import checkpoint, resume
from tensorx._ps.state.checkpoint_format import (
    CHECKPOINT_FORMAT,
    load_checkpoint,
    read_checkpoint,
    to_cpu,
)
from tensorx._ps.state.shard_layout import (
    ShardLayout,
    Slot,
    dense_splitter,
    flat_splitter,
    param_splitter,
    single_dtype,
    views,
)
from tensorx._ps.update.flat import FlatUpdate
from tensorx._ps.update.fold import DenseFold, Units
from tensorx._ps.update.optim import build_optimizer, step_failure
from tensorx._ps.update.rowsgd import RowSGD
from tensorx._ps.update.step import TorchStep, choose, dense_grads
from tensorx._ps.wire.checksum import checksum
from tensorx.errors import UsageError
from tensorx.memregion import MemoryRegion

__all__ = ["CHECKPOINT_FORMAT", "OptimizerFactory", "SchedulerFactory", "ShardLayout",
           "ShardState", "Slot", "checksum", "load_checkpoint", "read_checkpoint", "to_cpu",
           "views"]

logger = logging.getLogger(__name__)

# factory(params) or factory(named_params=[(name, param), ...]): see tensorx._ps.update.optim
OptimizerFactory = Callable[..., torch.optim.Optimizer]
SchedulerFactory = Callable[[torch.optim.Optimizer], Any]


class ShardState:
    """Parameters, one gradient slot per worker, and a real ``torch.optim`` optimizer.

    The optimizer's parameters are the model's (named, shaped as in the model, in model
    order; see :mod:`tensorx._ps.update.optim`) as views of the arena, and their ``.grad`` views of
    an accumulator that holds the ranks' gradients folded out of their slots (the mean; one
    rank's copied: see :mod:`tensorx._ps.update.fold`), so momentum, Adam, param groups and LR
    schedulers work unchanged.
    ``flat=None`` (the default) steps an elementwise optimizer (SGD, Adam(W), RMSprop,
    Adagrad, ...: :func:`tensorx._ps.update.flat.elementwise`) as a few flat ranges of the arena,
    one or more per param group, with torch's fused or foreach kernels: the same result,
    far fewer kernel launches; the optimizer still sees (and its ``state_dict`` still holds)
    the model's parameters (see :mod:`tensorx._ps.update.flat`). Other optimizers, and
    ``flat=False``, step per tensor. One INFO line says which and why.
    ``flat=True`` gives the optimizer itself one flat parameter over the whole arena instead
    of one per tensor (named ``"flat.0"``, ...): right for elementwise optimizers only.
    (Large shards get a few flat ranges or parameters of at most ``parts.PART_BYTES``
    each, so that the update can be applied and sent part by part: :meth:`apply_part`.)
    Sparse tables (:mod:`tensorx._ps.rows.tables`) get sparse gradients, as in torch: the flat
    update leaves them out and steps them on their own, as the first parts.
    ``shared=True`` puts the parameter arena and the slots in /dev/shm, so that workers on
    this host can map them (:attr:`shared` says whether that worked; else private memory).
    ``device="cuda:N"`` puts all of it, and the optimizer's state, on that GPU (see
    :mod:`tensorx._ps.common.device`; ``shared`` is then ignored).
    """

    def __init__(self, layout: ShardLayout, num_workers: int,
                 optimizer: OptimizerFactory, lr_scheduler: SchedulerFactory | None = None,
                 verify: bool = False, flat: bool | None = None, shared: bool = False,
                 device: str = "cpu") -> None:
        self.layout = layout
        self.num_workers = num_workers
        self.version = 0
        self.device = device
        self.params_region, *self.slot_regions = allocate_arenas(layout.nbytes, 1 + num_workers,
                                                           shared, device)
        self.shared = self.params_region.shared_name is not None
        self._acc_region = MemoryRegion.allocate(layout.nbytes, device=device)
        self.views = views(layout, self.params_region)  # one per plan entry, for checkpoints
        self.rows = SparseRows(layout.param_specs(), device)
        self.changed = ChangedRows(list(self.rows))  # rows each update changed (answers)
        dtype = single_dtype(layout) if flat and not self.rows else None
        if flat and dtype is None and layout.slots:
            logger.warning("flat=True needs one dtype in the arena and no sparse table; "
                           "optimizing per tensor")
        self.flat = dtype is not None
        split = flat_splitter(layout, dtype) if dtype is not None else param_splitter(layout)
        self._split = split
        self.params = [torch.nn.Parameter(v, requires_grad=True)
                       for v in split(self.params_region)]
        self.names = [f"flat.{k}" for k in range(len(self.params))] if self.flat \
            else [p.name for p in layout.param_specs()]
        acc = split(self._acc_region)
        dense_grads(self.params, acc, self.rows)
        # a shard the plan left empty still counts versions, with nothing to optimize
        self.optimizer = build_optimizer(optimizer, self.named_parameters()) \
            if self.params else None
        # what the factory gave, before a schedule changes it: see tensorx._ps.state.resume
        self._given = resume.given(self.optimizer) if self.optimizer is not None else []
        self._row_sgd = RowSGD.build(self.optimizer, self.params, self.rows, device)
        self._torch = TorchStep(self.optimizer, self.params, acc, self.rows, self.changed,
                                self._row_sgd, self.params_region, self._failure)
        # chosen once: the shard steps, folds and saves through it without asking which
        self._update = choose(flat, self.flat, self._torch, self._new_fold,
                              dense_splitter(layout), layout.param_specs(), self.names,
                              layout.nbytes)
        self._fold = self._update.fold
        self.update = self._update.description
        logger.info("ps shard %d update: %s", layout.shard, self.update)
        self.lr_scheduler = lr_scheduler(self.optimizer) \
            if lr_scheduler and self.optimizer is not None else None
        self._scheduled = resume.scheduler_given(self.lr_scheduler) \
            if self.lr_scheduler is not None else {}
        self.verify = verify
        self._checksum: int | None = None

    def _new_fold(self, units: Units) -> DenseFold:
        return DenseFold(units, self._acc_region, self.slot_region)

    @property
    def fast(self) -> FlatUpdate | None:
        """The flat update of a per-tensor optimizer, while it runs (see :mod:`.flat`)."""
        return self._update.fast

    def named_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        """(model name, parameter) of what the optimizer sees, in model order."""
        return list(zip(self.names, self.params, strict=True))

    def slot_region(self, rank: int) -> MemoryRegion:
        if not 0 <= rank < self.num_workers:
            raise UsageError(f"rank {rank} outside 0..{self.num_workers - 1}")
        return self.slot_regions[rank]

    def slot_views(self, rank: int) -> list[torch.Tensor]:
        """``rank``'s slot as the optimizer's parameters' gradients (views of it)."""
        return self._split(self.slot_region(rank))

    def renew_slot(self, rank: int) -> MemoryRegion:
        """Replace ``rank``'s gradient slot by fresh zeroed memory (in /dev/shm if the old
        one was) and close the old one, which unexports it wherever it was exported."""
        old = self.slot_region(rank)
        (new,) = allocate_arenas(self.layout.nbytes, 1, old.shared_name is not None, self.device)
        self.slot_regions[rank] = new
        self._fold.forget()
        self.rows.drop(rank)
        old.close()
        return new

    def new_arena(self) -> MemoryRegion:
        """Fresh memory the size of the parameter arena, where it lives (private: never
        offered for mapping), for :meth:`move_params`."""
        (region,) = allocate_arenas(self.layout.nbytes, 1, False, self.device)
        return region

    def move_params(self, new: MemoryRegion) -> MemoryRegion:
        """Copy the parameters into ``new`` and make it the arena: the optimizer's
        parameters (and the flat update's ranges) view it from now on, and the next update
        goes there. Returns the old arena, left exactly as it was and no longer the state's
        (the caller closes it once nothing reads it: :mod:`tensorx._ps.service.outbox`). The
        optimizer's state is kept by parameter, so momentum and the like carry over."""
        old, n = self.params_region, self.layout.nbytes
        if n:
            with torch.no_grad():
                new.view(torch.uint8, (n,), 0).copy_(old.view(torch.uint8, (n,), 0))
        for p, v in zip(self.params, self._split(new), strict=True):
            p.data = v
        self._update.rebind(new)
        self.views = views(self.layout, new)
        self.params_region = new
        fence(self.device)  # copied before the update (or a send) reads the new arena
        return old

    @property
    def num_parts(self) -> int:
        """Parts the update can be applied in, one after another (flat: the sparse tables
        first, one part each, then the flat ranges; else 1)."""
        return self._update.num_parts

    @property
    def in_parts(self) -> bool:
        """Apply the update part by part, sending finished parts meanwhile (see
        :func:`tensorx._ps.service.answer.apply_in_parts`)? Not if its dense bytes fit in one
        part: a thread hop per part costs more than it overlaps (DLRM-shaped: ~4 of 8 ms).
        Never on a GPU: the whole update is a few kernel launches, over well before a
        thread hop per part would let the first part leave."""
        return not self.params_region.is_cuda and self._update.worth_parts()

    @property
    def pipelined(self) -> bool:
        """The update can be applied part by part while gradients land (see
        :mod:`tensorx._ps.service.round`): the flat update in host memory, no sparse table."""
        return not self.params_region.is_cuda and self._update.pipelines()

    def part_state(self, k: int) -> tuple[dict[Any, Any], Any]:
        """Where the optimizer keeps flat range ``k``'s state: (mapping, key)."""
        return self._update.part_state(k)

    def part_table(self, k: int) -> int | None:
        """The sparse table part ``k`` is (its index among the parameters), if it is one."""
        return self._update.part_table(k)

    def part_bytes(self, k: int) -> tuple[int, int]:
        """(offset, nbytes) of part ``k`` in the arena."""
        return self._update.part_bytes(k)

    def fold(self, ranks: list[int], parts: list[int] | None = None, *,
             check: bool = True) -> None:
        """Fold ``ranks``' dense gradients (of ``parts``; default all) out of their slots
        into the gradient memory, afresh: what :meth:`apply` and :meth:`apply_part` step
        with, in memory no peer can write (see :mod:`tensorx._ps.update.fold`), checked as
        it is folded (:meth:`folded_finite` says; ``check=False``: not, and
        :meth:`folded_finite` sums the fold afresh: the fold alone, as a benchmark times it)."""
        self._fold.fold(ranks, self._units(parts), check=check)

    def folded_finite(self, parts: list[int] | None = None) -> bool:
        """Is the folded dense gradient (of ``parts``; default all) finite?"""
        return self._fold.finite(self._units(parts))

    def fold_each_checked(self, ranks: list[int], parts: list[int] | None = None
                          ) -> list[int]:
        """:meth:`fold` again, through a private copy of each rank's slot, each checked:
        the ranks whose copy holds NaN or Inf (see :meth:`DenseFold.fold_each_checked`)."""
        return self._fold.fold_each_checked(ranks, self._units(parts))

    def _units(self, parts: list[int] | None) -> list[int] | None:
        """The fold's units of ``parts`` (the flat update's ranges; a table has none)."""
        return None if parts is None else self._update.units(parts)

    def gather(self, ranks: Iterable[int]) -> None:
        """Fold ``ranks``' gradients into the gradient memory (unless :meth:`fold` did),
        where they may be changed (hook, clipping) before :meth:`apply` or
        :meth:`apply_part` step with them; the slots are left as the workers wrote them."""
        ranks = list(ranks)
        self.rows.gather(ranks)
        self._fold.ensure(ranks)
        self._torch.gathered = True
        for i, p in enumerate(self.params):
            p.grad = self._torch.grad(ranks, i)

    def ungather(self) -> None:
        """Forget a :meth:`gather` (or :meth:`fold`) whose update will not be made."""
        self._torch.gathered = False
        self._fold.forget()
        self.rows.ungather()

    def put_rows(self, rank: int, rows: Mapping[str, Rows]) -> None:
        """``rank``'s sparse rows of its latest push, whole (see :mod:`tensorx._ps.rows.tables`)."""
        self.rows.put(rank, rows)

    def named_grads(self) -> list[tuple[str, torch.Tensor]]:
        """(model name, averaged gradient) in model order, after :meth:`gather`; a sparse
        table's is sparse (coalesced), and absent when no rank touched it."""
        grads = [(n, self._torch.grad([], i)) for i, n in enumerate(self.names)]
        return [(n, g) for n, g in grads if g is not None]

    def grad_sumsq(self) -> float:
        """Sum of squares of the gathered gradient, for a global norm: each tensor's 2-norm
        in its own dtype, squared and summed in float64, as ``clip_grad_norm_`` combines
        per-tensor norms (and no float64 copy of the gradient)."""
        grads = [_dense_part(g) for _, g in self.named_grads()]
        if not grads:
            return 0.0
        with torch.no_grad():  # one transfer of the norms to host, not one per tensor
            norms = torch.stack([torch.linalg.vector_norm(g).double() for g in grads])
            return math.fsum(n * n for n in norms.tolist())

    def scale_grads(self, factor: float) -> None:
        with torch.no_grad():
            for _, g in self.named_grads():
                _dense_part(g).mul_(factor)

    def apply(self, ranks: Iterable[int]) -> None:
        """Fold the gradients in ``ranks``' slots (unless :meth:`fold` or :meth:`gather`
        did) and take one optimizer step."""
        ranks = list(ranks)
        self._fold.ensure(ranks)
        self._update.apply(ranks)
        self.finish_update()
        fence(self.device)  # the update is in the arena before a byte of it leaves

    def apply_part(self, ranks: list[int], k: int) -> None:
        """The update of part ``k`` alone (see :attr:`num_parts`); every part once, then
        :meth:`finish_update`, is the same update as :meth:`apply` for the elementwise
        optimizers ``flat`` is meant for. The other parts' gradients are unset meanwhile, so
        the optimizer skips them. Runs in a worker thread while the event loop sends."""
        self._update.apply_part(ranks, k)
        # part k is written out as soon as this returns: its kernels (queued by this
        # thread, on its current stream) must be done; an event, not a device-wide sync
        fence(self.device)

    def apply_tables(self, ranks: list[int], parts: list[int]) -> None:
        """The update of the sparse-table parts ``parts`` (see :meth:`part_table`) in one
        optimizer step: the same as :meth:`apply_part` of each, with one pass over the
        optimizer's parameters instead of one per table."""
        self._update.apply_tables(ranks, parts)
        fence(self.device)

    def finish_update(self) -> None:
        """After the last part: step the schedule, count the version."""
        self._update.finish()
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        self._torch.gathered = False
        self._fold.forget()
        self.rows.ungather()
        self.version += 1
        self._checksum = None
        self.changed.finished(self.version)

    def _failure(self, exc: Exception) -> str:
        return (f"update {self.version + 1} not applied: "
                f"{step_failure(self.optimizer, self.named_parameters(), exc)}")

    def checksum(self) -> int | None:
        """The current parameters' checksum when verification is on (cached per version)."""
        if not self.verify:
            return None
        if self._checksum is None:
            self._checksum = checksum(self.params_region)
        return self._checksum

    def param_labels(self) -> dict[int, str] | None:
        """``id(param)`` -> label (:attr:`ParamSpec.label`) of the optimizer's parameters;
        None when flat (a parameter covers several tensors)."""
        return self._update.labels()

    def param_numels(self) -> dict[str, int]:
        """Label -> elements of each parameter the (per-tensor) optimizer sees."""
        return {s.label: s.numel for s in self.layout.param_specs()}

    def load_params(self, tensors: dict[str, torch.Tensor]) -> None:
        self.changed.forget()
        with torch.no_grad():
            for slot, view in zip(self.layout.slots, self.views, strict=True):
                view.copy_(tensors[slot.key].reshape(-1))
        fence(self.device)  # loaded before a welcome sends the arena
        self._checksum = None

    # -- checkpoints ----------------------------------------------------------------------
    def state_dict(self, plan_bytes: bytes) -> dict[str, Any]:
        return {
            "format": CHECKPOINT_FORMAT,
            "fingerprint": self.layout.fingerprint,
            "plan": plan_bytes,
            "shard": self.layout.shard,
            "num_shards": self.layout.num_shards,
            "version": self.version,
            "flat": self.flat,
            "param_names": list(self.names),
            "params": {s.key: v.detach().to("cpu", copy=True)
                       for s, v in zip(self.layout.slots, self.views, strict=True)},
            "optimizer": to_cpu(self._optimizer_state()),
            "optimizer_class": resume.kind(self.optimizer) if self.optimizer else None,
            "optimizer_given": self._given,
            "lr_scheduler": self.lr_scheduler.state_dict() if self.lr_scheduler else None,
            "lr_scheduler_class": resume.kind(self.lr_scheduler) if self.lr_scheduler else None,
            "lr_scheduler_given": self._scheduled,
        }

    def load_state_dict(self, state: dict[str, Any], optimizer: bool = True) -> None:
        """Resume from a checkpoint: its parameters and version, and (``optimizer``) its
        optimizer state, hyperparameters included, and LR schedule (its state, as torch's
        ``scheduler.load_state_dict``), each judged before anything is replaced (see
        :mod:`tensorx._ps.state.resume`); UsageError in one line."""
        if state.get("fingerprint") != self.layout.fingerprint:
            raise UsageError("checkpoint was taken for a different plan (another model, "
                             "plan options or number of shards): resume it with the "
                             "model and options it was taken with, or start from another "
                             "checkpoint directory")
        loaded, schedule, notes = self._resumable(state) if optimizer else (None, None, [])
        self.changed.forget()
        self.load_params(state["params"])
        if loaded is not None:
            assert self.optimizer is not None
            self.optimizer.load_state_dict(loaded)
            self._given = state.get("optimizer_given") or self._given
        if schedule is not None:
            assert self.lr_scheduler is not None
            self.lr_scheduler.load_state_dict(schedule)
            self._scheduled = state.get("lr_scheduler_given") or self._scheduled
        fence(self.device)  # the optimizer's load_state_dict copied to the GPU
        self.version = int(state["version"])
        for note in notes:
            logger.warning("ps shard %d: %s", self.layout.shard, note)

    def _resumable(self, state: dict[str, Any]) -> tuple[dict[str, Any] | None,
                                                         dict[str, Any] | None, list[str]]:
        """The checkpoint's optimizer and LR scheduler states as this shard loads them, and
        the lines to log; UsageError when this optimizer or scheduler cannot resume them."""
        loaded, notes = self._optimizer_resumable(state)
        schedule, more = resume.check_scheduler(
            self.lr_scheduler, state.get("lr_scheduler"), state.get("lr_scheduler_class"),
            state.get("lr_scheduler_given"), self._scheduled)
        return loaded, schedule, notes + more

    def _optimizer_resumable(self, state: dict[str, Any]) -> tuple[dict[str, Any] | None,
                                                                   list[str]]:
        """The checkpoint's optimizer state as this optimizer loads it, and the lines to
        log; UsageError when this optimizer cannot resume it."""
        if bool(state.get("flat")) != self.flat:
            raise UsageError(f"checkpoint was taken with flat={bool(state.get('flat'))}; "
                             f"this server runs flat={self.flat}: run it with "
                             f"flat={bool(state.get('flat'))}, or {resume.FRESH}")
        if not self._update.same_params(state.get("param_names")):
            raise UsageError("checkpoint's optimizer parameters differ from this shard's (its "
                             f"optimizer was given other parameters): {resume.FRESH}")
        saved = state.get("optimizer")
        if self.optimizer is None or saved is None:
            return None, []
        saved = self._update.loaded_state(saved)
        label_of = self.param_labels() or {id(p): n for n, p in self.named_parameters()}
        return resume.check(self.optimizer, label_of, saved, state.get("optimizer_class"),
                            state.get("optimizer_given"), self._given)

    def _optimizer_state(self) -> dict[str, Any] | None:
        """The optimizer's state; a flat shard's in the one-parameter form (whatever the
        part size, see :mod:`tensorx._ps.update.parts`)."""
        if self.optimizer is None:
            return None
        return self._update.saved_state(self.optimizer.state_dict())

    def save(self, path: Path, plan_bytes: bytes, keep: int = checkpoint.KEEP) -> None:
        """Write durably and atomically, keeping ``keep`` generations (see
        :mod:`tensorx._ps.state.checkpoint`): a crash or a full disk mid-save raises and leaves the
        previous checkpoints intact."""
        state = self.state_dict(plan_bytes)
        checkpoint.save(path, lambda file: torch.save(state, file), keep)
        logger.info("checkpointed shard %d at version %d to %s",
                    self.layout.shard, self.version, path)

    def close(self) -> None:
        for region in (self.params_region, self._acc_region, *self.slot_regions):
            region.close()


def _dense_part(grad: torch.Tensor) -> torch.Tensor:
    """The values of a (coalesced) sparse gradient; a dense one itself."""
    return grad.values() if grad.is_sparse else grad


checkpoint_path = checkpoint.path_for
