"""The transport edge's one translator: backend exceptions become tensorx.errors types,
chained to the original; flow control and tensorx's own errors pass untouched."""

from __future__ import annotations

import errno

import pytest

import tensorx as tx
from tensorx.transport._exceptions import UCX_ERRORS, map_exceptions


def test_an_os_error_becomes_broken_with_its_cause() -> None:
    lost = map_exceptions("peer: connection lost")
    reset = ConnectionResetError(errno.ECONNRESET, "Connection reset by peer")
    with pytest.raises(tx.BrokenError, match=r"peer: connection lost: .*reset") as caught:
        with lost:
            raise reset
    assert caught.value.__cause__ is reset
    with pytest.raises(tx.BrokenError):  # one instance serves any number of blocks
        with lost:
            raise OSError(errno.EPIPE, "Broken pipe")


@pytest.mark.parametrize("exc", [BlockingIOError(), InterruptedError(), tx.RegionError("x"),
                                 ValueError("not a backend's")])
def test_flow_control_ours_and_unmapped_types_pass(exc: Exception) -> None:
    with pytest.raises(type(exc)) as caught, map_exceptions("x"):
        raise exc
    assert caught.value is exc


def test_other_mappings() -> None:
    with pytest.raises(tx.UsageError, match="cannot listen"), \
            map_exceptions("cannot listen", {OSError: tx.UsageError}):
        raise OSError(errno.EADDRINUSE, "Address already in use")
    with pytest.raises(tx.TransportUnavailableError, match="ucxx"), \
            map_exceptions("ucxx", UCX_ERRORS):
        raise RuntimeError("UCXConfigError")
