"""The same-host CUDA IPC lane: GPU to GPU, device to device, without UCX's trade-off.

On one host UCX offers its CUDA IPC transport only with peer error handling off (a dead peer
can then hang or abort the process). This lane needs neither: the owner puts the CUDA IPC
handle of each exported GPU region's allocation into the region's descriptor
(``keys["cuda_ipc"]``); a peer on the same host opens it once (``cuIpcOpenMemHandle``) and
from then on a write or read is one ``cudaMemcpyAsync`` on the lane's own stream, straight
between the two processes' device memory (NVLink or PCIe peer to peer; the owner's code never
runs). Completion is the copy's CUDA event. Peer death is seen by the control channel, as for
every lane: ops then fail with ``BrokenError`` and the mappings are closed once the lane's
copies have finished; nothing aborts.

The endpoint's other lanes (UCX or TCP) keep everything else: host memory, GPU memory of
peers whose descriptors carry no handle. It is reported in ``ep.info["gpu"]`` and in the
endpoint's INFO line.

Switch it off with ``Node(cuda_ipc=False)`` or ``TENSORX_CUDA_IPC=0``.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from tensorx import _cuda
from tensorx._deadline import wait_for
from tensorx._shm import host_id
from tensorx.errors import (
    BrokenError,
    ClosedError,
    TensorxError,
    TimeoutError,
    TransportUnavailableError,
)
from tensorx.memregion import MemoryRegion, RegionDescriptor
from tensorx.transport.base import CUDA, Capabilities, DataLane, LaneFactory, Link, Op

__all__ = ["KEY", "CudaIpcFactory", "CudaIpcLane", "enabled", "export_keys"]

logger = logging.getLogger(__name__)

KEY = "cuda_ipc"


def enabled(setting: bool | None) -> bool:
    """``Node(cuda_ipc=...)``; None reads ``TENSORX_CUDA_IPC`` (on unless ``0``)."""
    if setting is not None:
        return setting
    return os.environ.get("TENSORX_CUDA_IPC", "1").strip().lower() not in ("0", "no", "off",
                                                                            "false")


def export_keys(region: MemoryRegion) -> dict[str, Any] | None:
    """The descriptor keys that let a same-host peer map ``region``; None (logged once at
    INFO per reason) where CUDA IPC cannot export it, e.g. memory from cuMemCreate (torch's
    ``expandable_segments``) or managed memory."""
    try:
        return _cuda.ipc_export(region.address, region.nbytes, region.device).to_wire()
    except TensorxError as exc:
        reason = str(exc)
        if reason not in _told:
            _told.add(reason)
            logger.info("GPU region %#x gets no CUDA IPC handle (%s); same-host peers reach "
                        "it over the endpoint's other lane", region.region_id, reason)
        return None


_told: set[str] = set()


class CudaIpcFactory(LaneFactory):
    """Puts CUDA IPC handles into GPU regions' descriptors and opens :class:`CudaIpcLane` s
    to same-host peers that use CUDA too. ``enabled``: see :func:`enabled`."""

    name = KEY
    caps = Capabilities(memory=frozenset({CUDA}), one_sided=True, peer_death=True,
                        same_host=True, rank=40)

    def __init__(self, enabled: bool) -> None:
        self._enabled = enabled

    def register(self, region: MemoryRegion) -> dict[str, Any] | None:
        return export_keys(region) if self._enabled and region.is_cuda else None

    def offer(self, binding: bytes) -> Any:
        if not (self._enabled and _cuda.available()):
            return None
        return {"host": host_id(), "pid": os.getpid()}

    def reaches(self, offer: Any) -> bool:
        return self._enabled and isinstance(offer, dict) and offer.get("host") == host_id()

    async def open_lane(self, link: Link, *, timeout: float | None) -> CudaIpcLane:
        """The lane to a peer that the kernel places in a process of this host (the one it
        offers: never its word alone, see :meth:`Link.held_by`); in our own process only
        where the peer is another node of it, whose regions the lane then copies without
        IPC handles."""
        theirs = link.offer(KEY)
        if not self._enabled:
            raise TransportUnavailableError("off (cuda_ipc disabled here)")
        if not _cuda.available():
            raise TransportUnavailableError("off (no CUDA in this process: no GPU memory to "
                                            "move)")
        if not isinstance(theirs, dict):
            raise TransportUnavailableError("not offered by the peer (no CUDA there, or "
                                            "cuda_ipc disabled)")
        pid = theirs.get("pid")
        if theirs.get("host") != host_id() or not isinstance(pid, int) \
                or not 0 < pid < 2**31:
            raise TransportUnavailableError("the peer is on another host")
        held = link.held_by(pid)
        if held:
            raise TransportUnavailableError(f"the peer says it is process {pid}, the kernel "
                                            f"says: {held}")
        return CudaIpcLane(same_process=pid == os.getpid())


class CudaIpcLane(DataLane):
    """Device-to-device copies into and out of a same-host peer's GPU regions (the
    endpoint sends every other op to its other lanes)."""

    name = KEY
    bypasses_owner = True

    def __init__(self, *, same_process: bool) -> None:
        """``same_process``: the peer is another node of this process (the kernel says
        so: see :meth:`CudaIpcFactory.open_lane`)."""
        self._same_process = same_process
        self._maps: dict[bytes, _cuda.IpcMapping] = {}
        self._keys: dict[tuple[int, int], _cuda.IpcKeys | None] = {}
        self._devices: dict[str, int | None] = {}  # a GPU's index here, by its uuid
        self._streams: dict[int, Any] = {}
        self._last: dict[int, Any] = {}  # per stream: the event of its latest copy
        self._gone: str | None = None
        self._closed = False
        self.ops = 0  # ops this lane carried itself (instrumentation, tests)

    @property
    def info(self) -> dict[str, Any]:
        how = ("same process: device to device" if self._same_process else
               "CUDA IPC: device to device, same host")
        return {"gpu": f"{KEY} ({how}; peer death seen by the control channel)",
                "lanes": [KEY]}

    def carries(self, op: Op) -> bool:
        return op.nbytes > 0 and self._ipc_keys(op.remote) is not None

    # -- which ops are ours ---------------------------------------------------------------
    def _ipc_keys(self, desc: RegionDescriptor) -> _cuda.IpcKeys | None:
        if desc.device != "cuda":
            return None
        key = (desc.region_id, desc.cookie)
        if key not in self._keys:
            raw = desc.keys.get(KEY)
            keys = _cuda.IpcKeys.from_wire(raw) if isinstance(raw, dict) else None
            if keys is not None and self._device_of(keys.uuid) is None:
                keys = None  # the owner's GPU is not visible in this process
            if len(self._keys) > 4096:
                self._keys.clear()
            self._keys[key] = keys
        return self._keys[key]

    def _device_of(self, uuid: str) -> int | None:
        if uuid not in self._devices:
            self._devices[uuid] = _cuda.local_device_for(uuid)
        return self._devices[uuid]

    def _items(self, ops: Sequence[Op]) -> list[tuple[Op, _cuda.IpcKeys]]:
        items = []
        for op in ops:
            keys = self._ipc_keys(op.remote)
            if keys is None:  # the endpoint only gives us ops we carry
                raise BrokenError(f"region {op.remote.region_id:#x} has no CUDA IPC handle")
            items.append((op, keys))
        return items

    # -- the contract ---------------------------------------------------------------------
    async def write(self, op: Op, *, timeout: float | None) -> None:
        await self.write_many([op], timeout=timeout)

    async def read(self, op: Op, *, timeout: float | None) -> None:
        await self._copy(self._items([op]), to_remote=False, timeout=timeout)

    async def write_many(self, ops: Sequence[Op], *, timeout: float | None) -> None:
        await self._copy(self._items(ops), to_remote=True, timeout=timeout)

    async def flush(self, *, timeout: float | None) -> None:
        events = list(self._last.values())
        if events:
            await self._wait(events, timeout)

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._release()

    def abort(self) -> None:
        self._closed = True
        self._release()

    def peer_gone(self, why: str) -> None:
        self._gone = why
        self._release()

    # -- copies ---------------------------------------------------------------------------
    def _check(self) -> None:
        if self._gone is not None:
            raise BrokenError(f"peer gone: {self._gone}")
        if self._closed:
            raise ClosedError("the CUDA IPC lane is closed (its endpoint was closed)")

    async def _copy(self, items: list[tuple[Op, _cuda.IpcKeys]], *, to_remote: bool,
                    timeout: float | None) -> None:
        self._check()
        events = self._issue(items, to_remote)
        await self._wait(events, timeout)
        self.ops += len(items)
        self._check()  # the peer died meanwhile: its memory may be gone, report it

    def _issue(self, items: list[tuple[Op, _cuda.IpcKeys]], to_remote: bool) -> list[Any]:
        """Enqueue every copy on the lane's stream (one per local device) and record an
        event after them; never yields. Device to device: ``cuMemcpyAsync`` on raw
        pointers (a few microseconds per op); host memory at one end: a torch copy."""
        torch = _cuda.load_torch()
        by_device: dict[int, list[tuple[Op, _cuda.IpcKeys]]] = {}
        for op, keys in items:
            device = _cuda.device_index(op.local.device) if op.local.is_cuda \
                else self._device_of(keys.uuid)
            assert device is not None  # checked in _ipc_keys
            by_device.setdefault(device, []).append((op, keys))
        events = []
        for device, mine in by_device.items():
            stream = self._stream(torch, device)
            with _cuda.current(_cuda.primary_context(device)):
                for op, keys in mine:
                    remote = self._remote_ptr(keys, op.remote_offset, op.nbytes)
                    if op.local.is_cuda:
                        local = op.local.address + op.local_offset
                        dst, src = (remote, local) if to_remote else (local, remote)
                        _cuda.copy_async(dst, src, op.nbytes, stream.cuda_stream)
                    else:
                        self._host_copy(torch, stream, op, keys, remote, to_remote)
                event = _cuda.DriverEvent()
                event.record(stream.cuda_stream)
            self._last[device] = event
            events.append(event)
        return events

    def _host_copy(self, torch: Any, stream: Any, op: Op, keys: _cuda.IpcKeys, remote: int,
                   to_remote: bool) -> None:
        device = self._device_of(keys.uuid)
        assert device is not None  # checked in _ipc_keys
        theirs = _cuda.device_tensor(remote, op.nbytes, device)
        ours = _host(torch, op.local, op.local_offset, op.nbytes)
        dst, src = (theirs, ours) if to_remote else (ours, theirs)
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)

    def _remote_ptr(self, keys: _cuda.IpcKeys, offset: int, nbytes: int) -> int:
        """The device pointer, in this process, of ``nbytes`` at ``offset`` of the peer's
        region (its allocation opened once)."""
        if self._same_process and keys.pid == os.getpid():  # our own memory: no mapping
            return keys.address + offset
        mapping = self._maps.get(keys.handle)
        if mapping is None:
            if len(self._maps) >= 1024:
                raise BrokenError("more than 1024 GPU allocations of one peer mapped")
            device = self._device_of(keys.uuid)
            assert device is not None  # checked in _ipc_keys
            mapping = _cuda.IpcMapping(keys, device)
            self._maps[keys.handle] = mapping
        start = keys.offset + offset
        if start + nbytes > mapping.size:  # the owner checked the range, this is defence
            raise BrokenError("a GPU region's range runs past its peer allocation")
        return mapping.base + start

    def _stream(self, torch: Any, device: int) -> Any:
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device=device)
        return stream

    async def _wait(self, events: list[Any], timeout: float | None) -> None:
        if all(event.query() for event in events):  # done already (small copies, flush)
            return
        try:  # on any way out _cuda.wait waits for the copies first
            await wait_for(_cuda.wait(events), timeout)
        except asyncio.TimeoutError:
            raise TimeoutError(f"GPU copies did not complete within {timeout} s") from None

    def _release(self) -> None:
        """Close every mapping once this lane's copies are done (never while one runs)."""
        maps, self._maps = self._maps, {}
        if not maps:
            return
        try:
            _cuda.wait_sync(list(self._last.values()))
        except Exception as exc:  # a broken device: still try to close the mappings
            logger.warning("waiting for CUDA IPC copies failed: %s", exc)
        for mapping in maps.values():
            try:
                mapping.close()
            except TensorxError as exc:
                logger.warning("closing a CUDA IPC mapping failed: %s", exc)


def _host(torch: Any, region: MemoryRegion, offset: int, nbytes: int) -> Any:
    """A uint8 torch view of ``nbytes`` of host ``region`` at ``offset``."""
    flat = np.frombuffer(region.buffer(), dtype=np.uint8)
    return torch.from_numpy(flat[offset:offset + nbytes])
