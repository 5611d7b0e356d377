"""The raw-socket limit: one blocking TCP socket, the gradients as one contiguous buffer.

The worker sends an 8-byte length and its flat gradient buffer; the PS receives straight
into its flat gradient buffer (``MSG_WAITALL``), applies plain SGD on the flat parameters and
sends them back straight into the worker's flat parameter buffer. No framing, no asyncio, no
per-tensor work: what any design on sockets can at best do.

``--variant pipelined`` (an experiment: the limit of a pipelined PS round): the gradients go
in chunks; the PS applies SGD to each chunk as it lands and sends that chunk's parameters
back at once, while the worker is still sending (full duplex), so a round costs about one
transfer instead of two plus the update.
"""

from __future__ import annotations

import argparse
import socket
import struct
import threading

import torch

from benchmarks.baselines import common
from benchmarks.rawsock import _recv_into, _tune

LEN = struct.Struct("!Q")
CHUNK = 4 << 20


def _flat(n: int) -> tuple[torch.Tensor, memoryview]:
    t = torch.zeros(n)
    return t, memoryview(t.numpy()).cast("B")


def serve(args: argparse.Namespace) -> None:
    n = common.numel(common.MODELS[args.model]())
    params, pview = _flat(n)
    params.copy_(torch.cat([p.reshape(-1) for p in
                            common.make_params(common.MODELS[args.model]())]))
    grads, gview = _flat(n)
    head = memoryview(bytearray(LEN.size))
    lsock = socket.socket()
    _tune(lsock)
    lsock.bind((args.host, 0))
    lsock.listen(1)
    common.announce({"host": args.host, "port": lsock.getsockname()[1]})
    sock, _ = lsock.accept()
    try:
        while True:
            _recv_into(sock, head)
            nbytes = LEN.unpack(head)[0]
            if args.variant == "pipelined":
                _serve_pipelined(sock, params, grads, nbytes)
                continue
            _recv_into(sock, gview[:nbytes])
            common.sgd_([params], [grads])
            sock.sendall(pview)
    except ConnectionError:
        sock.close()


def _serve_pipelined(sock: socket.socket, params: torch.Tensor, grads: torch.Tensor,
                     nbytes: int) -> None:
    gview, pview = memoryview(grads.numpy()).cast("B"), memoryview(params.numpy()).cast("B")
    for start in range(0, nbytes, CHUNK):
        end = min(nbytes, start + CHUNK)
        _recv_into(sock, gview[start:end])
        common.sgd_([params[start // 4:end // 4]], [grads[start // 4:end // 4]])
        sock.sendall(pview[start:end])


def client(args: argparse.Namespace) -> None:
    n = common.numel(common.MODELS[args.model]())
    grads, gview = _flat(n)
    grads.fill_(common.GRAD_VALUE)
    _, pview = _flat(n)
    sock = socket.create_connection((args.host, args.port))
    _tune(sock)

    def one_round() -> None:
        sock.sendall(LEN.pack(len(gview)))
        if args.variant == "pipelined":  # send from a thread while receiving here
            sender = threading.Thread(target=sock.sendall, args=(gview,))
            sender.start()
            _recv_into(sock, pview)
            sender.join()
            return
        sock.sendall(gview)
        _recv_into(sock, pview)

    common.client_loop(lambda k: common.timed_rounds(one_round, k), {"system": "raw"})
    sock.close()
