"""torch.distributed.rpc with TensorPipe: the PyTorch parameter-server tutorial pattern.

The worker calls ``rpc_sync("ps", ps_round, args=(grads,))`` with its list of gradient
tensors; the PS applies plain SGD to its parameters and returns them (TensorPipe moves the
tensors; the worker keeps the returned list as its parameters, with no extra copy).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed.rpc as rpc

from benchmarks.baselines import common
from benchmarks.baselines.pair import NETWORK_ONLY

_PARAMS: list[torch.Tensor] = []
RPC_TIMEOUT = 300.0


def ps_round(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """Runs on the PS: apply the gradients, return the fresh parameters."""
    common.sgd_(_PARAMS, grads)
    return _PARAMS


def network_only() -> dict[str, list[str]]:
    """Between namespaces, only what TensorPipe would use between two hosts: the uv (TCP)
    transport and the basic channel (no shm transport, no cma channel)."""
    if os.environ.get(NETWORK_ONLY):
        return {"_transports": ["uv"], "_channels": ["basic"]}
    return {}


def init_ps_group(rank: int, host: str, port: int, workers: int, timeout: float) -> None:
    """Join the PS group: rank 0 is ``ps``, the others ``worker1``..``workerN``."""
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = host, str(port)
    opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://{host}:{port}",
                                           rpc_timeout=timeout, **network_only())
    name = "ps" if rank == 0 else f"worker{rank}"
    rpc.init_rpc(name, rank=rank, world_size=workers + 1, rpc_backend_options=opts)


def _init(name: str, rank: int, host: str, port: int) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = host, str(port)
    opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://{host}:{port}",
                                           rpc_timeout=RPC_TIMEOUT, **network_only())
    rpc.init_rpc(name, rank=rank, world_size=2, rpc_backend_options=opts)


def serve(args: argparse.Namespace) -> None:
    _PARAMS[:] = common.make_params(common.MODELS[args.model]())
    port = common.free_port(args.host)
    common.announce({"host": args.host, "port": port})
    _init("ps", 0, args.host, port)
    rpc.shutdown()  # graceful: returns once the worker has shut down too


def client(args: argparse.Namespace) -> None:
    _init("worker", 1, args.host, args.port)
    shapes = common.MODELS[args.model]()
    grads = common.make_grads(shapes)
    state = {"params": common.make_params(shapes)}

    def one_round() -> None:
        state["params"] = rpc.rpc_sync("ps", ps_round, args=(grads,))

    common.client_loop(lambda n: common.timed_rounds(one_round, n), {"system": "tensorpipe"})
    rpc.shutdown()
