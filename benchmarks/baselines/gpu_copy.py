"""The two processes of ``benchmarks/gpu.py``'s transfer part: ``python -m
benchmarks.baselines.gpu_copy owner|client ...``.

* ``owner``: a :class:`tensorx.Node` that exports one ``--size`` region on ``--device``
  (``cuda:0``, or ``cpu`` for the self-test) and prints
  ``READY {"address": ..., "desc": hex}``; it serves until its stdin says ``quit`` or closes
  (the driver gone), then closes its node and exits.
* ``client``: its own region of the same size on the same device, connects, checks once that
  a write and a read move the right bytes, then times ``ep.write`` and ``ep.read`` of the
  whole region and, interleaved with them in the same process, a plain torch copy of the same
  size (``dst.copy_(src)``, device to device). Each timed op is wall clock from a
  synchronized device to a synchronized device. Prints ``RESULT {...}`` (medians after
  ``--warmup``, ``ep.info``) and exits; when tensorx fails, the traceback goes to stderr
  and RESULT carries ``error`` and the torch copy timed alone.

Path choice is the driver's: ``--transport`` here, ``TENSORX_CUDA_IPC`` in the environment.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import statistics
import sys
import time
import traceback
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch

import tensorx as tx
from benchmarks.baselines import common


def _sync(device: str) -> Callable[[], None]:
    if device.startswith("cuda"):
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def _buffer(nbytes: int, device: str, fill: int) -> torch.Tensor:
    return torch.full((nbytes,), fill, dtype=torch.uint8, device=device)


async def owner(args: argparse.Namespace) -> None:
    buf = _buffer(args.size, args.device, 0)
    async with tx.Node(listen=f"tcp://{args.host}:0", transport=args.transport,
                       timeout=args.timeout) as node:
        region = tx.MemoryRegion.register(buf)
        desc = node.export(region, access="rw")
        common.announce({"address": node.address, "desc": desc.to_bytes().hex(),
                         "device": region.device})
        line = await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
        common.log(f"owner: {line.strip() or 'stdin closed'}, closing")
        region.close()


async def client(args: argparse.Namespace) -> dict[str, Any]:
    """The timings; a tensorx failure still returns the torch copy's (and ``error``)."""
    sync = _sync(args.device)
    src = _buffer(args.size, args.device, 7)
    dst = _buffer(args.size, args.device, 0)

    def copy() -> float:
        sync()
        t = time.perf_counter()
        dst.copy_(src)
        sync()
        return time.perf_counter() - t

    times: dict[str, list[float]] = {"copy": [], "write": [], "read": []}  # and more
    out: dict[str, Any] = {"info": {}, "verified": False}
    try:
        await _transfers(args, src, dst, copy, times, out)
    except Exception as exc:
        common.log(traceback.format_exc())
        out["error"] = f"{type(exc).__name__}: {exc}"
        if not times["copy"]:  # the copy alone, so the row still has its baseline
            times["copy"] = [copy() for _ in range(args.warmup + args.reps)][args.warmup:]
    return {**out, "reps": len(times["write"]),
            **{k: statistics.median(v) if v else None for k, v in times.items()}}


async def _transfers(args: argparse.Namespace, src: torch.Tensor, dst: torch.Tensor,
                     copy: Callable[[], float], times: dict[str, list[float]],
                     out: dict[str, Any]) -> None:
    sync = _sync(args.device)
    desc = tx.RegionDescriptor.from_bytes(bytes.fromhex(args.desc))
    async with tx.Node(listen=None, transport=args.transport, timeout=args.timeout) as node:
        local, back = tx.MemoryRegion.register(src), tx.MemoryRegion.register(dst)
        ep = await node.connect(args.address)
        out["info"] = info = dict(ep.info)
        common.log(f"client: endpoint {json.dumps(info, default=str)}")
        await ep.write(local, desc)
        await ep.read(back, desc)
        sync()
        out["verified"] = bool(torch.equal(src, dst))
        if not out["verified"]:
            raise RuntimeError("the bytes read back differ from the bytes written")

        async def timed(op: Callable[[], Awaitable[None]]) -> float:
            sync()
            t = time.perf_counter()
            await op()
            sync()
            return time.perf_counter() - t

        small = min(SMALL, args.size)
        raw = _raw_ipc(desc, args.device)  # the floor of the IPC lane: its copy alone

        def copy_small() -> float:
            sync()
            t = time.perf_counter()
            dst[:small].copy_(src[:small])
            sync()
            return time.perf_counter() - t

        deadline = time.monotonic() + args.max_s
        for i in range(args.warmup + args.reps):
            sample = {"copy": copy(),
                      "write": await timed(lambda: ep.write(local, desc)),
                      "read": await timed(lambda: ep.read(back, desc)),
                      "copy_small": copy_small(),
                      "write_small": await timed(lambda: ep.write(local, desc, nbytes=small)),
                      "read_small": await timed(lambda: ep.read(back, desc, nbytes=small))}
            if raw is not None:
                sample.update(raw(src, dst, sync))
            if i >= args.warmup:
                for k, v in sample.items():
                    times.setdefault(k, []).append(v)
            if time.monotonic() > deadline and i >= args.warmup:
                common.log(f"client: time limit {args.max_s} s reached after {i + 1} reps")
                break
        out["small"] = small
        local.close()
        back.close()


SMALL = 4096  # bytes of the small ops, whose time is the path's fixed cost per op


def _raw_ipc(desc: tx.RegionDescriptor, device: str
             ) -> Callable[[torch.Tensor, torch.Tensor, Callable[[], None]],
                           dict[str, float]] | None:
    """Where the owner's region has a CUDA IPC handle: time the copies the IPC lane makes,
    with no tensorx around them (the owner's allocation opened here once, a torch copy to
    it and one from it, each from a synchronized device to a synchronized device)."""
    if not device.startswith("cuda"):
        return None
    from tensorx import _cuda

    keys = _cuda.IpcKeys.from_wire(desc.keys.get("cuda_ipc"))
    if keys is None:
        return None
    index = _cuda.local_device_for(keys.uuid)
    if index is None:
        return None
    mapping = _cuda.IpcMapping(keys, index)
    remote = mapping.tensor[keys.offset:keys.offset + desc.nbytes]

    def run(src: torch.Tensor, dst: torch.Tensor, sync: Callable[[], None]
            ) -> dict[str, float]:
        times = {}
        for name, (a, b) in (("raw_write", (remote, src)), ("raw_read", (dst, remote))):
            sync()
            t = time.perf_counter()
            a.copy_(b)
            sync()
            times[name] = time.perf_counter() - t
        return times

    return run


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("role", choices=("owner", "client"))
    p.add_argument("--size", type=int, required=True, help="bytes")
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--transport", default="auto")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--address", default="", help="the owner's (client)")
    p.add_argument("--desc", default="", help="the owner's descriptor, hex (client)")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--max-s", type=float, default=60.0, help="stop timing after this long")
    p.add_argument("--timeout", type=float, default=60.0, help="the nodes' timeout")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"[gpu {args.role}] %(levelname)s %(name)s %(message)s")
    common.setup_process(1)
    if args.role == "owner":
        asyncio.run(owner(args))
        return
    print("RESULT " + json.dumps(asyncio.run(client(args)), default=str), flush=True)


if __name__ == "__main__":
    main()
