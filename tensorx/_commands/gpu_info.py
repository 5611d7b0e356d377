"""The GPU half of ``tensorx info``: which GPU paths this machine has, each with its reason.

Probes never raise: a missing torch, a torch built without CUDA, no visible device or a
failing driver each become the reason a path is unavailable. UCX's CUDA transports come
from the ``ucx_info`` output that :mod:`tensorx._commands.info` already parsed.
"""

from __future__ import annotations

import inspect
import os
from typing import Any

from tensorx.transport import cuda_ipc

__all__ = ["CUDA_IPC_ENV", "GPU_TLS", "PATHS", "collect_gpu", "format_gpu", "probe_torch"]

# UCX's transports for CUDA memory, as ``ucx_info -d`` names them: copies between host and
# GPU memory, mappings between GPUs on one host (NVLink/PCIe), GDRCopy's CPU-mapped BAR
GPU_TLS = ("cuda_copy", "cuda_ipc", "gdr_copy")
CUDA_IPC_ENV = "TENSORX_CUDA_IPC"
UCX_CUDA = "UCX GPU memory (cuda_copy)"
CUDA_IPC = "same-host CUDA IPC lane"
TCP_STAGING = "TCP staging of GPU memory (via pinned host)"
GPU_PS = "GPU parameter server (ParameterServer(device='cuda'))"
PATHS = (UCX_CUDA, CUDA_IPC, TCP_STAGING, GPU_PS)


def probe_torch() -> dict[str, Any]:
    """torch's version, its CUDA build, and the CUDA devices it sees (``error`` if a probe
    failed). Initialises no CUDA context beyond what counting devices takes."""
    out: dict[str, Any] = {"torch": None, "cuda": None, "devices": [], "error": None}
    try:
        import torch  # noqa: PLC0415 (optional dependency, probed)
    except Exception as exc:  # ImportError, or a broken install
        out["error"] = f"torch is not importable ({type(exc).__name__}: {exc})"
        return out
    out["torch"] = str(torch.__version__)
    out["cuda"] = torch.version.cuda
    if out["cuda"] is None:
        return out
    try:
        out["devices"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    except Exception as exc:  # driver too old, broken, or no permission on /dev/nvidia*
        out["error"] = f"CUDA failed: {type(exc).__name__}: {exc}"
    return out


def collect_gpu(ucx: dict[str, Any], torch_probe: dict[str, Any] | None = None
                ) -> dict[str, Any]:
    """The ``gpu`` part of ``tensorx info``: the CUDA transports UCX sees, what torch sees,
    and every GPU path with ``available`` and ``why``."""
    probe = probe_torch() if torch_probe is None else torch_probe
    seen = [t for t in GPU_TLS if t in ucx.get("devices", {})]
    cuda_why = _cuda_why(probe)
    paths = {
        UCX_CUDA: _ucx_cuda(ucx, seen),
        CUDA_IPC: _needs_cuda(cuda_why, probe) if cuda_ipc.enabled(None)
        else (False, f"switched off ({CUDA_IPC_ENV}={os.environ.get(CUDA_IPC_ENV)})"),
        TCP_STAGING: _needs_cuda(cuda_why, probe),
        GPU_PS: _gpu_ps(cuda_why, probe),
    }
    return {"torch": probe["torch"], "torch_cuda": probe["cuda"], "devices": probe["devices"],
            "ucx_cuda_transports": seen,
            "paths": [{"name": name, "available": ok, "why": why}
                      for name, (ok, why) in paths.items()]}


def _cuda_why(probe: dict[str, Any]) -> str | None:
    """Why torch cannot reach a GPU here; None when it can."""
    if probe["torch"] is None:
        return str(probe["error"] or "torch is not installed")
    if probe["cuda"] is None:
        return f"torch {probe['torch']} is built without CUDA"
    if probe["error"]:
        return str(probe["error"])
    if not probe["devices"]:
        return (f"no CUDA device visible to torch {probe['torch']} (no GPU or driver, or "
                "CUDA_VISIBLE_DEVICES hides them)")
    return None


def _devices_text(probe: dict[str, Any]) -> str:
    names = sorted(set(probe["devices"]))
    return (f"torch {probe['torch']} (CUDA {probe['cuda']}) sees {len(probe['devices'])} "
            f"device(s): {', '.join(names)}")


def _needs_cuda(cuda_why: str | None, probe: dict[str, Any]) -> tuple[bool, str]:
    return (False, cuda_why) if cuda_why else (True, _devices_text(probe))


def _ucx_cuda(ucx: dict[str, Any], seen: list[str]) -> tuple[bool, str]:
    if not ucx.get("available"):
        return False, f"UCX is not usable: {ucx.get('why') or 'not installed'}"
    if "cuda_copy" not in seen:
        build = " ".join(ucx.get("build", []))
        if "--with-cuda" in build:
            return False, "libucx has CUDA support but found no GPU or driver"
        return False, ("this libucx has no CUDA transports (install the ucx-cu12 or "
                       "ucx-cu13 extra that matches the driver)")
    missing = [t for t in ("cuda_ipc", "gdr_copy") if t not in seen]
    note = f"; not found: {', '.join(missing)}" if missing else ""
    return True, f"UCX transports {', '.join(seen)}{note}"


def _gpu_ps(cuda_why: str | None, probe: dict[str, Any]) -> tuple[bool, str]:
    if cuda_why:
        return False, cuda_why
    try:
        from tensorx.ps import ParameterServer  # noqa: PLC0415 (imports torch: only when probed)

        takes_device = "device" in inspect.signature(ParameterServer).parameters
    except Exception as exc:
        return False, f"tensorx.ps is not importable ({type(exc).__name__}: {exc})"
    if not takes_device:
        return False, "this tensorx's ParameterServer has no device= option"
    return True, _devices_text(probe)


def format_gpu(gpu: dict[str, Any]) -> list[str]:
    """The GPU lines of ``tensorx info``."""
    torch = "torch not installed" if not gpu["torch"] else (
        f"torch {gpu['torch']}, " + (f"CUDA {gpu['torch_cuda']}" if gpu["torch_cuda"]
                                     else "without CUDA"))
    seen = ", ".join(gpu["ucx_cuda_transports"]) or "none"
    lines = [f"GPU paths ({torch}; {len(gpu['devices'])} CUDA device(s); "
             f"UCX CUDA transports: {seen}):"]
    width = max(len(p["name"]) for p in gpu["paths"])
    lines += [f"  {p['name']:<{width}}  {'yes' if p['available'] else 'no ':3}  {p['why']}"
              for p in gpu["paths"]]
    return lines
