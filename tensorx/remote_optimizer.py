"""RemoteOptimizer: a ``torch.optim.Optimizer`` whose update runs on the parameter server.

A blocking facade over :class:`tensorx.worker.Worker` (run on a background event loop) for
ordinary PyTorch loops::

    opt = RemoteOptimizer(model, ps=["tcp://h:7000"], rank=0, num_workers=2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup)      # schedules work on the worker
    for x, y in data:
        opt.zero_grad(); loss_fn(model(x), y).backward(); opt.step(); sched.step()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)

What it mirrors, and the rules:

* ``param_groups`` are the server optimizer's groups, learnt at the handshake: the worker's
  own model parameters, grouped as the server grouped them (in model order within a group),
  with the server's hyperparameters. ``defaults`` are the server optimizer's.
* Hyperparameters (``lr`` above all; any key whose value is None, bool, int, float, str or a
  short tuple of numbers) changed in ``param_groups`` on **any rank** before ``step()``
  reach every shard before that step's update: a push carries the keys that rank changed
  since the server last told it their values. When ranks disagree within one sync update,
  the **lowest rank wins** (the shard logs a WARNING). After ``step()`` every rank's
  ``param_groups`` show the values the server holds (including what a server-side
  ``lr_scheduler`` set), so a schedule computed the same way on every rank, or set on rank
  0 alone, behaves as in one process. Run a schedule on the workers or on the server, not
  both.
* ``state_dict()`` gathers the server's optimizer state from every shard (the tensors move
  one-sided, never pickled, whatever their size) in torch's format: ``state`` indexed by
  position in ``param_groups`` order, tensors in the parameters' shapes, so it is
  interchangeable with the state of the same ``torch.optim`` optimizer built locally over
  the same groups. ``load_state_dict()`` checks it like torch does and scatters it to the
  shards (the hyperparameters in it too), which check it against their parameters and
  their optimizer's own rules (shapes, dtypes, finite values, ``step`` and second
  moments) and load it all or, with a UsageError naming what is wrong, none of it. Both
  are for quiet moments between steps. A load changes what every rank trains with, so
  **every rank loads the same state between the same two steps** (as every DDP rank loads
  the same checkpoint): the shards load it once every rank has sent it; a rank that loads
  alone (the others step), or ranks that load different states, get a UsageError and
  nothing is loaded.
* A hyperparameter change must be usable by the server's optimizer: a value of the kind
  the group holds (None only where it has None), finite, and accepted by the optimizer's
  constructor (torch's range checks: ``lr >= 0``, ``betas`` in [0, 1), ...). RemoteOptimizer
  refuses what it can check before sending (UsageError from ``step()``, nothing sent); a
  value the server refuses fails that rank's ``step()`` with a UsageError naming the key
  and the value, none of that step's changes apply, and the rank is disconnected as a
  refused push is (the other ranks train on, see ``on_worker_loss``).
* ``state`` stays empty on the worker: the optimizer state lives on the server.
* ``zero_grad(set_to_none=...)``: gradients are zeroed in place either way and stay bound
  to the registered memory that is pushed (``p.grad`` is never None afterwards); a
  parameter without a gradient is pushed as zeros, so it is not skipped by the server's
  optimizer the way torch skips a ``None`` gradient.

Not supported (:class:`~tensorx.errors.UsageError`): ``add_param_group``, adding, removing or
reordering groups or the parameters in them, removing a hyperparameter key, values that
cannot travel (tensors, callables), ``state_dict()`` from a ``flat=True`` server, and
``step(closure)`` where the closure is to be re-evaluated (it is called once, as by SGD).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import threading
from collections.abc import Sequence
from typing import Any

import torch

from tensorx._ps.update.optim import plan_params
from tensorx._ps.wire import hyper
from tensorx._ps.wire.optim_state import State
from tensorx.errors import ProtocolError, UsageError
from tensorx.worker import Worker

__all__ = ["RemoteOptimizer"]

# close() takes no budget: its tasks are cancelled by then, and a loop thread that still
# does not stop must not hold the caller's close (or the interpreter's exit) up forever.
STOP_TIMEOUT = 10.0


class RemoteOptimizer(torch.optim.Optimizer):
    """A ``torch.optim.Optimizer`` for ``model`` whose optimizer runs on the PS shards at
    ``ps`` (see the module docstring for what is mirrored and the rules). ``options`` go
    to :class:`~tensorx.worker.Worker`. Close it (or use ``with``) to leave the server
    cleanly; a forgotten one is closed at interpreter exit."""

    def __init__(self, model: torch.nn.Module, ps: str | Sequence[str], rank: int = 0,
                 num_workers: int = 1, **options: Any) -> None:
        self._started = False
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True,
                                        name=f"tensorx-worker-{rank}")
        self._thread.start()
        self.worker = Worker(model, ps, rank, num_workers, **options)
        try:
            self._call(self.worker.start())
            groups, defaults = self._mirror(model)
            super().__init__(groups, defaults)
        except BaseException:
            self.close()
            raise
        self._started = True
        self._params = [[id(p) for p in g["params"]] for g in self.param_groups]
        atexit.register(self.close)

    # -- the server's groups, on this worker ----------------------------------------------
    def _mirror(self, model: torch.nn.Module) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """This worker's parameters grouped as the shards' optimizers group theirs."""
        infos = [o for o in self.worker.optim if o["groups"]]
        if not infos:
            raise UsageError("the server has no optimizer parameters for this model")
        first = infos[0]
        # The same number of groups everywhere; their values may differ for a moment (another
        # rank's load_state_dict reaching one shard before the other): those of the first
        # shard are taken, and every shard's answers keep them current.
        for info in infos[1:]:
            if len(info["groups"]) != len(first["groups"]):
                raise UsageError("the shards' optimizers have different numbers of param "
                                 f"groups ({len(info['groups'])} vs {len(first['groups'])}): "
                                 "build the same groups on every shard, empty ones included")
        runs = plan_params(self.worker.plan)  # what the shards' optimizers see
        name_of = {e.label: e.name for e in runs}
        self._entries: dict[str, list[Any]] = {}
        for e in sorted(runs, key=lambda e: e.chunk):
            self._entries.setdefault(e.name, []).append(e)
        order = {name: i for i, (name, _) in enumerate(model.named_parameters())}
        params = dict(model.named_parameters())
        group_of: dict[str, int] = {}
        for info in infos:
            for i, g in enumerate(info["groups"]):
                for label in g["params"]:
                    if label not in name_of:
                        raise ProtocolError(f"the server optimizes {label!r}, which is not "
                                            "in this worker's plan")
                    if group_of.setdefault(name_of[label], i) != i:
                        raise UsageError(f"{name_of[label]} is split across shards and its "
                                         "chunks are in different param groups")
        self._name = {id(params[n]): n for n in group_of}
        hps = hyper.snapshot([g["hp"] for g in first["groups"]])
        groups = [{**hp, "params": sorted((params[n] for n, g in group_of.items() if g == i),
                                          key=lambda p: order[self._name[id(p)]])}
                  for i, hp in enumerate(hps)]
        return groups, hyper.snapshot([first["defaults"]])[0]

    def _known(self) -> list[dict[str, Any]]:
        """The groups' hyperparameters as the shards last told us."""
        return next(h for h in self.worker.hyper if h)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if getattr(self, "_started", True):
            raise UsageError("RemoteOptimizer.add_param_group is not supported: the param "
                             "groups are the server optimizer's (build them there)")
        super().add_param_group(param_group)

    def _check_groups(self) -> list[dict[str, Any]]:
        if [[id(p) for p in g["params"]] for g in self.param_groups] != self._params:
            raise UsageError("the parameters of RemoteOptimizer.param_groups cannot be "
                             "changed: the groups are the server optimizer's")
        return hyper.changes(self.param_groups, self._known())

    def _refresh(self) -> None:
        for group, values in zip(self.param_groups, self._known(), strict=True):
            group.update(values)

    # -- what a training loop calls -------------------------------------------------------
    def _call(self, coro: Any) -> Any:
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        return future.result()

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        """Send this step's gradients (and changed hyperparameters), wait for the update,
        and return with the new parameters in the model. ``closure`` is called once."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        changes = self._check_groups()
        rejoins = self.worker.stats["rejoins"]
        self._call(self.worker.step(changes))
        if self.worker.stats["rejoins"] == rejoins:
            self._refresh()
        # else the step was dropped by a rejoin (Worker reconnect=): the changes stay in
        # param_groups, differ from what the new server said, and go with the next step
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradients in place (whatever ``set_to_none`` says, see the module
        docstring)."""
        self.worker.zero_grad()

    def _check_portable(self) -> None:
        if any(o["flat"] for o in self.worker.optim):
            raise UsageError("the optimizer state of a flat=True server cannot be transferred "
                             "(its parameters span several tensors); run it with flat=False")

    def state_dict(self) -> dict[str, Any]:
        """The server's optimizer state, gathered from every shard, in torch's format."""
        self._check_portable()
        fetched = self._call(self.worker.fetch_optimizer_state())
        by_label: State = {}
        for _, state in fetched:
            by_label.update(state)
        out: dict[int, dict[str, Any]] = {}
        groups, index = [], 0
        for group in self.param_groups:
            ids = []
            for p in group["params"]:
                merged = self._merge(self._name[id(p)], p, by_label)
                if merged:
                    out[index] = merged
                ids.append(index)
                index += 1
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": ids})
        return {"state": out, "param_groups": groups}

    def _merge(self, name: str, p: torch.Tensor, by_label: State) -> dict[str, Any]:
        entries = self._entries[name]
        parts = [by_label.get(e.label) for e in entries]
        if not any(parts):
            return {}
        if not all(parts):
            raise ProtocolError(f"the server has optimizer state for part of {name} only")
        first = parts[0]
        assert first is not None
        merged: dict[str, Any] = {}
        for key, value in first.items():
            chunks = [q[key] for q in parts if q is not None]
            if all(isinstance(c, torch.Tensor) and c.dim() > 0 and c.numel() == e.numel
                   for c, e in zip(chunks, entries, strict=True)):
                value = torch.cat([c.reshape(-1) for c in chunks]).reshape(p.shape)
            merged[key] = value
        return merged

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Check ``state_dict`` as torch does, then load it into every shard's optimizer
        (every shard or none; every rank loads the same state, see the module docstring)."""
        self._check_portable()
        saved = state_dict.get("param_groups") if isinstance(state_dict, dict) else None
        if not isinstance(saved, list) or not isinstance(state_dict.get("state"), dict):
            raise UsageError("not an optimizer state_dict (needs 'state' and 'param_groups')")
        if len(saved) != len(self.param_groups) or any(
                len(s.get("params", ())) != len(g["params"])
                for s, g in zip(saved, self.param_groups, strict=True)):
            raise UsageError("loaded state dict has a different number of parameter groups, "
                             "or groups of different sizes, than this RemoteOptimizer")
        by_param = {i: p for s, g in zip(saved, self.param_groups, strict=True)
                    for i, p in zip(s["params"], g["params"], strict=True)}
        states: list[State] = [{} for _ in range(self.worker.num_shards)]
        for i, value in state_dict["state"].items():
            if i not in by_param or not isinstance(value, dict):
                raise UsageError(f"loaded state dict has state for parameter {i!r}, which "
                                 "is in none of its groups")
            self._split(by_param[i], value, states)
        new = [{**{k: v for k, v in s.items() if k != "params"}, "params": g["params"]}
               for s, g in zip(saved, self.param_groups, strict=True)]
        self._call(self.worker.load_optimizer_state(hyper.snapshot(new), states))
        for group, values in zip(self.param_groups, new, strict=True):
            group.clear()
            group.update(values)
        self._refresh()

    def _split(self, p: torch.Tensor, value: dict[str, Any], states: list[State]) -> None:
        for e in self._entries[self._name[id(p)]]:
            part: dict[str, Any] = {}
            for key, v in value.items():
                if isinstance(v, torch.Tensor) and v.dim() > 0 and v.numel() == p.numel():
                    v = v.reshape(-1)[e.start:e.start + e.numel] if not e.whole else v
                part[key] = v
            states[e.shard][e.label] = part

    # -- lifetime -------------------------------------------------------------------------
    def close(self) -> None:
        """Leave the server and stop the background loop. Idempotent."""
        if self._loop.is_closed():
            return
        atexit.unregister(self.close)
        try:
            self._call(self.worker.aclose())
        finally:
            self._stop_loop()

    def _stop_loop(self) -> None:
        with contextlib.suppress(Exception):
            self._call(_cancel_leftovers())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=STOP_TIMEOUT)
        self._loop.close()

    def __enter__(self) -> RemoteOptimizer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getstate__(self) -> dict[str, Any]:
        raise UsageError("a RemoteOptimizer cannot be pickled or copied; save its "
                         "state_dict() instead")


async def _cancel_leftovers() -> None:
    """Cancel and await every other task on this loop (transport loops included)."""
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
