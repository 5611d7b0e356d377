"""The raw-socket limit: one blocking TCP socket, the gradients as one contiguous buffer.

The worker sends an 8-byte length and its flat gradient buffer; the PS receives straight
into its flat gradient buffer (``MSG_WAITALL``), applies plain SGD on the flat parameters and
sends them back straight into the worker's flat parameter buffer. No framing, no asyncio, no
per-tensor work: what any design on sockets can at best do.
"""

from __future__ import annotations

import argparse
import socket
import struct

import torch

from benchmarks.baselines import common

LEN = struct.Struct("!Q")
SOCK_BUF = 4 << 20


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        sock.setsockopt(socket.SOL_SOCKET, opt, SOCK_BUF)


def _recv_into(sock: socket.socket, view: memoryview) -> None:
    pos = 0
    while pos < len(view):
        n = sock.recv_into(view[pos:], 0, socket.MSG_WAITALL)
        if not n:
            raise ConnectionError("peer closed")
        pos += n


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
            _recv_into(sock, gview[:LEN.unpack(head)[0]])
            common.sgd_([params], [grads])
            sock.sendall(pview)
    except ConnectionError:
        sock.close()


def client(args: argparse.Namespace) -> None:
    n = common.numel(common.MODELS[args.model]())
    grads, gview = _flat(n)
    grads.fill_(common.GRAD_VALUE)
    _, pview = _flat(n)
    sock = socket.create_connection((args.host, args.port))
    _tune(sock)

    def one_round() -> None:
        sock.sendall(LEN.pack(len(gview)))
        sock.sendall(gview)
        _recv_into(sock, pview)

    common.client_loop(lambda k: common.timed_rounds(one_round, k), {"system": "raw"})
    sock.close()
