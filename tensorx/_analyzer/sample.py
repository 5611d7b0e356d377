"""A sample forward pass that leaves no trace (planning with ``sample_inputs``).

The analyzer runs the model once to learn the order its modules are called in, or the shapes
its edges carry. That run must not change what the caller's training does next: buffers
(batch-norm statistics) are put back, and the random-number generators of the CPU and of
every CUDA device the run may draw from (dropout) are left as they were.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

__all__ = ["cuda_devices", "traceless"]


@contextlib.contextmanager
def traceless(module: nn.Module, inputs: Any) -> Iterator[None]:
    """Run ``module`` (on ``inputs``) inside: no autograd, and afterwards its buffers and the
    RNG of the CPU and of :func:`cuda_devices` are what they were before."""
    saved = [(b, b.detach().clone()) for b in module.buffers()]
    try:
        with torch.random.fork_rng(devices=cuda_devices(module, inputs)), torch.no_grad():
            yield
    finally:
        with torch.no_grad():
            for b, value in saved:
                b.copy_(value)


def cuda_devices(module: nn.Module, inputs: Any) -> list[int]:
    """The CUDA devices a forward pass of ``module`` on ``inputs`` may draw random numbers
    on: those of its parameters, buffers and input tensors, and the current one (where
    ``device="cuda"`` lands) once CUDA is in use. Never initialises CUDA itself."""
    found = {t.device.index for t in [*module.parameters(), *module.buffers()]
             if t.device.type == "cuda"}
    found |= {t.device.index for t in _tensors(inputs) if t.device.type == "cuda"}
    if torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        found.add(torch.cuda.current_device())
    return sorted(i for i in found if i is not None)


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, Mapping):
        for v in value.values():
            yield from _tensors(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)
