"""Where a shard keeps its memory and runs its update: ``device="cpu"`` or a CUDA device.

With ``device="cuda:N"`` every per-shard tensor lives on that GPU: the parameter arena, the
gradient slots, the gradient accumulator, the optimizer's state, the sparse rows received
and the sums behind the non-finite check and ``clip_grad_norm``. The update runs there, and
workers write gradients straight into the GPU slots and read parameters straight out of the
GPU arena (over a lane that reaches GPU memory: UCX with cuda_copy/cuda_ipc/RDMA, or TCP
staged through host). Only what is unavoidable and off the hot path comes back to host: a
checkpoint (saved as CPU tensors, so a checkpoint moves between CPU and GPU servers), the
``verify`` checksum, an optimizer state lent to :class:`tensorx.RemoteOptimizer`, and the
few scalars the non-finite check and the global norm need.

Same-host mapping (``share_memory``) maps host memory in /dev/shm, so a GPU shard never
offers it (:class:`tensorx._ps.service.samehost.Sharing` says so once).
"""

from __future__ import annotations

import logging
import re
from typing import Any

from tensorx.errors import RegionError, UsageError
from tensorx.memregion import MemoryRegion

__all__ = ["allocate_arenas", "fence", "is_cuda", "resolve"]

logger = logging.getLogger("tensorx._ps.state.shard")  # its warning read as the shard's

_FORM = re.compile(r"(cpu|cuda)(?::(\d+))?")


def resolve(device: Any) -> str:
    """``"cpu"`` or ``"cuda:N"`` for a ``device`` argument (``"cuda"`` is the current CUDA
    device); UsageError naming what is wrong with anything else."""
    text = str(device) if _is_torch_device(device) else device
    match = _FORM.fullmatch(text) if isinstance(text, str) else None
    if match is None or (match[1] == "cpu" and match[2] is not None):
        raise UsageError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    if match[1] == "cpu":
        return "cpu"
    try:
        import torch  # noqa: PLC0415 (optional dependency)
    except ImportError as exc:  # pragma: no cover - the server itself needs torch
        raise UsageError(f"device={device!r} needs torch with CUDA") from exc
    if not torch.cuda.is_available():
        raise UsageError(f"device={device!r}: CUDA is not available here (torch "
                         f"{torch.__version__}, built for CUDA {torch.version.cuda}); "
                         "run the server with device='cpu'")
    count = torch.cuda.device_count()
    index = torch.cuda.current_device() if match[2] is None else int(match[2])
    if index >= count:
        raise UsageError(f"device={device!r}: this host has {count} CUDA device(s), "
                         f"cuda:0..cuda:{count - 1}")
    return f"cuda:{index}"


def is_cuda(device: str) -> bool:
    return device.startswith("cuda")


def fence(device: str) -> None:
    """Wait until the kernels this thread queued on ``device`` so far have finished.

    Called after an update (or a load) and before any byte of the arena leaves the GPU or
    a worker is told a new version exists: a remote read or a copy engine does not wait for
    our stream. An event recorded on the current stream and waited on costs a few
    microseconds and waits for that stream alone, never for the whole device (no
    ``torch.cuda.synchronize()``: other streams of the process, e.g. a training loop
    sharing the GPU, keep running). No-op on the CPU."""
    if not is_cuda(device):
        return
    import torch  # noqa: PLC0415 (optional dependency)

    event = torch.cuda.Event()  # type: ignore[no-untyped-call]
    event.record(torch.cuda.current_stream(torch.device(device)))
    event.synchronize()


def _is_torch_device(obj: Any) -> bool:
    return type(obj).__name__ == "device" and type(obj).__module__ == "torch"


def allocate_arenas(nbytes: int, count: int, shared: bool,
                    where: str = "cpu") -> list[MemoryRegion]:
    """``count`` regions, all in /dev/shm when ``shared`` and it has room, else all private;
    on the GPU ``where`` names, if it names one (never shared)."""
    regions: list[MemoryRegion] = []
    if is_cuda(where):
        regions = [MemoryRegion.allocate(nbytes, device=where) for _ in range(count)]
        fence(where)  # zeroed before they are exported: no late memset over a write
        return regions
    if shared:
        try:
            for _ in range(count):
                regions.append(MemoryRegion.allocate(nbytes, shared=True))
            return regions
        except RegionError as exc:
            for region in regions:
                region.close()
            logger.warning("shard arenas in private memory (workers cannot map them): %s", exc)
    return [MemoryRegion.allocate(nbytes) for _ in range(count)]
