"""The verify checksum (tensorx._ps.wire.checksum): one number on every device, computed where the
arena lives, that changes with any changed byte; and the PS protocol that carries it."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from tensorx import GraphAnalyzer, MemoryRegion, Node
from tensorx._ps.wire import checksum as cs
from tensorx._ps.wire import protocol
from tensorx.errors import UsageError
from tensorx.ps import ParameterServer

SIZES = [0, 1, 3, 4, 5, 4095, 4096, 4097, 3 * 4096 + 7, 5 * 1024 * 1024 + 13]


def reference(raw: bytes) -> int:
    """The module docstring's definition, in numpy with Python integers at the end."""
    padded = raw + b"\0" * (-len(raw) % 4)
    w = np.frombuffer(padded, dtype="<i4").astype(np.int64) % cs.P
    i = np.arange(len(w), dtype=np.int64) % cs.P
    a = (len(raw) + int(w.sum())) % cs.P
    b = int((i * w % cs.P).sum()) % cs.P  # each term < 2**31: the sum stays exact
    return a << 31 | b


def random_bytes(n: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)


@pytest.mark.parametrize("n", SIZES)
def test_checksum_follows_its_definition(n: int) -> None:
    data = random_bytes(n)
    assert cs.checksum_bytes(data) == reference(data.numpy().tobytes())
    assert 0 <= cs.checksum_bytes(data) < 2**62  # fits the wire's int field


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.int64,
                                   torch.float16, torch.uint8])
@pytest.mark.parametrize("offset", [0, 1, 2, 4, 64, 4099])
def test_same_value_whatever_the_dtype_offset_and_path(dtype: torch.dtype, offset: int) -> None:
    """A region of any dtype is its bytes; an unaligned start, a small block size, and the
    integer path (what a GPU runs) all give the value the definition gives."""
    values = random_bytes(8 * 3001, seed=offset).view(dtype)
    raw = values.view(torch.uint8)
    backing = torch.zeros(offset + raw.numel(), dtype=torch.uint8)
    backing[offset:] = raw
    data = backing[offset:]
    want = reference(raw.numpy().tobytes())
    assert cs.checksum_bytes(data) == want
    with MemoryRegion.register(values) as region:
        assert cs.checksum(region) == want
    rows = cs._row_sums_int(raw[:4 * cs.ROW * 2].view(torch.int32).view(-1, cs.ROW))
    blas = cs._row_sums_blas(raw[:4 * cs.ROW * 2].view(torch.int32).view(-1, cs.ROW))
    assert all(torch.equal(x, y) for x, y in zip(rows, blas, strict=True))


def test_same_value_for_any_block_size_and_row_sum_path(
        monkeypatch: pytest.MonkeyPatch) -> None:
    data = random_bytes(37 * 4 * cs.ROW + 5, seed=1)
    want = cs.checksum_bytes(data)
    monkeypatch.setitem(cs._BLOCK_ROWS, "cpu", 3)
    assert cs.checksum_bytes(data) == want
    monkeypatch.setattr(cs, "_row_sums", cs._row_sums_int)
    assert cs.checksum_bytes(data) == want


def test_extreme_words_stay_exact() -> None:
    """Every word at int32's ends: the largest sums the arithmetic must hold exactly."""
    for word in (-(2**31), 2**31 - 1):
        data = torch.full((3 * cs.ROW + 1,), word, dtype=torch.int32).view(torch.uint8)
        assert cs.checksum_bytes(data) == reference(data.numpy().tobytes())


def test_only_bytes_are_accepted() -> None:
    with pytest.raises(UsageError, match="1-D uint8"):
        cs.checksum_bytes(torch.zeros(4, dtype=torch.float32))


@settings(max_examples=200, deadline=None)
@given(data=st.binary(min_size=1, max_size=3 * 4 * cs.ROW + 9), where=st.integers(0),
       flip=st.integers(1, 255))
def test_a_changed_byte_anywhere_changes_the_checksum(data: bytes, where: int,
                                                      flip: int) -> None:
    raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    before = cs.checksum_bytes(raw)
    raw[where % len(data)] ^= flip
    assert cs.checksum_bytes(raw) != before


@settings(max_examples=100, deadline=None)
@given(data=st.binary(min_size=8, max_size=2 * 4 * cs.ROW), i=st.integers(0), j=st.integers(0))
def test_swapped_words_change_the_checksum(data: bytes, i: int, j: int) -> None:
    words = torch.frombuffer(bytearray(data[:len(data) // 4 * 4]), dtype=torch.int32)
    i, j = i % len(words), j % len(words)
    if (int(words[i]) - int(words[j])) % cs.P == 0:
        return  # equal words (mod P): a swap changes nothing the sums can see
    before = cs.checksum_bytes(words.view(torch.uint8))
    words[[i, j]] = words[[j, i]]
    assert cs.checksum_bytes(words.view(torch.uint8)) != before


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("n", [*SIZES, 300 * 1024 * 1024 + 3])
def test_cuda_and_cpu_give_the_same_value(n: int) -> None:
    host = random_bytes(n, seed=n % 97)
    dev = host.cuda()
    assert cs.checksum_bytes(dev) == cs.checksum_bytes(host)
    assert cs.checksum_bytes(dev[1:]) == cs.checksum_bytes(host[1:])  # unaligned start
    with MemoryRegion.register(dev) as region:
        assert cs.checksum(region) == cs.checksum_bytes(host)


async def test_a_worker_of_the_last_protocol_is_told_why() -> None:
    """Checksums changed with protocol 4: a protocol-3 worker gets a clear error, not a
    checksum mismatch at its first pull."""
    plan = GraphAnalyzer(nn.Linear(4, 2)).plan()
    async with ParameterServer(num_workers=1, transport="tcp") as ps, \
            Node(None, transport="tcp", timeout=20) as node:
        with MemoryRegion.allocate(4096) as region:
            ep = await node.connect(ps.address)
            await ep.notify(protocol.encode(
                "hello", proto=3, rank=0, num_workers=1, shard=0, num_shards=1,
                fingerprint=plan.fingerprint, plan=plan.to_bytes(),
                params=node.export(region).to_bytes(), verify=True, share=False))
            _, payload = await asyncio.wait_for(node.notifications.get(), 30)
    answer = protocol.decode(payload)
    assert answer["t"] == "error"
    assert answer["code"] == "protocol"
    assert f"worker speaks ps protocol 3, this server {protocol.PROTOCOL}" in answer["msg"]
