"""A slow, stalled or lossy link between two network namespaces (two "hosts" on a veth pair).

An owner process in one namespace exports regions; a client process in the other moves
them over TCP while the test slows the link (tbf), takes it down (``ip link set down``) or
drops packets at random (nftables). Timeouts fire within their budget, nothing hangs, the
data that arrives is right, and the owner's file descriptors and asyncio tasks return to
what they were. The last test trains through a slow link: ``tensorx ps`` in one namespace,
two workers in the other, exact parameters. Each test prints what it measured (``-s``).
Needs root and ``ip`` (iproute2); the slow link ``tc``; the lossy one ``nft`` (nftables).
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
import queue
import re
import time
import traceback
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest

from tensorx._netns import TwoHosts, Unavailable, enter_netns, two_hosts
from tensorx.memregion import RegionDescriptor
from tensorx.testing import OwnerProcess, digest, pattern, wait_until
from tests.support.clusters import PsProcess
from tests.support.lanes import transports

pytestmark = pytest.mark.netns

TOKEN = "netns-fault-test"
MIB = 1 << 20
RATE = 40e6  # bit/s of the slow link
SLOW = {"rate": "40mbit", "burst": "64kb", "latency": "100ms"}
LOSS = 5  # percent of packets dropped each way (at 10 a MiB takes ~5 s: TCP's RTO backoff)


def report(scenario: str, **figures: Any) -> None:
    shown = ", ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}"
                      for k, v in figures.items())
    print(f"\n[netns] {scenario}: {shown}")


def or_skip(fn: Callable[..., None], *args: Any, **kw: Any) -> None:
    """Apply a fault; a tool or kernel feature that is missing skips the test."""
    try:
        fn(*args, **kw)
    except Unavailable as exc:
        pytest.skip(str(exc))


@pytest.fixture
def hosts() -> Iterator[TwoHosts]:
    with contextlib.ExitStack() as stack:
        try:
            made = stack.enter_context(two_hosts())
        except Unavailable as exc:
            pytest.skip(f"no network namespaces here: {exc}")
        yield made


@pytest.fixture
def slow(hosts: TwoHosts) -> TwoHosts:
    """The link capped at 40 Mbit/s each way (asked for before ``pair``: a missing ``tc``
    skips before any process starts)."""
    or_skip(hosts.shape, **SLOW)
    return hosts


@pytest.fixture
def lossy(hosts: TwoHosts) -> TwoHosts:
    """The link dropping LOSS % of the packets each way (needs ``nft``)."""
    or_skip(hosts.drop, LOSS)
    return hosts


Pair = tuple[OwnerProcess, OwnerProcess]


@pytest.fixture
async def pair(request: pytest.FixtureRequest, hosts: TwoHosts) -> AsyncIterator[Pair]:
    """The owner in namespace 0, the client in namespace 1; both stopped afterwards.
    TCP unless parametrized (indirect); over UCX, endpoints are in peer error-handling
    mode (the default), hence on UCX's tcp lanes."""
    transport = getattr(request, "param", "tcp")
    owner = OwnerProcess(transport, TOKEN, listen=f"tcp://{hosts.ip[0]}:0", netns=hosts.ns[0])
    client = OwnerProcess(transport, TOKEN, listen=f"tcp://{hosts.ip[1]}:0", netns=hosts.ns[1])
    try:
        await owner.__aenter__()
        await client.__aenter__()
        yield owner, client
    finally:
        await asyncio.gather(owner.stop(), client.stop())


async def ok(result: dict[str, Any]) -> dict[str, Any]:
    assert result["ok"], f"transfer failed: {result}"
    return result


def timed_out(result: dict[str, Any], timeout: float) -> None:
    """The op raised tensorx.TimeoutError, naming the budget that ran out: the caller's
    timeout (or what was left of it), not some other, longer bound."""
    assert result["error"] == "TimeoutError", result
    budget = re.search(r"(?:after|within) ([0-9.]+) s", result["message"])
    assert budget is not None and float(budget.group(1)) <= timeout, result


async def baseline(owner: OwnerProcess, client: OwnerProcess,
                   desc: RegionDescriptor) -> dict[str, int]:
    """The owner's resources after one connection came and went (what a transport sets
    up once, on first use, is not a leak)."""
    ep = await client.connect(owner.address)
    await ok(await client.transfer(ep, "read", desc, timeout=10))
    return await closed(owner, client)


async def closed(owner: OwnerProcess, client: OwnerProcess) -> dict[str, int]:
    """Close the client's endpoints; wait until the owner has dropped its side."""
    await client.call("close_endpoints")

    async def dropped() -> dict[str, int] | None:
        after: dict[str, int] = await owner.resources()
        return after if after["endpoints"] == 0 else None

    found: dict[str, int] = await wait_until(dropped, what="the owner dropping its endpoints")
    return found


async def check_no_leaks(owner: OwnerProcess, client: OwnerProcess,
                         before: dict[str, int]) -> None:
    """Close the client's endpoints: the owner's tasks and fds go back to ``before``
    (within a few seconds: a transport may close a socket once its peer has answered)."""
    after = await closed(owner, client)

    async def settled() -> bool:
        after.update(await owner.resources())
        return after["fds"] <= before["fds"] and after["tasks"] <= before["tasks"]

    with contextlib.suppress(TimeoutError):
        await wait_until(settled, 5)
    assert after["tasks"] <= before["tasks"], f"owner tasks {before} -> {after}"
    assert after["fds"] <= before["fds"], f"owner fds {before} -> {after}"


async def setup(owner: OwnerProcess, client: OwnerProcess
                ) -> tuple[RegionDescriptor, RegionDescriptor, dict[str, int], Any]:
    """A 1 MiB and a 4 MiB region on the owner, its resources after one connection came
    and went, and the client's endpoint for the test."""
    desc = await owner.export(MIB, seed=1)
    big = await owner.export(4 * MIB, seed=1)
    before = await baseline(owner, client, desc)
    return desc, big, before, await client.connect(owner.address)


async def test_slow_link_is_correct_and_a_short_timeout_fires(slow: TwoHosts,
                                                              pair: Pair) -> None:
    owner, client = pair
    desc, big, before, ep = await setup(owner, client)
    wrote = await ok(await client.transfer(ep, "write", desc, seed=2, timeout=10))
    assert wrote["elapsed"] > 0.8 * MIB * 8 / RATE, "the link is not slow: shaping failed"
    assert await owner.call("digest", desc.region_id) == digest(pattern(MIB, 2))
    got = await ok(await client.transfer(ep, "read", desc, timeout=10))
    assert got["digest"] == digest(pattern(MIB, 2))
    late = await client.transfer(ep, "write", big, seed=3, timeout=0.25)  # needs ~0.84 s
    timed_out(late, 0.25)
    # a write that timed out may have landed in part (what is cut off depends on the lane:
    # a prefix on TCP, fragments on UCX): the caller writes it again, and then it is all there
    again = await ok(await client.transfer(ep, "write", big, seed=3, timeout=10))
    assert await owner.call("digest", big.region_id) == digest(pattern(4 * MIB, 3))
    after = await ok(await client.transfer(ep, "write", desc, seed=4, timeout=10))
    assert await owner.call("digest", desc.region_id) == digest(pattern(MIB, 4))
    assert await owner.call("guards_intact")
    report(f"{owner.transport}: slow link 40 Mbit/s", write_1mib_s=wrote["elapsed"],
           read_1mib_s=got["elapsed"], timeout_0_25_fired_after_s=late["elapsed"],
           retry_4mib_s=again["elapsed"], next_1mib_write_s=after["elapsed"])
    await check_no_leaks(owner, client, before)


@pytest.mark.parametrize("pair", transports(), indirect=True)
async def test_stalled_link_times_out_and_recovers_on_the_same_endpoint(slow: TwoHosts,
                                                                         pair: Pair) -> None:
    """Slow too: a 4 MiB write lasts ~0.84 s, long enough to cut it in the middle."""
    owner, client = pair
    desc, big, before, ep = await setup(owner, client)
    await ok(await client.transfer(ep, "write", desc, seed=2, timeout=10))
    unwritten = await owner.call("digest", big.region_id)
    cut = asyncio.create_task(client.transfer(ep, "write", big, seed=3, timeout=1.0))

    async def landing() -> bool:  # the first bytes are in: the write is under way
        return bool(await owner.call("digest", big.region_id) != unwritten)

    await wait_until(landing, 10, what="the 4 MiB write under way", interval=0.01)
    down_at = time.monotonic()
    slow.set_link(0, up=False)
    try:
        mid = await cut
        stalled = await client.transfer(ep, "read", desc, timeout=0.5)
    finally:
        # the outage lasts 2 s whatever the ops above took: the behaviour under test
        await asyncio.sleep(max(0.0, 2.0 - (time.monotonic() - down_at)))
        slow.set_link(0, up=True)
    timed_out(mid, 1.0)
    timed_out(stalled, 0.5)
    back = await ok(await client.transfer(ep, "write", desc, seed=4, timeout=20))
    got = await ok(await client.transfer(ep, "read", desc, timeout=10))
    assert got["digest"] == digest(pattern(MIB, 4))
    await ok(await client.transfer(ep, "write", big, seed=3, timeout=20))  # the cut one, again
    assert await owner.call("digest", big.region_id) == digest(pattern(4 * MIB, 3))
    assert await owner.call("guards_intact")
    fresh = await client.connect(owner.address, timeout=10)
    again = await ok(await client.transfer(fresh, "read", big, timeout=10))
    assert again["digest"] == digest(pattern(4 * MIB, 3))
    report(f"{owner.transport}: stalled link (down 2 s)",
           mid_transfer_timeout_1_0_fired_after_s=mid["elapsed"],
           while_down_timeout_0_5_fired_after_s=stalled["elapsed"],
           first_write_after_up_s=back["elapsed"])
    await check_no_leaks(owner, client, before)


async def test_lossy_link_still_delivers_everything(lossy: TwoHosts, pair: Pair) -> None:
    owner, client = pair
    desc = await owner.export(MIB // 2, seed=1)
    before = await baseline(owner, client, desc)
    ep = await client.connect(owner.address)
    times = []
    for seed in (2, 3):
        times.append((await ok(await client.transfer(ep, "write", desc, seed, 30)))["elapsed"])
        got = await ok(await client.transfer(ep, "read", desc, timeout=30))
        times.append(got["elapsed"])
        assert got["digest"] == digest(pattern(MIB // 2, seed))
    dropped = lossy.dropped()
    assert dropped > 0, "nothing was dropped: the loss rule did not apply"
    report(f"{owner.transport}: lossy link ({LOSS}% of packets dropped each way)",
           packets_dropped=dropped, slowest_512kib_op_s=max(times),
           mean_512kib_op_s=sum(times) / len(times))
    await check_no_leaks(owner, client, before)


# -- a parameter server and two workers across a slow link --------------------------------
SIZE = 64 * 1024  # floats per tensor: 512 KiB of parameters, pushed and pulled every step
STEPS = 4
SCALE = 2.0 ** -10  # rank r pushes (r + 1) * SCALE: the sums are exact in float32


def run_workers(out: Any, netns: str, address: str) -> None:
    """Both worker ranks in one process (one torch import on a 2-core machine)."""
    try:
        enter_netns(netns)
        out.put(("done", asyncio.run(_train_both(address))))
    except BaseException:
        out.put(("error", traceback.format_exc()))


async def _train_both(address: str) -> list[tuple[list[float], float]]:
    return list(await asyncio.gather(_train(0, address), _train(1, address)))


async def _train(rank: int, address: str) -> tuple[list[float], float]:
    import torch

    import tensorx as tx

    torch.set_num_threads(1)
    model = torch.nn.ParameterDict({k: torch.nn.Parameter(torch.zeros(SIZE)) for k in "ab"})
    grad = torch.full((SIZE,), (rank + 1) * SCALE)
    async with tx.Worker(model, address, rank=rank, num_workers=2, transport="tcp",
                         token=TOKEN, timeout=60) as worker:
        started = time.perf_counter()
        for _ in range(STEPS):
            model.zero_grad()
            sum((p * grad).sum() for p in model.values()).backward()
            await worker.step()
        seconds = time.perf_counter() - started
    return [float(v) for p in model.values() for v in (p.detach().min(), p.detach().max())], seconds


def test_ps_and_workers_train_exactly_across_a_slow_link(slow: TwoHosts) -> None:
    ps = PsProcess("--listen", f"tcp://{slow.ip[0]}:0", "--workers", "2", "--transport", "tcp",
                   "--optimizer", "sgd:lr=1.0", "--log-every", "0", prefix=slow.prefix(0),
                   env={"TENSORX_TOKEN": TOKEN})
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc: Any = None
    try:
        (address,) = ps.addresses(1)
        proc = ctx.Process(target=run_workers, args=(out, slow.ns[1], address), daemon=True)
        proc.start()
        done = _expect(out)
    finally:
        if proc is not None:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
        log = ps.stop()
    assert ps.proc.returncode == 0, log
    want = -STEPS * 1.5 * SCALE  # lr 1, mean of (1, 2) * SCALE per step
    for values, _ in done:
        assert values == [want] * 4, f"got {values}, want {want}"
    # every step: 2 workers x 2 tensors pushed one way, then pulled the other way
    link_s = STEPS * 2 * 2 * 2 * SIZE * 4 * 8 / RATE
    slowest = max(seconds for _, seconds in done)
    assert slowest > 0.8 * link_s, "the link is not slow: shaping failed"
    report("ps + 2 workers over 40 Mbit/s", steps=STEPS, train_s=slowest,
           link_bound_s=link_s, final_parameter=want)


def _expect(out: Any) -> list[tuple[list[float], float]]:
    try:
        kind, value = out.get(timeout=90)
    except queue.Empty:
        raise AssertionError("the workers sent nothing within 90 s") from None
    assert kind == "done", f"the workers failed:\n{value}"
    return value  # type: ignore[no-any-return]
