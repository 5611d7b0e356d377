"""Sparse-embedding PS training for ``benchmarks/sparse.py``: one PS, two workers, sync.

A DLRM-shaped model (facebookresearch/dlrm's structure: a bottom MLP over 13 dense features,
26 ``nn.EmbeddingBag(sparse=True)`` tables, their dot-product interactions, a top MLP) on a
synthetic click log whose ids follow a Zipf law per table, as in the Criteo data. Table sizes
are spread over ``10^4 .. 10^5`` rows of 32 floats (``dlrm``: 132 MB of embeddings) or ten
times that (``dlrm-x10``: 1.3 GB), with the same batches: the rows a step touches are the
same, only the tables grow. Three systems:

* ``tensorx``: :class:`tensorx.ps.ParameterServer` (sync, SGD, default options) and, per
  worker, :class:`tensorx.RemoteOptimizer` in an ordinary PyTorch loop; tensorx finds the
  sparse tables by itself.
* ``rpc``: a ``torch.distributed.rpc`` (TensorPipe) parameter server that moves rows, the
  way recommendation PSs do (TorchRec, Persia, XDL, Paddle): a worker sends its dense
  gradients and, per table, the ids and gradient rows it touched; once every worker has,
  the PS applies SGD to the average (rows with ``index_add_``) and answers each worker with
  the dense parameters and the fresh values of the rows it will look up next (its batch).
* ``local``: no PS; each worker steps its own model (``torch.optim.SGD``) on its batch: the
  forward, backward and update every system's step contains, on the same cores at once.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed.rpc as rpc
from torch import nn

from benchmarks.baselines import common
from benchmarks.baselines.rpc import init_ps_group

WORKERS = 2
BATCH = 256
DIM = 32
TABLES = 26
LR = 0.05
TIMEOUT = 300.0
SCALES = {"dlrm": 1, "dlrm-x10": 10}


def table_rows(scale: int) -> list[int]:
    """26 sizes spread log-uniformly over 1e4 .. 1e5 rows (times ``scale``)."""
    return [int(scale * 10 ** (4 + k / (TABLES - 1))) for k in range(TABLES)]


class DLRM(nn.Module):
    def __init__(self, rows: list[int]) -> None:
        super().__init__()
        self.bottom = nn.Sequential(nn.Linear(13, 64), nn.ReLU(), nn.Linear(64, DIM), nn.ReLU())
        self.emb = nn.ModuleList(nn.EmbeddingBag(n, DIM, mode="sum", sparse=True)
                                 for n in rows)
        pairs = (TABLES + 1) * TABLES // 2
        self.top = nn.Sequential(nn.Linear(DIM + pairs, 64), nn.ReLU(), nn.Linear(64, 1))
        self._iu = torch.triu_indices(TABLES + 1, TABLES + 1, offset=1)

    def forward(self, dense: torch.Tensor, ids: list[torch.Tensor]) -> torch.Tensor:
        x = self.bottom(dense)
        feats = torch.stack([x, *(e(i.view(-1, 1)) for e, i in zip(self.emb, ids,
                                                                    strict=True))], 1)
        inter = torch.bmm(feats, feats.transpose(1, 2))[:, self._iu[0], self._iu[1]]
        return self.top(torch.cat([x, inter], 1)).squeeze(1)


def build_model(model: str) -> DLRM:
    torch.manual_seed(0)
    return DLRM(table_rows(SCALES[model]))


def batch(rank: int) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
    """One fixed batch per rank: dense features, Zipf(1.1) ids per table (ranks 0..1e4, the
    same whatever the table size: hot rows are the low ids), labels."""
    gen = torch.Generator().manual_seed(rank + 1)
    ranks = torch.arange(1, 10_001, dtype=torch.float64)
    zipf = ranks.pow(-1.1)
    ids = [torch.multinomial(zipf, BATCH, replacement=True, generator=gen) for _ in
           range(TABLES)]
    return (torch.randn(BATCH, 13, generator=gen), ids,
            torch.randint(0, 2, (BATCH,), generator=gen).float())


def backward(model: DLRM, rank: int) -> Callable[[], None]:
    dense, ids, labels = batch(rank)
    return lambda: nn.functional.binary_cross_entropy_with_logits(
        model(dense, ids), labels).backward()


def rows_touched(rank: int) -> int:
    return sum(int(i.unique().numel()) for i in batch(rank)[1])


# -- tensorx -----------------------------------------------------------------------------------
def tensorx_serve(args: argparse.Namespace) -> None:
    from tensorx.ps import ParameterServer

    async def serve() -> None:
        ps = ParameterServer(f"tcp://{args.host}:0", num_workers=WORKERS, mode="sync",
                             optimizer=lambda p: torch.optim.SGD(p, lr=LR),
                             transport=args.transport, timeout=TIMEOUT)
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, ps.stop)
        async with ps:
            common.announce({"host": args.host, "address": ps.address})
            await ps.serve()

    asyncio.run(serve())


def tensorx_client(args: argparse.Namespace) -> None:
    from tensorx import RemoteOptimizer

    model = build_model(args.model)
    with RemoteOptimizer(model, args.address, rank=args.rank, num_workers=WORKERS,
                         transport=args.transport, timeout=TIMEOUT) as opt:
        run_backward = backward(model, args.rank)

        def step() -> None:
            opt.zero_grad()
            run_backward()
            opt.step()

        ep = opt.worker.node.endpoints[0]
        common.client_loop(lambda n: common.timed_rounds(step, n),
                           {"lanes": ep.info["lanes"], "host": ep.info.get("host", ""),
                            "rows": rows_touched(args.rank)})


# -- no PS: each worker's own step (the floor under any PS's step) ----------------------------
def local_serve(args: argparse.Namespace) -> None:
    common.announce({"host": args.host})
    threading.Event().wait()  # until the driver stops us (SIGTERM)


def local_client(args: argparse.Namespace) -> None:
    """The same forward, backward and sparse SGD step, on this worker's batch alone: what a
    step costs before any parameter server adds to it."""
    model = build_model(args.model)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    run_backward = backward(model, args.rank)

    def step() -> None:
        opt.zero_grad()
        run_backward()
        opt.step()

    common.client_loop(lambda n: common.timed_rounds(step, n),
                       {"lanes": [], "rows": rows_touched(args.rank)})


# -- torch.distributed.rpc: a PS that moves rows ------------------------------------------------
class _RowPS:
    def __init__(self, model: str) -> None:
        m = build_model(model)
        self.dense = [p.detach() for n, p in m.named_parameters() if not n.startswith("emb")]
        self.tables = [e.weight.detach() for e in m.emb]
        self.acc = [torch.zeros_like(p) for p in self.dense]
        self.rows: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in self.tables]
        self.lock = threading.Lock()
        self.pending = 0
        self.future: torch.futures.Future[bool] = torch.futures.Future()


_PS: _RowPS | None = None


def _apply(ps: _RowPS) -> None:
    scale = -LR / WORKERS
    torch._foreach_add_(ps.dense, ps.acc, alpha=scale)
    torch._foreach_zero_(ps.acc)
    for table, got in zip(ps.tables, ps.rows, strict=True):
        for ids, grads in got:
            table.index_add_(0, ids, grads, alpha=scale)
        got.clear()


@rpc.functions.async_execution  # type: ignore[misc]
def push_pull(dense: list[torch.Tensor], ids: list[torch.Tensor],
              grads: list[torch.Tensor]) -> torch.futures.Future[Any]:
    ps = _PS
    assert ps is not None
    with ps.lock:
        torch._foreach_add_(ps.acc, dense)
        for got, i, g in zip(ps.rows, ids, grads, strict=True):
            got.append((i, g))
        ps.pending += 1
        future = ps.future
        if ps.pending == WORKERS:
            _apply(ps)
            ps.pending = 0
            ps.future = torch.futures.Future()
            future.set_result(True)

    def answer(_: Any) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        return ps.dense, [t.index_select(0, i) for t, i in zip(ps.tables, ids, strict=True)]

    return future.then(answer)


def _init_rpc(rank: int, host: str, port: int) -> None:
    init_ps_group(rank, host, port, WORKERS, TIMEOUT)


def rpc_serve(args: argparse.Namespace) -> None:
    global _PS
    _PS = _RowPS(args.model)
    port = common.free_port(args.host)
    common.announce({"host": args.host, "port": port})
    _init_rpc(0, args.host, port)
    rpc.shutdown()


def rpc_client(args: argparse.Namespace) -> None:
    _init_rpc(args.rank + 1, args.host, args.port)
    model = build_model(args.model)
    dense = [p for n, p in model.named_parameters() if not n.startswith("emb")]
    run_backward = backward(model, args.rank)

    def step() -> None:
        model.zero_grad(set_to_none=True)
        run_backward()
        ids, grads = [], []
        for e in model.emb:
            g = e.weight.grad.coalesce()  # the rows this batch touched, summed per id
            ids.append(g.indices()[0])
            grads.append(g.values())
        fresh, rows = rpc.rpc_sync("ps", push_pull,
                                   args=([p.grad for p in dense], ids, grads))
        with torch.no_grad():
            torch._foreach_copy_(dense, fresh)
            for e, i, r in zip(model.emb, ids, rows, strict=True):
                e.weight.index_copy_(0, i, r)

    common.client_loop(lambda n: common.timed_rounds(step, n),
                       {"lanes": [], "rows": rows_touched(args.rank)})
    rpc.shutdown()
