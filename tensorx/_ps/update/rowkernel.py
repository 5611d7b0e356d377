"""A small C kernel for plain SGD on a shard's sparse rows (issue 17's apply rate).

:class:`~tensorx._ps.update.rowsgd.RowSGD` steps a group of tables with a few torch and numpy ops:
the ranks' rows summed by key (a sort and an ``embedding_bag``), divided by the number of
ranks, the table's rows gathered, ``rows + (-lr) * grad``, scattered back. Each op is a pass
of its own, and the gather and the scatter each wait on every row's cache misses: 8192 rows
of 64 floats of a 1e6-row table took 1.0-1.2 ms, against 0.5-0.7 ms for a bare gather and
scatter. This kernel does the same arithmetic in two passes, with the same bits:

1. merge the ranks' rows (each rank's row ids ascending and distinct, as workers stage
   them) into one contiguous buffer: a row one rank sent, as it is (one rank) or ``+0.0 +
   row`` (several: the sum from zero), a row several sent, their sum in rank order; then
   divided by the number of ranks where there are several. Every id is checked against the
   table here, before anything is written.
2. ``row = fma(grad, -lr, row)`` (or ``row + (-lr) * grad``) for each id, in place: one
   read and one write of each row.

Whether the fused multiply-add or the separate one gives torch's bits is measured on the
spot (:class:`~tensorx._ps.update.rowsgd.RowSGD` probes both against torch's own sparse step, per
dtype, row shape and lr), as for the torch ops. Built on first use with the host's C
compiler (``$CC``, else ``cc``) into ``$TENSORX_CACHE_DIR`` (else ``~/.cache/tensorx``),
once per machine and source, loaded with ctypes, only as :mod:`tensorx._cache` allows (a
cache other users could write is not loaded from: the kernel is built privately instead);
where that fails (no compiler, a read-only cache) or ``TENSORX_ROW_KERNEL=0``, the torch
ops serve, logged once at INFO. x86-64 uses
its FMA instructions where the CPU has them (checked at run time); other machines the C
library's ``fma``.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from collections.abc import Sequence

import torch

from tensorx import _cache
from tensorx._ps.update import ckernel

__all__ = ["ENV", "RowKernel", "load"]

logger = logging.getLogger("tensorx.ps")

ENV = "TENSORX_ROW_KERNEL"
MAX_PARTS = 256  # ranks whose rows one call merges

SOURCE = r"""
#include <math.h>
#include <stddef.h>
#include <stdint.h>

#if defined(__x86_64__) && defined(__GNUC__)
#define FMA_TARGET __attribute__((target("avx2,fma")))
static int have_fma(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}
#else
#define FMA_TARGET
static int have_fma(void) { return 1; }
#endif

#define MAX_PARTS 256

/* Pass 1 (ids only): the union of the parts' ids (each part's ascending and distinct) into
   keys, ascending, and for each the rows that hold its gradient, part after part:
   rows[start[i]] .. rows[start[i + 1] - 1]. Returns the number of ids; -1 an id not above
   its part's previous one, -2 an id outside 0..nrows-1, -3 too many parts. */
static int64_t merge(int64_t nrows, int64_t width, size_t itemsize, int32_t nparts,
                     const int64_t *const *ids, const int64_t *counts,
                     const char *const *vals, int64_t *keys, int64_t *start,
                     const char **rows) {
    int64_t at[MAX_PARTS];
    int64_t n = 0, m = 0;
    if (nparts < 0 || nparts > MAX_PARTS) return -3;
    for (int32_t r = 0; r < nparts; r++) {
        at[r] = 0;
        for (int64_t i = 0; i < counts[r]; i++) {
            if (ids[r][i] < 0 || ids[r][i] >= nrows) return -2;
            if (i && ids[r][i] <= ids[r][i - 1]) return -1;
        }
    }
    for (;;) {
        int64_t k = INT64_MAX;
        for (int32_t r = 0; r < nparts; r++)
            if (at[r] < counts[r] && ids[r][at[r]] < k) k = ids[r][at[r]];
        if (k == INT64_MAX) break;
        start[n] = m;
        for (int32_t r = 0; r < nparts; r++) {
            if (at[r] < counts[r] && ids[r][at[r]] == k) {
                rows[m++] = vals[r] + (size_t)at[r] * (size_t)width * itemsize;
                at[r]++;
            }
        }
        keys[n++] = k;
    }
    start[n] = m;
    return n;
}

/* Pass 2: each key's row plus alpha times its gradient: the rows that hold it summed in
   order (from +0.0 when add_zero), divided by divisor when divide; fused or not. One read
   and one write of each table row, one read of each pushed row. */
#define UPDATE(NAME, T, ATTR, FMA)                                                         \
ATTR static void NAME(T *restrict table, int64_t width, int64_t n,                         \
                      const int64_t *restrict keys, const int64_t *restrict start,         \
                      const char *const *rows, int add_zero, int divide, T d, T alpha,     \
                      T *restrict g) {                                                     \
    for (int64_t i = 0; i < n; i++) {                                                      \
        T *restrict p = table + keys[i] * width;                                           \
        const T *restrict v = (const T *)rows[start[i]];                                   \
        int64_t c = start[i + 1] - start[i];                                               \
        if (c == 1 && !add_zero && !divide) {                                              \
            for (int64_t j = 0; j < width; j++) p[j] = FMA(v[j], alpha, p[j]);             \
        } else if (c == 1 && !add_zero) {                                                  \
            for (int64_t j = 0; j < width; j++) p[j] = FMA(v[j] / d, alpha, p[j]);         \
        } else if (c == 1 && divide) {                                                     \
            for (int64_t j = 0; j < width; j++)                                            \
                p[j] = FMA(((T)0 + v[j]) / d, alpha, p[j]);                                \
        } else {                                                                           \
            for (int64_t j = 0; j < width; j++) g[j] = add_zero ? (T)0 + v[j] : v[j];      \
            for (int64_t q = start[i] + 1; q < start[i + 1]; q++) {                        \
                const T *restrict w = (const T *)rows[q];                                  \
                for (int64_t j = 0; j < width; j++) g[j] += w[j];                          \
            }                                                                              \
            if (divide) for (int64_t j = 0; j < width; j++) g[j] = g[j] / d;               \
            for (int64_t j = 0; j < width; j++) p[j] = FMA(g[j], alpha, p[j]);             \
        }                                                                                  \
    }                                                                                      \
}

#define FUSED_F(x, a, y) __builtin_fmaf((x), (a), (y))
#define FUSED_D(x, a, y) __builtin_fma((x), (a), (y))
#define PLAIN(x, a, y) ((y) + (a) * (x))
UPDATE(fused_f32, float, FMA_TARGET, FUSED_F)
UPDATE(fused_f64, double, FMA_TARGET, FUSED_D)
UPDATE(plain_f32, float, , PLAIN)
UPDATE(plain_f64, double, , PLAIN)

/* Both passes, the table written only once pass 1 found every id good. keys: room for
   every pushed id; start: one more; rows: every pushed id; g: one row. -4: fused asked
   for and the CPU has no FMA (nothing written then either). */
#define SGD(NAME, T, FUSED_FN, PLAIN_FN)                                                   \
int64_t NAME(T *table, int64_t nrows, int64_t width, int32_t nparts,                       \
             const int64_t *const *ids, const int64_t *counts, const char *const *vals,    \
             int add_zero, int divide, double divisor, double alpha, int fused,            \
             int64_t *keys, int64_t *start, const char **rows, T *g) {                     \
    if (fused && !have_fma()) return -4;                                                   \
    if (nparts == 0) return 0;                                                             \
    int64_t n = merge(nrows, width, sizeof(T), nparts, ids, counts, vals, keys, start,     \
                      rows);                                                               \
    if (n <= 0) return n;                                                                  \
    if (fused) FUSED_FN(table, width, n, keys, start, rows, add_zero, divide, (T)divisor, \
                        (T)alpha, g);                                                      \
    else PLAIN_FN(table, width, n, keys, start, rows, add_zero, divide, (T)divisor,       \
                  (T)alpha, g);                                                            \
    return n;                                                                              \
}

SGD(tx_row_sgd_f32, float, fused_f32, plain_f32)
SGD(tx_row_sgd_f64, double, fused_f64, plain_f64)
"""

_ERRORS = {-1: "row ids not ascending", -2: "a row id outside the table",
           -3: "too many ranks", -4: "no FMA instructions on this CPU"}

_lock = threading.Lock()
_loaded: list[RowKernel | None] = []  # [] until tried; then [the kernel] or [None]


class RowKernel:
    """The loaded kernel (see the module docstring)."""

    _DTYPES = {torch.float32: ("tx_row_sgd_f32", ctypes.c_float),
               torch.float64: ("tx_row_sgd_f64", ctypes.c_double)}

    def __init__(self, lib: ctypes.CDLL, built: _cache.Built) -> None:
        self.path = built.origin
        self._built = built  # its descriptor stays open while the library is mapped
        self._fns = {}
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        for dtype, (name, _) in self._DTYPES.items():
            fn = getattr(lib, name)
            fn.restype = i64
            fn.argtypes = [p, i64, i64, ctypes.c_int32, p, p, p, ctypes.c_int, ctypes.c_int,
                           ctypes.c_double, ctypes.c_double, ctypes.c_int, p, p, p, p]
            self._fns[dtype] = fn

    def sgd(self, table: torch.Tensor, parts: Sequence[tuple[torch.Tensor, torch.Tensor]],
            ranks: int, alpha: float, fused: bool) -> torch.Tensor | None:
        """Rows of ``table`` (2-D, contiguous, in host memory) plus ``alpha`` times the mean
        over ``ranks`` ranks of ``parts``' rows ((ids, rows) per rank that sent some);
        the ids it changed, ascending. None, with the table untouched, where the kernel
        cannot: a dtype other than float32/64, rows not laid out as ``table``'s, a part's
        ids not ascending (the torch ops then sum them). An id outside the table raises
        IndexError, the table untouched."""
        fn = self._fns.get(table.dtype)
        width = table.shape[1] if table.dim() == 2 else 0
        if fn is None or not table.is_contiguous() or table.device.type != "cpu" or \
                not 0 < len(parts) <= MAX_PARTS or not width:
            return None
        ids, vals, counts = [], [], []
        for i, v in parts:
            if i.dtype != torch.int64 or i.dim() != 1 or v.dtype != table.dtype or \
                    v.device.type != "cpu" or i.device.type != "cpu" or \
                    tuple(v.shape) != (i.numel(), width) or not (i.is_contiguous() and
                                                                 v.is_contiguous()):
                return None
            ids.append(i)
            vals.append(v)
            counts.append(i.numel())
        total = sum(counts)
        keys = torch.empty(total, dtype=torch.int64)
        index = torch.empty(2 * total + 1, dtype=torch.int64)  # start, then rows' addresses
        row = torch.empty(width, dtype=table.dtype)
        n = len(parts)
        got = fn(table.data_ptr(), table.shape[0], width, n,
                 (ctypes.c_void_p * n)(*[i.data_ptr() for i in ids]),
                 (ctypes.c_int64 * n)(*counts),
                 (ctypes.c_void_p * n)(*[v.data_ptr() for v in vals]),
                 int(n > 1), int(ranks > 1), float(ranks), float(alpha), int(fused),
                 keys.data_ptr(), index.data_ptr(), index.data_ptr() + 8 * (total + 1),
                 row.data_ptr())
        if got == -2:
            raise IndexError("a row id outside its table reached the SGD kernel")
        if got < 0:
            return None
        return keys[:got]

    def fused_available(self) -> bool:
        """Does this CPU run the fused update? (an empty call tells)"""
        fn = self._fns[torch.float32]
        zero = (ctypes.c_int64 * 1)(0)
        got = fn(None, 0, 1, 0, None, zero, None, 0, 0, 1.0, 0.0, 1, None, None, None, None)
        return bool(got != -4)


def load() -> RowKernel | None:
    """The kernel, built and loaded on first call; None where it cannot be (said once)."""
    with _lock:
        if not _loaded:
            _loaded.append(_load())
        return _loaded[0]


def _load() -> RowKernel | None:
    if os.environ.get(ENV, "1").strip() == "0":
        logger.info("%s=0: sparse SGD steps with torch ops", ENV)
        return None
    try:
        lib, built = ckernel.build("rowkernel", SOURCE, "the sparse SGD kernel")
        return RowKernel(lib, built)
    except ckernel.ERRORS as exc:
        logger.info("the sparse SGD kernel is unavailable (%s); steps use torch ops, "
                    "about 1.5x slower", str(exc).strip().splitlines()[0] if str(exc) else
                    type(exc).__name__)
        return None
