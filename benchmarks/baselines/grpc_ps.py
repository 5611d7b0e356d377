"""gRPC (grpcio): one unary call per round, tensors packed into one message each way.

The worker packs its gradient tensors into one bytes message; the PS unpacks them as views
(``np.frombuffer``), applies plain SGD and answers with its parameters packed the same way;
the worker copies them into its model. No protobuf codegen: a generic handler on bytes.
"""

from __future__ import annotations

import argparse
import threading
from concurrent import futures

import grpc
import numpy as np
import torch

from benchmarks.baselines import common

METHOD = "/tensorx.bench.PS/Round"
OPTIONS = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]


def pack(tensors: list[torch.Tensor]) -> bytes:
    return b"".join(memoryview(t.numpy()).cast("B") for t in tensors)


def unpack(data: bytes, shapes: list[common.Shape]) -> list[torch.Tensor]:
    flat = torch.from_numpy(np.frombuffer(data, np.float32))
    out, pos = [], 0
    for s in shapes:
        n = int(np.prod(s))
        out.append(flat[pos:pos + n].view(s))
        pos += n
    return out


def serve(args: argparse.Namespace) -> None:
    shapes = common.MODELS[args.model]()
    params = common.make_params(shapes)

    def handle(request: bytes, context: object) -> bytes:
        common.sgd_(params, unpack(request, shapes))
        return pack(params)

    handler = grpc.method_handlers_generic_handler(
        "tensorx.bench.PS", {"Round": grpc.unary_unary_rpc_method_handler(handle)})
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), options=OPTIONS,
                         handlers=[handler])
    port = server.add_insecure_port(f"{args.host}:0")
    server.start()
    common.announce({"host": args.host, "port": port})
    threading.Event().wait()  # until SIGTERM


def client(args: argparse.Namespace) -> None:
    shapes = common.MODELS[args.model]()
    params = common.make_params(shapes)
    grads = common.make_grads(shapes)
    with grpc.insecure_channel(f"{args.host}:{args.port}", options=OPTIONS) as channel:
        call = channel.unary_unary(METHOD)

        def one_round() -> None:
            fresh = unpack(call(pack(grads), timeout=300), shapes)
            torch._foreach_copy_(params, fresh)

        common.client_loop(lambda n: common.timed_rounds(one_round, n), {"system": "grpc"})
