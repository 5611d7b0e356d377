"""The checksum a shard stamps on each update and a worker checks on each pull (``verify``).

It is computed where the parameter arena lives, with torch ops, and only the number leaves
the device: a worker on a GPU never copies its arena to the host to check it, and a shard
and a worker get the same number whatever device each of them holds the arena on.

Definition: the bytes, zero-padded to whole little-endian signed int32 words ``w[i]``, give
``A = (nbytes + sum(w[i])) mod P`` and ``B = sum(i * w[i]) mod P`` with ``P = 2**31 - 1``;
the checksum is ``A * 2**31 + B`` (below ``2**62``). Every step is exact integer arithmetic
(no overflow and no rounding, in any summation order), so every device and every block size
gives the same number. ``A`` changes with any changed byte (a change of ``d * 2**(8k)``,
``0 < |d| < 256``, is never a multiple of the prime ``P``); ``B`` also sees words moved.

Rows of ``ROW`` words: each row's plain and position-weighted sums (``r``, ``t``) come from
one float64 product on the CPU (BLAS; exact because ``|t| < 2**51 < 2**53``) and from int64
ops on other devices; rows combine as ``B = sum(row * ROW * r + t)`` modulo ``P``.
"""

from __future__ import annotations

import functools

import torch

from tensorx.errors import UsageError
from tensorx.memregion import MemoryRegion

__all__ = ["ROW", "P", "checksum", "checksum_bytes"]

P = (1 << 31) - 1
ROW = 1 << 10  # words per row
_BLOCK_ROWS = {"cpu": 256}  # rows per pass: a 1 MiB block stays in cache on a CPU
_GPU_BLOCK_ROWS = 1 << 16  # 256 MiB per pass elsewhere (bounded scratch on a large arena)


def checksum(region: MemoryRegion) -> int:
    """The checksum of ``region``'s bytes, computed on its device."""
    raw: torch.Tensor = region.view(torch.uint8)
    return checksum_bytes(raw)


def checksum_bytes(data: torch.Tensor) -> int:
    """The checksum of a 1-D ``uint8`` tensor on any device (see the module docstring)."""
    if data.dtype != torch.uint8 or data.dim() != 1:
        raise UsageError(f"checksum_bytes takes a 1-D uint8 tensor, got {data.dtype} "
                        f"{tuple(data.shape)}")
    nbytes = data.numel()
    if nbytes == 0:
        return 0
    if not data.is_contiguous() or data.storage_offset() % 4 or data.data_ptr() % 4:
        data = data.clone()  # on its own device; int32 words need 4-byte alignment
    whole = nbytes - nbytes % (4 * ROW)
    a = torch.zeros((), dtype=torch.int64, device=data.device)
    b = torch.zeros((), dtype=torch.int64, device=data.device)
    rows = data[:whole].view(torch.int32).view(-1, ROW)
    step = _BLOCK_ROWS.get(data.device.type, _GPU_BLOCK_ROWS)
    for first in range(0, rows.shape[0], step):
        a, b = _add_rows(a, b, rows[first:first + step], first)
    if whole < nbytes:  # the last, partial row, zero-padded (at most 4 KiB, on the device)
        tail = torch.zeros(4 * ROW, dtype=torch.uint8, device=data.device)
        tail[:nbytes - whole] = data[whole:]
        a, b = _add_rows(a, b, tail.view(torch.int32).view(1, ROW), rows.shape[0])
    a_sum, b_sum = (int(v) for v in torch.stack([a, b]).tolist())  # the one copy back
    return ((a_sum + nbytes) % P) << 31 | b_sum % P


def _add_rows(a: torch.Tensor, b: torch.Tensor, words: torch.Tensor,
              first: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Add rows ``first..`` (int32 ``[n, ROW]``) to the running sums ``a``, ``b`` (mod P)."""
    r, t = _row_sums(words)
    r = r.remainder(P)  # |r| < 2**41, |t| < 2**51: exact; now both in [0, P)
    at = torch.arange(first, first + words.shape[0], dtype=torch.int64, device=words.device)
    weighted = (at * ROW).remainder_(P).mul_(r).remainder_(P)  # < 2**62 before the remainder
    b = (b + weighted.add_(t.remainder(P)).sum()).remainder(P)  # n * 2**32 < 2**63
    return (a + r.sum()).remainder(P), b


def _row_sums(words: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: ``sum(w)`` and ``sum(k * w)`` over its words ``k = 0..ROW-1``, as int64."""
    if words.device.type == "cpu":
        return _row_sums_blas(words)
    return _row_sums_int(words)


def _row_sums_blas(words: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    both = torch.mm(words.to(torch.float64), _weights(words.device)).to(torch.int64)
    return both[:, 0], both[:, 1]


def _row_sums_int(words: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    k = torch.arange(ROW, dtype=torch.int64, device=words.device)
    return words.sum(1, dtype=torch.int64), torch.mul(words, k).sum(1)


@functools.cache
def _weights(device: torch.device) -> torch.Tensor:
    """``[ROW, 2]`` float64: a column of ones and one of positions."""
    k = torch.arange(ROW, dtype=torch.float64, device=device)
    return torch.stack([torch.ones_like(k), k], 1)
