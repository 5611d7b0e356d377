"""The C kernel that folds and checks the ranks' dense gradients in one pass
(tensorx._ps.update.foldkernel): torch's bits, a verdict on every value, nothing written
where it declines, and the torch ops wherever it cannot be built or differs from torch."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import pytest
import torch

from tensorx._ps.update import fold, foldkernel
from tests.support.host import fold_kernel_or_skip


@pytest.fixture
def kernel() -> foldkernel.FoldKernel:
    return fold_kernel_or_skip()


def slots_of(dtype: torch.dtype, ranks: int, n: int = 10_007, seed: int = 0
             ) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = [torch.randn(n, generator=g, dtype=dtype) * 100 for _ in range(ranks)]
    out[0][3] = torch.finfo(dtype).tiny / 7  # a subnormal
    out[-1][5] = -0.0
    return out


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    ints = torch.int32 if a.dtype == torch.float32 else torch.int64
    return torch.equal(a.view(ints), b.view(ints))


@pytest.mark.parametrize("stream", [False, True], ids=["cached", "streamed"])
@pytest.mark.parametrize("ranks", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_kernel_gives_torchs_bits_and_says_finite(kernel: foldkernel.FoldKernel,
                                                      dtype: torch.dtype, ranks: int,
                                                      stream: bool) -> None:
    """Also where the accumulator starts off the vector alignment (a part of an arena)."""
    slots = slots_of(dtype, ranks)
    want = torch.empty_like(slots[0])
    fold._mean_into(want, slots)
    for skip in (0, 1):
        got = torch.full_like(slots[0], 7.0)
        assert kernel.fold(got[skip:], [s[skip:] for s in slots], stream=stream) is True
        assert same_bits(want[skip:], got[skip:])
        assert bool((got[:skip] == 7.0).all())


def test_a_fold_larger_than_the_cache_is_streamed_past_it(
        kernel: foldkernel.FoldKernel, monkeypatch: pytest.MonkeyPatch) -> None:
    """By default the accumulator is written past the caches from STREAM_BYTES up (the
    same bits either way)."""
    used: list[bool] = []
    for stream in (False, True):
        fn = kernel._fns[torch.float32, stream]
        monkeypatch.setitem(kernel._fns, (torch.float32, stream),
                            lambda *a, fn=fn, stream=stream: used.append(stream) or fn(*a))
    monkeypatch.setattr(foldkernel, "STREAM_BYTES", 4096)
    small, large = slots_of(torch.float32, 2, n=1023), slots_of(torch.float32, 2, n=1024)
    assert kernel.fold(torch.empty(1023), small) is True
    assert kernel.fold(torch.empty(1024), large) is True
    assert used == [False, True]


@pytest.mark.parametrize("stream", [False, True], ids=["cached", "streamed"])
@pytest.mark.parametrize("special", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("where", [0, 5000, -1])
@pytest.mark.parametrize("ranks", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_value_that_is_not_finite_is_found_wherever_it_is(
        kernel: foldkernel.FoldKernel, dtype: torch.dtype, ranks: int, where: int,
        special: float, stream: bool) -> None:
    """First (in the head before the first aligned vector: the accumulator starts one value
    off alignment), in the middle (the vector loop), last (the tail after it)."""
    slots = [s[1:] for s in slots_of(dtype, ranks)]
    slots[-1][where] = special
    got = torch.empty(slots[0].numel() + 1, dtype=dtype)[1:]
    assert kernel.fold(got, slots, stream=stream) is False
    assert not bool(torch.isfinite(got[where]))


def test_a_mean_that_overflows_is_not_finite_but_large_values_are(
        kernel: foldkernel.FoldKernel) -> None:
    """Each value is looked at, not a sum: values near the largest float are finite (a sum
    of them would overflow); a mean whose sum overflows is not."""
    big = torch.full((1000,), 3e38)
    acc = torch.empty(1000)
    for stream in (False, True):
        assert kernel.fold(acc, [big], stream=stream) is True
        assert kernel.fold(acc, [big, big], stream=stream) is False


@pytest.mark.parametrize("slots", [
    pytest.param(lambda: [torch.ones(64)] * 3, id="three-ranks"),
    pytest.param(lambda: [torch.ones(64, dtype=torch.float16)], id="float16"),
    pytest.param(lambda: [torch.ones(128)[::2]], id="not-contiguous"),
    pytest.param(lambda: [torch.ones(64), torch.ones(32)], id="other-shape"),
    pytest.param(lambda: [torch.ones(64, dtype=torch.float64)], id="other-dtype"),
    pytest.param(lambda: [], id="no-ranks"),
])
def test_what_the_kernel_declines_is_left_untouched(
        kernel: foldkernel.FoldKernel, slots: object) -> None:
    made: Sequence[torch.Tensor] = slots()  # type: ignore[operator]
    dtype = made[0].dtype if made and made[0].dtype == torch.float16 else torch.float32
    acc = torch.full((64,), 5.0, dtype=dtype)
    assert kernel.fold(acc, made) is None
    assert bool((acc == 5.0).all())


def test_no_compiler_or_switched_off_means_torch_ops(tmp_path: pytest.TempPathFactory,
                                                     monkeypatch: pytest.MonkeyPatch,
                                                     caplog: pytest.LogCaptureFixture
                                                     ) -> None:
    monkeypatch.setenv("TENSORX_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    with caplog.at_level(logging.INFO, logger="tensorx.ps"):
        assert foldkernel._load(fold._mean_into) is None
    assert "gradient fold kernel is unavailable" in caplog.text and "no-such-cc" in caplog.text
    monkeypatch.delenv("CC")
    monkeypatch.setenv(foldkernel.ENV, "0")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="tensorx.ps"):
        assert foldkernel._load(fold._mean_into) is None
    assert "TENSORX_FOLD_KERNEL=0" in caplog.text


def test_a_kernel_that_differs_from_torch_is_not_used(
        kernel: foldkernel.FoldKernel, caplog: pytest.LogCaptureFixture) -> None:
    """The probe at load compares the kernel with the torch ops it stands in for: against
    a fold whose two-rank mean lands one step off (as a fold that rounds otherwise would),
    it says where they differ and the torch ops serve."""
    def one_off(acc: torch.Tensor, slots: Sequence[torch.Tensor]) -> None:
        fold._mean_into(acc, slots)
        if len(slots) == 2:
            acc.copy_(torch.nextafter(acc, torch.full_like(acc, float("inf"))))

    assert foldkernel.probe(kernel, fold._mean_into) is None
    assert "2 ranks" in (foldkernel.probe(kernel, one_off) or "")
    with caplog.at_level(logging.INFO, logger="tensorx.ps"):
        assert foldkernel._load(one_off) is None
    assert "differs from torch" in caplog.text
