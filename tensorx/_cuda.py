"""CUDA below the transports: stream ordering, contexts and IPC handles.

Three jobs, none of which imports torch or loads the driver at import time:

* **Stream ordering.** A GPU region may only leave once the kernels that wrote it have
  finished. :func:`ready` records a CUDA event on the stream that produces the region (the
  ``stream`` of its ``__cuda_array_interface__`` where one was given, and the caller's current
  torch stream) and :func:`wait` awaits it without blocking the event loop and without a
  device-wide synchronize.
* **Contexts.** Threads that drive UCX (tensorx's progress driver, ucxx's thread) need the
  device's primary context current; :func:`primary_context` hands out its handle and
  :func:`make_current` installs it on the calling thread.
* **IPC.** :func:`ipc_export` and :func:`IpcMapping` wrap ``cuIpcGetMemHandle`` /
  ``cuIpcOpenMemHandle``, for the same-host CUDA IPC lane.

The driver API is reached through ``ctypes`` (``libcuda.so.1`` is there wherever a GPU driver
is), so nothing here needs cupy or a CUDA toolkit.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from tensorx.errors import TransportUnavailableError

__all__ = ["DriverEvent", "IpcMapping", "available", "copy_async", "device_tensor",
           "ipc_export", "load_torch", "make_current", "primary_context", "ready", "record",
           "spin", "wait", "wait_sync"]

_lock = threading.Lock()
_driver: Any = None
_primary: dict[int, int] = {}
CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 1


class CudaError(TransportUnavailableError):
    """A CUDA driver call failed (the GPU path it was for is not usable)."""


class _Handle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_ubyte * 64)]


def torch_cuda() -> Any:
    """torch, if it is already imported and has a usable CUDA device; else None. Never
    imports torch: a process with a CUDA model has imported it long before."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    try:
        return torch if torch.cuda.is_available() else None
    except Exception:  # a broken CUDA install reads as no CUDA
        return None


def load_torch() -> Any:
    try:
        import torch  # noqa: PLC0415 (optional dependency)
    except ImportError as exc:  # pragma: no cover - GPU regions come with torch or cupy
        raise TransportUnavailableError("GPU regions need torch for stream ordering "
                                        "(pip install 'tensorx-rdma[torch]')") from exc
    return torch


def available() -> bool:
    return torch_cuda() is not None


_usable: Any = None  # torch, once it was seen to have a usable CUDA device


def _torch_with_cuda(region: Any) -> Any:
    """torch, which can use CUDA (asked once: torch.cuda.is_available() costs hundreds of
    microseconds on some hosts); TransportUnavailableError naming ``region`` if not."""
    global _usable
    if _usable is None:
        torch = load_torch()
        if not torch.cuda.is_available():
            raise TransportUnavailableError(
                f"region {region.region_id:#x} is GPU memory ({region.device}) but CUDA is "
                "not usable in this process")
        _usable = torch
    return _usable


def _lib() -> Any:
    global _driver
    with _lock:
        if _driver is None:
            try:
                cu = ctypes.CDLL("libcuda.so.1")
            except OSError as exc:
                raise CudaError(f"no CUDA driver here ({exc})") from exc
            u64, p64 = ctypes.c_uint64, ctypes.POINTER(ctypes.c_uint64)
            cu.cuGetErrorString.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
            cu.cuInit.argtypes = [ctypes.c_uint]
            cu.cuDeviceGet.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int]
            cu.cuDevicePrimaryCtxRetain.argtypes = [ctypes.POINTER(ctypes.c_void_p),
                                                    ctypes.c_int]
            cu.cuCtxSetCurrent.argtypes = [ctypes.c_void_p]
            cu.cuCtxGetCurrent.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
            cu.cuCtxPushCurrent_v2.argtypes = [ctypes.c_void_p]
            cu.cuCtxPopCurrent_v2.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
            cu.cuMemGetAddressRange_v2.argtypes = [p64, ctypes.POINTER(ctypes.c_size_t), u64]
            cu.cuIpcGetMemHandle.argtypes = [ctypes.POINTER(_Handle), u64]
            cu.cuIpcOpenMemHandle_v2.argtypes = [p64, _Handle, ctypes.c_uint]
            cu.cuIpcCloseMemHandle.argtypes = [u64]
            vp = ctypes.c_void_p
            cu.cuMemcpyAsync.argtypes = [u64, u64, ctypes.c_size_t, vp]
            cu.cuEventCreate.argtypes = [ctypes.POINTER(vp), ctypes.c_uint]
            cu.cuEventRecord.argtypes = [vp, vp]
            cu.cuEventQuery.argtypes = [vp]
            cu.cuEventSynchronize.argtypes = [vp]
            cu.cuEventDestroy_v2.argtypes = [vp]
            _driver = cu
        return _driver


def _check(rc: int, what: str) -> None:
    if rc != 0:
        text = ctypes.c_char_p()
        _lib().cuGetErrorString(rc, ctypes.byref(text))
        name = text.value.decode(errors="replace") if text.value else "unknown error"
        raise CudaError(f"{what} failed: CUDA error {rc} ({name})")


def primary_context(device: int) -> int:
    """The handle of ``device``'s primary context (the one torch and cupy use), retained for
    the life of the process."""
    with _lock:
        if device in _primary:
            return _primary[device]
    cu = _lib()
    _check(cu.cuInit(0), "cuInit")
    dev, ctx = ctypes.c_int(), ctypes.c_void_p()
    _check(cu.cuDeviceGet(ctypes.byref(dev), device), f"cuDeviceGet({device})")
    _check(cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
    with _lock:
        _primary.setdefault(device, int(ctx.value or 0))
        return _primary[device]


def make_current(device: int) -> None:
    """Make ``device``'s primary context current on the calling thread."""
    _check(_lib().cuCtxSetCurrent(primary_context(device)), "cuCtxSetCurrent")


@contextlib.contextmanager
def current(context: int) -> Iterator[None]:
    """``context`` current on the calling thread inside the block, and the thread's own
    one again after it (the caller's current device, which torch reads from it, stays)."""
    cu = _lib()
    _check(cu.cuCtxPushCurrent_v2(context), "cuCtxPushCurrent")
    try:
        yield
    finally:
        cu.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))


def device_index(device: str) -> int:
    """``"cuda:3"`` -> 3; ``"cuda"`` -> 0."""
    _, _, index = device.partition(":")
    return int(index or 0)


# -- stream ordering ---------------------------------------------------------------------
def ready(regions: Any) -> list[Any]:
    """Events recorded now on the streams producing each CUDA region among ``regions``: once
    they complete, every kernel enqueued before this call that writes (or reads) the regions
    has finished. Empty when no region is on a GPU. (Driver events on the streams' raw
    handles: a few microseconds per op where torch's Event and current_stream cost tens.)"""
    events: list[Any] = []
    seen: set[tuple[int, int]] = set()
    for region in regions:
        if not region.is_cuda:
            continue
        torch = _torch_with_cuda(region)
        index = device_index(region.device)
        streams = [current_stream(torch, index)]
        external = getattr(region, "stream", None)
        if external is not None:  # __cuda_array_interface__'s stream, honoured too
            streams.append(int(external))  # (1 and 2 name the legacy and per-thread default)
        with current(primary_context(index)):
            for stream in streams:
                key = (index, stream)
                if key in seen:
                    continue
                seen.add(key)
                event = DriverEvent()
                event.record(stream)
                events.append(event)
    return events


def current_stream(torch: Any, index: int) -> int:
    """The raw handle of the calling thread's current torch stream on device ``index``."""
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # noqa: SLF001 (torch has no public raw-stream getter)
    if raw is not None:
        return int(raw(index))
    return int(torch.cuda.current_stream(index).cuda_stream)  # pragma: no cover


CUDA_ERROR_NOT_READY = 600
CUDA_ERROR_INVALID_CONTEXT = 201


class DriverEvent:
    """A CUDA event made and used through the driver API (no timing): ``record(stream)``,
    ``query()``, ``synchronize()`` (which lets go of the GIL while it waits), as much of
    ``torch.cuda.Event`` as :func:`wait` needs. Made in the context current on the calling
    thread; destroyed with the object (the driver keeps one still pending until it
    completes)."""

    __slots__ = ("_ctx", "_handle")

    def __init__(self) -> None:
        cu = _lib()
        ctx, handle = ctypes.c_void_p(), ctypes.c_void_p()
        _check(cu.cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
        _check(cu.cuEventCreate(ctypes.byref(handle), 0x2), "cuEventCreate")
        self._ctx = ctx  # made current wherever the event is waited for or destroyed
        self._handle = handle

    def record(self, stream: int) -> None:
        _check(_lib().cuEventRecord(self._handle, stream), "cuEventRecord")

    def query(self) -> bool:
        rc = _driver.cuEventQuery(self._handle)
        if rc == CUDA_ERROR_INVALID_CONTEXT:  # a thread with no context current
            with current(self._ctx.value or 0):
                rc = _driver.cuEventQuery(self._handle)
        if rc == 0:
            return True
        if rc == CUDA_ERROR_NOT_READY:
            return False
        _check(rc, "cuEventQuery")
        return False  # pragma: no cover

    def synchronize(self) -> None:
        with current(self._ctx.value or 0):  # e.g. in a worker thread, which has none
            _check(_lib().cuEventSynchronize(self._handle), "cuEventSynchronize")

    def __del__(self) -> None:
        try:
            if _driver is not None:
                with current(self._ctx.value or 0):
                    _driver.cuEventDestroy_v2(self._handle)
        except Exception:  # pragma: no cover - at interpreter exit
            pass


def copy_async(dst: int, src: int, nbytes: int, stream: int) -> None:
    """Enqueue a copy of ``nbytes`` from device pointer ``src`` to ``dst`` on ``stream``
    (unified addressing: any two devices, a peer's mapped memory included)."""
    _check(_lib().cuMemcpyAsync(dst, src, nbytes, stream), "cuMemcpyAsync")


def record(device: Any) -> list[Any]:
    """An event recorded now on the calling thread's current stream of ``device`` (autograd
    runs backward kernels on the forward's streams; a hook records on the right one)."""
    torch = sys.modules["torch"]
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return [event]


SPIN_S = 2e-4  # how long wait() yields to the loop, polling, before it blocks in a thread


async def wait(events: list[Any]) -> None:
    """Await ``events`` without blocking the loop. Most are complete by the time they are
    asked (the kernels ran while the caller did other work); one that is not is polled
    while yielding to the loop for up to :data:`SPIN_S`, then waited for in a thread
    (``event.synchronize()``), which returns the moment it completes. (A sleep between
    polls would not do: the loop's selector sleeps at least 1 ms, far longer than a device
    copy of many MiB: measured on an H200, a 256 MiB copy of 0.15 ms was seen after about
    1.2 ms with a sleeping back-off.) If cancelled, wait for them synchronously before
    letting the cancellation through, so nothing the caller freed afterwards is still being
    written."""
    try:
        for event in events:
            if not await spin(event):
                await asyncio.to_thread(event.synchronize)
    except BaseException:
        wait_sync(events)
        raise


async def spin(event: Any) -> bool:
    """Whether ``event`` completed while it was polled once a loop turn for up to
    :data:`SPIN_S` (no selector sleep between polls; see :func:`wait`)."""
    if event.query():
        return True
    end = time.perf_counter() + SPIN_S
    while time.perf_counter() < end:
        await asyncio.sleep(0)
        if event.query():
            return True
    return False


def wait_sync(events: list[Any]) -> None:
    for event in events:
        event.synchronize()


# -- IPC ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class IpcKeys:
    """What a same-host peer needs to map a region: the allocation's IPC handle, where the
    region starts in that allocation, the device's UUID and the owner's pid."""

    handle: bytes
    offset: int
    size: int  # of the whole allocation
    uuid: str
    pid: int
    address: int  # the region's device pointer in the owner's process

    def to_wire(self) -> dict[str, Any]:
        return {"handle": self.handle, "offset": self.offset, "size": self.size,
                "uuid": self.uuid, "pid": self.pid, "address": self.address}

    @classmethod
    def from_wire(cls, keys: Any) -> IpcKeys | None:
        try:
            k = cls(bytes(keys["handle"]), int(keys["offset"]), int(keys["size"]),
                    str(keys["uuid"]), int(keys["pid"]), int(keys["address"]))
        except (KeyError, TypeError, ValueError):
            return None
        ok = len(k.handle) == 64 and 0 <= k.offset < k.size and k.address >= 0
        return k if ok else None


def device_uuid(index: int) -> str:
    torch = sys.modules["torch"]
    return str(torch.cuda.get_device_properties(index).uuid)


def ipc_export(address: int, nbytes: int, device: str) -> IpcKeys:
    """IPC keys for ``nbytes`` of device memory at ``address`` (any pointer inside an
    allocation: the handle names the whole allocation, the offset says where we are)."""
    cu = _lib()
    index = device_index(device)
    make_current(index)
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    _check(cu.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), address),
           "cuMemGetAddressRange")
    handle = _Handle()
    _check(cu.cuIpcGetMemHandle(ctypes.byref(handle), base.value), "cuIpcGetMemHandle")
    offset = address - base.value
    if offset + nbytes > size.value:
        raise CudaError("region runs past the end of its CUDA allocation")
    return IpcKeys(bytes(bytearray(handle.reserved)), offset, int(size.value),
                   device_uuid(index), os.getpid(), address)


def local_device_for(uuid: str) -> int | None:
    """The index, in this process, of the GPU with ``uuid`` (CUDA_VISIBLE_DEVICES may
    number them differently in each process); None if it is not visible here."""
    torch = sys.modules["torch"]
    for i in range(torch.cuda.device_count()):
        if device_uuid(i) == uuid:
            return i
    return None


class IpcMapping:
    """A peer's allocation opened in this process: a torch uint8 tensor over all of it."""

    def __init__(self, keys: IpcKeys, device: int) -> None:
        cu = _lib()
        make_current(device)
        handle = _Handle()
        ctypes.memmove(ctypes.byref(handle), keys.handle, 64)
        ptr = ctypes.c_uint64()
        _check(cu.cuIpcOpenMemHandle_v2(ctypes.byref(ptr), handle,
                                        CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS),
               "cuIpcOpenMemHandle")
        self.base = int(ptr.value)
        self.size = keys.size
        self.device = device
        self.tensor = device_tensor(self.base, keys.size, device)

    def close(self) -> None:
        if self.base:
            base, self.base = self.base, 0
            self.tensor = None
            make_current(self.device)
            _check(_lib().cuIpcCloseMemHandle(base), "cuIpcCloseMemHandle")


class _DeviceMemory:
    """Just enough ``__cuda_array_interface__`` for torch to wrap raw device memory."""

    def __init__(self, address: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1",
                                         "data": (address, False), "version": 3,
                                         "strides": None, "stream": None}


def device_tensor(address: int, nbytes: int, device: int) -> Any:
    torch = sys.modules["torch"]
    return torch.as_tensor(_DeviceMemory(address, nbytes), device=f"cuda:{device}")
