"""Entry point of one benchmark process: ``python -m benchmarks.baselines.launch SYSTEM ROLE``.

    SYSTEM: tensorx | tensorpipe | grpc | raw (one PS round)
            train-tensorx | train-rpc (PS training, two workers: --rank)
            sparse-tensorx | sparse-rpc | sparse-local (DLRM-shaped training, two workers:
            --rank; local: no PS)
            gpu-tensorx | gpu-tensorpipe (one PS round on --device, --workers workers)
    ROLE:   server | client
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.baselines import common

ENTRIES = {  # system: (module, server function, client function)
    "tensorx": ("tensorx_ps", "serve", "client"),
    "tensorpipe": ("rpc", "serve", "client"),
    "grpc": ("grpc_ps", "serve", "client"),
    "raw": ("raw", "serve", "client"),
    "train-tensorx": ("training", "tensorx_serve", "tensorx_client"),
    "train-rpc": ("training", "rpc_serve", "rpc_client"),
    "gpu-tensorx": ("gpu_ps", "tensorx_serve", "tensorx_client"),
    "gpu-tensorpipe": ("gpu_ps", "rpc_serve", "rpc_client"),
    "sparse-tensorx": ("sparse_train", "tensorx_serve", "tensorx_client"),
    "sparse-rpc": ("sparse_train", "rpc_serve", "rpc_client"),
    "sparse-local": ("sparse_train", "local_serve", "local_client"),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("system", choices=sorted(ENTRIES))
    p.add_argument("role", choices=("server", "client"))
    p.add_argument("--model", default="resnet50",
                   choices=[*sorted(common.MODELS), "wide-mlp", "dlrm", "dlrm-x10"])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="the server's port (client)")
    p.add_argument("--address", default="", help="the server's tensorx address (client)")
    p.add_argument("--transport", default="tcp", help="tensorx: tcp | ucx | ucx-shm | auto")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--variant", default="",
                   help="experiments: raw: pipelined; tensorx: one-part, per-tensor (flat=False), "
                        "flat-params (flat=True); gpu-tensorx: flat")
    p.add_argument("--rank", type=int, default=0, help="worker rank (training)")
    p.add_argument("--workers", type=int, default=1, help="gpu-*: number of workers")
    p.add_argument("--device", default="cpu", help="gpu-*: cuda:0, or cpu (self-test)")
    p.add_argument("--overlap", choices=("on", "off", "auto"), default="auto",
                   help="tensorx training (auto: the default, measured)")
    p.add_argument("--share-memory", choices=("on", "off"), default="off",
                   help="tensorx: map the PS arenas when on the same host (off: copy path)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format=f"[{args.system} {args.role}] %(levelname)s %(message)s")
    common.setup_process(args.threads)
    module, serve, client = ENTRIES[args.system]
    entry = getattr(importlib.import_module(f"benchmarks.baselines.{module}"),
                    serve if args.role == "server" else client)
    entry(args)


if __name__ == "__main__":
    main()
