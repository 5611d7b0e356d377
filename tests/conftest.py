from __future__ import annotations

import importlib.util

import pytest

HAVE_UCX = importlib.util.find_spec("ucxx") is not None


def transports() -> list[object]:
    """Every backend the conformance suite runs over; ucx only where ucxx imports."""
    return ["tcp", pytest.param("ucx", marks=[pytest.mark.ucx, pytest.mark.skipif(
        not HAVE_UCX, reason="ucxx not installed")])]
