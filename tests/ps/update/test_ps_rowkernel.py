"""The C kernel for plain SGD on sparse rows (tensorx._ps.update.rowkernel): torch's bits, nothing
written where it refuses, and the torch ops wherever it cannot be built."""

from __future__ import annotations

import logging
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tensorx._ps.rows.tables import no_invariant_checks, sum_rows
from tensorx._ps.update import ckernel, rowkernel, rowsgd
from tests.support.host import NOBODY, as_root, kernel_or_skip, plant
from tests.support.logs import only_warning


@pytest.fixture
def kernel() -> rowkernel.RowKernel:
    return kernel_or_skip()


def torch_step(table: torch.Tensor, parts: list[tuple[torch.Tensor, torch.Tensor]],
               ranks: int, lr: float) -> torch.Tensor:
    """What torch.optim.SGD does to ``table`` with the shard's mean of ``parts``."""
    out = table.clone()
    ids, grad = sum_rows(parts)
    if ranks > 1:
        grad.div_(ranks)
    with no_invariant_checks():
        out.add_(torch.sparse_coo_tensor(ids[None], grad, table.shape, is_coalesced=True),
                 alpha=-lr)
    return out


def random_parts(gen: torch.Generator, rows: int, width: int, dtype: torch.dtype,
                 count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    parts = []
    for _ in range(count):
        ids = torch.randperm(rows, generator=gen)[:rows // 3].sort().values
        parts.append((ids, torch.randn(len(ids), width, generator=gen).to(dtype)))
    return parts


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("width", [1, 7, 64, 130])
def test_kernel_gives_torchs_bits(kernel: rowkernel.RowKernel, dtype: torch.dtype,
                                  width: int) -> None:
    """One to four ranks' rows (many ids in common, some ranks sending none), the fused or
    plain update as the probe chose: every bit as torch's sparse step, and the ids changed
    are the union, ascending."""
    lr = 0.037
    fused = rowsgd._probe_kernel(kernel, dtype, (width,), lr)
    assert fused is not None, "the kernel matches torch in neither mode"
    gen = torch.Generator().manual_seed(width)
    for count, ranks in ((1, 1), (1, 3), (2, 2), (3, 4), (4, 4)):
        table = torch.randn(300, width, generator=gen).to(dtype)
        parts = random_parts(gen, 300, width, dtype, count)
        expected = torch_step(table, parts, ranks, lr)
        keys = kernel.sgd(table, parts, ranks, -lr, fused)
        assert keys is not None
        assert torch.equal(keys, torch.cat([p[0] for p in parts]).unique())
        assert torch.equal(table.view(torch.uint8), expected.view(torch.uint8))


def test_refused_rows_leave_the_table_untouched(kernel: rowkernel.RowKernel) -> None:
    """Ids not ascending, a dtype it has no kernel for, rows shaped unlike the table: None,
    nothing written; an id outside the table (the last rank's last id): IndexError, nothing
    written either (every id is checked before the first row is)."""
    gen = torch.Generator().manual_seed(0)
    table = torch.randn(50, 8, generator=gen)
    before = table.clone()
    good = (torch.tensor([1, 4, 9]), torch.randn(3, 8, generator=gen))
    cases: list[list[tuple[torch.Tensor, torch.Tensor]]] = [
        [good, (torch.tensor([3, 2]), torch.randn(2, 8))],  # not ascending
        [good, (torch.tensor([5, 5]), torch.randn(2, 8))],  # repeated
        [(good[0], good[1].double())],  # another dtype than the table's
        [(good[0], torch.randn(3, 4))],  # rows of another width
        [(good[0], torch.randn(8, 3).t())],  # not contiguous
    ]
    for parts in cases:
        assert kernel.sgd(table, parts, 2, -0.1, False) is None
        assert torch.equal(table, before)
    assert kernel.sgd(table.half(), [(good[0], good[1].half())], 1, -0.1, False) is None
    for bad in (50, -1):
        with pytest.raises(IndexError, match="outside its table"):
            kernel.sgd(table, [good, (torch.tensor([0, bad]), torch.randn(2, 8))], 2, -0.1,
                       False)
        assert torch.equal(table, before)


def test_no_compiler_means_torch_ops(tmp_path: pytest.TempPathFactory,
                                     monkeypatch: pytest.MonkeyPatch,
                                     caplog: pytest.LogCaptureFixture) -> None:
    """A compiler that fails (here: none at that path) or TENSORX_ROW_KERNEL=0: no kernel,
    one INFO line saying why, and the shard's SGD on rows still gives torch's bits."""
    monkeypatch.setenv("TENSORX_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    with caplog.at_level(logging.INFO, logger="tensorx.ps"):
        assert rowkernel._load() is None
    assert "sparse SGD kernel is unavailable" in caplog.text and "no-such-cc" in caplog.text
    monkeypatch.delenv("CC")
    monkeypatch.setenv(rowkernel.ENV, "0")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="tensorx.ps"):
        assert rowkernel._load() is None
    assert "TENSORX_ROW_KERNEL=0" in caplog.text
    assert not list(tmp_path.glob("rowkernel-*/*.so"))


def test_built_once_per_cache(tmp_path: pytest.TempPathFactory,
                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The first load compiles into the cache, the next finds it there (no compiler run).
    Every folder it creates is 0700 and every file 0600, whatever the umask, and the
    object's digest is recorded beside it."""
    if shutil.which(os.environ.get("CC") or "cc") is None:
        pytest.skip("no C compiler here")
    monkeypatch.setenv("TENSORX_CACHE_DIR", str(tmp_path / "runs" / "cache"))
    old = os.umask(0o022)
    try:
        first = rowkernel._load()
    finally:
        os.umask(old)
    assert first is not None and first.path.is_relative_to(tmp_path)
    created = [tmp_path / "runs", *(tmp_path / "runs").rglob("*")]
    assert {p.name: stat.S_IMODE(p.lstat().st_mode) for p in created} == {
        "runs": 0o700, "cache": 0o700, first.path.parent.name: 0o700, ".lock": 0o600,
        "rowkernel.so": 0o600, "rowkernel.so.sha256": 0o600}
    stamp = first.path.stat().st_mtime_ns

    def no_compiler(*_: object, **__: object) -> None:
        raise AssertionError("compiled again")

    monkeypatch.setattr(ckernel.subprocess, "run", no_compiler)
    again = rowkernel._load()
    assert again is not None and again.path == first.path
    assert first.path.stat().st_mtime_ns == stamp


@pytest.fixture(scope="module")
def kernel_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the kernel lives under a cache root (``rowkernel-MACHINE-TAG/rowkernel.so``):
    the deterministic name another user would plant a shared object under."""
    kernel_or_skip()
    cache = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TENSORX_CACHE_DIR", str(cache))
        assert rowkernel._load() is not None
    found = list(cache.glob("rowkernel-*/rowkernel.so"))
    assert len(found) == 1, found
    return found[0].relative_to(cache)


def hostile_cache(tmp_path: Path, kernel_file: Path, how: str) -> tuple[Path, Path]:
    """(the TENSORX_CACHE_DIR to use, where the planted object lies) for each way another
    local user gets a shared object into a cache: a world-writable cache (a shared one
    under /tmp), a link at the cache or at a folder or file in it, a file of another uid."""
    cache, elsewhere = tmp_path / "cache", tmp_path / "elsewhere"
    cache.mkdir(mode=0o700)
    elsewhere.mkdir(mode=0o700)
    entry = cache / kernel_file.parent
    if how == "world-writable cache":
        cache.chmod(0o777)
        return cache, cache / kernel_file
    if how == "cache is a link":
        (tmp_path / "link").symlink_to(elsewhere)
        return tmp_path / "link", elsewhere / kernel_file
    if how == "folder is a link":
        entry.symlink_to(elsewhere)
        return cache, elsewhere / kernel_file.name
    entry.mkdir(mode=0o700)
    if how == "object is a link":
        (cache / kernel_file).symlink_to(elsewhere / kernel_file.name)
        return cache, elsewhere / kernel_file.name
    assert how == "object of another uid"
    return cache, cache / kernel_file


@pytest.mark.parametrize(("how", "why"), [
    ("world-writable cache", "writable by other users"),
    ("cache is a link", "symbolic link"),
    ("folder is a link", "symbolic link"),
    ("object is a link", "symbolic link"),
    pytest.param("object of another uid", "owned by uid 65534", marks=as_root),
])
def test_an_object_another_user_planted_is_never_loaded(
        tmp_path: Path, kernel_file: Path, how: str, why: str,
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A shared object under the kernel's name in a cache another user could write (its
    constructor would run as us, as root in a shard): not loaded, not even opened by the
    loader; the kernel is built privately instead, with one WARNING naming the path and
    why, and nothing in that cache is written or replaced."""
    root, planted = hostile_cache(tmp_path, kernel_file, how)
    marker = tmp_path / "marker"
    plant(planted, marker)
    if how == "object of another uid":
        os.chown(planted, NOBODY, NOBODY)
    before = planted.read_bytes()
    monkeypatch.setenv("TENSORX_CACHE_DIR", str(root))
    with caplog.at_level(logging.WARNING, logger="tensorx"):
        kernel = rowkernel._load()
    assert not marker.exists(), "the planted object was loaded"
    assert kernel is not None and kernel.fused_available() in (True, False)
    said = only_warning(caplog)
    assert why in said and str(tmp_path) in said, said
    assert planted.read_bytes() == before
    if how == "world-writable cache":
        assert [p.name for p in root.iterdir()] == [kernel_file.parts[0]]


def test_a_kernel_replaced_after_its_build_is_rebuilt(
        tmp_path: Path, kernel_file: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """A kernel an earlier process built, then replaced by other contents under the same
    name (a cache of ours, a file of ours): the digest recorded at the build tells, and it
    is rebuilt in place rather than loaded, with one WARNING; the next load is quiet."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("TENSORX_CACHE_DIR", str(cache))
    subprocess.run([sys.executable, "-c",
                    "from tensorx._ps.update import rowkernel; assert rowkernel._load()"],
                   check=True, timeout=120)
    marker = tmp_path / "marker"
    plant(cache / kernel_file, marker)
    with caplog.at_level(logging.WARNING, logger="tensorx"):
        kernel = rowkernel._load()
    assert not marker.exists(), "the replaced object was loaded"
    assert kernel is not None and kernel.fused_available() in (True, False)
    assert "does not match" in only_warning(caplog)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="tensorx"):
        assert rowkernel._load() is not None
    assert not caplog.records
    assert not marker.exists()
