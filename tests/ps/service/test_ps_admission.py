"""Who may join a shard (issue 16, items 7 and 9): one live holder per rank, and a plan
adopted only once its state is built and its worker admitted."""

from __future__ import annotations

import asyncio
import socket
import threading
from typing import Any

import pytest
import torch
from torch import nn

from tensorx import GraphAnalyzer, MemoryRegion, Node
from tensorx._ps.wire import protocol
from tensorx.errors import RankTakenError
from tensorx.ps import ParameterServer
from tensorx.transport import handshake
from tensorx.transport.control import ControlChannel
from tensorx.worker import Worker
from tests.support.lanes import transports
from tests.support.models import small_mlp

TRANSPORTS = transports()


pytestmark = pytest.mark.usefixtures("one_torch_thread")


async def train(w: Worker, model: nn.Module, steps: int) -> None:
    gen = torch.Generator().manual_seed(w.rank)
    for _ in range(steps):
        w.zero_grad()
        model(torch.randn(4, 8, generator=gen)).square().mean().backward()
        await w.step()


# -- item 9: two workers with one rank ------------------------------------------------------
@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_second_live_claimant_of_a_rank_is_refused(transport: str) -> None:
    """Both with reconnect: before, each hello evicted the other (over 1,100 times in 4 s)."""
    kw: dict[str, Any] = {"num_workers": 2, "transport": transport, "reconnect": 5.0,
                          "timeout": 20, "share_memory": False}
    async with ParameterServer(num_workers=2, mode="async", transport=transport) as ps:
        holder_model = small_mlp()
        async with Worker(holder_model, ps.address, rank=0, **kw) as holder:
            await train(holder, holder_model, 2)
            rival = Worker(small_mlp(), ps.address, rank=0, **kw)
            with pytest.raises(RankTakenError, match="rank 0 is taken"):
                await rival.start()
            await train(holder, holder_model, 3)  # the holder never noticed
            assert holder.stats["rejoins"] == 0
            assert holder.steps == 5
            assert ps.stats["updates"] == 5


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_rank_passes_on_once_its_holder_is_gone(transport: str) -> None:
    """A holder whose connections drop without a goodbye (as in a crash) is gone: a new
    connection with its rank is admitted, whether or not the shard has noticed yet."""
    kw: dict[str, Any] = {"num_workers": 2, "transport": transport, "timeout": 20,
                          "share_memory": False}
    async with ParameterServer(num_workers=2, mode="async", transport=transport) as ps:
        old_model = small_mlp()
        old = Worker(old_model, ps.address, rank=0, **kw)
        await old.start()
        try:
            await train(old, old_model, 2)
            for ep in old._eps:
                ep.abort()  # no bye, at once
            new_model = small_mlp()
            async with Worker(new_model, ps.address, rank=0, **kw) as new:
                await train(new, new_model, 2)
        finally:
            await old.aclose()
        assert ps.stats["updates"] == 4


# -- item 7: the first hello must not lock the plan ---------------------------------------
async def raw_hello(address: str, transport: str, plan: Any, rank: int) -> dict[str, Any]:
    """A hello from a plain node (what a worker sends), and the shard's answer."""
    async with Node(None, transport=transport, timeout=20) as node:
        region = MemoryRegion.allocate(4096)
        try:
            desc = node.export(region)
            ep = await node.connect(address)
            await ep.notify(protocol.encode(
                "hello", proto=protocol.PROTOCOL, rank=rank, num_workers=2, shard=0,
                num_shards=1, fingerprint=plan.fingerprint, plan=plan.to_bytes(),
                params=desc.to_bytes(), verify=False, share=False))
            _, payload = await asyncio.wait_for(node.notifications.get(), 30)
            return protocol.decode(payload)
        finally:
            region.close()


async def honest_pair(address: str, transport: str, steps: int = 3) -> None:
    models = [small_mlp(), small_mlp()]
    ws = [Worker(m, address, rank=r, num_workers=2, transport=transport, timeout=20,
                 share_memory=False) for r, m in enumerate(models)]
    try:
        await asyncio.gather(*(w.start() for w in ws))
        await asyncio.gather(*(train(w, m, steps) for w, m in zip(ws, models, strict=True)))
    finally:
        await asyncio.gather(*(w.aclose() for w in ws), return_exceptions=True)


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_plan_too_big_to_allocate_is_refused_and_not_adopted(transport: str) -> None:
    """Before: no answer at all, and every honest worker then got PlanMismatchError."""
    huge = GraphAnalyzer(nn.Linear(1 << 18, 1 << 18, bias=False, device="meta")).plan()
    assert huge.total_bytes >= 1 << 38  # 256 GiB per arena: more than this host has
    async with ParameterServer(num_workers=2, mode="sync", transport=transport) as ps:
        answer = await raw_hello(ps.address, transport, huge, rank=0)
        assert answer["t"] == "error"
        assert answer["code"] == "usage"
        assert "cannot build this shard's state" in answer["msg"]
        await honest_pair(ps.address, transport)
        assert ps.stats["updates"] == 3


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("rank", [0, 1])
async def test_a_worker_of_another_model_that_leaves_does_not_lock_the_plan(
        transport: str, rank: int) -> None:
    async with ParameterServer(num_workers=2, mode="sync", transport=transport) as ps:
        stranger = Worker(small_mlp(hidden=17), ps.address, rank=rank, num_workers=2,
                          transport=transport, timeout=3, share_memory=False)
        if rank == 0:  # says hello, seeds the parameters, leaves
            await stranger.start()
            await stranger.aclose()
        else:  # says hello, waits for a rank 0 that never comes, leaves
            with pytest.raises(TimeoutError, match="welcome"):
                await stranger.start()
        await honest_pair(ps.address, transport)
        assert ps.stats["updates"] == 3


async def test_building_a_large_state_does_not_starve_other_handshakes() -> None:
    """The first hello builds the shard's state (arenas, the optimizer: seconds for a large
    model on a busy host). Before, that ran on the server's loop, and a peer whose handshake
    was under way meanwhile missed its deadline and was refused (seen with a DLRM-sized
    model under load). Here a peer handshakes (from another thread's loop) while the build
    runs, and is served before the build is over."""
    building, served, built = threading.Event(), threading.Event(), threading.Event()

    def slow_optimizer(params: Any) -> torch.optim.Optimizer:
        building.set()
        # a large state being built (a thread now; before: the loop), until the late peer
        # was served (before: it never could be, and this gave up after 30 s)
        served.wait(30)
        built.set()
        return torch.optim.SGD(params, lr=0.1)

    async with ParameterServer(num_workers=2, mode="sync", transport="tcp",
                               optimizer=slow_optimizer,
                               node_options={"handshake_timeout": 5}) as ps:
        host, port = ps.address.removeprefix("tcp://").rsplit(":", 1)
        sock = socket.create_connection((host, int(port)))
        sock.setblocking(False)
        outcome: list[BaseException | None] = []

        def late_peer() -> None:
            async def run() -> None:
                building.wait(30)  # the server is building now
                conn = ControlChannel(sock, "late")
                try:
                    await handshake.initiate(conn, "late-peer", ps.node._token, {}, 10)
                    await handshake.conclude(conn, 10)
                    # served while the build still ran (before: only once it was over)
                    assert not built.is_set(), "the handshake waited for the build"
                    served.set()
                finally:
                    await conn.aclose()
            try:
                asyncio.run(run())
                outcome.append(None)
            except BaseException as exc:
                outcome.append(exc)

        thread = threading.Thread(target=late_peer)
        thread.start()
        model = small_mlp()
        worker = Worker(model, ps.address, rank=0, num_workers=2, transport="tcp")
        joining = asyncio.ensure_future(worker.start())  # waits for rank 1: never comes
        await asyncio.to_thread(thread.join, 60)
        joining.cancel()
        await asyncio.gather(joining, return_exceptions=True)
        await worker.aclose()
        assert outcome == [None], outcome


# -- joins under churn ---------------------------------------------------------------------
async def join_and_leave(address: str, rank: int, how: str) -> tuple[float, list[bool]]:
    """A worker joins (its start timed: connect, handshake, welcome, first pull) and leaves
    ``how``: "clean" (closes), "abort" (its connection dropped right after joining) or
    "push" (dropped once its push is on its way)."""
    model = small_mlp()
    w = Worker(model, address, rank=rank, num_workers=2, timeout=10)
    t0 = asyncio.get_running_loop().time()
    await w.start()
    took, mapped = asyncio.get_running_loop().time() - t0, list(w.mapped)
    if how == "push":
        w.zero_grad()
        model(torch.randn(4, 8)).square().mean().backward()
        step = asyncio.ensure_future(w.step())
        await asyncio.sleep(0.05)
        step.cancel()
    if how != "clean":
        for ep in w.node.endpoints:
            ep.abort()
    await asyncio.gather(w.aclose(), return_exceptions=True)
    return took, mapped


async def test_joins_under_churn_are_quick_and_offered_the_mapping() -> None:
    """Joins and departures of both ranks, clean and aborted, one at a time (so that at
    times no worker is connected, and none has ever completed an update): every join is
    welcomed (a rank 1 alone takes the parameters rank 0 gave before it left), the mapping
    is offered to every rank after the churn, and joins do not slow down as it goes on."""
    hows = ["clean", "abort", "push"] * 3
    async with ParameterServer(num_workers=2, mode="sync") as ps:
        joins = [await join_and_leave(ps.address, i % 2, how) for i, how in enumerate(hows)]
        after = await asyncio.gather(join_and_leave(ps.address, 0, "clean"),
                                     join_and_leave(ps.address, 1, "clean"))
        assert ps.version == 0 and ps.stats["pushes"] >= 1  # nothing applied
    assert all(mapped == [True] for _, mapped in [*joins, *after]), [*joins, *after]
    first = max(took for took, _ in joins[:3])
    assert max(took for took, _ in [*joins[3:], *after]) < max(2.0, 3 * first), joins


async def test_rank_0_gives_the_parameters_again_to_a_plan_left_idle() -> None:
    """Every worker left before the first update: the plan is kept for rank 1 to come
    back to, and rank 0's next hello gives the parameters again, as its first did."""
    async with ParameterServer(num_workers=2, mode="sync", transport="tcp") as ps:
        first = small_mlp()
        async with Worker(first, ps.address, rank=0, num_workers=2, transport="tcp"):
            pass
        again = small_mlp()
        with torch.no_grad():
            for p in again.parameters():
                p.fill_(0.5)
        async with Worker(again, ps.address, rank=0, num_workers=2, transport="tcp"), \
                Worker(small_mlp(), ps.address, rank=1, num_workers=2,
                       transport="tcp") as w1:
            assert all(bool((p == 0.5).all()) for p in w1.model.parameters())
