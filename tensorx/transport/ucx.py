"""UCX data lanes: true one-sided put/get with ``ucp_put_nbx``/``ucp_get_nbx``.

ucxx provides the UCP context, the worker and its progress thread; the RMA calls, the
endpoints and the rkeys go through our cffi binding (:mod:`tensorx.transport._ucp`) on
ucxx's own handles. No code of the owner runs for a read or write: only UCX's progress.

UCX's tcp transport is left out unless allowed (``allow_tcp``): it carries one-sided ops in
software with no bounds check, reachable by anyone who reaches its ports. Error handling is
a real trade-off on a single host (see the class docstring of :class:`UcxFactory`): with
``error_handling=True`` (the default) endpoints use UCX's peer failure mode, which confines
them to tcp lanes on one host but turns a dead peer into ``BrokenError``; with
``error_handling=False`` endpoints get shared-memory lanes (cma, posix) and run several
times faster, but a peer that dies *during* a transfer aborts this process inside libucp (a
peer that exited between calls is caught by a pidfd watch and gives ``BrokenError``).

This module holds the factory: settings, the checks of what UCX runs here, peers' worker
addresses (``_ucx_probe.py``) and opening lanes. What its lanes share (the context, the
registrations, progress and completion) is its :class:`~._ucx_runtime.UcxRuntime`, which
each lane receives at construction; the lanes are in ``_ucx_lane.py``.
"""

from __future__ import annotations

import inspect
import logging
import os
import re
import socket
from collections.abc import Mapping
from typing import Any

from tensorx._deadline import Deadline
from tensorx._text import printable
from tensorx.errors import ClosedError, ProtocolError, TransportUnavailableError, UsageError
from tensorx.memregion import MemoryRegion
from tensorx.transport import _ucp
from tensorx.transport._ucx_lane import UcxLane, UcxSettings
from tensorx.transport._ucx_probe import AddressProbe
from tensorx.transport._ucx_progress import ProgressDriver
from tensorx.transport._ucx_runtime import UcxRuntime
from tensorx.transport.base import CUDA, HOST, Capabilities, LaneFactory, Link

__all__ = ["UcxFactory", "UcxLane"]

logger = logging.getLogger("tensorx.transport.ucx")

DEFAULT_CHUNK = 256 << 20
DEFAULT_SPIN_US = 50.0
# Settings applied when this process initialises ucxx (never at import time).
DEFAULT_OPTIONS: Mapping[str, str] = {
    "RNDV_SCHEME": "put_zcopy",  # tag transfers: the sender pushes; get is emulated on tcp
    # RMA over tcp is emulated with active messages cut into segments: 8K (UCX's default)
    # costs ucx_perftest itself about half of its put/get bandwidth on loopback.
    "TCP_TX_SEG_SIZE": "256K",
    "TCP_RX_SEG_SIZE": "1M",
    # cma copies in pieces of this size, one per worker progress call (UCX default: 512K).
    "CMA_SEG_SIZE": "4M",
    "WARN_UNUSED_ENV_VARS": "n",
}


class UcxFactory(LaneFactory):
    """Registers memory with UCP and opens :class:`UcxLane` s to peers.

    Parameters:
        error_handling: use UCX peer-failure handling on every endpoint (both peers must
            agree, see :meth:`local_info`). ``None`` reads ``$TENSORX_UCX_ERROR_HANDLING``
            (``0`` or ``1``, default ``1``). ``True`` (the default, safe): a dead peer gives
            ``BrokenError``; on one host UCX then only offers tcp lanes, so without
            ``allow_tcp`` the factory is unavailable there (the node uses tensorx TCP).
            ``False`` (fast):
            same-host peers get cma/posix lanes, but a peer dying mid-transfer aborts this
            process from inside libucp (one that exited between calls is a ``BrokenError``).
            On RDMA NICs both go together.
        tls: ``UCX_TLS`` for this process's UCX context, e.g. ``"rc,sm"`` or ``"posix,cma"``
            (``None``: the environment's ``UCX_TLS``, else all but tcp unless allowed).
        options: extra UCX settings (names without ``UCX_``); override the defaults.
        allow_tcp: let UCX run its tcp transport in this process. ``None`` reads
            ``$TENSORX_UCX_TCP`` (``1`` allows; default no). UCX over tcp carries one-sided
            ops in software that writes and reads wherever a request says, with no bounds
            check, and listens on every network device: anyone who reaches those ports can
            read and write all of this process's memory, token or not. So by default UCX's
            tcp transport is left out (``UCX_TLS=^tcp``) and peers on a network without
            RDMA use tensorx's own TCP lane, where the owner checks every op. Allow it only
            on a network and with peers you trust entirely.
        chunk_bytes: transfers are issued to UCP in pieces of at most this size.
        inline_bytes: over a network lane (tcp, RDMA), calls moving fewer bytes progress
            the worker inline a little before sleeping (microsecond latency); larger ones
            leave progress to the driver thread, since two threads progressing one worker
            contend for its lock. Where every lane copies inside the call (cma, posix: one
            host, error handling off) calls of any size progress inline: their flush is
            done in a few passes, and waking the driver cost about 150 us per call.
        inline_progress: worker progress passes made inline for small calls.
        progress_spin_us: progress the worker with tensorx's driver thread, which keeps
            polling this many microseconds after the last sign of work before it sleeps
            (a bulk transfer over tcp, e.g. a peer's get served by this process, produces
            work every few microseconds); ``None`` keeps ucxx's progress thread, which
            sleeps as soon as the worker is idle. ``$TENSORX_UCX_SPIN_US`` overrides.

    UCX settings only take effect if this is the first user of ucxx in the process (ucxx
    has one context per process); otherwise the running context is used and a differing
    ``tls`` is logged as a warning.
    """

    name = "ucx"

    def __init__(self, *, error_handling: bool | None = None, tls: str | None = None,
                 options: Mapping[str, str] | None = None, chunk_bytes: int = DEFAULT_CHUNK,
                 inline_bytes: int = 256 << 10, inline_progress: int = 64,
                 progress_spin_us: float | None = DEFAULT_SPIN_US,
                 allow_tcp: bool | None = None) -> None:
        self.check_settings({"error_handling": error_handling, "tls": tls, "options": options,
                             "chunk_bytes": chunk_bytes, "inline_bytes": inline_bytes,
                             "inline_progress": inline_progress,
                             "progress_spin_us": progress_spin_us, "allow_tcp": allow_tcp})
        if error_handling is None:
            error_handling = os.environ.get("TENSORX_UCX_ERROR_HANDLING", "1") != "0"
        self.error_handling = bool(error_handling)
        self.chunk_bytes = int(chunk_bytes)
        self.inline_bytes = int(inline_bytes)
        self.inline_progress = int(inline_progress)
        self._ucp = _ucp.load()
        self._ffi, self._lib = self._ucp.ffi, self._ucp.lib
        if allow_tcp is None:
            allow_tcp = os.environ.get("TENSORX_UCX_TCP", "0") == "1"
        self.allow_tcp = bool(allow_tcp)
        if tls is None and not self.allow_tcp and "UCX_TLS" not in os.environ:
            tls = "^tcp"
        ctx, created = _ucp.ucxx_context(DEFAULT_OPTIONS, tls, options)
        self.context_handle = int(ctx.context.handle)
        if created:  # tensorx's own ucxx: it may drive its progress from now on
            ProgressDriver.created(self.context_handle)
        self.transports = self._check_transports()
        # GPU memory: without cuda_copy UCX can neither register nor move it; the node then
        # exports GPU regions without UCX keys and their ops go to the TCP lane (UcxLane.carries)
        self.gpu_memory = "cuda_copy" in self.transports
        self.caps = Capabilities(
            memory=frozenset({HOST, CUDA} if self.gpu_memory else {HOST}), one_sided=True,
            peer_death=self.error_handling, same_host=False, rank=20)
        settings = {**DEFAULT_OPTIONS, **(options or {}), "TLS": str(ctx.config["TLS"])}
        self._probe = AddressProbe(self._ucp.fd,
                                   {f"UCX_{k.upper()}": str(v) for k, v in settings.items()})
        self.runtime = UcxRuntime(self._ucp, ctx, spin_ns=_spin_ns(progress_spin_us),
                                  inline_progress=self.inline_progress)
        self._settings = UcxSettings(self.error_handling, self.chunk_bytes, self.inline_bytes,
                                     self.gpu_memory)
        self._lanes: set[UcxLane] = set()
        self._closed = False

    @staticmethod
    def check_settings(settings: Mapping[str, Any]) -> None:
        """UsageError naming the first of ``settings`` (keyword arguments of
        :class:`UcxFactory`, as ``Node(ucx_options=)`` gives them) that it does not take
        (checked where the factory is made, and by a node that starts UCX only at its
        first UCX peer when the node starts, so that a bad setting never waits for a peer
        to show)."""
        known = [n for n in inspect.signature(UcxFactory.__init__).parameters if n != "self"]
        unknown = sorted(str(k) for k in settings if k not in known)
        if unknown:
            raise UsageError(f"ucx_options: unknown setting {printable(unknown[0])[:60]!r} "
                             f"(the settings are {', '.join(known)})")
        error_handling, allow_tcp = settings.get("error_handling"), settings.get("allow_tcp")
        tls, options = settings.get("tls"), settings.get("options")
        progress_spin_us = settings.get("progress_spin_us")

        def number(name: str, value: Any, low: float, integer: bool = True) -> None:
            kinds = (int,) if integer else (int, float)
            if isinstance(value, bool) or not isinstance(value, kinds) or value < low:
                want = "an int" if integer else "a number"
                raise UsageError(f"ucx_options: {name} must be {want} >= {low:g}, got "
                                 f"{printable(repr(value))[:60]}")

        for name, value in (("error_handling", error_handling), ("allow_tcp", allow_tcp)):
            if value is not None and not isinstance(value, bool):
                raise UsageError(f"ucx_options: {name} must be True, False or None, got "
                                 f"{printable(repr(value))[:60]}")
        if tls is not None and not isinstance(tls, str):
            raise UsageError(f"ucx_options: tls must be a string such as 'rc,sm', got "
                             f"{printable(repr(tls))[:60]}")
        if options is not None:
            if not isinstance(options, Mapping) or not all(
                    isinstance(k, str) and isinstance(v, (str, int, float))
                    and not isinstance(v, bool) for k, v in options.items()):
                raise UsageError("ucx_options: options must map UCX setting names (strings, "
                                 "without UCX_) to strings or numbers, got "
                                 f"{printable(repr(options))[:80]}")
        number("chunk_bytes", settings.get("chunk_bytes", DEFAULT_CHUNK), 1)
        number("inline_bytes", settings.get("inline_bytes", 0), 0)
        number("inline_progress", settings.get("inline_progress", 0), 0)
        if progress_spin_us is not None:
            number("progress_spin_us", progress_spin_us, 0, integer=False)

    @property
    def driver(self) -> bool:
        """Whether tensorx's progress driver progresses the worker for this factory."""
        return self.runtime.driver

    def _check_transports(self) -> set[str]:
        """The transports of this process's UCX context; TransportUnavailableError where
        they would expose the process or cannot give the lanes asked for."""
        raw = self._lib.tx_context_info(self.context_handle)
        text = "" if raw == self._ffi.NULL else self._ffi.string(raw).decode(errors="replace")
        if raw != self._ffi.NULL:
            self._lib.tx_free(raw)
        found = {m.group(1) for m in _RESOURCE.finditer(text)}
        if "tcp" in found and not self.allow_tcp:
            raise TransportUnavailableError(
                "UCX in this process runs its tcp transport (UCX_TLS, or another user of "
                "ucxx), which writes wherever a request says: anyone reaching its ports could "
                "read and write all of this process's memory. Allow it on a trusted network "
                "with allow_tcp=True or TENSORX_UCX_TCP=1")
        if self.error_handling and not any(t.startswith(PEER_FAILURE_TLS) for t in found):
            raise TransportUnavailableError(
                "UCX here has no RDMA device (it has "
                f"{', '.join(sorted(found)) or 'nothing'}; its tcp is left out since it writes "
                "wherever a request says), so no transport that both detects a dead peer and "
                "bounds one-sided ops; error_handling=False gives same-host shared-memory "
                "lanes, allow_tcp=True UCX tcp on a trusted network")
        return found

    # -- LaneFactory -----------------------------------------------------------------
    def register(self, region: MemoryRegion) -> dict[str, Any] | None:
        if region.is_cuda and not self.gpu_memory:  # its ops go over the TCP lane
            return None
        reg = self.runtime.register(region)
        return {"addr": region.address, "rkey": reg.rkey}

    def release(self, region: MemoryRegion) -> None:
        self.runtime.unpin([region])

    def offer(self, binding: bytes) -> Any:
        return self.local_info()

    def reaches(self, offer: Any) -> bool:
        return isinstance(offer, dict)

    def local_info(self) -> dict[str, Any]:
        """What a peer needs to open a UCX lane to us (our :meth:`offer`)."""
        return {"worker_address": self.runtime.address, "error_handling": self.error_handling,
                "host": socket.gethostname(), "pid": os.getpid(),
                "ucx": self._ucp.version(), "gpu": self.gpu_memory}

    async def open_lane(self, link: Link, *, timeout: float | None) -> UcxLane:
        offer = link.offer(self.name)
        if not isinstance(offer, dict):
            raise TransportUnavailableError(
                f"the peer offers no UCX (its transport={link.caps.get('transport')!r})")
        return await self.connect(offer, peer=link.peer, timeout=timeout)

    async def connect(self, peer_info: dict[str, Any], *, peer: str,
                      timeout: float | None) -> UcxLane:
        """A lane to the peer that offered ``peer_info`` (its :meth:`local_info`)."""
        self._check_open()
        address = peer_info.get("worker_address")
        if not isinstance(address, bytes) or not address:
            raise ProtocolError(f"{peer} offers UCX but sent no UCX worker address")
        if peer_info.get("error_handling") != self.error_handling:
            raise TransportUnavailableError(
                f"UCX error handling differs ({peer}: {peer_info.get('error_handling')}, "
                f"here: {self.error_handling}); UCX needs both sides to agree")
        self.runtime.attach_loop()
        deadline = Deadline(timeout)  # the caller's budget, whatever is left of it
        await self._probe.check(address, self.error_handling, peer, deadline.left())
        lane = UcxLane(self.runtime, self._settings, address, peer, peer_info,
                       closed=self._lanes.discard)
        try:
            await lane._connect(deadline.left())  # noqa: SLF001 (the factory connects the lane it made)
        except BaseException:
            lane.abort()
            raise
        self._lanes.add(lane)
        logger.debug("ucx lane to %s: %s %s", peer, lane.roles, lane.why)
        return lane

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            for lane in list(self._lanes):
                await lane.aclose()
        finally:
            self.runtime.close()

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("the UCX transport is closed")


def _spin_ns(progress_spin_us: float | None) -> int | None:
    """The driver's polling time after work (None: ucxx's thread progresses instead)."""
    spin = os.environ.get("TENSORX_UCX_SPIN_US")
    if spin is not None:
        progress_spin_us = None if spin.lower() in ("", "none", "off") else float(spin)
    if progress_spin_us and len(os.sched_getaffinity(0)) < 2:
        progress_spin_us = 0.0  # one core: polling only delays the threads that share it
    return None if progress_spin_us is None else int(progress_spin_us * 1000)


# transports with UCX peer-failure handling that carry RMA in hardware (tcp: in software)
PEER_FAILURE_TLS = ("rc", "dc", "ud", "tcp")
_RESOURCE = re.compile(r"resource\s+\d+\s*:.*?--\s+([A-Za-z0-9_]+)/")
