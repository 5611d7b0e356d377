"""A small C kernel that folds the ranks' dense gradient slots and checks the fold in the
same pass: one read of each slot, one write of the accumulator, no second pass.

:func:`tensorx._ps.update.fold._mean_into_checked` otherwise folds with torch ops and sums
each 4 MiB piece while it is in cache: a few torch calls per piece, about a quarter more
than the fold alone on a ResNet-50 arena. Here each value is checked as it is written
(its exponent bits: NaN and infinities have them all set), so the check costs nothing
beyond the copy, and a large but finite gradient is never taken for a non-finite one.

The arithmetic is torch's, with the same bits: one rank's slot copied, two ranks' summed
and halved, each operation rounded to the dtype (float32 and float64). More ranks, other
dtypes or tensors that are not contiguous take the torch ops (with three ranks or more the
kernel was no faster than torch's vectorized ops in cached pieces). A probe at load
compares the kernel with the torch ops on random values, specials included, for 1 and 2
ranks, with the accumulator written through the caches and past them (non-temporal stores,
what a fold larger than the last-level cache uses: :data:`STREAM_BYTES`); any difference and
the torch ops serve. Built as :mod:`tensorx._ps.update.ckernel` says;
``TENSORX_FOLD_KERNEL=0`` or a build that fails leaves the torch ops, logged once at INFO.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from collections.abc import Callable, Sequence

import torch

from tensorx import _cache
from tensorx._ps.update import ckernel

__all__ = ["ENV", "STREAM_BYTES", "FoldKernel", "load", "streamed"]

logger = logging.getLogger("tensorx.ps")

ENV = "TENSORX_FOLD_KERNEL"
MAX_RANKS = 2  # more ranks: the torch ops in cached pieces were as fast


def _last_level_cache() -> int:
    """Bytes of the host's last-level cache (32 MiB where it does not say)."""
    try:
        size = os.sysconf("SC_LEVEL3_CACHE_SIZE") or os.sysconf("SC_LEVEL2_CACHE_SIZE")
    except (ValueError, OSError, AttributeError):
        size = 0
    return size if size > 0 else 32 << 20


# a fold at least this large is written past the caches: it would not stay in them until the
# update reads it (on a 2-core EPYC, 102 MB folded in 4.9-5.0 ms so, 6.8-6.9 ms through them)
STREAM_BYTES = _last_level_cache()


def streamed(nbytes: int) -> bool:
    """Is a fold of ``nbytes`` written past the caches (:data:`STREAM_BYTES` or more)?"""
    return nbytes >= STREAM_BYTES

SOURCE = r"""
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

/* acc = the mean of the k slots (k == 1: a copy, k == 2: their sum halved), n values;
   returns 1 when every value written is finite, 0 when one is not, -1 for another k.
   Each value's exponent bits are looked at as it is written: all set is a NaN or an
   infinity. */
#define FOLD(NAME, T, U, EXP)                                                              \
int32_t NAME(T *restrict acc, const T *const *slots, int32_t k, int64_t n) {              \
    U bad = 0;                                                                             \
    if (k < 1 || k > 2) return -1;                                                         \
    if (k == 1) {                                                                          \
        const U *restrict s = (const U *)slots[0];                                         \
        U *restrict a = (U *)acc;                                                          \
        for (int64_t i = 0; i < n; i++) {                                                  \
            U b = s[i];                                                                    \
            a[i] = b;                                                                      \
            bad |= (U)((b & EXP) == EXP);                                                  \
        }                                                                                  \
        return bad == 0;                                                                   \
    }                                                                                      \
    const T d = (T)k;                                                                      \
    const T *restrict s0 = slots[0];                                                       \
    const T *restrict s1 = slots[1];                                                       \
    U *restrict a = (U *)acc;                                                              \
    for (int64_t i = 0; i < n; i++) {                                                      \
        T v = (s0[i] + s1[i]) / d;                                                         \
        U b;                                                                               \
        memcpy(&b, &v, sizeof b);                                                          \
        a[i] = b;                                                                          \
        bad |= (U)((b & EXP) == EXP);                                                      \
    }                                                                                      \
    return bad == 0;                                                                       \
}

FOLD(tx_fold_f32, float, uint32_t, (uint32_t)0x7f800000u)
FOLD(tx_fold_f64, double, uint64_t, (uint64_t)0x7ff0000000000000ull)

/* The same fold, the accumulator written with non-temporal stores (past the caches: a
   fold larger than the cache is read back only after all of it is made, so a store that
   first reads its line in is a third more memory traffic for nothing). The same
   arithmetic, one IEEE add and one divide per value; a value is NaN or an infinity when
   v - v is a NaN. Where SSE2 is not there: the plain fold. */
#if defined(__SSE2__)
#define STREAM(NAME, PLAIN, T, V, LOADU, STORE, ADD, DIV, SUB, UNORD, OR, SET1, ZERO, MASK, W) \
int32_t NAME(T *restrict acc, const T *const *slots, int32_t k, int64_t n) {              \
    if (k < 1 || k > 2) return -1;                                                         \
    const T *s0 = slots[0], *s1 = k == 2 ? slots[1] : slots[0];                            \
    int64_t head = 0;                                                                      \
    while (head < n && ((uintptr_t)(acc + head) & 15)) head++;                             \
    int32_t ok = 1;                                                                        \
    if (head) ok &= PLAIN(acc, slots, k, head);                                            \
    int64_t i = head;                                                                      \
    V bad = ZERO();                                                                        \
    const V two = SET1((T)2);                                                              \
    if (k == 1) {                                                                          \
        for (; i + 2 * W <= n; i += 2 * W) {                                               \
            V v0 = LOADU(s0 + i), v1 = LOADU(s0 + i + W);                                  \
            STORE(acc + i, v0);                                                            \
            STORE(acc + i + W, v1);                                                        \
            V d0 = SUB(v0, v0), d1 = SUB(v1, v1);                                          \
            bad = OR(bad, OR(UNORD(d0, d0), UNORD(d1, d1)));                               \
        }                                                                                  \
    } else {                                                                               \
        for (; i + 2 * W <= n; i += 2 * W) {                                               \
            V v0 = DIV(ADD(LOADU(s0 + i), LOADU(s1 + i)), two);                            \
            V v1 = DIV(ADD(LOADU(s0 + i + W), LOADU(s1 + i + W)), two);                    \
            STORE(acc + i, v0);                                                            \
            STORE(acc + i + W, v1);                                                        \
            V d0 = SUB(v0, v0), d1 = SUB(v1, v1);                                          \
            bad = OR(bad, OR(UNORD(d0, d0), UNORD(d1, d1)));                               \
        }                                                                                  \
    }                                                                                      \
    _mm_sfence();                                                                          \
    if (MASK(bad)) ok = 0;                                                                 \
    if (i < n) {                                                                           \
        const T *rest[2] = {s0 + i, s1 + i};                                               \
        ok &= PLAIN(acc + i, rest, k, n - i);                                              \
    }                                                                                      \
    return ok;                                                                             \
}
STREAM(tx_fold_stream_f32, tx_fold_f32, float, __m128, _mm_loadu_ps, _mm_stream_ps,
       _mm_add_ps, _mm_div_ps, _mm_sub_ps, _mm_cmpunord_ps, _mm_or_ps, _mm_set1_ps,
       _mm_setzero_ps, _mm_movemask_ps, 4)
STREAM(tx_fold_stream_f64, tx_fold_f64, double, __m128d, _mm_loadu_pd, _mm_stream_pd,
       _mm_add_pd, _mm_div_pd, _mm_sub_pd, _mm_cmpunord_pd, _mm_or_pd, _mm_set1_pd,
       _mm_setzero_pd, _mm_movemask_pd, 2)
#else
int32_t tx_fold_stream_f32(float *acc, const float *const *slots, int32_t k, int64_t n) {
    return tx_fold_f32(acc, slots, k, n);
}
int32_t tx_fold_stream_f64(double *acc, const double *const *slots, int32_t k, int64_t n) {
    return tx_fold_f64(acc, slots, k, n);
}
#endif
"""

Reference = Callable[[torch.Tensor, Sequence[torch.Tensor]], None]  # torch's fold
_lock = threading.Lock()
_loaded: list[FoldKernel | None] = []  # [] until tried; then [the kernel] or [None]


class FoldKernel:
    """The loaded kernel (see the module docstring)."""

    _NAMES = {torch.float32: "f32", torch.float64: "f64"}

    def __init__(self, lib: ctypes.CDLL, built: _cache.Built) -> None:
        self.path = built.origin
        self._built = built  # its descriptor stays open while the library is mapped
        self._fns: dict[tuple[torch.dtype, bool], Callable[..., int]] = {}
        p = ctypes.c_void_p
        for dtype, name in self._NAMES.items():
            for stream in (False, True):
                fn = getattr(lib, f"tx_fold_{'stream_' if stream else ''}{name}")
                fn.restype = ctypes.c_int32
                fn.argtypes = [p, p, ctypes.c_int32, ctypes.c_int64]
                self._fns[dtype, stream] = fn

    def fold(self, acc: torch.Tensor, slots: Sequence[torch.Tensor], *,
             stream: bool | None = None) -> bool | None:
        """The mean of ``slots`` into ``acc`` (one slot: copied); whether every value of
        it is finite. None, nothing written, where the kernel does not take them (a dtype
        other than float32/64, another device, not contiguous, shapes that differ).
        ``stream``: write ``acc`` past the caches (default: when it is larger than
        :data:`STREAM_BYTES`, so that it would not stay cached until it is read)."""
        if stream is None:
            stream = streamed(acc.numel() * acc.element_size())
        fn = self._fns.get((acc.dtype, stream))
        if fn is None or acc.device.type != "cpu" or not acc.is_contiguous() or \
                not 0 < len(slots) <= MAX_RANKS:
            return None
        for s in slots:
            if s.dtype != acc.dtype or s.device.type != "cpu" or s.shape != acc.shape or \
                    not s.is_contiguous():
                return None
        k = len(slots)
        got = fn(acc.data_ptr(), (ctypes.c_void_p * k)(*[s.data_ptr() for s in slots]), k,
                 acc.numel())
        return bool(got == 1)


def load(reference: Reference) -> FoldKernel | None:
    """The kernel, built, loaded and probed against ``reference`` (the torch ops it stands
    in for) on first call; None where it cannot be (said once)."""
    with _lock:
        if not _loaded:
            _loaded.append(_load(reference))
        return _loaded[0]


def _load(reference: Reference) -> FoldKernel | None:
    if os.environ.get(ENV, "1").strip() == "0":
        logger.info("%s=0: dense gradients are folded with torch ops", ENV)
        return None
    try:
        lib, built = ckernel.build("foldkernel", SOURCE, "the gradient fold kernel")
        kernel = FoldKernel(lib, built)
    except ckernel.ERRORS as exc:
        logger.info("the gradient fold kernel is unavailable (%s); dense gradients are "
                    "folded with torch ops", str(exc).strip().splitlines()[0] if str(exc)
                    else type(exc).__name__)
        return None
    differs = probe(kernel, reference)
    if differs:
        logger.info("the gradient fold kernel differs from torch here (%s); dense gradients "
                    "are folded with torch ops", differs)
        return None
    return kernel


def probe(kernel: FoldKernel, reference: Reference) -> str | None:
    """Where the kernel's fold differs from ``reference``'s (the bits of every finite
    value, which values are NaN or which infinity, the verdict) on random values with
    specials, for 1 and 2 ranks and both dtypes; None: nowhere."""
    g = torch.Generator().manual_seed(5)
    for dtype in (torch.float32, torch.float64):
        for k in (1, 2):
            slots = [torch.randn(4099, generator=g, dtype=dtype) * 1e3 for _ in range(k)]
            slots[0][7] = torch.finfo(dtype).max  # sums that overflow, subnormals
            slots[-1][8] = torch.finfo(dtype).max
            slots[0][9] = torch.finfo(dtype).tiny / 3
            for special in (None, float("nan"), float("inf")):
                if special is not None:
                    slots[-1][4000] = special
                want = torch.empty(4099, dtype=dtype)
                reference(want, slots)
                for stream in (False, True):
                    got = torch.empty(4099, dtype=dtype)
                    finite = kernel.fold(got[1:], [s[1:] for s in slots], stream=stream)
                    if not _same(want[1:], got[1:]) or \
                            finite != bool(torch.isfinite(want[1:]).all()):
                        return (f"{str(dtype).removeprefix('torch.')}, {k} ranks, {special}"
                                + (", streamed" if stream else ""))
    return None


def _same(want: torch.Tensor, got: torch.Tensor) -> bool:
    """The same bits where ``want`` is finite; NaN where it is NaN, its infinities."""
    ints = torch.int32 if want.dtype == torch.float32 else torch.int64
    ok = torch.isfinite(want)
    return (torch.equal(want.view(ints)[ok], got.view(ints)[ok])
            and torch.equal(torch.isnan(want), torch.isnan(got))
            and torch.equal(want[torch.isinf(want)], got[torch.isinf(want)]))
