"""What every system in the PS round benchmark shares: model shapes, the round's math, and
the line protocol between the benchmark driver and the server/client processes.

Each system runs as two processes, a server (the parameter server) and a client (the worker),
started with ``python -m benchmarks.baselines.launch`` (optionally inside a network
namespace). They talk to the driver over stdin/stdout, one line per message:

    server -> driver   READY {"host": ..., "port": ..., "address": ...}
    client -> driver   READY {...info...}          (after connecting and warm-up rounds)
    driver -> client   run N
    client -> driver   TIMES [seconds per round, ...]
    driver -> client   quit

Anything else a process prints goes to stderr.
"""

from __future__ import annotations

import json
import math
import os
import socket
import sys
import time
from collections.abc import Callable

import torch
from torch import nn

LR = 1e-3
GRAD_VALUE = 1e-3
WARMUP_ROUNDS = 2
Shape = tuple[int, ...]


# -- model shapes ---------------------------------------------------------------------------
def resnet50_shapes() -> list[Shape]:
    """torchvision's ResNet-50 parameters: 161 tensors, 25,557,032 parameters."""
    shapes: list[Shape] = [(64, 3, 7, 7), (64,), (64,)]
    inplanes = 64
    for planes, blocks in ((64, 3), (128, 4), (256, 6), (512, 3)):
        out = planes * 4
        for i in range(blocks):
            shapes += [(planes, inplanes, 1, 1), (planes,), (planes,),
                       (planes, planes, 3, 3), (planes,), (planes,),
                       (out, planes, 1, 1), (out,), (out,)]
            if i == 0:
                shapes += [(out, inplanes, 1, 1), (out,), (out,)]
            inplanes = out
    return [*shapes, (1000, 2048), (1000,)]


def bert_base_shapes() -> list[Shape]:
    """HuggingFace BertModel (uncased base): 199 tensors, 109,482,240 parameters."""
    h, ff = 768, 3072
    shapes: list[Shape] = [(30522, h), (512, h), (2, h), (h,), (h,)]
    for _ in range(12):
        shapes += [(h, h), (h,)] * 4 + [(h,), (h,), (ff, h), (ff,), (h, ff), (h,), (h,), (h,)]
    return [*shapes, (h, h), (h,)]


def many_small_shapes() -> list[Shape]:
    return [(256,)] * 2000


def tiny_shapes() -> list[Shape]:
    """Four small tensors: for self-tests of the harness, not for figures."""
    return [(64, 32), (64,), (10, 64), (10,)]


MODELS: dict[str, Callable[[], list[Shape]]] = {
    "resnet50": resnet50_shapes,
    "bert-base": bert_base_shapes,
    "many-small": many_small_shapes,
    "tiny": tiny_shapes,
}


def numel(shapes: list[Shape]) -> int:
    return sum(math.prod(s) for s in shapes)


def model_bytes(name: str) -> int:
    return 4 * numel(MODELS[name]())


class ShapeModel(nn.Module):
    """A module with exactly the given parameter shapes (float32, seeded)."""

    def __init__(self, shapes: list[Shape], seed: int = 0) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.params = nn.ParameterList(
            nn.Parameter(torch.randn(s, generator=gen) * 0.01) for s in shapes)


def make_params(shapes: list[Shape]) -> list[torch.Tensor]:
    """The PS side's parameters as plain tensors (same values as :class:`ShapeModel`)."""
    return [p.detach() for p in ShapeModel(shapes).parameters()]


def make_grads(shapes: list[Shape]) -> list[torch.Tensor]:
    return [torch.full(s, GRAD_VALUE) for s in shapes]


def sgd_(params: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
    """Plain SGD, in place: what every baseline's PS applies (tensorx uses torch.optim.SGD)."""
    with torch.no_grad():
        torch._foreach_add_(params, grads, alpha=-LR)


# -- process plumbing -------------------------------------------------------------------------
def setup_process(threads: int = 1) -> None:
    """Same conditions in every process: ``threads`` torch threads, logs to stderr."""
    torch.set_num_threads(threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))


def announce(info: dict[str, object]) -> None:
    print("READY " + json.dumps(info), flush=True)


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def timed_rounds(round_fn: Callable[[], object], n: int) -> list[float]:
    times = []
    for _ in range(n):
        t = time.perf_counter()
        round_fn()
        times.append(time.perf_counter() - t)
    return times


def client_loop(run: Callable[[int], list[float]], info: dict[str, object]) -> None:
    """Warm up, say READY, then answer ``run N`` with ``TIMES [...]`` until ``quit``/EOF."""
    run(WARMUP_ROUNDS)
    announce(info)
    for line in sys.stdin:
        cmd = line.split()
        if not cmd or cmd[0] == "quit":
            break
        if cmd[0] == "run":
            print("TIMES " + json.dumps(run(int(cmd[1]))), flush=True)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
