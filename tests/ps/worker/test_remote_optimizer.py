"""RemoteOptimizer behaves as a torch.optim.Optimizer: groups, schedules, state, errors.

Two workers in threads (RemoteOptimizer blocks), against real shards on a background loop;
every result is compared with the same torch optimizer in one process on the union batch.
"""

from __future__ import annotations

import asyncio
import math
import pickle
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from tensorx._ps.update.optim import plan_params
from tensorx._ps.wire import hyper, optim_state
from tensorx.errors import ProtocolError, UsageError
from tensorx.ps import ParameterServer
from tensorx.remote_optimizer import RemoteOptimizer
from tensorx.worker import Worker
from tests.support.clusters import on_ranks, serving_in_thread
from tests.support.lanes import assert_link, link_options, links
from tests.support.models import small_mlp

Factory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


def adamw_groups(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    """Weight decay for the weight matrices only, told apart by ``dim()``: the same rule on
    the model and on the server's views, where a matrix cut between shards (balancing cuts
    even small tensors at whole rows) is still a matrix, but not necessarily a large one."""
    decay = [p for p in params if p.dim() > 1]
    rest = [p for p in params if p.dim() <= 1]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                              {"params": rest, "weight_decay": 0.0}], lr=0.02,
                             betas=(0.9, 0.95))


def adam(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=0.01)


def sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.5)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def batches(steps: int, workers: int = 2) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    gen = torch.Generator().manual_seed(7)
    return [[(torch.randn(4, 8, generator=gen), torch.randint(0, 3, (4,), generator=gen))
             for _ in range(workers)] for _ in range(steps)]


Hook = Callable[[torch.optim.Optimizer, int, int], None]  # (optimizer, step, rank)


def loop(opt: torch.optim.Optimizer, model: nn.Module, data: list[Any], rank: int,
         hook: Hook | None = None, sched: Any = None) -> None:
    for i, step in enumerate(data):
        x, y = step[rank] if rank >= 0 else (torch.cat([b[0] for b in step]),
                                             torch.cat([b[1] for b in step]))
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        if hook is not None:
            hook(opt, i, rank)
        opt.step()
        if sched is not None:
            sched.step()


def local(factory: Factory, data: list[Any], hook: Hook | None = None,
          schedule: Callable[[Any], Any] | None = None,
          model: nn.Module | None = None) -> tuple[nn.Module, torch.optim.Optimizer]:
    """One process on the union batch: what two sync workers must equal."""
    model = model or small_mlp()
    opt = factory(list(model.parameters()))  # type: ignore[arg-type]
    loop(opt, model, data, -1, hook, schedule(opt) if schedule else None)
    return model, opt


def close(a: nn.Module, b: nn.Module) -> None:
    for (name, x), y in zip(a.named_parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(x.detach(), y.detach(), rtol=1e-5, atol=1e-5, msg=name)


SCHEDULES: dict[str, Callable[[Any], Any]] = {
    "lambda": lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min(1, (i + 1) / 4)),
    "cosine": lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=6,
                                                                     eta_min=1e-3),
}


@pytest.mark.parametrize("link", links())
@pytest.mark.parametrize("schedule", ["lambda", "cosine"])
def test_worker_schedules_equal_single_process(link: str, schedule: str) -> None:
    """torch LR schedulers on both workers, weight-decay groups on two shards."""
    if schedule == "cosine" and link != "default":
        pytest.skip("one schedule over every link is enough")
    data = batches(8)
    models = [small_mlp(), small_mlp(seed=5)]
    with serving_in_thread(2, 2, optimizer=adamw_groups, **link_options(link)) as ps:
        def work(rank: int) -> list[dict[str, Any]]:
            with RemoteOptimizer(models[rank], ps, rank, 2, **link_options(link)) as opt:
                loop(opt, models[rank], data, rank, sched=SCHEDULES[schedule](opt))
                assert_link(opt.worker, link)
                return [{k: v for k, v in g.items() if k != "params"}
                        for g in opt.param_groups]

        groups = on_ranks(work)
    want, opt = local(adamw_groups, data, schedule=SCHEDULES[schedule])
    close(models[0], want)
    close(models[1], want)
    for got in groups:  # the groups' values on the workers are the server's (and torch's)
        assert got == [{k: v for k, v in g.items() if k != "params"}
                       for g in opt.param_groups]


def test_param_groups_mirror_the_server_groups() -> None:
    with serving_in_thread(2, 1, optimizer=adamw_groups) as ps:
        model = small_mlp()
        with RemoteOptimizer(model, ps) as opt:
            assert isinstance(opt, torch.optim.Optimizer)
            want = adamw_groups(list(model.parameters()))  # type: ignore[arg-type]
            assert [[id(p) for p in g["params"]] for g in opt.param_groups] == \
                [[id(p) for p in g["params"]] for g in want.param_groups]
            assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
            assert opt.defaults["betas"] == (0.9, 0.95) and opt.defaults["lr"] == 0.02
            assert not opt.state


def test_lr_set_on_one_rank_reaches_the_next_update(caplog: pytest.LogCaptureFixture) -> None:
    """Rank 0 alone sets the lr before step 2: that very update uses it (no half-round
    delay), and rank 1 sees it once its step returns. Conflicting changes in one update:
    the lowest rank wins, on every rank."""
    def hook(opt: torch.optim.Optimizer, i: int, rank: int) -> None:
        if i == 2 and rank in (0, -1):
            opt.param_groups[0]["lr"] = 0.5
        if i == 4:
            opt.param_groups[0]["lr"] = 0.02 if rank in (0, -1) else 0.9
            opt.param_groups[0]["momentum"] = 0.0 if rank in (1, -1) else 0.5

    data = batches(7)
    models = [small_mlp(), small_mlp()]
    seen: list[list[float]] = [[], []]
    with serving_in_thread(1, 2, optimizer=sgd, transport="tcp", share_memory=False) as ps:
        def work(rank: int) -> None:
            with RemoteOptimizer(models[rank], ps, rank, 2, transport="tcp",
                                 share_memory=False) as opt:
                for i in range(len(data)):
                    loop(opt, models[rank], data[i:i + 1], rank,
                         lambda o, _, r, i=i: hook(o, i, r))
                    seen[rank].append(opt.param_groups[0]["lr"])

        on_ranks(work)
    close(models[0], local(sgd, data, hook)[0])
    assert seen[0] == seen[1] == [0.1, 0.1, 0.5, 0.5, 0.02, 0.02, 0.02]
    assert "ranks 0 and 1 set param_groups[0]['lr'] to 0.02 and 0.9" in caplog.text


@pytest.mark.parametrize("link", links())
def test_state_dict_round_trip_resumes_exactly(link: str, tmp_path: Path) -> None:
    """Tensors split into chunks across two shards: state_dict() equals torch's own, in
    torch's format; saved, loaded into fresh servers, training continues as if never
    interrupted."""
    data = batches(10)
    opts = {**link_options(link), "plan_options": {"chunk_bytes": 256}}
    models = [small_mlp(), small_mlp()]
    with serving_in_thread(2, 2, optimizer=adam, **link_options(link)) as ps:
        def first(rank: int) -> dict[str, Any]:
            with RemoteOptimizer(models[rank], ps, rank, 2, **opts) as opt:
                assert any(not e.whole for e in opt.worker.plan.entries)  # really chunked
                loop(opt, models[rank], data[:5], rank)
                assert_link(opt.worker, link)
                return opt.state_dict()

        saved = on_ranks(first)[0]
    _, half = local(adam, data[:5])
    want = half.state_dict()
    assert saved["param_groups"] == want["param_groups"]
    assert saved["state"].keys() == want["state"].keys()
    for i, entry in want["state"].items():
        for key, value in entry.items():
            torch.testing.assert_close(saved["state"][i][key], value, rtol=1e-5, atol=1e-6)
    torch.save({"model": models[0].state_dict(), "optimizer": saved}, tmp_path / "ckpt.pt")

    ckpt = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    resumed = [small_mlp(seed=3), small_mlp(seed=4)]
    with serving_in_thread(2, 2, optimizer=adam, **link_options(link)) as ps:
        def second(rank: int) -> None:
            resumed[rank].load_state_dict(ckpt["model"])
            with RemoteOptimizer(resumed[rank], ps, rank, 2, **opts) as opt:
                opt.load_state_dict(ckpt["optimizer"])
                loop(opt, resumed[rank], data[5:], rank)
                assert_link(opt.worker, link)

        on_ranks(second)
    close(resumed[0], local(adam, data)[0])


def test_unsupported_calls_are_clear_errors() -> None:
    with serving_in_thread(1, 1, optimizer=adamw_groups) as ps:
        model = small_mlp()
        with RemoteOptimizer(model, ps) as opt:
            with pytest.raises(UsageError, match="add_param_group"):
                opt.add_param_group({"params": [nn.Parameter(torch.zeros(2))]})
            opt.zero_grad()
            nn.functional.cross_entropy(model(torch.randn(2, 8)), torch.tensor([0, 1])
                                        ).backward()
            opt.param_groups[0]["lr"] = torch.tensor(0.1)
            with pytest.raises(UsageError, match="cannot be sent"):
                opt.step()
            opt.param_groups[0]["lr"] = 0.01
            del opt.param_groups[1]["eps"]
            with pytest.raises(UsageError, match="removed"):
                opt.step()
            opt.param_groups[1]["eps"] = 1e-8
            opt.param_groups[1]["params"].append(nn.Parameter(torch.zeros(1)))
            with pytest.raises(UsageError, match="cannot be changed"):
                opt.step()
            opt.param_groups[1]["params"].pop()
            opt.step()  # everything undone: steps again
            assert opt.param_groups[0]["lr"] == 0.01
            sd = opt.state_dict()
            with pytest.raises(UsageError, match="groups"):
                opt.load_state_dict({"state": {}, "param_groups": sd["param_groups"][:1]})
            with pytest.raises(UsageError, match="state_dict"):
                opt.load_state_dict({"param_groups": []})
            with pytest.raises(UsageError, match="pickled"):
                pickle.dumps(opt)
    with serving_in_thread(1, 1, optimizer=sgd, flat=True) as ps, \
            RemoteOptimizer(small_mlp(), ps) as opt:
        with pytest.raises(UsageError, match="flat=True"):
            opt.state_dict()


def test_bad_hyperparameters_from_a_peer_are_refused() -> None:
    """A malformed field is a ProtocolError; a value the group cannot take, a UsageError
    naming it."""
    groups = hyper.snapshot(adamw_groups([nn.Parameter(torch.zeros(20))]).param_groups)
    assert hyper.check([], groups) == []
    assert hyper.check([{"lr": 0.5}, {}], groups) == [{"lr": 0.5}, {}]
    assert hyper.check([{"betas": [0.8, 0.9]}, {}], groups)[0]["betas"] == (0.8, 0.9)
    assert hyper.check([{"initial_lr": 0.5}, {}], groups)[0]["initial_lr"] == 0.5
    assert hyper.check([{"foreach": True}, {}], groups)[0]["foreach"] is True
    assert hyper.check([{"amsgrad": None}, {}], groups)[0]["amsgrad"] is None  # a flag
    for bad in ({"lr": 1}, [{"params": 1}, {}], [{"lr": 0.1}], [{"lr": {"x": 1}}, {}],
                [{"x" * 200: 1}, {}], [{"lr": 2**70}, {}]):
        with pytest.raises(ProtocolError):
            hyper.check(bad, groups)
    for bad in ([{"lr": "fast"}, {}], [{"betas": [0.9]}, {}], [{"lr": None}, {}],
                [{}, {"eps": math.nan}], [{"betas": [0.9, math.inf]}, {}],
                [{"amsgrad": 1}, {}], [{"initial_lr": -math.inf}, {}]):
        with pytest.raises(UsageError, match=r"param_groups\[[01]\]\['"):
            hyper.check(bad, groups)


def test_bad_state_manifests_are_protocol_errors() -> None:
    numels = {"w": 10, "b": 2}
    good = {"groups": [], "tensors": {"w": {"exp_avg": ["float32", [10], 0]}},
            "values": {"w": {"step": 3.0}}}
    optim_state.check_manifest(good, numels, 64)
    bad_tensors: list[Any] = [
        {"x": {"exp_avg": ["float32", [10], 0]}},      # not an entry of this shard
        {"w": {"exp_avg": ["float32", [11], 0]}},      # more elements than the entry
        {"w": {"exp_avg": ["float32", [10], 32]}},     # beyond the region
        {"w": {"exp_avg": ["float32", [10], 2]}},      # misaligned
        {"w": {"exp_avg": ["object", [10], 0]}},       # not a tensor dtype
        {"w": {"exp_avg": ["float32", [-1], 0]}},
        {"w": {str(k): ["float32", [1], 0] for k in range(17)}},
    ]
    for tensors in bad_tensors:
        with pytest.raises(ProtocolError):
            optim_state.check_manifest({**good, "tensors": tensors}, numels, 64)
    with pytest.raises(ProtocolError):
        optim_state.check_manifest({**good, "values": {"w": {"step": [1, 2]}}}, numels, 64)
    with pytest.raises(ProtocolError):
        optim_state.check_manifest({**good, "groups": [{"hp": {"lr": 0.1}}]}, numels, 64)


def test_a_change_survives_a_rejoin(tmp_path: Path) -> None:
    """The server restarts (from its checkpoint) under a step that carries a change: the
    worker rejoins and drops that step, and the change goes with the next one instead of
    being silently lost."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    run = lambda coro: asyncio.run_coroutine_threadsafe(coro, loop).result(60)  # noqa: E731
    kw: dict[str, Any] = {"num_workers": 1, "optimizer": sgd, "transport": "tcp",
                          "checkpoint_dir": tmp_path, "log_every": None}
    first = ParameterServer("tcp://127.0.0.1:0", **kw)
    run(first.start())
    second = ParameterServer(first.address, **kw)
    model = small_mlp()
    x, y = torch.randn(4, 8), torch.tensor([0, 1, 2, 0])
    try:
        with RemoteOptimizer(model, first.address, transport="tcp", timeout=10,
                             reconnect=30) as opt:
            for _ in range(2):
                opt.zero_grad()
                nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
            run(first.aclose())
            run(second.start())
            opt.param_groups[0]["lr"] = 0.5
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            assert opt.worker.stats["rejoins"] == 1
            assert opt.param_groups[0]["lr"] == 0.5
            assert second.state is not None and second.state.optimizer is not None
            assert second.state.optimizer.param_groups[0]["lr"] == 0.1
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            assert second.state.optimizer.param_groups[0]["lr"] == 0.5
    finally:
        run(first.aclose())
        run(second.aclose())
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)
        loop.close()


# -- what one rank may change for everyone --------------------------------------------------
# (key, value, how the refusal shows the value): values Adam cannot use, each sent by a raw
# peer (RemoteOptimizer itself refuses some before sending); the last one, all-or-nothing.
BAD_HYPER: list[tuple[dict[str, Any], str, str]] = [
    ({"lr": None}, "lr", "None"),
    ({"lr": math.nan}, "lr", "nan"),
    ({"lr": math.inf}, "lr", "inf"),
    ({"lr": -1.0}, "lr", "-1.0"),
    ({"betas": (0.9, 1.5)}, "betas", "(0.9, 1.5)"),
    ({"weight_decay": "\x1b[2J" * 30}, "weight_decay", "\\x1b[2J"),
    ({"lr": 0.5, "eps": -1.0}, "eps", "-1.0"),
]


async def test_a_bad_hyperparameter_fails_the_step_of_its_rank_alone() -> None:
    """Rank 1 (a new connection for each value) sends a value its optimizer refuses: its
    step raises UsageError naming the key and the value (escaped), it is disconnected as a
    refused push is, nothing of its change is applied, and rank 0 trains on."""
    models = [small_mlp(), small_mlp()]
    kw: dict[str, Any] = {"transport": "tcp", "share_memory": False, "timeout": 20}
    # a timeout beyond the two ranks' pushes' skew (with 0 each barrier would go on with
    # whichever rank pushed first, the other one missing it)
    async with ParameterServer("tcp://127.0.0.1:0", num_workers=2, optimizer=adam,
                               on_worker_loss="continue", worker_loss_timeout=0.5,
                               log_every=None, transport="tcp") as ps:
        async with Worker(models[0], ps.address, 0, 2, **kw) as honest:
            for i, (change, key, shown) in enumerate(BAD_HYPER):
                async with Worker(models[1], ps.address, 1, 2, **kw) as peer:
                    for w, m in zip((honest, peer), models, strict=True):
                        w.zero_grad()
                        nn.functional.cross_entropy(m(torch.randn(4, 8)),
                                                    torch.tensor([0, 1, 2, i % 3])).backward()
                    ok, refused = await asyncio.gather(honest.step(), peer.step([change]),
                                                       return_exceptions=True)
                    assert ok is None, ok
                    assert isinstance(refused, UsageError), refused
                    assert f"[{key!r}]" in str(refused) and shown in str(refused), refused
                    assert "\x1b" not in str(refused) and len(str(refused)) < 400
            assert ps.state is not None and ps.state.optimizer is not None
            group = ps.state.optimizer.param_groups[0]
            assert (group["lr"], group["betas"], group["eps"], group["weight_decay"]) == \
                (0.01, (0.9, 0.999), 1e-8, 0)
            assert honest.hyper[0][0]["lr"] == 0.01
            assert all(torch.isfinite(p).all() for p in models[0].parameters())
            assert ps.version == len(BAD_HYPER)


def test_remote_optimizer_refuses_a_value_that_cannot_be_used_before_sending() -> None:
    with serving_in_thread(1, 1, optimizer=adam) as ps:
        model = small_mlp()
        with RemoteOptimizer(model, ps) as opt:
            for value in (None, math.nan, -math.inf, "fast"):
                opt.zero_grad()
                nn.functional.cross_entropy(model(torch.randn(2, 8)), torch.tensor([0, 1])
                                            ).backward()
                opt.param_groups[0]["lr"] = value
                with pytest.raises(UsageError, match=r"param_groups\[0\]\['lr'\]"):
                    opt.step()
            opt.param_groups[0]["lr"] = 0.02
            opt.step()  # the worker is still connected: nothing was sent
            assert opt.param_groups[0]["lr"] == 0.02


def adam_state(opt: RemoteOptimizer) -> dict[str, Any]:
    """``opt``'s state_dict after two steps on one batch."""
    model = opt.worker.model
    for _ in range(2):
        opt.zero_grad()
        nn.functional.cross_entropy(model(torch.randn(4, 8)), torch.tensor([0, 1, 2, 0])
                                    ).backward()
        opt.step()
    return opt.state_dict()


# state entry 2 (the last weight, 3 x 16; whole on shard 0, while shard 1 holds a part of
# the first weight) changed: the key, its new value (None: the key removed)
BAD_STATE: dict[str, tuple[str, Callable[[torch.Tensor], torch.Tensor] | None]] = {
    "exp_avg of another size": ("exp_avg", lambda t: torch.zeros(5)),
    "exp_avg of another shape": ("exp_avg", lambda t: torch.zeros(3, 1)),
    "exp_avg of its size, transposed": ("exp_avg", lambda t: torch.zeros(16, 3)),
    "integer exp_avg": ("exp_avg", lambda t: t.to(torch.int64)),
    "NaN in exp_avg": ("exp_avg", lambda t: torch.full_like(t, math.nan)),
    "negative exp_avg_sq": ("exp_avg_sq", lambda t: torch.full_like(t, -1.0)),
    "negative step": ("step", lambda t: torch.tensor(-3.0)),
    "fractional step": ("step", lambda t: torch.tensor(2.5)),
    "missing exp_avg_sq": ("exp_avg_sq", None),
    "a key Adam does not keep": ("momentum_buffer", lambda t: torch.zeros(3, 16)),
}


def poisoned(saved: dict[str, Any], key: str,
             change: Callable[[torch.Tensor], torch.Tensor] | None) -> dict[str, Any]:
    """``saved`` with entry 2 changed, and every other entry's ``exp_avg`` doubled (good
    values: a shard that loaded its part alone would show them)."""
    state = {i: {**e, "exp_avg": 2 * e["exp_avg"]} for i, e in saved["state"].items()}
    state[2] = dict(saved["state"][2])
    if change is None:
        del state[2][key]
    else:
        state[2][key] = change(state[2].get(key, state[2]["exp_avg"]))
    return {"state": state, "param_groups": saved["param_groups"]}


def same_state(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a["param_groups"] == b["param_groups"] and a["state"].keys() == b["state"].keys() \
        and all(torch.equal(torch.as_tensor(a["state"][i][k]), torch.as_tensor(v))
                for i, entry in b["state"].items() for k, v in entry.items())


@pytest.mark.parametrize("flat", [None, False])
def test_a_bad_optimizer_state_is_refused_whole(flat: bool | None) -> None:
    """Each bad state is refused with UsageError naming the tensor and the key (the
    shards check it: RemoteOptimizer sends what it is given, as a raw peer would); the
    shard whose part is good loads nothing either; training goes on."""
    with serving_in_thread(2, 1, optimizer=adam, flat=flat) as ps:
        model = small_mlp()
        with RemoteOptimizer(model, ps, timeout=20) as opt:
            saved = adam_state(opt)
            shards = {e.label: e.shard for e in plan_params(opt.worker.plan)}
            assert shards["2.weight"] == 0 and shards["0.weight[1]"] == 1
            for what, (key, change) in BAD_STATE.items():
                with pytest.raises(UsageError, match=r"'2\.weight'") as raised:
                    opt.load_state_dict(poisoned(saved, key, change))
                assert f"[{key!r}]" in str(raised.value), (what, raised.value)
            assert same_state(opt.state_dict(), saved)
            opt.load_state_dict(saved)  # a good one still loads
            adam_state(opt)
            assert all(torch.isfinite(p).all() for p in model.parameters())


def test_one_rank_cannot_load_state_for_everyone() -> None:
    """Sync mode: every rank loads the same state between the same steps, as every DDP
    rank loads the same checkpoint. A rank that loads alone, or ranks that load different
    states, get UsageError and nothing is loaded: training equals a run without the load."""
    data = batches(4)
    models = [small_mlp(), small_mlp()]
    with serving_in_thread(1, 2, optimizer=adam) as ps:
        def work(rank: int) -> None:
            with RemoteOptimizer(models[rank], ps, rank, 2, timeout=20) as opt:
                loop(opt, models[rank], data[:1], rank)
                zeroed = opt.state_dict()
                zeroed["state"] = {i: {k: torch.zeros_like(v) for k, v in e.items()}
                                   for i, e in zeroed["state"].items()}
                if rank == 1:  # alone: rank 0 steps meanwhile
                    with pytest.raises(UsageError, match="every rank"):
                        opt.load_state_dict(zeroed)
                loop(opt, models[rank], data[1:2], rank)
                other = opt.state_dict()
                if rank == 1:
                    other["param_groups"][0]["lr"] = 0.5
                with pytest.raises(UsageError, match="different"):
                    opt.load_state_dict(other)
                loop(opt, models[rank], data[2:], rank)

        on_ranks(work)
    close(models[0], local(adam, data)[0])
    close(models[1], models[0])
