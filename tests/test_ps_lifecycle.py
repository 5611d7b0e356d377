"""A run's life: workers started before the server, runs that end, departures named."""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Iterator

import pytest
import torch

from tensorx.errors import BrokenError
from tensorx.ps import ParameterServer
from tensorx.worker import Worker

from .conftest import transports
from .test_ps_train import backward, batches, make_model

TRANSPORTS = transports()


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


async def logged(caplog: pytest.LogCaptureFixture, text: str, within: float = 30.0) -> None:
    """Wait (bounded) until a log record containing ``text`` was emitted."""
    deadline = time.monotonic() + within
    while not any(text in r.getMessage() for r in caplog.records):
        assert time.monotonic() < deadline, f"never logged {text!r}"
        await asyncio.sleep(0.02)


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_worker_started_before_the_server_waits_for_it(
        transport: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="tensorx")
    port = free_port()
    model = make_model()
    worker = Worker(model, f"tcp://127.0.0.1:{port}", transport=transport, timeout=60.0)
    joining = asyncio.ensure_future(worker.start())
    await logged(caplog, "waiting for the ps shard")
    await asyncio.sleep(0.3)  # a few refused attempts
    assert not joining.done()
    async with ParameterServer(f"tcp://127.0.0.1:{port}", num_workers=1,
                               transport=transport) as ps:
        await joining
        try:
            ((x, y),) = batches(1, 1)[0]
            worker.zero_grad()
            backward(model, x, y)
            await worker.step()
            assert ps.version == 1
        finally:
            await worker.aclose()
    waits = [r for r in caplog.records if "waiting for the ps shard" in r.getMessage()]
    assert len(waits) == 1 and waits[0].levelno == logging.INFO  # one line, not one per try


async def test_the_first_join_gives_up_after_the_timeout() -> None:
    port = free_port()
    worker = Worker(make_model(), f"tcp://127.0.0.1:{port}", transport="tcp", timeout=0.5)
    with pytest.raises(BrokenError, match=r"no ps shard .* answered within 0.5 s"):
        await worker.start()
