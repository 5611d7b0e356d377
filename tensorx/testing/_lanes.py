"""The data-lane conformance suite: what every lane must do, checked against a real owner.

The checks run against an :class:`~tensorx.testing.OwnerProcess` (a node in another
process, so every byte crosses the lane) through an :class:`~tensorx.Endpoint` of a local
node; each gets a fresh pair from the caller's ``make_pair`` (one check kills its owner).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from contextlib import AbstractAsyncContextManager
from typing import Any

import numpy as np

from tensorx._deadline import Deadline, wait_for
from tensorx.endpoint import Endpoint
from tensorx.errors import BrokenError, RegionError, UsageError
from tensorx.errors import TimeoutError as TxTimeoutError
from tensorx.memregion import MemoryRegion, RegionDescriptor
from tensorx.node import Node

from ._owner import OwnerProcess, digest, pattern

MiB = 1 << 20


@dataclasses.dataclass
class LanePair:
    """What a check works with: ``owner`` exports regions and reports on its memory,
    ``node`` is ours, ``ep`` our endpoint to the owner over the lane under test."""

    owner: OwnerProcess
    node: Node
    ep: Endpoint


MakePair = Callable[[], AbstractAsyncContextManager[LanePair]]
Check = Callable[[LanePair], Awaitable[None]]
LANE_CHECKS: dict[str, Check] = {}


def owner_pair(transport: str = "auto", token: str | None = None,
               **node_options: Any) -> MakePair:
    """A ``make_pair`` for :func:`check_lane`: an :class:`OwnerProcess` and a local node,
    both made with ``transport``, ``token`` and ``node_options``, our node connected."""

    @contextlib.asynccontextmanager
    async def make() -> AsyncIterator[LanePair]:
        async with OwnerProcess(transport, token=token, node_options=node_options) as owner, \
                Node(None, transport=transport, token=token, **node_options) as node:
            yield LanePair(owner, node, await node.connect(owner.address))

    return make


async def check_lane(make_pair: MakePair, checks: Iterable[str] | None = None) -> None:
    """Run the conformance checks (all of :data:`LANE_CHECKS`, in order, or the ones named
    in ``checks``) over a lane, each on a fresh pair from ``make_pair()``: an async context
    manager yielding a :class:`LanePair` whose endpoint uses the lane under test.

    A lane's author runs the same suite as tensorx's own lanes (tcp, ucx, cma)::

        await check_lane(owner_pair("mylane"))            # every check
        await check_lane(owner_pair("mylane"), ["sizes"])  # one of them

    What is checked: whole regions of 0, 1, 4 KiB, 16 MiB + 3 and 256 MiB written and read
    back, odd offsets and lengths, 100 concurrent ops, ``write_many`` (one completion, its
    defaults), a notification never before the data of the writes issued before it (small
    and large writes, ``write(notify=)`` also where another lane carries it, a refused
    write's never delivered), notifications
    both ways, cancelled writes and reads (the endpoint stays usable, the buffer of a
    cancelled or timed-out read is never written later), timeouts (a
    :class:`tensorx.TimeoutError` that is also a builtin one), peer death
    (:class:`tensorx.BrokenError`, ``node.disconnected``), regions revoked by their owner,
    regions exported again (usable under the new descriptor only) and forged or
    out-of-range descriptors (:class:`tensorx.RegionError`, the owner's memory and the
    guard bands around it untouched), and no file descriptor or task left on the owner
    by closed connections. A failing check raises with a note naming it.
    """
    names = list(LANE_CHECKS) if checks is None else list(checks)
    unknown = [n for n in names if n not in LANE_CHECKS]
    if unknown:
        raise UsageError(f"no lane check {', '.join(unknown)}; known: {', '.join(LANE_CHECKS)}")
    for name in names:
        try:
            async with make_pair() as pair:
                await LANE_CHECKS[name](pair)
        except BaseException as exc:
            note = getattr(exc, "add_note", None)  # Python >= 3.11
            if note is not None:
                note(f"in lane check {name!r}")
            raise


def _check(name: str) -> Callable[[Check], Check]:
    def register(fn: Check) -> Check:
        LANE_CHECKS[name] = fn
        return fn

    return register


async def wait_until(predicate: Callable[[], Any], timeout: float = 10.0, *,
                     what: str = "the condition", interval: float = 0.02) -> Any:
    """Poll ``predicate()`` (plain or async) until it returns something true, and return
    that; raise :class:`tensorx.TimeoutError` naming ``what`` after ``timeout`` seconds.
    For state no event reports (another process's counters, a log); wait on the event
    where there is one."""
    deadline = Deadline(timeout)
    while True:
        value = predicate()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if deadline.expired:
            raise TxTimeoutError(f"{what} did not happen within {timeout} s")
        await asyncio.sleep(interval)


class _Raised:
    value: BaseException


@contextlib.contextmanager
def _raises(kind: type[BaseException], match: str | None = None) -> Any:
    """``pytest.raises`` without pytest: a lane's author may run the checks outside it."""
    raised = _Raised()
    try:
        yield raised
    except kind as exc:
        if match is not None and match not in str(exc):
            raise AssertionError(f"{type(exc).__name__}({exc!s}) does not say {match!r}") \
                from exc
        raised.value = exc
    else:
        raise AssertionError(f"did not raise {kind.__name__}")


async def _echo(pair: LanePair, text: str) -> None:
    """Notify ``echo:<text>`` and wait for the owner to send it back: the owner has seen
    every notification we sent before it."""
    payload = f"echo:{text}".encode()
    await pair.ep.notify(payload)
    peer, got = await wait_for(pair.node.notifications.get(), 10)
    assert (peer, got) == (pair.ep, payload), (peer, got)


async def _answered(pair: LanePair) -> None:
    notification = await wait_for(pair.node.notifications.get(), 10)
    assert notification[1] == b"checked", notification


# -- bytes --------------------------------------------------------------------------------
@_check("sizes")
async def _sizes(pair: LanePair) -> None:
    for seed, nbytes in enumerate((0, 1, 4096, 16 * MiB + 3, 256 * MiB)):
        desc = await pair.owner.export(nbytes, seed=2 * seed + 1)
        data = pattern(nbytes, seed=2 * seed + 2)
        await pair.ep.write(MemoryRegion.register(data), desc)
        assert await pair.owner.call("digest", desc.region_id) == digest(data), nbytes
        back = np.zeros(nbytes, np.uint8)
        await pair.ep.read(MemoryRegion.register(back), desc)
        assert np.array_equal(back, data), f"{nbytes} B read back differ"
    assert await pair.owner.call("guards_intact")


# (local offset, remote offset, nbytes): small, a page less one, either side of 256 KiB
# (where lanes change paths), several MiB, past 16 MiB; odd wherever possible
RANGES = [(10, 500, 50), (0, 0, 1), (1, 3, 7), (5, 1000, 4093), (3, 77, 256 * 1024 - 1),
          (7, 5, 256 * 1024 + 1), (11, 13, 3 * MiB), (1, 2, 16 * MiB + 5)]


@_check("odd-offsets")
async def _odd_offsets(pair: LanePair) -> None:
    size = 17 * MiB + 37
    desc = await pair.owner.export(size, seed=1)
    remote, src = pattern(size, 1), pattern(size, 2)
    region = MemoryRegion.register(src)
    for off, roff, n in RANGES:
        await pair.ep.write(region, desc, off, roff, n)
        remote[roff:roff + n] = src[off:off + n]
    assert await pair.owner.call("digest", desc.region_id) == digest(remote)
    out = np.zeros(size, np.uint8)
    dst = MemoryRegion.register(out)
    for off, roff, n in RANGES:
        await pair.ep.read(dst, desc, off, roff, n)
        assert np.array_equal(out[off:off + n], remote[roff:roff + n]), (off, roff, n)
    assert await pair.owner.call("guards_intact")


@_check("concurrent-ops")
async def _concurrent(pair: LanePair) -> None:
    n, chunk = 100, 64 * 1024
    desc = await pair.owner.export(n * chunk)
    src = pattern(n * chunk, seed=4)
    region = MemoryRegion.register(src)
    await asyncio.gather(*(pair.ep.write(region, desc, i * chunk, i * chunk, chunk)
                           for i in range(n)))
    out = np.zeros_like(src)
    dst = MemoryRegion.register(out)
    await asyncio.gather(*(pair.ep.read(dst, desc, i * chunk, i * chunk, chunk)
                           for i in range(n)))
    assert np.array_equal(out, src)


@_check("write-many")
async def _write_many(pair: LanePair) -> None:
    descs = [await pair.owner.export(4096, seed=s) for s in range(3)]
    src = pattern(3 * 4096, seed=9)
    region = MemoryRegion.register(src)
    await pair.ep.write_many([(region, d, i * 4096, 0, 4096) for i, d in enumerate(descs)])
    for i, d in enumerate(descs):
        want = digest(src[i * 4096:(i + 1) * 4096])
        assert await pair.owner.call("digest", d.region_id) == want, i


@_check("write-many-defaults")
async def _write_many_defaults(pair: LanePair) -> None:
    desc = await pair.owner.export(64, seed=11)
    src = pattern(64, seed=12)
    region = MemoryRegion.register(src)
    await pair.ep.write_many([(region, desc, 32)])  # offset 32, remote 0, nbytes: the rest
    expected = pattern(64, 11)
    expected[:32] = src[32:]
    assert await pair.owner.call("digest", desc.region_id) == digest(expected)
    with _raises(UsageError):
        await pair.ep.write_many([(region,)])


# -- notifications ------------------------------------------------------------------------
@_check("notify-after-writes")
async def _notify_after_writes(pair: LanePair) -> None:
    """A notification issued while 64 writes are in flight: the owner checks on arrival
    that the region already holds their data (and answers before we write again)."""
    nbytes = 256 * 1024
    desc = await pair.owner.export(nbytes)
    for seed in range(100, 140):
        region = MemoryRegion.register(pattern(nbytes, seed=seed))
        writes = [asyncio.ensure_future(pair.ep.write(region, desc, i, i, 4096))
                  for i in range(0, nbytes, 4096)]
        await asyncio.sleep(0)  # one loop turn: the writes are issued, none has completed
        await pair.ep.notify(f"check:{desc.region_id}:{seed}".encode())
        await asyncio.gather(*writes)
        await _answered(pair)
    notes = await pair.owner.call("notes")
    assert len([n for n in notes if n.startswith(b"check:")]) == 40
    assert await pair.owner.call("violations") == []


@_check("notify-after-large-writes")
async def _notify_after_large_writes(pair: LanePair) -> None:
    """Writes of 8 MiB each, in flight together, then a notification: the owner checks the
    last byte of each write, fast enough to catch one that has not landed yet."""
    nbytes, piece = 64 * MiB, 8 * MiB
    desc = await pair.owner.export(nbytes)
    for value in range(1, 7):
        region = MemoryRegion.register(np.full(nbytes, value, np.uint8))
        writes = [asyncio.ensure_future(pair.ep.write(region, desc, i, i, piece))
                  for i in range(0, nbytes, piece)]
        await asyncio.sleep(0)  # one loop turn: the writes are issued, none has completed
        await pair.ep.notify(f"fill:{desc.region_id}:{value}:{piece}".encode())
        await asyncio.gather(*writes)
        await _answered(pair)
    assert await pair.owner.call("violations") == []


@_check("notify-with-data-after-large-writes")
async def _notify_with_data_after_large_writes(pair: LanePair) -> None:
    """A write of 64 MiB in flight, then a write of no bytes with a notification: an
    endpoint of several lanes sends that one by another lane than the large write, one
    that carries the notification with its data. It still arrives after the large write
    has landed. (One large write: the copy leaves a core to the owner, which looks.)"""
    nbytes, piece = 64 * MiB, 8 * MiB
    desc = await pair.owner.export(nbytes)
    for value in range(1, 4):
        region = MemoryRegion.register(np.full(nbytes, value, np.uint8))
        large = asyncio.ensure_future(pair.ep.write(region, desc))
        await asyncio.sleep(0)  # one loop turn: the write is issued, it has not completed
        await pair.ep.write(region, desc, 0, 0, 0,
                            notify=f"fill:{desc.region_id}:{value}:{piece}".encode())
        await large
        await _answered(pair)
    assert await pair.owner.call("violations") == []


@_check("write-with-notify")
async def _write_notify(pair: LanePair) -> None:
    """``write(..., notify=)`` and ``write_many(..., notify=)``: the notification arrives
    once the data is there."""
    nbytes, piece = 64 * MiB, 8 * MiB
    desc = await pair.owner.export(nbytes)
    for value in (1, 2, 3):
        region = MemoryRegion.register(np.full(nbytes, value, np.uint8))
        payload = f"fill:{desc.region_id}:{value}:{piece}".encode()
        if value == 2:
            await pair.ep.write_many([(region, desc, i, i, piece)
                                      for i in range(0, nbytes, piece)], notify=payload)
        else:
            await pair.ep.write(region, desc, notify=payload)
        await _answered(pair)
    assert await pair.owner.call("violations") == []
    assert pair.ep.info["stats"]["notify"]["ops"] == 3


@_check("refused-write-never-notifies")
async def _write_notify_refused(pair: LanePair) -> None:
    """A write the owner refuses (a forged right, in the first of two ops) raises, and its
    notification is never delivered; the endpoint keeps working."""
    readonly = await pair.owner.export(4096, access="r", seed=31)
    ok = await pair.owner.export(4096, seed=32)
    forged = dataclasses.replace(readonly, access="rw")
    src = MemoryRegion.register(pattern(4096, seed=33))
    with _raises(RegionError):
        await pair.ep.write_many([(src, forged), (src, ok)], notify=b"must not arrive")
    await pair.ep.write(src, ok, notify=b"arrives")
    await _echo(pair, "after")  # the owner has seen all we sent
    notes = await pair.owner.call("notes")
    assert b"arrives" in notes, notes
    assert b"must not arrive" not in notes, notes
    assert await pair.owner.call("digest", readonly.region_id) == digest(pattern(4096, 31))
    assert await pair.owner.call("digest", ok.region_id) == digest(pattern(4096, 33))


@_check("notifications-both-ways")
async def _notifications(pair: LanePair) -> None:
    await pair.ep.notify(b"hello")
    await _echo(pair, "there")  # theirs to us, after ours to them
    assert (await pair.owner.call("notes"))[:2] == [b"hello", b"echo:there"]
    with _raises(UsageError):
        await pair.ep.notify("not bytes")  # type: ignore[arg-type]


# -- cancellation, timeouts ---------------------------------------------------------------
@_check("cancelled-write")
async def _cancelled_write(pair: LanePair) -> None:
    """A 64 MiB write cancelled before, as and while it is issued: the endpoint stays
    usable (a small write and read after it are exact)."""
    desc = await pair.owner.export(64 * MiB)
    big = MemoryRegion.register(pattern(64 * MiB, seed=5))
    for turns in (0, 1, 10, 100):
        task = asyncio.ensure_future(pair.ep.write(big, desc, timeout=30))
        for _ in range(turns):  # loop turns, not time: the same points on any machine
            await asyncio.sleep(0)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        small = pattern(4096, seed=6 + turns)
        await pair.ep.write(MemoryRegion.register(small), desc, nbytes=4096)
        out = np.zeros(4096, np.uint8)
        await pair.ep.read(MemoryRegion.register(out), desc, nbytes=4096)
        assert np.array_equal(out, small), f"after a write cancelled at turn {turns}"


async def _settled(ep: Endpoint) -> None:
    """Every op issued on ``ep`` before has finished (a notification flushes the lane
    first): a late reply of an abandoned read would have landed by now."""
    await ep.notify(b"")


@_check("cancelled-read")
async def _cancelled_read(pair: LanePair) -> None:
    """A read cancelled as soon as its first bytes have landed never writes the buffer
    again, and the endpoint stays usable."""
    desc = await pair.owner.export(64 * MiB, seed=33)
    small = await pair.owner.export(4096, seed=34)
    out = np.zeros(64 * MiB, np.uint8)
    task = asyncio.ensure_future(pair.ep.read(MemoryRegion.register(out), desc, timeout=30))
    for _ in range(1_000_000):  # poll the buffer itself: no event says "bytes landed"
        if out[:4096].any() or task.done():
            break
        await asyncio.sleep(0)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    before = out.copy()
    check = np.zeros(4096, np.uint8)
    await pair.ep.read(MemoryRegion.register(check), small, timeout=30)
    assert np.array_equal(check, pattern(4096, 34))
    await _settled(pair.ep)
    assert np.array_equal(out, before), "a cancelled read wrote the buffer later"


async def check_timed_out_reads(ep: Endpoint, big: RegionDescriptor, small: RegionDescriptor,
                                small_seed: int) -> int:
    """Read ``big`` (64 MiB) with ever longer timeouts; after each read that timed out,
    check that its late reply never lands in the buffer (a read of ``small``, written with
    :func:`pattern` of ``small_seed``, is ordered after it) and the endpoint stays usable.
    Returns how many timed out (a caller asserts at least one did). The shortest timeout
    fires before the reply starts even on a loaded host."""
    timed_out = 0
    for timeout in (0.0002, 0.001, 0.005, 0.01, 0.02, 0.05):
        out = np.zeros(big.nbytes, np.uint8)
        try:
            await ep.read(MemoryRegion.register(out), big, timeout=timeout)
        except TimeoutError:
            timed_out += 1
            before = out.copy()
            check = np.zeros(small.nbytes, np.uint8)  # stream order: after the late reply
            await ep.read(MemoryRegion.register(check), small, timeout=30)
            assert np.array_equal(check, pattern(small.nbytes, small_seed))
            await _settled(ep)
            assert np.array_equal(out, before), "a timed-out read wrote the buffer later"
        assert not ep.closed
    return timed_out


@_check("timed-out-reads")
async def _timed_out_reads(pair: LanePair) -> None:
    desc = await pair.owner.export(64 * MiB, seed=31)
    small = await pair.owner.export(4096, seed=32)
    assert await check_timed_out_reads(pair.ep, desc, small, small_seed=32)


@_check("timeout-types")
async def _timeout_types(pair: LanePair) -> None:
    desc = await pair.owner.export(256 * MiB)
    big = MemoryRegion.register(np.zeros(256 * MiB, np.uint8))
    with _raises(TxTimeoutError) as caught:
        await pair.ep.read(big, desc, timeout=0.0001)
    assert isinstance(caught.value, TimeoutError)


# -- failures -----------------------------------------------------------------------------
@_check("peer-death")
async def _peer_death(pair: LanePair) -> None:
    """The owner killed while reads are in flight: they raise BrokenError, so do later
    ops, and the endpoint is reported on ``node.disconnected``."""
    desc = await pair.owner.export(64 * MiB)
    big = MemoryRegion.register(np.zeros(64 * MiB, np.uint8))
    moving = asyncio.Event()

    async def hammer() -> None:
        while True:
            await pair.ep.read(big, desc, timeout=20)
            moving.set()  # the next read is issued before this task yields again

    task = asyncio.ensure_future(hammer())
    await wait_for(moving.wait(), 20)
    pair.owner.kill()
    with _raises(BrokenError):
        await wait_for(task, 25)
    with _raises(BrokenError):
        await pair.ep.write(big, desc, nbytes=8)
    assert await wait_for(pair.node.disconnected.get(), 5) is pair.ep


@_check("revoked-region")
async def _revoked(pair: LanePair) -> None:
    """A region its owner closed is refused (RegionError naming it closed), and nothing
    reaches its memory."""
    desc = await pair.owner.export(4096, seed=21)
    src = MemoryRegion.register(pattern(4096, seed=22))
    await pair.ep.write(src, desc, nbytes=8)  # used (and, on UCX, validated) while open
    await pair.owner.call("close_region", desc.region_id)
    # the owner's revocation is ahead of its answer on the control channel
    exports = (await pair.ep.query("exports"))["exports"]
    assert f"{desc.region_id:#x}" not in {e["region"] for e in exports}
    with _raises(RegionError, match="closed"):
        await pair.ep.write(src, desc)
    with _raises(RegionError, match="closed"):
        await pair.ep.read(src, desc)
    expected = pattern(4096, 21)
    expected[:8] = pattern(4096, 22)[:8]
    assert await pair.owner.call("backing_digest", desc.region_id) == digest(expected)


@_check("re-exported-region")
async def _re_exported(pair: LanePair) -> None:
    """A region its owner exports again (having unexported it, or while it is still
    exported) is usable again under the new descriptor, and only under it: each export has
    a cookie of its own, and a descriptor of an earlier export is refused (RegionError)
    without reaching the memory."""
    first = await pair.owner.export(4096, seed=23)
    src = MemoryRegion.register(pattern(4096, seed=24))
    await pair.ep.write(src, first, nbytes=8)  # used (and, on UCX, validated) while open
    stale = [first]
    for unexport in (True, False):
        raw = await pair.owner.call("export_again", first.region_id, "rw", unexport)
        fresh = RegionDescriptor.from_bytes(raw)
        assert fresh.region_id == first.region_id
        assert fresh.cookie not in {d.cookie for d in stale}
        await pair.ep.query("exports")  # the owner's revocation is ahead of its answer
        for old in stale:
            with _raises(RegionError):
                await pair.ep.write(src, old, remote_offset=16, nbytes=8)
            with _raises(RegionError):
                await pair.ep.read(src, old)
        await pair.ep.write(src, fresh, offset=8, remote_offset=8, nbytes=8)
        got = MemoryRegion.register(np.zeros(4096, np.uint8))
        await pair.ep.read(got, fresh)
        stale.append(fresh)
    expected = pattern(4096, 23)
    expected[:16] = pattern(4096, 24)[:16]
    assert bytes(got.buffer()) == expected.tobytes()
    assert await pair.owner.call("digest", first.region_id) == digest(expected)


@_check("bad-descriptors")
async def _bad_descriptors(pair: LanePair) -> None:
    """Forged descriptors (cookie, size, region, rights, owner) and ranges past the end
    are refused with RegionError, both ways; the owner's memory and guards are untouched."""
    desc = await pair.owner.export(4096, seed=6)
    readonly = await pair.owner.export(4096, access="r", seed=7)
    src = MemoryRegion.register(pattern(1 * MiB, 8))
    forged = [dataclasses.replace(desc, cookie=desc.cookie ^ 1),
              dataclasses.replace(desc, region_id=desc.region_id ^ 1),
              dataclasses.replace(desc, owner=desc.owner + "-elsewhere")]
    larger = dataclasses.replace(desc, nbytes=1 * MiB)  # its ops must stay in the real one
    for op in (pair.ep.write, pair.ep.read):
        for bad in forged:
            with _raises(RegionError):
                await op(src, bad, nbytes=64)
        for bad in (larger, desc):
            with _raises(RegionError):
                await op(src, bad, remote_offset=4000, nbytes=97)
    with _raises(RegionError):
        await pair.ep.write(src, dataclasses.replace(readonly, access="rw"), nbytes=64)
    await _settled(pair.ep)
    assert await pair.owner.call("digest", desc.region_id) == digest(pattern(4096, 6))
    assert await pair.owner.call("digest", readonly.region_id) == digest(pattern(4096, 7))
    assert await pair.owner.call("guards_intact")
    out = np.zeros(4096, np.uint8)  # and the endpoint still works
    await pair.ep.read(MemoryRegion.register(out), desc)
    assert np.array_equal(out, pattern(4096, 6))


@_check("no-leaks")
async def _no_leaks(pair: LanePair) -> None:
    """Connect, move bytes, close, five times: the owner ends with the fds and tasks it
    had after the first round (what a transport sets up once is not a leak)."""
    owner = pair.owner
    desc = await owner.export(4096)
    buf = MemoryRegion.register(np.zeros(4096, np.uint8))

    async def no_endpoints() -> dict[str, int] | None:
        found: dict[str, int] = await owner.resources()
        return found if found["endpoints"] == 0 else None

    async def one_round() -> dict[str, int]:
        ep = await pair.node.connect(owner.address)
        await ep.read(buf, desc)
        await ep.aclose()
        found: dict[str, int] = await wait_until(
            no_endpoints, what="the owner dropping the endpoint of a closed connection")
        return found

    await pair.ep.aclose()
    first = await one_round()
    for _ in range(5):
        await one_round()
    last: dict[str, int] = {}

    async def settled() -> bool:  # UCX closes an endpoint's socket a moment later, and a
        last.update(await owner.resources())  # connection's tasks end on a later loop turn
        return last["fds"] <= first["fds"] and last["tasks"] <= first["tasks"]

    with contextlib.suppress(TimeoutError):
        await wait_until(settled, 5)
    assert last["fds"] <= first["fds"], f"owner fds {first['fds']} -> {last['fds']}"
    assert last["tasks"] <= first["tasks"], f"owner tasks {first['tasks']} -> {last['tasks']}"
