"""Same-host mapping: shared regions in /dev/shm, and workers bound straight into a shard."""

from __future__ import annotations

import asyncio
import logging
import mmap
import multiprocessing as mp
import os
import secrets
import subprocess
import sys
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import pytest
import torch

from tensorx import _shm
from tensorx._ps.worker.samehost import plan_obstacle
from tensorx.errors import ProtocolError, RegionError, UsageError
from tensorx.graph_analyzer import GraphAnalyzer
from tensorx.memregion import MemoryRegion, host_id
from tensorx.ps import ParameterServer
from tensorx.worker import Worker
from tests.support.clusters import servers, workers
from tests.support.data import backward, batches
from tests.support.host import shm_files
from tests.support.lanes import assert_link, link_options, links
from tests.support.logs import retried
from tests.support.models import cnn, small_mlp, sparse_embedding
from tests.support.training import ADAM, SGD_MOMENTUM, reference, train_single

pytestmark = pytest.mark.skipif(not host_id(), reason="no usable /dev/shm")


def shm_path(name: str | None) -> Path:
    assert name is not None
    return Path(_shm.SHM_DIR) / name


# -- shared regions ----------------------------------------------------------------------
def test_shared_region_is_a_private_file_mapped_by_name_and_removed_on_close() -> None:
    owner = MemoryRegion.allocate(4096, shared=True)
    path = shm_path(owner.shared_name)
    st = path.stat()
    assert (st.st_mode & 0o777, st.st_uid) == (0o600, os.getuid())
    assert MemoryRegion.allocate(64).shared_name is None
    peer = MemoryRegion.attach(path.name, 4096)
    owner.view(torch.float32)[:] = 7.0
    assert bool((peer.view(torch.float32) == 7.0).all())
    peer.view(torch.int32)[3] = 12345
    assert int(owner.view(torch.int32)[3]) == 12345
    peer.close()  # unmaps only: the owner's file stays
    assert path.exists()
    owner.close()
    assert not path.exists()
    owner.close()  # idempotent


def test_attach_refuses_what_is_not_ours(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(UsageError, match="not a tensorx shared-memory name"):
        MemoryRegion.attach("../../etc/passwd", 8)
    with pytest.raises(RegionError, match="does not exist"):
        MemoryRegion.attach(f"tensorx-1-{secrets.token_hex(16)}", 8)
    with MemoryRegion.allocate(4096, shared=True) as owner:
        name = owner.shared_name
        assert name is not None
        with pytest.raises(RegionError, match="holds 4096 B but 8192 B"):
            MemoryRegion.attach(name, 8192)
        os.chmod(shm_path(name), 0o644)
        with pytest.raises(RegionError, match="other users can open it"):
            MemoryRegion.attach(name, 4096)
        os.chmod(shm_path(name), 0o600)
        if os.geteuid() == 0:
            os.chown(shm_path(name), 12345, -1)
        else:
            monkeypatch.setattr(_shm, "_uid", lambda: os.getuid() + 1)
        with pytest.raises(RegionError, match="owned by uid"):
            MemoryRegion.attach(name, 4096)
        link = shm_path(f"tensorx-1-{secrets.token_hex(16)}")
        link.symlink_to(shm_path(name))
        try:
            with pytest.raises(RegionError, match="cannot open"):
                MemoryRegion.attach(link.name, 4096)
        finally:
            link.unlink()


def test_files_of_a_killed_owner_are_swept_and_a_live_owners_are_not() -> None:
    code = ("import time; from tensorx.memregion import MemoryRegion; "
            "r = MemoryRegion.allocate(4096, shared=True); print(r.shared_name, flush=True); "
            "time.sleep(120)")  # an owner alive until killed
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        path = shm_path(proc.stdout.readline().strip())
        assert path.exists()
        MemoryRegion.allocate(1, shared=True).close()  # sweeps: the owner is alive
        assert path.exists()
    finally:
        proc.kill()
        proc.wait(30)
    assert path.exists()  # SIGKILL: nobody unlinked it
    MemoryRegion.allocate(1, shared=True).close()
    assert not path.exists()


def test_host_id_changes_with_the_network_namespace() -> None:
    here = host_id()
    assert here == host_id()
    done = subprocess.run(["unshare", "--net", sys.executable, "-c",
                           "from tensorx.memregion import host_id; print(host_id())"],
                          capture_output=True, text=True, timeout=60, check=False)
    if done.returncode != 0:
        pytest.skip(f"cannot make a network namespace here: {done.stderr.strip()[-200:]}")
    assert done.stdout.strip() not in ("", here)


def test_plans_that_cannot_be_mapped_say_why() -> None:
    assert plan_obstacle(GraphAnalyzer(small_mlp()).plan(), "cpu") == ""
    assert "cuda:0" in plan_obstacle(GraphAnalyzer(small_mlp()).plan(), "cuda:0")
    # sparse tables map too: their rows travel to the shard, its updates are in the map
    assert plan_obstacle(GraphAnalyzer(sparse_embedding()).plan(), "cpu") == ""
    assert "buffers" in plan_obstacle(GraphAnalyzer(cnn(), include_buffers=True).plan(), "cpu")


# -- workers in their own processes --------------------------------------------------------
STEPS = 12


def _worker_main(address: str, rank: int, conn: Connection) -> None:
    torch.set_num_threads(1)
    asyncio.run(_worker(address, rank, conn))


async def _worker(address: str, rank: int, conn: Connection) -> None:
    model = small_mlp(seed=0 if rank == 0 else 99)  # rank 1's own init must not win
    async with Worker(model, address, rank=rank, num_workers=2, transport="tcp",
                      verify=True) as w:
        for step in batches(STEPS, 2):
            w.zero_grad()
            backward(model, *step[rank])
            await w.step()
        params = list(model.parameters())
        conn.send({"mapped": w.mapped, "data": shm_files(params),
                   "grads": shm_files(p.grad for p in params if p.grad is not None),
                   "params": [p.detach().numpy().copy() for p in params]})
        conn.recv()  # the server wrote into its arena: do we see it?
        conn.send(all(bool((p == 42.0).all()) for p in params))
    conn.send(shm_files(model.parameters()))  # closed: private memory again


async def _recv(conn: Connection, timeout: float = 90.0) -> Any:
    if not await asyncio.to_thread(conn.poll, timeout):
        raise TimeoutError("worker process did not report")
    return conn.recv()


async def test_sync_workers_in_processes_map_and_equal_one_process() -> None:
    ctx = mp.get_context("spawn")
    async with ParameterServer(num_workers=2, mode="sync", optimizer=SGD_MOMENTUM,
                               transport="tcp") as ps:
        pipes = [ctx.Pipe() for _ in range(2)]
        procs = [ctx.Process(target=_worker_main, args=(ps.address, r, child), daemon=True)
                 for r, (_, child) in enumerate(pipes)]
        for p in procs:
            p.start()
        try:
            reports = [await _recv(parent) for parent, _ in pipes]
            assert ps.state is not None
            params_file = shm_path(ps.state.params_region.shared_name)
            for rank, report in enumerate(reports):
                assert report["mapped"] == [True]
                assert report["data"] == {params_file.name}
                assert report["grads"] == {ps.state.slot_region(rank).shared_name}
            want = train_single(SGD_MOMENTUM, STEPS)
            for report in reports:
                for got, w in zip(report["params"], want, strict=True):
                    torch.testing.assert_close(torch.from_numpy(got), w, rtol=1e-5, atol=1e-6)
            ps.state.params_region.view(torch.float32).fill_(42.0)
            for parent, _ in pipes:
                parent.send("look")
            assert [await _recv(parent) for parent, _ in pipes] == [True, True]
            assert [await _recv(parent) for parent, _ in pipes] == [{""}, {""}]
        finally:
            for p in procs:
                p.join(30)
                if p.is_alive():
                    p.kill()
    assert not params_file.exists()


# -- when not to map -----------------------------------------------------------------------
async def _train(model: torch.nn.Module, address: str, steps: int, **kw: Any) -> Worker:
    async with Worker(model, address, transport="tcp", **kw) as w:
        for step in batches(steps, 1):
            w.zero_grad()
            backward(model, *step[0])
            await w.step()
    return w


async def test_async_mode_does_not_map(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="tensorx")
    async with ParameterServer(num_workers=1, mode="async", optimizer=ADAM,
                               transport="tcp") as ps:
        model = small_mlp()
        w = await _train(model, ps.address, 4)
        assert ps.state is not None and not ps.state.shared
    assert w.mapped == [False]
    assert "mode=async updates the arena while workers compute" in caplog.text
    assert "arenas not mapped, copying: the server did not offer it" in caplog.text
    for g, want in zip(model.parameters(), reference(batches(4, 1)).parameters(),
                       strict=True):
        torch.testing.assert_close(g.detach(), want.detach(), rtol=1e-5, atol=1e-6)


async def test_another_host_falls_back_to_copies(monkeypatch: pytest.MonkeyPatch,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    import dataclasses

    from tensorx.node import SHM_KEY, Node

    caplog.set_level(logging.INFO, logger="tensorx")
    export = Node.export

    def elsewhere(self: Node, region: Any, access: str = "rw") -> Any:
        """The server's descriptors say another host (both ends run in this process)."""
        desc = export(self, region, access)
        if SHM_KEY not in desc.keys:
            return desc
        keys = {**desc.keys, SHM_KEY: {**desc.keys[SHM_KEY], "host": "some other machine"}}
        return dataclasses.replace(desc, keys=keys)

    monkeypatch.setattr(Node, "export", elsewhere)
    async with ParameterServer(num_workers=1, optimizer=ADAM, transport="tcp") as ps:
        model = small_mlp()
        w = await _train(model, ps.address, 4)
    assert w.mapped == [False]
    assert "is on another host (or network namespace)" in caplog.text
    for g, want in zip(model.parameters(), reference(batches(4, 1)).parameters(),
                       strict=True):
        torch.testing.assert_close(g.detach(), want.detach(), rtol=1e-5, atol=1e-6)


async def test_a_mapped_push_that_was_not_offered_is_refused() -> None:
    async with ParameterServer(num_workers=1, transport="tcp", share_memory=False) as ps:
        model = small_mlp()
        async with Worker(model, ps.address, transport="tcp") as w:
            assert w.mapped == [False]
            assert w._shared is not None
            w._shared.mapped[0] = True  # a worker that claims what it was not given
            with pytest.raises(ProtocolError, match="not offered"):
                await w.step()
            w._shared.mapped[0] = False


async def test_rejoin_maps_the_restarted_servers_arenas(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="tensorx.worker")
    model = small_mlp()

    def server(listen: str) -> ParameterServer:
        return ParameterServer(listen, num_workers=1, checkpoint_dir=tmp_path,
                               transport="tcp")

    first = await server("tcp://127.0.0.1:0").start()
    address = first.address
    async with Worker(model, address, transport="tcp", reconnect=20) as w:
        async def step() -> None:
            w.zero_grad()
            model(torch.randn(2, 8)).sum().backward()
            await w.step()

        await step()
        assert first.state is not None
        assert shm_files(model.parameters()) == {first.state.params_region.shared_name}
        await first.aclose()

        async def restart() -> ParameterServer:
            await retried(caplog)
            return await server(address).start()

        coming_back = asyncio.create_task(restart())
        await step()  # dropped; rejoins the new server
        async with await coming_back as second:
            await step()
            assert w.mapped == [True] and w.stats["rejoins"] == 1
            assert second.state is not None and second.version == 2
            assert shm_files(model.parameters()) == {second.state.params_region.shared_name}


# -- a mapped worker that edits its weights in place (issue 16, item 10) -------------------
@pytest.mark.parametrize("link", links())
async def test_an_edit_in_place_stays_the_workers_own(link: str) -> None:
    """Before: a mapped worker's edit changed the server's and every worker's parameters,
    while on the copy path it was discarded at the next pull. Now both paths discard it."""
    models = [small_mlp(), small_mlp(seed=99)]
    share = link_options(link)["share_memory"]
    async with servers(1, 2, mode="sync", optimizer=SGD_MOMENTUM, **link_options(link)) \
            as (ps,), workers(models, [ps.address], **link_options(link)) as ws:
        for step in batches(2, 2):
            for w, m, (x, y) in zip(ws, models, step, strict=True):
                w.zero_grad()
                backward(m, x, y)
            await asyncio.gather(*(w.step() for w in ws))
        assert [w.mapped for w in ws] == [[share], [share]]
        for w in ws:
            assert_link(w, link)
        assert ps.state is not None
        server = [v.clone() for v in ps.state.views]
        with torch.no_grad():
            for p in models[0].parameters():
                p.fill_(7.0)  # the edit, in place
        assert all(torch.equal(a, b) for a, b in zip(server, ps.state.views, strict=True))
        assert not any(bool((p == 7.0).all()) for p in models[1].parameters())
        for w, m, (x, y) in zip(ws, models, batches(1, 2)[0], strict=True):
            w.zero_grad()
            backward(m, x, y)
        await asyncio.gather(*(w.step() for w in ws))
        assert all(torch.equal(a, b) for a, b in
                   zip(models[0].parameters(), models[1].parameters(), strict=True))
        assert not any(bool((p == 7.0).all()) for p in models[0].parameters())


def test_a_private_attach_sees_the_owner_and_keeps_its_own_writes_until_dropped() -> None:
    owner = MemoryRegion.allocate(8 * 4096, shared=True)
    try:
        assert owner.shared_name is not None
        mine = MemoryRegion.attach(owner.shared_name, owner.nbytes, private=True)
        try:
            theirs, ours = owner.view(torch.uint8), mine.view(torch.uint8)
            theirs.fill_(1)
            assert bool((ours == 1).all())  # the owner's writes show
            assert mine.drop_own_writes() == 0
            ours[5 * 4096] = 9  # an edit in place: copy-on-write, one page
            assert int(theirs[5 * 4096]) == 1  # never reaches the owner
            theirs.fill_(2)
            assert int(ours[5 * 4096]) == 9 and int(ours[0]) == 2
            assert mine.drop_own_writes() in (1, -1)  # -1: pagemap unreadable, all dropped
            assert bool((ours == 2).all())
        finally:
            mine.close()
        with pytest.raises(UsageError, match="private=True"):
            owner.drop_own_writes()
    finally:
        owner.close()


@pytest.mark.parametrize("scan", [True, False], ids=["pagemap-scan", "pagemap-read"])
def test_own_writes_in_many_runs_are_all_found_and_dropped(
        scan: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """More runs of written pages than one PAGEMAP_SCAN call returns (64): the scan goes on
    where the kernel's walk stopped, and finds the same runs /proc/self/pagemap shows; on a
    kernel without the scan (forced here) the pagemap read drops the same pages."""
    from tensorx import _shm

    if not scan:
        monkeypatch.setattr(_shm, "_scan_ok", False)

    page, pages = mmap.PAGESIZE, 400
    owner = MemoryRegion.allocate(pages * page, shared=True)
    try:
        assert owner.shared_name is not None
        owner.view(torch.uint8).fill_(1)
        mine = MemoryRegion.attach(owner.shared_name, owner.nbytes, private=True)
        try:
            ours = mine.view(torch.uint8)
            assert bool((ours == 1).all())  # every page mapped from the file
            written = list(range(0, pages, 3))  # 134 runs, the last page among them
            for p in written:
                ours[p * page + 7] = 9
            want = [(p, p + 1) for p in written]
            scanned = _shm._own_runs_scan(mine.address, mine.address + mine.nbytes)
            read = _shm._own_runs_pagemap(mine.address // page, pages)
            assert read is None or read == want
            assert scanned == want if scan and _shm._scan_ok else scanned is None
            assert mine.drop_own_writes() in (len(written), -1)
            assert bool((ours == 1).all())
            assert mine.drop_own_writes() in (0, -1)
        finally:
            mine.close()
    finally:
        owner.close()
