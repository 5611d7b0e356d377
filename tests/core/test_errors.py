"""The error-code registry: one stable code per error class, on every wire that carries
errors (a TCP owner's ERROR frames, a parameter server's "error" messages)."""

from __future__ import annotations

import pytest
from torch import nn

import tensorx as tx
from tensorx import errors
from tensorx._cuda import CudaError
from tensorx._ps.wire import protocol
from tensorx.endpoint import Endpoint
from tensorx.errors import CODES, TensorxError, error_code, error_from_code
from tensorx.worker import Worker

CLASSES = [cls for cls in vars(errors).values()
           if isinstance(cls, type) and issubclass(cls, TensorxError)]


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_every_error_class_crosses_the_wire_as_itself(cls: type[TensorxError]) -> None:
    back = error_from_code(error_code(cls("why")), "why")
    assert type(back) is cls and str(back) == "why"


def test_codes_are_unique_and_the_old_tcp_codes_stay() -> None:
    assert len(set(CODES.values())) == len(CODES)
    for code, cls in {"region": tx.RegionError, "protocol": tx.ProtocolError,
                      "auth": tx.AuthError, "usage": tx.UsageError,
                      "broken": tx.BrokenError}.items():
        assert CODES[code] is cls


def test_a_subclass_travels_as_its_nearest_registered_base() -> None:
    assert error_code(CudaError("no driver")) == "unavailable"
    assert error_code(RuntimeError("not ours")) == "error"


@pytest.mark.parametrize("code", ["no-such-code", "", 7, None, b"region"])
def test_an_unknown_code_is_the_base_error(code: object) -> None:
    exc = error_from_code(code, "m")
    assert type(exc) is TensorxError and str(exc) == "m"


def test_the_class_names_older_servers_sent_are_understood() -> None:
    assert type(error_from_code("RankTakenError", "m")) is tx.RankTakenError
    assert type(error_from_code("PlanMismatchError", "m")) is tx.PlanMismatchError


def test_the_peer_message_is_escaped_and_bounded() -> None:
    exc = error_from_code("usage", "a\nWARNING forged\x1b[31m" + "x" * 10_000, "shard 0: ")
    text = str(exc)
    assert text.startswith("shard 0: a\\nWARNING forged\\x1b[31m")
    assert "\n" not in text and "\x1b" not in text
    assert len(text) < errors.MESSAGE_LIMIT + 100


async def test_a_worker_gets_the_shards_error_class_with_the_message_escaped() -> None:
    """A shard refusing a hello: the worker raises that class (the registry's code), and a
    newline in the shard's message no longer reaches the worker's caller raw."""

    async def refuse(ep: Endpoint) -> None:
        assert protocol.decode(await ep.messages.get(20))["t"] == "hello"
        await ep.notify(protocol.encode("error", code=error_code(tx.RankTakenError()),
                                        msg="rank 0 is taken\nWARNING forged"))

    async with tx.Node(transport="tcp", handler=refuse) as shard:
        worker = Worker(nn.Linear(2, 1), shard.address, transport="tcp", timeout=20,
                        share_memory=False)
        with pytest.raises(tx.RankTakenError, match=r"ps shard 0: rank 0 is taken\\nWARNING"):
            await worker.start()
