"""``tensorx info``: what this machine offers tensorx (UCX, its lanes, RDMA and GPU paths).

Works, and says so, without UCX: every probe reports what it found or why it could not.
Nothing here initialises UCX in this process; transports and devices come from the
``ucx_info`` tool of the ``libucx`` package.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any

import tensorx
from tensorx import _eventloop
from tensorx._commands.gpu_info import GPU_TLS, collect_gpu, format_gpu
from tensorx.errors import TensorxError
from tensorx.node import Node

__all__ = ["add_parser", "collect_info", "format_info", "format_node", "query_node", "run"]

RDMA_TLS = ("rc_verbs", "rc_mlx5", "dc_mlx5", "ud_verbs", "ud_mlx5", "srd", "gga")
SHM_TLS = ("posix", "sysv", "cma", "knem", "xpmem")


def add_parser(subparsers: Any) -> None:
    """Register the ``info`` command on an ``argparse`` subparsers object."""
    parser = subparsers.add_parser(
        "info", help="show UCX, its transports and devices, RDMA and GPU paths",
        description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")
    parser.add_argument("--node", metavar="ADDRESS",
                        help="instead, ask the running node at ADDRESS what it exports and "
                             "who is connected (authenticates with --token / TENSORX_TOKEN)")
    parser.add_argument("--token", default=None, help="shared token (default $TENSORX_TOKEN)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.node:
        return _run_node_query(args)
    info = collect_info()
    print(json.dumps(info, indent=2) if args.json else format_info(info))
    return 0


def _run_node_query(args: argparse.Namespace) -> int:
    try:
        answer = _eventloop.run(query_node(args.node, args.token))
    except TensorxError as exc:
        print(f"tensorx info: {args.node}: {exc}")
        return 1
    print(json.dumps(answer, indent=2) if args.json else format_node(answer))
    return 0


async def query_node(address: str, token: str | None, timeout: float = 10.0) -> dict[str, Any]:
    """What the node at ``address`` exports and who is connected to it (over TCP control)."""
    async with Node(listen=None, transport="tcp", token=token, timeout=timeout) as node:
        ep = await node.connect(address)
        exports = await ep.query("exports")
        endpoints = await ep.query("endpoints")
        await ep.aclose()
    return {"node": exports["node"], "exports": exports["exports"],
            "endpoints": [e for e in endpoints["endpoints"] if e.get("peer") != node.id]}


def format_node(answer: dict[str, Any]) -> str:
    lines = [f"node {answer['node']}", f"exports ({len(answer['exports'])}):"]
    lines += [f"  {e['region']}  {e['nbytes']:>14,} B  {e['device']:<4}  {e['access']:<2}  "
              f"via {', '.join(e['transports'])}" for e in answer["exports"]]
    lines.append(f"endpoints ({len(answer['endpoints'])}, not counting this query):")
    lines += [f"  peer {e['peer']}  {e['transport']} over {', '.join(e['lanes'])}  "
              f"{e['address']}" for e in answer["endpoints"]]
    return "\n".join(lines)


def collect_info() -> dict[str, Any]:
    """Everything ``tensorx info`` prints, as plain data (JSON-serialisable)."""
    ucx = _ucx_info()
    return {
        "tensorx": tensorx.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "ucx": ucx,
        "gpu": collect_gpu(ucx),
    }


def _ucx_info() -> dict[str, Any]:
    out: dict[str, Any] = {"available": False, "version": None, "ucxx": _dist_version("ucxx"),
                           "transports": [], "devices": {}, "rdma": False, "gpu": False,
                           "shared_memory": False, "binding": None, "why": ""}
    try:
        import libucx  # noqa: PLC0415 (optional dependency, probed)
    except ImportError:
        out["why"] = "UCX is not installed (pip install 'tensorx-rdma[ucx]'); tensorx uses TCP"
        return out
    root = Path(libucx.__file__).parent
    out["version"] = str(getattr(libucx, "__version__", "unknown"))
    text, err = _ucx_info_output(root, "-d")
    if text is None:
        out["why"] = f"ucx_info failed: {err}"
        return out
    devices = _parse_devices(text)
    out["devices"] = devices
    out["transports"] = sorted(devices)
    build, _ = _ucx_info_output(root, "-v")
    out["build"] = _configure_flags(build or "")
    out["rdma"] = any(t in devices for t in RDMA_TLS)
    out["gpu"] = any(t in devices for t in GPU_TLS)
    out["shared_memory"] = any(t in devices for t in SHM_TLS)
    out["binding"] = _binding_state()
    out["available"] = out["ucxx"] is not None and out["binding"]["ok"]
    out["why"] = _why(out)
    return out


def _dist_version(name: str) -> str | None:
    for dist in (name, f"{name}-cu12", f"{name}-cu13", f"{name}-cu11"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def _ucx_info_output(root: Path, flag: str) -> tuple[str | None, str]:
    binary = root / "bin" / "ucx_info"
    if not binary.is_file():
        return None, f"no ucx_info in {binary.parent}"
    env = dict(os.environ, UCX_WARN_UNUSED_ENV_VARS="n",
               LD_LIBRARY_PATH=f"{root / 'lib'}:{os.environ.get('LD_LIBRARY_PATH', '')}")
    try:
        res = subprocess.run([str(binary), flag], env=env, capture_output=True, text=True,
                             timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, str(exc)
    if res.returncode != 0:
        return None, (res.stderr or res.stdout).strip()[-300:]
    return res.stdout, ""


def _parse_devices(text: str) -> dict[str, list[str]]:
    """``{transport: [device, ...]}`` from ``ucx_info -d``."""
    devices: dict[str, list[str]] = {}
    transport = None
    for line in text.splitlines():
        m = re.match(r"#\s+Transport:\s+(\S+)", line)
        if m:
            transport = m.group(1)
            continue
        m = re.match(r"#\s+Device:\s+(\S+)", line)
        if m and transport is not None:
            devices.setdefault(transport, [])
            if m.group(1) not in devices[transport]:
                devices[transport].append(m.group(1))
    return devices


def _configure_flags(text: str) -> list[str]:
    m = re.search(r"Configured with: (.*)", text)
    wanted = ("verbs", "rdmacm", "cuda", "cma", "knem", "xpmem", "mt")
    flags = m.group(1).split() if m else []
    return [f for f in flags if any(w in f for w in wanted) and not f.startswith("--prefix")]


def _binding_state() -> dict[str, Any]:
    """Is the cffi RMA binding built, or can it be built here?"""
    state: dict[str, Any] = {"ok": False, "cached": None, "compiler": shutil.which("cc")}
    try:
        import cffi  # noqa: F401, PLC0415 (optional dependency, probed)

        from tensorx.transport import _ucp  # noqa: PLC0415 (inside the probe's try: a failing import is the answer)

        version, _, lib = _ucp.ucx_paths()
        cache = _ucp.cache_dir(version, lib)
        state["cached"] = str(cache) if any(cache.glob("_tensorx_ucp*.so")) else None
    except Exception as exc:
        state["error"] = f"{type(exc).__name__}: {exc}"
        return state
    state["ok"] = state["cached"] is not None or state["compiler"] is not None
    if not state["ok"]:
        state["error"] = "no C compiler to build the RMA binding (install gcc)"
    return state


def _why(info: dict[str, Any]) -> str:
    if info["ucxx"] is None:
        return "libucx is installed but ucxx is not: tensorx uses TCP"
    if not info["binding"]["ok"]:
        return f"UCX RMA binding unavailable: {info['binding'].get('error')}; tensorx uses TCP"
    paths = []
    if info["rdma"]:
        paths.append("RDMA")
    if info["shared_memory"]:
        paths.append("same-host shared memory (with error_handling=False)")
    if "tcp" in info["devices"]:
        paths.append("tcp (only with allow_tcp / TENSORX_UCX_TCP=1: no bounds checks, trusted "
                     "networks only; by default tensorx TCP)")
    if info["gpu"]:
        paths.append("GPU memory")
    return "UCX usable: " + ", ".join(paths)


def format_info(info: dict[str, Any]) -> str:
    """The text ``tensorx info`` prints."""
    lines = [f"tensorx {info['tensorx']}  (Python {info['python']}, {info['platform']})"]
    lines += _format_ucx(info["ucx"])
    return "\n".join(lines + format_gpu(info["gpu"]))


def _format_ucx(ucx: dict[str, Any]) -> list[str]:
    if ucx["version"] is None:
        return [f"UCX: not available - {ucx['why']}"]
    lines = [f"UCX {ucx['version']} (ucxx {ucx['ucxx'] or 'not installed'}): "
             f"{'available' if ucx['available'] else 'NOT available'}"]
    for transport, devs in sorted(ucx["devices"].items()):
        lines.append(f"  {transport:10s} {', '.join(devs)}")
    build = " ".join(ucx.get("build", []))
    rdma_note = "" if ucx["rdma"] else (
        " (this libucx was built --without-verbs)" if "--without-verbs" in build
        else " (no RDMA device found)")
    lines.append(f"RDMA:  {'yes' if ucx['rdma'] else 'no'}{rdma_note}")
    gpu_note = "" if ucx["gpu"] else (
        " (libucx has CUDA support, but no GPU or driver was found)" if "--with-cuda" in build
        else "")
    lines.append(f"GPU:   {'yes' if ucx['gpu'] else 'no'}{gpu_note}")
    binding = ucx["binding"] or {}
    lines.append("RMA binding: " + (f"built ({binding['cached']})" if binding.get("cached")
                 else "builds on first use" if binding.get("ok")
                 else f"unavailable ({binding.get('error')})"))
    lines.append(ucx["why"])
    return lines
