"""The packed pull of changed sparse rows (tensorx._ps.rows.pull) without a network: the shard's
payload, copied into the worker's inbox as a write would, scatters into the worker's tables;
a payload that does not add up is a ProtocolError and leaves the tables alone."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch

from tensorx._ps.rows.pull import ALIGN, RowInbox, RowOutbox, layout
from tensorx.errors import ProtocolError
from tensorx.memregion import RegionDescriptor


@dataclass(frozen=True)
class Entry:  # what the plan's dynamic entries tell both sides
    name: str
    num_rows: int
    row_shape: tuple[int, ...]
    dtype: str
    capacity_rows: int

    @property
    def row_bytes(self) -> int:
        return 4 * int(torch.tensor(self.row_shape).prod())


ENTRIES = [Entry("a", 100, (3,), "float32", 8), Entry("b", 50, (2, 2), "float32", 8)]


class Exports:
    def export(self, region: Any, access: str) -> RegionDescriptor:
        return RegionDescriptor("me", 1, 0, region.nbytes, "cpu", access)


def tables(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(e.num_rows, *e.row_shape, generator=gen) for e in ENTRIES]


def deliver(outbox: RowOutbox, inbox: RowInbox, ids: list[torch.Tensor | None],
            server: list[torch.Tensor]) -> dict[str, Any]:
    """The answer's write, done by hand; its message."""
    nbytes, want = outbox.plan(0, ids)
    if nbytes:
        src, _, _, _, n = outbox.op(0, server, ids)
        assert inbox.region is not None
        inbox.region.view(torch.uint8)[:n].copy_(src.view(torch.uint8)[:n])
    return {"rows": nbytes, "rows_want": want}


def test_layout_aligns_every_part() -> None:
    at = layout([3, 0, 5], [12, 16, 8])
    assert at.ids % ALIGN == 0 and all(r % ALIGN == 0 for r in at.rows)
    assert at.rows[0] >= at.ids + 8 * 8 and at.nbytes >= at.rows[2] + 5 * 8


def test_rows_scatter_into_the_workers_tables() -> None:
    outbox, inbox = RowOutbox(ENTRIES), RowInbox(ENTRIES)
    outbox.announce(0, inbox.announce(Exports()))
    server, worker = tables(0), tables(1)
    ids = [torch.tensor([0, 7, 99]), torch.tensor([3])]
    inbox.accept(deliver(outbox, inbox, ids, server), worker)
    for s, w, i in zip(server, worker, ids, strict=True):
        assert torch.equal(w[i], s[i])
    untouched = torch.ones(100, dtype=torch.bool)
    untouched[ids[0]] = False
    assert not torch.equal(worker[0][untouched], server[0][untouched])


def test_a_small_inbox_is_not_used_and_grows() -> None:
    outbox, inbox = RowOutbox(ENTRIES), RowInbox(ENTRIES)
    outbox.announce(0, inbox.announce(Exports()))
    server, worker = tables(0), tables(1)
    many = [torch.arange(60), torch.arange(40)]  # more than a first inbox takes
    msg = deliver(outbox, inbox, many, server)
    assert msg["rows"] == 0 and msg["rows_want"] > 0
    inbox.accept(msg, worker)
    raw = inbox.announce(Exports())
    assert raw  # a larger inbox, named in the next push
    outbox.announce(0, raw)
    inbox.accept(deliver(outbox, inbox, many, server), worker)
    assert all(torch.equal(w[i], s[i]) for s, w, i in zip(server, worker, many, strict=True))


def test_a_payload_that_does_not_add_up_is_refused() -> None:
    outbox, inbox = RowOutbox(ENTRIES), RowInbox(ENTRIES)
    outbox.announce(0, inbox.announce(Exports()))
    server, worker = tables(0), tables(1)
    msg = deliver(outbox, inbox, [torch.tensor([1, 2]), None], server)
    before = [t.clone() for t in worker]
    with pytest.raises(ProtocolError, match="holds"):
        inbox.accept({**msg, "rows": msg["rows"] + ALIGN}, worker)
    assert inbox.region is not None
    ids_at = layout([2, 0], [12, 16]).ids
    inbox.region.view(torch.int64, (1,), ids_at).fill_(100)  # past the table's end
    with pytest.raises(ProtocolError, match="out of range"):
        inbox.accept(msg, worker)
    assert all(torch.equal(b, w) for b, w in zip(before, worker, strict=True))


RUN = [Entry("c", 40, (16,), "float32", 40), Entry("d", 30, (16,), "float32", 40),
       Entry("e", 20, (3,), "float32", 40), Entry("f", 10, (16,), "float32", 40),
       Entry("g", 25, (16,), "float32", 40)]


def arena_tables(seed: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """RUN's tables as views of one arena, back to back (as a shard's and a worker's are),
    but for ``e`` (3-float rows: a run ends there) and a gap between ``f`` and ``g``."""
    sizes = [e.num_rows * int(torch.tensor(e.row_shape).prod()) for e in RUN]
    arena = torch.randn(sum(sizes) + 16, generator=torch.Generator().manual_seed(seed))
    out, at = [], 0
    for entry, size in zip(RUN, sizes, strict=True):
        at += 16 if entry.name == "g" else 0
        out.append(arena[at:at + size].view(entry.num_rows, *entry.row_shape))
        at += size
    return arena, out


def test_tables_back_to_back_move_as_one_the_same_rows() -> None:
    """Tables that lie back to back in one arena are gathered and scattered a run at a
    time: the same rows land where one copy per table puts them."""
    gen = torch.Generator().manual_seed(7)
    ids = [torch.randperm(e.num_rows, generator=gen)[:k].sort().values
           for e, k in zip(RUN, [5, 0, 4, 3, 6], strict=True)]
    ids[1] = None  # type: ignore[call-overload]
    _, server = arena_tables(1)
    _, worker = arena_tables(2)
    separate = [t.clone() for t in worker]
    outbox, inbox = RowOutbox(RUN), RowInbox(RUN)
    outbox.announce(0, inbox.announce(Exports()))
    msg = deliver(outbox, inbox, ids, server)
    assert msg["rows"]  # the rows came in the inbox
    inbox.accept(msg, worker)
    outbox2, inbox2 = RowOutbox(RUN), RowInbox(RUN)
    outbox2.announce(0, inbox2.announce(Exports()))
    inbox2.accept(deliver(outbox2, inbox2, ids, [t.clone() for t in server]), separate)
    for name, ours, theirs, mine, rows in zip("cdefg", worker, separate, server, ids,
                                              strict=True):
        assert torch.equal(ours, theirs), name
        if rows is not None:
            assert torch.equal(ours[rows], mine[rows]), name
    assert [(first, end) for first, end, _, _ in inbox._runs[next(iter(inbox._runs))]] == \
        [(0, 2), (2, 3), (3, 4), (4, 5)]


def test_an_answer_of_the_same_rows_is_copied_not_gathered_again() -> None:
    """The workers of an update get the same rows: the second answer made with the same
    objects standing for them copies the first's payload (a change of the tables after
    the first gather does not show), and other objects gather afresh (it does)."""
    gen = torch.Generator().manual_seed(3)
    ids = [torch.randperm(e.num_rows, generator=gen)[:k].sort().values
           for e, k in zip(ENTRIES, [6, 4], strict=True)]
    server = tables(1)
    outbox = RowOutbox(ENTRIES)
    inboxes = {r: RowInbox(ENTRIES) for r in (0, 1, 2)}
    for r, inbox in inboxes.items():
        outbox.announce(r, inbox.announce(Exports()))
    memo, arena = object(), object()
    first = outbox.op(0, server, ids, same=(memo, arena))
    want = bytes(first[0].buffer()[:first[4]])
    with torch.no_grad():
        for t in server:
            t.add_(1.0)  # (an update would have made new objects: see below)
    copied = outbox.op(1, server, ids, same=(memo, arena))
    assert copied[0] is not first[0] and bytes(copied[0].buffer()[:copied[4]]) == want
    later = object()
    fresh = outbox.op(2, server, ids, same=(later, arena))
    now = bytes(fresh[0].buffer()[:fresh[4]])
    assert now != want
    outbox.forget(2)  # the source of the last gather left: rank 1 gathers for itself
    again = outbox.op(1, server, ids, same=(later, arena))
    assert bytes(again[0].buffer()[:again[4]]) == now


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_gpu_shards_answer_gathers_row_ids_kept_in_host_memory() -> None:
    """A GPU shard's payload buffer is GPU memory and the changed row ids it answers with
    are host tensors (the first GPU run of a sparse table's answer failed: torch.cat of
    CPU ids into a CUDA buffer). The payload lands in a worker's GPU tables as on a CPU
    shard."""
    outbox, inbox = RowOutbox(ENTRIES, device="cuda:0"), RowInbox(ENTRIES, device="cuda:0")
    outbox.announce(0, inbox.announce(Exports()))
    server, worker = [t.cuda() for t in tables(0)], [t.cuda() for t in tables(1)]
    ids = [torch.tensor([0, 7, 99]), torch.tensor([3])]
    try:
        inbox.accept(deliver(outbox, inbox, ids, server), worker)
        for s, w, i in zip(server, worker, ids, strict=True):
            assert torch.equal(w[i.cuda()], s[i.cuda()])
    finally:
        outbox.close()
        inbox.close()
