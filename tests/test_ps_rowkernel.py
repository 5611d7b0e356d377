"""The C kernel for plain SGD on sparse rows (tensorx._ps.rowkernel): torch's bits, nothing
written where it refuses, and the torch ops wherever it cannot be built."""

from __future__ import annotations

import logging
import os
import shutil

import pytest
import torch

from tensorx._ps import rowkernel, rowsgd
from tensorx._ps.rows import no_invariant_checks, sum_rows

from .test_ps_rowsgd import kernel_or_skip


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
    """The first load compiles into the cache, the next finds it there (no compiler run)."""
    if shutil.which(os.environ.get("CC") or "cc") is None:
        pytest.skip("no C compiler here")
    monkeypatch.setenv("TENSORX_CACHE_DIR", str(tmp_path))
    first = rowkernel._load()
    assert first is not None and first.path.is_relative_to(tmp_path)
    stamp = first.path.stat().st_mtime_ns

    def no_compiler(*_: object, **__: object) -> None:
        raise AssertionError("compiled again")

    monkeypatch.setattr(rowkernel.subprocess, "run", no_compiler)
    again = rowkernel._load()
    assert again is not None and again.path == first.path
    assert first.path.stat().st_mtime_ns == stamp
