"""Memory regions: memory registered once, and the descriptors a peer needs to reach it.

This is the edge where buffers are normalised (numpy, torch, bytearray, buffer protocol,
DLPack, ``__cuda_array_interface__``); below it only :class:`MemoryRegion` exists.
"""

from __future__ import annotations

import logging
import mmap
import secrets
import threading
import warnings
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

from tensorx import _shm
from tensorx._backing import Backing
from tensorx._schema import Record, choice, seq, table, text, uint
from tensorx._shm import host_id
from tensorx._text import printable
from tensorx.errors import ClosedError, ProtocolError, UsageError

__all__ = ["ACCESS_MODES", "MemoryRegion", "RegionDescriptor", "check_name", "host_id"]

# 1: the eight fields below; 2: the same and a ninth, a map of what a typed or named
# export adds (its name, its dtype and shape). A descriptor without them is written as
# version 1, which every tensorx reads.
DESCRIPTOR_VERSION = 2
VERSIONS = (1, 2)
ACCESS_MODES = ("r", "w", "rw")
MAX_DESCRIPTOR = 64 << 10  # bytes; a UCX rkey, the largest key, is a few hundred
MAX_NAME = 64  # characters of an export's name
MAX_DIMS = 32
_FIELDS = {
    "version": uint(8), "owner": text(64), "region_id": uint(64), "cookie": uint(64),
    "nbytes": uint(64), "device": choice("cpu", "cuda"), "access": choice(*ACCESS_MODES),
    "keys": table(16),
}
META = Record("region descriptor meta", {
    "name": text(MAX_NAME) | None, "dtype": text(32) | None,
    "shape": seq(MAX_DIMS, uint(63)) | None,
})
# The wire form: a list of these, in this order (the version first, checked on its own).
DESCRIPTOR = Record("region descriptor", _FIELDS)
DESCRIPTOR_V2 = Record("region descriptor", {**_FIELDS, "meta": table(8, META)})
PAGE = mmap.PAGESIZE

# One id per process: the owner identity of regions that no node exported yet.
_PROCESS_OWNER = secrets.token_hex(8)
_cache_lock = threading.Lock()
_registered: weakref.WeakValueDictionary[tuple[int, int, str], MemoryRegion] = (
    weakref.WeakValueDictionary()
)


def check_name(name: object) -> str:
    """``name`` if it can name an export (UsageError if not): 1 to 64 printable
    characters, without spaces at either end."""
    if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME or not name.isprintable() \
            or name != name.strip():
        raise UsageError(f"an export's name is 1 to {MAX_NAME} printable characters without "
                         f"spaces at either end, not {printable(name)!r}")
    return name


@dataclass(frozen=True)
class RegionDescriptor:
    """Everything a peer needs to read or write a region: plain data, safe to send.

    ``name``: the name its owner exported it under (``Node.export(..., name=)``), if any.
    ``dtype`` and ``shape``: of the tensor or array the region was registered from (the
    dtype as numpy and torch both spell it: ``"float32"``), ``None`` for raw memory;
    :meth:`Endpoint.read_rows` and :meth:`Endpoint.write_rows` check against them."""

    owner: str
    region_id: int
    cookie: int
    nbytes: int
    device: str
    access: str
    keys: Mapping[str, Any] = field(default_factory=dict)
    name: str | None = None
    dtype: str | None = None
    shape: tuple[int, ...] | None = None

    def _meta(self) -> dict[str, Any]:
        meta = {"name": self.name, "dtype": self.dtype,
                "shape": None if self.shape is None else list(self.shape)}
        return {k: v for k, v in meta.items() if v is not None}

    def to_bytes(self) -> bytes:
        """The descriptor's wire form (version 1, which every tensorx reads, unless it has a
        name, a dtype or a shape)."""
        meta = self._meta()
        fields = [self.owner, self.region_id, self.cookie, self.nbytes, self.device,
                  self.access, dict(self.keys)]
        row = [2, *fields, meta] if meta else [1, *fields]
        raw: bytes = msgpack.packb(row, use_bin_type=True)
        return raw

    @classmethod
    def from_bytes(cls, data: bytes) -> RegionDescriptor:
        if len(data) > MAX_DESCRIPTOR:
            raise ProtocolError(f"not a region descriptor: {len(data)} B, more than "
                                f"{MAX_DESCRIPTOR} B")
        try:
            fields = msgpack.unpackb(data, raw=False, strict_map_key=False)
        except Exception as exc:
            raise ProtocolError(f"not a region descriptor: {exc}") from exc
        version = fields[0] if isinstance(fields, list) and fields else None
        if version not in VERSIONS:
            raise ProtocolError(f"region descriptor version {printable(version)}; this "
                                f"tensorx reads {' and '.join(map(str, VERSIONS))}")
        if version == 1:
            _, *values = DESCRIPTOR.check_row(fields)
            return cls(*values)
        _, *values, meta = DESCRIPTOR_V2.check_row(fields)
        return cls(*values, **_checked_meta(meta))

    def validate(self) -> None:
        """Raise ProtocolError unless every field has the right type and range."""
        keys = dict(self.keys) if isinstance(self.keys, Mapping) else self.keys
        DESCRIPTOR_V2.check_row([2, self.owner, self.region_id, self.cookie, self.nbytes,
                                 self.device, self.access, keys, self._meta()])
        _checked_meta(self._meta())

    def allows(self, need: str) -> bool:
        return need in self.access


def _checked_meta(meta: dict[str, Any]) -> dict[str, Any]:
    """A version-2 descriptor's meta map (its schema passed) as the fields it sets (its
    name must be one an export can have)."""
    name = meta.get("name")
    if name is not None:
        try:
            check_name(name)
        except UsageError as exc:
            raise ProtocolError(f"region descriptor: field 'name': {exc}") from None
    shape = meta.get("shape")
    return {"name": name, "dtype": meta.get("dtype"),
            "shape": None if shape is None else tuple(shape)}


class MemoryRegion:
    """A contiguous range of host or GPU memory that transports may read and write.

    Build one with :meth:`register` (zero-copy over an existing object) or :meth:`allocate`.
    The region keeps the underlying object alive until :meth:`close`.
    """

    def __init__(self, obj: Any, address: int, nbytes: int, device: str,
                 readonly: bool, buffer: memoryview | None,
                 backing: Backing | None = None) -> None:
        self._obj = obj
        self.address = address
        self.nbytes = nbytes
        self.device = device
        self.readonly = readonly
        self.region_id = secrets.randbits(62)
        self._buffer = buffer
        self._closed = False
        self._close_callbacks: list[Callable[[MemoryRegion], None]] = []
        self._export: RegionDescriptor | None = None  # the latest, see _exported()
        # the mapping's state (ops in flight on it, the /dev/shm file) has an owner of its
        # own, which transports pin and the node asks, and which outlives a close while
        # an op still runs
        self.backing = backing or Backing()
        self.shared_name: str | None = None  # the /dev/shm name, for shared regions
        self._private = False  # attached copy-on-write (attach(private=True))
        # the producer's stream from __cuda_array_interface__ (v3): ops wait on it too
        self.stream: int | None = None
        # of the tensor or array it was registered from (None: raw memory); see
        # RegionDescriptor
        self.dtype: str | None = None
        self.shape: tuple[int, ...] | None = None

    # -- construction -------------------------------------------------------------------
    @classmethod
    def register(cls, obj: Any, *, writable: bool = True) -> MemoryRegion:
        """Register ``obj``'s memory without copying it.

        ``writable=True`` (the default) needs writable memory, because peers may write it;
        pass ``writable=False`` to export read-only memory. Registering the same memory
        twice returns the same region while it is open.
        """
        if isinstance(obj, MemoryRegion):
            return obj
        address, nbytes, device, readonly, buffer = _normalise(obj)
        if writable and readonly:
            raise UsageError(
                f"{type(obj).__name__} is read-only; pass writable=False to register it for reads"
            )
        key = (address, nbytes, device)
        with _cache_lock:
            cached = _registered.get(key)
            if cached is not None and not cached.closed:
                return cached
            region = cls(obj, address, nbytes, device, readonly, buffer)
            region.stream = _cai_stream(obj)
            region.dtype, region.shape = _typed(obj)
            if nbytes:
                _registered[key] = region
        return region

    @classmethod
    def allocate(cls, nbytes: int, device: str = "cpu", *, shared: bool = False
                 ) -> MemoryRegion:
        """Allocate ``nbytes`` of zeroed, page-aligned memory (``device="cpu"``) or on a GPU.

        ``shared=True`` (CPU only) puts it in a /dev/shm file (mode 0600) that processes of
        this uid on this host can map with :meth:`attach` under :attr:`shared_name`; the
        file is unlinked when the region is closed (and by the next allocation anywhere on
        the host if this process dies first).
        """
        if not isinstance(nbytes, int) or nbytes < 0:
            raise UsageError(f"nbytes must be a non-negative int, got {nbytes!r}")
        if device.startswith("cuda"):
            if shared:
                raise UsageError("shared=True allocates host memory; use device='cpu'")
            return cls.register(_cuda_empty(nbytes, device))
        if device != "cpu":
            raise UsageError(f"unknown device {device!r}; use 'cpu' or 'cuda[:N]'")
        if shared:
            return cls._shared(_shm.create(nbytes), nbytes)
        return cls._over_mmap(_anonymous(max(nbytes, 1)), nbytes)

    @classmethod
    def attach(cls, name: str, nbytes: int, *, private: bool = False) -> MemoryRegion:
        """Map the first ``nbytes`` of another process's ``allocate(shared=True)`` region.

        Refused (RegionError, UsageError for a malformed name) unless ``name`` is a tensorx
        shared-memory file owned by this uid, private to it and at least ``nbytes`` long.
        Closing the attached region only unmaps it; its creator owns the file.
        ``private=True`` maps it copy-on-write: the creator's writes show, ours stay ours
        until :meth:`drop_own_writes`.
        """
        mm = _shm.attach(name, nbytes, private)
        region = cls._over_mmap(mm, nbytes, Backing(attached=mm))
        region.shared_name = name
        region._private = private  # noqa: SLF001 (same class: the factory fills in its new region)
        return region

    def drop_own_writes(self) -> int:
        """Of a region attached with ``private=True``: forget what this process wrote, so
        that it reads the creator's memory again. Returns the pages it had written (-1:
        unknown, all were dropped)."""
        self._check_open()
        if not self._private:
            raise UsageError("drop_own_writes() is for regions attached with private=True")
        return _shm.drop_own_writes(self._obj, self.address, self.nbytes)

    @classmethod
    def _over_mmap(cls, mm: mmap.mmap, nbytes: int,
                   backing: Backing | None = None) -> MemoryRegion:
        buf = memoryview(mm)[:nbytes]
        address = np.frombuffer(memoryview(mm), dtype=np.uint8).ctypes.data
        return cls(mm, address, nbytes, "cpu", False, buf, backing)

    @classmethod
    def _shared(cls, f: _shm.ShmFile, nbytes: int) -> MemoryRegion:
        region = cls._over_mmap(f.mm, nbytes, Backing(file=f))
        region.shared_name = f.name
        return region

    # -- state --------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def is_cuda(self) -> bool:
        return self.device.startswith("cuda")

    @property
    def obj(self) -> Any:
        """The object whose memory this region covers."""
        self._check_open()
        return self._obj

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError(f"memory region {self.region_id:#x} is closed")

    def add_close_callback(self, fn: Callable[[MemoryRegion], None]) -> None:
        """Call ``fn(region)`` when the region is closed (transports deregister here);
        the callback added last runs first."""
        self._check_open()
        self._close_callbacks.append(fn)

    def close(self) -> None:
        """Deregister. Idempotent; later use of the region or its descriptors is an error."""
        if self._closed:
            return
        self._closed = True
        callbacks, self._close_callbacks = self._close_callbacks, []
        for fn in reversed(callbacks):  # last added first: a node unexports (and may hold
            # the memory for its peers) before the transport that registered it deregisters
            try:
                fn(self)
            except Exception:  # a failing callback must not keep memory registered
                logging.getLogger(__name__).exception("region close callback failed")
        self._buffer = None
        self.backing.release()  # unmapped now, or after the last op still using it

    def _exported(self, desc: RegionDescriptor) -> None:
        """What :meth:`descriptor` returns from now on; called by the export table only."""
        self._export = desc

    def __enter__(self) -> MemoryRegion:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<MemoryRegion {self.region_id:#x} {self.nbytes} B on {self.device} {state}>"

    # -- access -------------------------------------------------------------------------
    def buffer(self) -> memoryview:
        """The region's bytes as a flat ``uint8`` memoryview (host memory only)."""
        self._check_open()
        if self._buffer is None:
            raise UsageError(f"{self.device} memory has no host buffer; use a GPU transport")
        return self._buffer

    def view(self, dtype: Any, shape: tuple[int, ...] | int | None = None,
             offset: int = 0) -> Any:
        """A numpy array (numpy dtype) or torch tensor (torch dtype) over the region; no copy."""
        self._check_open()
        if _is_torch_dtype(dtype):
            return self._torch_view(dtype, shape, offset)
        dt = np.dtype(dtype)
        count = self._count(dt.itemsize, shape, offset)
        arr = np.frombuffer(self.buffer(), dtype=dt, count=count, offset=offset)
        return arr.reshape(_shape(shape, count))

    def _count(self, itemsize: int, shape: tuple[int, ...] | int | None, offset: int) -> int:
        if offset < 0 or offset > self.nbytes:
            raise UsageError(f"offset {offset} outside region of {self.nbytes} B")
        if offset % itemsize:
            raise UsageError(f"offset {offset} is not a multiple of the item size {itemsize}")
        if shape is None:
            return (self.nbytes - offset) // itemsize
        count = int(np.prod(_shape(shape, 0), dtype=np.int64))
        if offset + count * itemsize > self.nbytes:
            raise UsageError(
                f"view of {count * itemsize} B at offset {offset} exceeds region of {self.nbytes} B"
            )
        return count

    def _torch_view(self, dtype: Any, shape: tuple[int, ...] | int | None, offset: int) -> Any:
        import torch  # noqa: PLC0415 (optional dependency)

        itemsize = torch.empty((), dtype=dtype).element_size()
        count = self._count(itemsize, shape, offset)
        if self.is_cuda:
            return _cuda_torch_view(self, dtype, count, offset).reshape(_shape(shape, count))
        if count == 0:
            return torch.empty(_shape(shape, 0), dtype=dtype)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # read-only buffers warn; the region enforces rights
            t = torch.frombuffer(self.buffer(), dtype=dtype, count=count, offset=offset)
        return t.reshape(_shape(shape, count))

    def descriptor(self, access: str | None = None) -> RegionDescriptor:
        """The descriptor of the latest export, or a local (unexported) one.

        A peer can use only descriptors returned by ``Node.export``; an unexported one names
        this process as owner and is refused by every node.
        """
        self._check_open()
        if self._export is not None and access in (None, self._export.access):
            return self._export
        access = access or ("r" if self.readonly else "rw")
        return RegionDescriptor(_PROCESS_OWNER, self.region_id, 0, self.nbytes,
                                "cuda" if self.is_cuda else "cpu", access, {},
                                dtype=self.dtype, shape=self.shape)


# -- normalisation helpers ---------------------------------------------------------------
def _typed(obj: Any) -> tuple[str | None, tuple[int, ...] | None]:
    """(dtype name, shape) of a tensor or array, or (None, None) for other memory. The
    name is what numpy and torch both call the type (``"float32"``); a numpy dtype that is
    not in native byte order keeps its full spelling (``">f4"``), so it matches no other."""
    if _torch_module(obj) is not None:
        return str(obj.dtype).removeprefix("torch."), tuple(int(d) for d in obj.shape)
    if isinstance(obj, np.ndarray):
        return (obj.dtype.name if obj.dtype.isnative else obj.dtype.str), obj.shape
    cai = getattr(obj, "__cuda_array_interface__", None)
    if isinstance(cai, dict):
        dt = np.dtype(cai["typestr"])
        return (dt.name if dt.isnative else dt.str), tuple(cai["shape"])
    return None, None


def _normalise(obj: Any) -> tuple[int, int, str, bool, memoryview | None]:
    """(address, nbytes, device, readonly, host buffer) for any supported object."""
    torch = _torch_module(obj)
    if torch is not None:
        return _from_torch(obj)
    if hasattr(obj, "__cuda_array_interface__"):
        return _from_cuda_interface(obj)
    try:
        mv = memoryview(obj)
    except TypeError:
        mv = None
    if mv is not None:
        return _from_buffer(mv, type(obj).__name__)
    if hasattr(obj, "__dlpack__"):
        return _from_dlpack(obj)
    raise UsageError(
        f"cannot register {type(obj).__name__}: need the buffer protocol, DLPack, "
        "__cuda_array_interface__ or a torch tensor"
    )


def _from_buffer(mv: memoryview, name: str) -> tuple[int, int, str, bool, memoryview]:
    if not mv.c_contiguous:
        raise UsageError(f"{name} is not contiguous; register a contiguous copy")
    flat = mv.cast("B") if mv.nbytes else memoryview(bytearray())
    address = np.frombuffer(flat, dtype=np.uint8).ctypes.data if mv.nbytes else 0
    return address, mv.nbytes, "cpu", mv.readonly, flat


def _from_torch(t: Any) -> tuple[int, int, str, bool, memoryview | None]:
    if not t.is_contiguous():
        raise UsageError("torch tensor is not contiguous; register t.contiguous()")
    nbytes = t.numel() * t.element_size()
    if t.is_cuda:
        return t.data_ptr(), nbytes, f"cuda:{t.device.index or 0}", False, None
    if t.device.type != "cpu":
        raise UsageError(f"torch tensors on {t.device} are not supported")
    import torch  # noqa: PLC0415 (optional dependency)

    raw = t.detach().reshape(-1).view(torch.uint8) if nbytes else None
    buf = memoryview(raw.numpy()) if raw is not None else memoryview(bytearray())
    return t.data_ptr(), nbytes, "cpu", False, buf


def _from_cuda_interface(obj: Any) -> tuple[int, int, str, bool, None]:
    cai = obj.__cuda_array_interface__
    shape, strides = tuple(cai["shape"]), cai.get("strides")
    itemsize = np.dtype(cai["typestr"]).itemsize
    count = int(np.prod(shape, dtype=np.int64))
    if strides is not None and strides != _c_strides(shape, itemsize):
        raise UsageError(f"{type(obj).__name__} is not contiguous; register a contiguous copy")
    address, readonly = cai["data"]
    return address, count * itemsize, f"cuda:{_cuda_device_of(obj)}", bool(readonly), None


def _cai_stream(obj: Any) -> int | None:
    """The stream a ``__cuda_array_interface__`` (v3) names as the producer's, if any
    (torch tensors are ordered through torch's current stream instead)."""
    if _torch_module(obj) is not None or not hasattr(obj, "__cuda_array_interface__"):
        return None
    stream = obj.__cuda_array_interface__.get("stream")
    return stream if isinstance(stream, int) and not isinstance(stream, bool) and stream > 0 \
        else None


def _from_dlpack(obj: Any) -> tuple[int, int, str, bool, memoryview | None]:
    device_type, _device_id = obj.__dlpack_device__()
    if device_type == 2:  # kDLCUDA
        import torch  # noqa: PLC0415 (optional dependency)

        return _from_torch(torch.utils.dlpack.from_dlpack(obj))
    try:
        arr = np.from_dlpack(obj)
    except Exception as exc:
        raise UsageError(f"cannot import {type(obj).__name__} through DLPack: {exc}") from exc
    return _from_buffer(memoryview(arr), type(obj).__name__)  # type: ignore[arg-type]


def _c_strides(shape: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    strides, step = [], itemsize
    for dim in reversed(shape):
        strides.append(step)
        step *= dim
    return tuple(reversed(strides))


def _cuda_device_of(obj: Any) -> int:
    dev = getattr(obj, "device", None)
    return int(getattr(dev, "id", getattr(dev, "index", 0)) or 0)


def _torch_module(obj: Any) -> Any:
    mod = type(obj).__module__
    if not mod.startswith("torch"):
        return None
    import torch  # noqa: PLC0415 (optional dependency)

    return torch if isinstance(obj, torch.Tensor) else None


def _is_torch_dtype(dtype: Any) -> bool:
    return type(dtype).__module__ == "torch" and type(dtype).__name__ == "dtype"


def _shape(shape: tuple[int, ...] | int | None, count: int) -> tuple[int, ...]:
    if shape is None:
        return (count,)
    return (shape,) if isinstance(shape, int) else tuple(shape)


def _cuda_empty(nbytes: int, device: str) -> Any:
    try:
        import torch  # noqa: PLC0415 (optional dependency)
    except ImportError as exc:
        raise UsageError("allocating GPU memory needs torch "
                         "(pip install 'tensorx-rdma[torch]')") from exc
    if not torch.cuda.is_available():
        raise UsageError(f"no CUDA device here to allocate on {device!r}")
    return torch.zeros(nbytes, dtype=torch.uint8, device=device)


def _cuda_torch_view(region: MemoryRegion, dtype: Any, count: int, offset: int) -> Any:
    import torch  # noqa: PLC0415 (optional dependency)

    base = region.obj
    if not isinstance(base, torch.Tensor):
        base = torch.as_tensor(base, device=region.device)
    flat = base.reshape(-1).view(torch.uint8)
    itemsize = torch.empty((), dtype=dtype).element_size()
    return flat[offset: offset + count * itemsize].view(dtype)


HUGE_PAGE = 2 << 20


def _anonymous(nbytes: int) -> mmap.mmap:
    """Zeroed, page-aligned private memory, asked to come in huge pages where it is large
    enough: a sparse table's rows are read and written at random, and on 4 KiB pages
    every row costs a TLB miss (a parameter server's SGD step over 8192 random rows of a
    1e6 x 64-float table: 1.6 -> 1.1 ms with huge pages, on a 2-core KVM guest)."""
    mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE)
    if nbytes >= HUGE_PAGE and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            mm.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # a kernel without transparent huge pages: small pages then
            pass
    return mm
