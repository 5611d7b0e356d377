"""A parameter server on a GPU (``ParameterServer(device="cuda:0")``): sync training with its
arenas, slots and optimizer on the GPU equals one process training on the union batch; a
CPU server serves a CUDA model; checkpoints move between GPU and CPU servers.

Every test needs CUDA (``pytest -m gpu tests/ps/test_gpu_ps.py``). Servers and workers share one
event loop over real endpoints, as in tests/ps/test_ps_train.py. The shard-level tests at the
end need no transport that reaches GPU memory; the end-to-end ones need one (UCX with
cuda_copy, or the TCP lane staging GPU memory through host).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from tensorx._ps.service.nonfinite import finite
from tensorx._ps.state.shard import (
    ShardLayout,
    ShardState,
    Slot,
    checkpoint_path,
    checksum,
    load_checkpoint,
    views,
)
from tensorx.ps import ParameterServer
from tests.support import flat_update
from tests.support.clusters import servers, workers
from tests.support.data import backward, batches
from tests.support.lanes import HAVE_UCX
from tests.support.models import small_mlp
from tests.support.training import ADAM, SGD_MOMENTUM, OptFactory, reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.usefixtures("one_torch_thread"),
]

CUDA = "cuda:0"
# the lane that carries GPU memory: the CUDA IPC lane (same process here: device to device
# without handles), TCP staging through pinned host memory, UCX's CUDA transports
TRANSPORTS = ["ipc", "tcp", pytest.param("ucx", marks=[pytest.mark.ucx, pytest.mark.skipif(
    not HAVE_UCX, reason="ucxx not installed")])]
STEPS = 12
TOL: dict[str, Any] = {"rtol": 1e-4, "atol": 1e-5}  # float summation order, GPU vs CPU
OPTS = [pytest.param(SGD_MOMENTUM, id="sgd-momentum"), pytest.param(ADAM, id="adam")]
NOT_MAPPED = "only host memory can be mapped"


def lanes(lane: str) -> dict[str, Any]:
    """Node options for ``lane``: ``ipc`` keeps the CUDA IPC lane (the default), ``tcp``
    turns it off so GPU memory is staged through host memory, ``ucx`` turns it off and runs
    UCX without its peer error handling, which on one host keeps UCX to tcp lanes (no
    cuda_copy/cuda_ipc), as two processes on one GPU host would be run."""
    if lane == "ipc":
        return {"node_options": {"cuda_ipc": True}}
    if lane == "tcp":
        return {"node_options": {"cuda_ipc": False}}
    return {"node_options": {"cuda_ipc": False, "ucx_options": {"error_handling": False}}}


def transport_of(lane: str) -> str:
    return "ucx" if lane == "ucx" else "tcp"


def data_on(device: str, steps: int, num_workers: int = 2
            ) -> list[list[tuple[torch.Tensor, ...]]]:
    return [[tuple(t.to(device) for t in batch) for batch in step]
            for step in batches(steps, num_workers)]


def tensors_of(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from tensors_of(v)
    elif isinstance(value, list | tuple):
        for v in value:
            yield from tensors_of(v)


async def train_sync(opt: OptFactory, transport: str, server: str, model: str,
                     share_memory: bool = True) -> list[torch.Tensor]:
    """1 shard on ``server``, 2 workers with their models on ``model``; rank 0's final
    parameters, on the CPU."""
    data = data_on(model, STEPS)
    models = [small_mlp().to(model), small_mlp(seed=99).to(model)]
    async with servers(1, 2, transport_of(transport), mode="sync", optimizer=opt, device=server,
                       share_memory=share_memory, **lanes(transport)) as (ps,), \
            workers(models, [ps.address], transport_of(transport), verify=True,
                    share_memory=share_memory, **lanes(transport)) as ws:
        for step in data:
            for w, m, (x, y) in zip(ws, models, step, strict=True):
                w.zero_grad()
                backward(m, x, y)
            await asyncio.gather(*(w.step() for w in ws))
        assert ps.version == STEPS
        state = ps.state
        assert state is not None
        assert state.params_region.device == server
        assert all(r.device == server for r in state.slot_regions)
        assert state.optimizer is not None
        for t in tensors_of(state.optimizer.state_dict()["state"]):
            if t.dim() > 0:  # per-element state (momentum, exp_avg...) is with the params
                assert str(t.device) == server
        assert not any(w.mapped[0] for w in ws)  # a CUDA model or a GPU shard copies
        for a, b in zip(models[0].parameters(), models[1].parameters(), strict=True):
            assert torch.equal(a, b)
        return [p.detach().cpu() for p in models[0].parameters()]


def train_single(opt: OptFactory, device: str) -> list[torch.Tensor]:
    model = small_mlp().to(device)
    optimizer = opt(list(model.parameters()))  # type: ignore[arg-type]
    for step in data_on(device, STEPS):
        optimizer.zero_grad()
        backward(model, torch.cat([x for x, _ in step]), torch.cat([y for _, y in step]))
        optimizer.step()
    return [p.detach().cpu() for p in model.parameters()]


def assert_same(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, **TOL)


# -- end to end -------------------------------------------------------------------------
@pytest.mark.parametrize("share_memory", [True, False], ids=["share", "no-share"])
@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("opt", OPTS)
async def test_gpu_server_equals_single_process(opt: OptFactory, transport: str,
                                                share_memory: bool,
                                                caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="tensorx._ps.service.samehost"):
        got = await train_sync(opt, transport, CUDA, CUDA, share_memory)
    said = [r for r in caplog.records if NOT_MAPPED in r.getMessage()]
    assert len(said) == (1 if share_memory else 0)
    assert_same(got, train_single(opt, CUDA))


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_cpu_server_serves_a_cuda_model(transport: str) -> None:
    got = await train_sync(ADAM, transport, "cpu", CUDA)
    assert_same(got, train_single(ADAM, CUDA))


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_gpu_server_serves_a_cpu_model(transport: str) -> None:
    got = await train_sync(SGD_MOMENTUM, transport, CUDA, "cpu")
    assert_same(got, train_single(SGD_MOMENTUM, "cpu"))


@pytest.mark.parametrize("first", [CUDA, "cpu"], ids=["gpu-then-cpu", "cpu-then-gpu"])
@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_checkpoint_moves_between_gpu_and_cpu_servers(tmp_path: Path, transport: str,
                                                            first: str) -> None:
    """3 steps on one server (checkpointed at close), 3 more on a server on the other
    device resuming from that checkpoint: the same as 6 steps in one process."""
    data = batches(6, 1)

    async def train(device: str, model: nn.Module, rounds: list[Any]) -> int:
        model.to(device)
        async with ParameterServer(num_workers=1, checkpoint_dir=tmp_path, optimizer=ADAM,
                                   transport=transport_of(transport), device=device,
                                   **lanes(transport)) as ps, \
                workers([model], [ps.address], transport_of(transport),
                        **lanes(transport)) as (w,):
            for ((x, y),) in rounds:
                w.zero_grad()
                backward(model, x.to(device), y.to(device))
                await w.step()
            return ps.version

    second = "cpu" if first == CUDA else CUDA
    assert await train(first, small_mlp(), data[:3]) == 3
    saved = load_checkpoint(checkpoint_path(tmp_path, 0, 1))
    assert saved is not None
    assert all(t.device.type == "cpu" for t in tensors_of(saved))  # whatever the server's
    fresh = small_mlp(seed=5)  # the checkpoint, not rank 0, seeds the resumed server
    assert await train(second, fresh, data[3:]) == 6
    assert_same([p.detach().cpu() for p in fresh.parameters()],
                [p.detach() for p in reference(data).parameters()])


# -- one shard's state, no transport ----------------------------------------------------
def _layout() -> ShardLayout:
    slots = (Slot("w", 0, 6, torch.float32), Slot("b", 64, 3, torch.float32))
    return ShardLayout(0, 1, 128, slots, "fp-gpu")


def _state(device: str, flat: bool = False) -> ShardState:
    opt: OptFactory = lambda p: torch.optim.Adam(p, lr=0.1)  # noqa: E731
    state = ShardState(_layout(), 2, opt, flat=flat, device=device)
    state.load_params({"w": torch.arange(6.0), "b": torch.ones(3)})
    return state


def _push(state: ShardState, rank: int, step: int) -> None:
    for i, v in enumerate(views(state.layout, state.slot_region(rank))):
        v.copy_(torch.linspace(-1, 1, v.numel()) * (rank + 1) * (step + 1) + i)


def _run(state: ShardState, steps: int, start: int = 0) -> None:
    for step in range(start, start + steps):
        for rank in (0, 1):
            _push(state, rank, step)
        assert finite(state, 0) and finite(state, 1)
        state.gather([0, 1])
        state.apply([0, 1])


@pytest.mark.parametrize("flat", [False, True], ids=["per-tensor", "flat"])
def test_shard_state_on_the_gpu_updates_as_on_the_cpu(flat: bool) -> None:
    gpu, cpu = _state(CUDA, flat), _state("cpu", flat)
    try:
        assert gpu.params_region.is_cuda and all(p.is_cuda for p in gpu.params)
        assert checksum(gpu.params_region) == checksum(cpu.params_region)
        _run(gpu, 5)
        _run(cpu, 5)
        for g, c in zip(gpu.views, cpu.views, strict=True):
            torch.testing.assert_close(g.cpu(), c, **TOL)
        gpu.gather([0, 1])
        cpu.gather([0, 1])
        assert gpu.grad_sumsq() == pytest.approx(cpu.grad_sumsq(), rel=1e-6)
        gpu.ungather()
        views(gpu.layout, gpu.slot_region(1))[0][2] = float("nan")
        assert finite(gpu, 0) and not finite(gpu, 1)
    finally:
        gpu.close()
        cpu.close()


@pytest.mark.parametrize("name", list(flat_update.ELEMENTWISE))
def test_a_gpu_shard_steps_the_flat_update_by_default(name: str) -> None:
    """``flat=None`` on a GPU shard: the flat update (fused or foreach passes over the
    arena's ranges, the whole update at once), the same parameters and optimizer state as
    stepping each tensor there (SGD bit for bit)."""
    cls, kw = flat_update.ELEMENTWISE[name]
    make = flat_update.two_groups(cls, **kw)
    layout = flat_update.layout()
    auto, ref = (ShardState(layout, 2, make, flat=f, device=CUDA) for f in (None, False))
    try:
        assert auto.fast is not None and ref.fast is None
        assert auto.update.startswith("flat over"), auto.update
        assert auto.fast.flat[0].is_cuda and not auto.in_parts
        flat_update.train(auto, range(6))
        flat_update.train(ref, range(6))
        flat_update.same(auto, ref, exact=cls is torch.optim.SGD)
    finally:
        auto.close()
        ref.close()


@pytest.mark.parametrize(("first", "second"), [(CUDA, "cpu"), ("cpu", CUDA)],
                         ids=["gpu-to-cpu", "cpu-to-gpu"])
def test_shard_checkpoint_moves_between_devices(tmp_path: Path, first: str,
                                                second: str) -> None:
    a, b, ref = _state(first), _state(second), _state("cpu")
    try:
        _run(a, 3)
        _run(ref, 3)
        path = tmp_path / "shard.pt"
        a.save(path, b"plan")
        saved = load_checkpoint(path)
        assert saved is not None
        assert all(t.device.type == "cpu" for t in tensors_of(saved))
        b.load_state_dict(saved)
        assert b.version == 3
        assert b.optimizer is not None
        for t in tensors_of(b.optimizer.state_dict()["state"]):
            if t.dim() > 0:
                assert str(t.device) == second
        _run(b, 3, start=3)
        _run(ref, 3, start=3)
        for got, want in zip(b.views, ref.views, strict=True):
            torch.testing.assert_close(got.cpu(), want, **TOL)
    finally:
        for state in (a, b, ref):
            state.close()
