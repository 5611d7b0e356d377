"""Node: one process's presence on the network. Exports regions, makes and accepts endpoints.

The transport is chosen per endpoint and always reported: UCX when both peers have it and a
lane opens, TCP otherwise, with one INFO line per endpoint naming transport, lanes and why.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import os
import secrets
import socket
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor
from typing import Any
from urllib.parse import urlsplit

from tensorx import _auth, _cuda
from tensorx._deadline import Deadline, wait_for
from tensorx._queues import LatestQueue, NotificationQueue
from tensorx._text import printable
from tensorx.endpoint import DEFAULT, Endpoint
from tensorx.errors import (
    ClosedError,
    TensorxError,
    TimeoutError,
    TransportUnavailableError,
    UsageError,
)
from tensorx.memregion import ExportTable, MemoryRegion, RegionDescriptor, host_id
from tensorx.transport import cma as cma_lane
from tensorx.transport import cuda_ipc as cuda_ipc_lane
from tensorx.transport import handshake
from tensorx.transport._tcp_lane import TcpLane
from tensorx.transport.base import DataLane, LaneFactory
from tensorx.transport.gpu_route import GpuViaTcp
from tensorx.transport.tcp import Connection, TcpListener, open_socket

__all__ = ["Node"]

logger = logging.getLogger(__name__)

SHM_KEY = "shm"  # a descriptor's /dev/shm name and host, for Node.attach

TRANSPORTS = ("auto", "tcp", "ucx")
REQUIREMENTS = (None, "ucx", "rdma")
MAX_DISCONNECTED = 1024  # disconnect events kept for a user who never reads them
RDMA_LANES = ("rc", "dc", "ud", "ib", "roce", "mlx", "verbs", "efa")


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def parse_address(address: str) -> tuple[str, str, int]:
    """``"tcp://host:port"`` or ``"ucx://host:port"`` -> (scheme, host, port)."""
    parts = urlsplit(address if "://" in address else f"tcp://{address}")
    if parts.scheme not in ("tcp", "ucx") or not parts.hostname or parts.port is None:
        raise UsageError(f"bad address {address!r}; expected tcp://HOST:PORT or ucx://HOST:PORT")
    return parts.scheme, parts.hostname, parts.port


class Node:
    """A process's tensorx node. Use as ``async with Node(...) as node:``.

    ``listen``: ``"tcp://HOST:PORT"`` (port 0 picks one) or ``None`` for a client-only node.
    ``transport``: ``"auto"`` (UCX when both peers have it, else TCP), ``"tcp"`` or ``"ucx"``.
    ``token``: shared secret (default ``$TENSORX_TOKEN``); peers prove it before anything else.
    ``timeout``: default seconds for every wait (``None``: forever).
    ``require``: ``"ucx"`` or ``"rdma"`` (default ``$TENSORX_REQUIRE``): fail instead of
    falling back to a slower transport.
    ``insecure``: allow listening on a non-loopback address without a token (and then use
    none: only peers that are also ``insecure`` can connect). With no token and not
    insecure, both sides use this user's per-user secret (see :mod:`tensorx._auth`), so
    processes of one user on one host need no flags and other users are refused.

    Limits on what peers can make this node hold (each logged when it bites):
    ``handshake_timeout``: seconds an unauthenticated connection may take to prove the token.
    ``max_handshakes``: unauthenticated connections at once; past it the oldest is dropped.
    ``notify_queue``: ``(count, bytes)`` bound of ``notifications``; a connection whose
    notification does not fit waits (stops reading its peer) until the user takes some.

    ``handler``: ``async def handler(ep)``, run as a task of its own for every endpoint a
    peer opens to this node, once its handshake is done. That endpoint's notifications then
    go to ``ep.messages`` (in order, ending after the last one: no separate disconnect to
    race with), not to ``notifications``. The node cancels these tasks when it closes; an
    exception escaping one is logged and aborts that endpoint alone.

    ``cuda_ipc``: GPU regions between same-host peers that both use CUDA travel device to
    device over CUDA IPC (reported in ``ep.info["gpu"]``); ``None`` reads
    ``$TENSORX_CUDA_IPC`` (on unless ``0``). See docs/transports.md, "GPU memory".

    ``same_host``: host memory between two nodes on one host moves by cross-memory attach
    (``process_vm_writev/readv``: one copy; reported in ``ep.info["host"]``) where both allow
    it; ``None`` means on under ``transport="auto"`` unless ``$TENSORX_SAME_HOST=0``.
    See docs/transports.md, "Same host".
    """

    def __init__(self, listen: str | None = "tcp://127.0.0.1:0", *, transport: str = "auto",
                 token: str | bytes | None = None, timeout: float | None = 30.0,
                 require: str | None = None, ucx_options: dict[str, Any] | None = None,
                 insecure: bool = False, handshake_timeout: float = 5.0,
                 max_handshakes: int = 64,
                 notify_queue: tuple[int, int] = (4096, 64 << 20),
                 cuda_ipc: bool | None = None, same_host: bool | None = None,
                 handler: Callable[[Endpoint], Awaitable[None]] | None = None) -> None:
        if transport not in TRANSPORTS:
            raise UsageError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
        require = require if require is not None else os.environ.get("TENSORX_REQUIRE") or None
        if require not in REQUIREMENTS:
            raise UsageError(f"require must be one of {REQUIREMENTS}, got {require!r}")
        self.id = secrets.token_hex(8)
        self.transport = transport
        self.require = require
        self.timeout = timeout
        self._listen = listen
        self._given_token = _auth.resolve_token(token)
        self._token = b""
        self.handshake_timeout = handshake_timeout
        self.max_handshakes = max_handshakes
        self._handshaking: dict[Connection, str] = {}  # unauthenticated, oldest first
        self._dropped: set[Connection] = set()  # pushed out by newer ones, not yet gone
        self._failures = handshake.FailureLog()
        self._ucx_options = dict(ucx_options or {})
        self._insecure = insecure
        self._cuda_ipc = cuda_ipc_lane.enabled(cuda_ipc)
        self._cma = cma_lane.enabled(same_host, transport)
        self._cma_pool: Executor | None = None
        self._probes: dict[Connection, cma_lane.Probe] = {}  # per connection, while it lives
        self._exports = ExportTable(self.id)
        self._factory: LaneFactory | None = None
        self._factory_why = ""
        self._listener: TcpListener | None = None
        self._endpoints: set[Endpoint] = set()
        self._handler = handler
        self._handling: set[asyncio.Task[None]] = set()  # handler(ep) tasks
        # closed regions whose memory peers may still reach: region, peers yet to ack
        self._held: dict[int, tuple[MemoryRegion, set[Endpoint]]] = {}
        self._state = "new"
        self.notifications: asyncio.Queue[tuple[Endpoint, bytes]] = NotificationQueue(
            *notify_queue)
        self.disconnected: asyncio.Queue[Endpoint] = LatestQueue(
            MAX_DISCONNECTED, f"node {self.id}: disconnected endpoints")

    def __repr__(self) -> str:
        return f"<Node {self.id} {self._state} {self.address if self._listener else ''}>"

    # -- lifecycle ----------------------------------------------------------------------
    async def start(self) -> Node:
        if self._state != "new":
            raise UsageError(f"node already {self._state}")
        self._state = "starting"
        self._token = self._resolve_secret()
        self._factory, self._factory_why = self._make_factory()
        if self._listen is not None:
            scheme, host, port = parse_address(self._listen)
            self._check_exposure(host)
            if scheme == "ucx" and self._factory is None:
                raise TransportUnavailableError(f"cannot listen on ucx://: {self._factory_why}")
            self._listener = await TcpListener.start(host, port, self._on_accept)
        self._state = "running"
        logger.info("node %s up: %s; data transport %s", self.id,
                    self.address if self._listener else "client only", self._factory_why)
        return self

    def _resolve_secret(self) -> bytes:
        """The token given, else none when insecure, else this user's per-user secret."""
        if self._given_token or self._insecure:
            return self._given_token
        return _auth.user_secret()

    def _check_exposure(self, host: str) -> None:
        """Refuse to expose memory beyond this machine without a token (unless insecure)."""
        if self._given_token or self._insecure or _is_loopback(host):
            return
        raise UsageError(f"listening on {host} (not loopback) needs a token: pass token= or "
                         "set TENSORX_TOKEN (or insecure=True to accept any peer)")

    def _make_factory(self) -> tuple[LaneFactory | None, str]:
        if self.transport == "tcp":
            return None, "tcp (asked for transport='tcp')"
        try:
            from tensorx.transport.ucx import UcxFactory

            factory: LaneFactory = UcxFactory(**self._ucx_options)
        except (ImportError, TransportUnavailableError) as exc:
            why = f"UCX unavailable ({exc})"
            if self.transport == "ucx" or self.require is not None:
                raise TransportUnavailableError(why) from exc
            return None, f"tcp ({why})"
        return factory, "ucx when the peer has it, else tcp"

    async def aclose(self) -> None:
        """Close every endpoint, the listener and all registrations. Idempotent."""
        if self._state in ("closed", "new"):
            self._state = "closed"
            return
        self._state = "closed"
        try:
            if self._listener is not None:
                await self._listener.aclose()
            for task in list(self._handling):
                task.cancel()
            await asyncio.gather(*self._handling, return_exceptions=True)
            await asyncio.gather(*(ep.aclose() for ep in list(self._endpoints)),
                                 return_exceptions=True)
        finally:
            if self._cma_pool is not None:  # every lane has waited for its copies
                self._cma_pool.shutdown(wait=False)
            if self._factory is not None:
                await self._factory.aclose()

    def abort(self) -> None:
        for task in list(self._handling):
            task.cancel()
        for ep in list(self._endpoints):
            ep.abort()
        if self._cma_pool is not None:  # its threads finish the piece they copy, then end
            self._cma_pool.shutdown(wait=False)
        self._state = "closed"

    async def __aenter__(self) -> Node:
        return self if self._state == "running" else await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def _check_running(self) -> None:
        if self._state != "running":
            raise ClosedError(f"node {self.id} is {self._state}") if self._state == "closed" \
                else UsageError("node is not started; use 'async with Node(...)'")

    @property
    def address(self) -> str:
        """Where peers connect: ``tcp://HOST:PORT``, or ``ucx://HOST:PORT`` with UCX data."""
        if self._listener is None:
            raise UsageError("this node does not listen (listen=None) or is not started")
        host, port = self._listener.host_port
        scheme = "ucx" if self._factory is not None else "tcp"
        return f"{scheme}://{host}:{port}"

    @property
    def endpoints(self) -> list[Endpoint]:
        return list(self._endpoints)

    # -- memory -------------------------------------------------------------------------
    def export(self, region: MemoryRegion | Any, access: str = "rw") -> RegionDescriptor:
        """Make ``region`` reachable by authenticated peers with ``access`` ("r", "w", "rw").
        Returns the descriptor to hand to peers. Closing the region unexports it."""
        self._check_running()
        if not isinstance(region, MemoryRegion):
            region = MemoryRegion.register(region, writable="w" in access)
        keys: dict[str, Any] = {}
        if self._factory is not None and (not region.is_cuda or self._factory_gpu()):
            keys[self._factory.name] = self._factory.register(region)
        if region.is_cuda and self._cuda_ipc:
            ipc = cuda_ipc_lane.export_keys(region)
            if ipc is not None:
                keys[cuda_ipc_lane.KEY] = ipc
        if region.shared_name is not None and region._shm is not None:  # our /dev/shm file
            keys[SHM_KEY] = {"host": host_id(), "name": region.shared_name}
        desc = self._exports.add(region, access, keys)
        region.add_close_callback(self.unexport)
        logger.debug("exported %r as %s", region, access)
        return desc

    def attach(self, desc: RegionDescriptor | bytes, *,
               private: bool | None = None) -> MemoryRegion:
        """Map a region a peer on this host exported, instead of copying to and from it.

        Same-host peers only, and only regions their owner allocated in shared memory
        (``MemoryRegion.allocate(nbytes, shared=True)``): the descriptor of such a region
        carries its /dev/shm name and its owner's :func:`host_id` (same kernel, /dev/shm and
        network namespace). The file is private to the uid that created it, so only
        processes of that uid can map it. Loads and stores then go straight to the owner's
        memory: no lane, no copy, no notification (order them with ``ep.notify`` or your own
        protocol). ``private``: map copy-on-write (the owner's writes show, ours stay ours,
        see :meth:`MemoryRegion.drop_own_writes`); the default for a region exported
        read-only (``access="r"``), which cannot be mapped shared. Closing the mapping only
        unmaps it. When the owner closes the region its file is unlinked but our mapping
        stays valid (it holds the old memory, which nobody else writes any more).

        UsageError when ``desc`` has no shared memory or its owner is on another host;
        RegionError when the file is gone or not the owner's."""
        if isinstance(desc, bytes | bytearray | memoryview):
            desc = RegionDescriptor.from_bytes(bytes(desc))
        if not isinstance(desc, RegionDescriptor):
            raise UsageError(f"attach() takes a RegionDescriptor or its bytes, not "
                             f"{type(desc).__name__}")
        shm = desc.keys.get(SHM_KEY)
        if not (isinstance(shm, dict) and isinstance(shm.get("host"), str)
                and isinstance(shm.get("name"), str)):
            raise UsageError(f"region {desc.region_id:#x} is not in shared memory (its owner "
                             "allocated it without shared=True): read or write it through "
                             "an endpoint")
        if shm["host"] != host_id():
            raise UsageError(f"region {desc.region_id:#x} is on another host (or network "
                             "namespace): read or write it through an endpoint")
        writable = "w" in desc.access
        private = not writable if private is None else private
        if not private and not writable:
            raise UsageError(f"region {desc.region_id:#x} was exported read-only: attach it "
                             "with private=True (copy-on-write)")
        region = MemoryRegion.attach(shm["name"], desc.nbytes, private=private)
        logger.debug("attached %s (%s) as %r", printable(shm["name"]),
                     "private" if private else "shared", region)
        return region

    def unexport(self, region: MemoryRegion) -> None:
        """Stop serving ``region`` and tell every connected peer to drop it.

        Peers whose lane reaches the memory without us (UCX) may have ops on it in flight:
        the memory stays mapped and registered (even once the region is closed) until each
        of them has acknowledged, having completed every op issued before, or is gone. So
        a late write lands in the old memory, never in memory reused for something else."""
        exported = self._exports.remove(region)
        holders = set()
        for ep in self._endpoints:
            ep._conn.revoke(region.region_id)
            if ep.bypassed and not ep.closed:
                holders.add(ep)
        if not (exported and holders):
            return
        held = self._held.get(region.region_id)
        if held is None:
            if self._factory is not None:
                self._factory.hold(region)
            else:  # only a CUDA IPC lane reaches it: keep the memory itself
                region._pin()
            self._held[region.region_id] = (region, holders)
        else:
            held[1].update(holders)

    def _revoke_acked(self, ep: Endpoint, region_id: int) -> None:
        """``ep``'s peer has no op on the region in flight any more (or is gone)."""
        held = self._held.get(region_id)
        if held is None:
            return
        held[1].discard(ep)
        if not held[1]:
            del self._held[region_id]
            if self._factory is not None:
                self._factory.release(held[0])
            else:
                held[0]._unpin()

    def exports(self) -> list[RegionDescriptor]:
        """Descriptors of every region this node exports now."""
        return self._exports.regions()

    # -- endpoints ----------------------------------------------------------------------
    def _caps_for(self, conn: Connection) -> Callable[[bytes], dict[str, Any]]:
        """Our capabilities on ``conn``, given its handshake binding (see _caps)."""
        return lambda binding: self._caps(conn, binding)

    def _caps(self, conn: Connection | None = None, binding: bytes = b"") -> dict[str, Any]:
        caps: dict[str, Any] = {"transport": self.transport}
        if self._factory is not None:
            caps[self._factory.name] = self._factory.local_info()
        if self._cuda_ipc and _cuda.available():
            caps[cuda_ipc_lane.KEY] = {"host": host_id(), "pid": os.getpid()}
        if self._cma and conn is not None:  # the probe token belongs to this connection
            probe = self._probes[conn] = cma_lane.Probe(binding, self.id)
            caps[cma_lane.KEY] = probe.caps()
        return caps

    async def connect(self, address: str, *, timeout: float | None = DEFAULT) -> Endpoint:
        """Connect and authenticate to the node at ``address``; ``timeout`` is one budget for
        connecting, the handshake and opening the data lane."""
        self._check_running()
        deadline = Deadline(self.timeout if timeout is DEFAULT else timeout)
        _, host, port = parse_address(address)
        try:
            sock = await wait_for(open_socket(host, port), deadline.left())
        except asyncio.TimeoutError:
            raise TimeoutError(f"connecting to {address} timed out") from None
        conn = Connection(sock, self._exports, f"{self.id}->{address}")
        try:
            await handshake.initiate(conn, self.id, self._token, self._caps_for(conn),
                                     deadline.left())
            return await self._finish(conn, address, deadline.left())
        except BaseException:
            self._probes.pop(conn, None)
            conn.abort()
            raise

    async def _on_accept(self, sock: socket.socket) -> None:
        try:
            peer = "{}:{}".format(*sock.getpeername()[:2])
        except OSError:  # already gone
            sock.close()
            return
        conn = Connection(sock, self._exports, f"{self.id}<-{peer}")
        deadline = Deadline(self.timeout)  # one budget for the handshake and the lanes
        try:
            await self._authenticate(conn, peer, deadline)
            ep = await self._finish(conn, f"tcp://{peer}", deadline.left(),
                                    claim=self._handler is not None)
            if self._handler is not None:
                self._handle(ep, self._handler)
        except TensorxError as exc:
            if conn not in self._dropped:  # (a dropped one was reported when dropped)
                self._failures.failed(peer.rsplit(":", 1)[0], exc)
            self._probes.pop(conn, None)
            conn.abort()
        except BaseException:
            self._probes.pop(conn, None)
            conn.abort()
            raise
        finally:
            self._dropped.discard(conn)

    def _handle(self, ep: Endpoint, handler: Callable[[Endpoint], Awaitable[None]]) -> None:
        task = asyncio.get_running_loop().create_task(self._run_handler(ep, handler))
        self._handling.add(task)
        task.add_done_callback(self._handling.discard)

    async def _run_handler(self, ep: Endpoint,
                           handler: Callable[[Endpoint], Awaitable[None]]) -> None:
        try:
            await handler(ep)
        except Exception:  # one peer's handler failing must not stop the node
            logger.exception("node %s: the handler of endpoint %s failed; aborting it",
                             self.id, printable(ep.peer))
            ep.abort()

    async def _authenticate(self, conn: Connection, peer: str, deadline: Deadline) -> None:
        """The handshake of an accepted connection: within ``handshake_timeout`` too (a
        limit on what an unauthenticated peer may hold, not a caller's budget), and at most
        ``max_handshakes`` at once (a new one pushes out the oldest, which a real peer,
        done in milliseconds, never is)."""
        if len(self._handshaking) >= self.max_handshakes:
            self._drop_oldest_handshake()
        self._handshaking[conn] = peer
        timeout = deadline.least(self.handshake_timeout)
        try:
            await handshake.accept(conn, self.id, self._token, self._caps_for(conn), timeout)
        finally:
            self._handshaking.pop(conn, None)

    def _drop_oldest_handshake(self) -> None:
        """Push out the oldest unauthenticated connection. Shutting its socket down ends
        its handshake with an ordinary error (its task then ends and everything it held is
        freed at once); cancelling the task instead left each one reachable for a while,
        about 15 KiB apiece, through the cancelled tasks' tracebacks."""
        oldest, who = next(iter(self._handshaking.items()))
        del self._handshaking[oldest]
        self._dropped.add(oldest)
        with contextlib.suppress(OSError):
            oldest.sock.shutdown(socket.SHUT_RDWR)
        self._failures.failed(who.rsplit(":", 1)[0], TimeoutError(
            f"{self.max_handshakes} unauthenticated connections at once: dropped the "
            "oldest (raise Node(max_handshakes=) if real peers need more)"))

    async def _finish(self, conn: Connection, address: str, timeout: float | None,
                      claim: bool = False) -> Endpoint:
        lane, notes = await self._choose_lane(conn, timeout)
        bypassed = cma_lane.offered(self._cma, conn.peer_caps.get(cma_lane.KEY))
        ep = Endpoint(self, conn, lane, address, notes=notes, bypassed=bypassed)
        if claim:  # before the first notification can arrive
            ep.messages  # noqa: B018
        conn.on_notify = lambda c, payload: ep._deliver(payload)
        conn.on_closed = lambda c, exc: self._on_broken(ep, exc)
        conn.on_query = self._answer
        conn.on_revoke_ack = lambda region_id: self._revoke_acked(ep, region_id)
        conn.start()
        self._endpoints.add(ep)
        info = ep.info
        logger.info("endpoint %s <-> %s (%s): transport=%s lanes=%s why=%s%s; host=%s",
                    self.id, conn.peer, address, info["transport"], ",".join(info["lanes"]),
                    printable(info["why"]), f"; gpu={info['gpu']}" if "gpu" in info else "",
                    printable(info["host"]))
        return ep

    async def _choose_lane(self, conn: Connection, timeout: float | None
                           ) -> tuple[DataLane, dict[str, str]]:
        lane = await self._try_ucx(conn, timeout)
        if lane is None:
            lane = TcpLane(conn, self._tcp_why(conn))
        self._enforce_require(lane)
        lane, notes = self._with_cma(conn, lane)
        return self._with_cuda_ipc(conn, lane), notes

    def _with_cma(self, conn: Connection, lane: DataLane) -> tuple[DataLane, dict[str, str]]:
        """Same-host peers that may read each other's memory get the CMA lane for host
        memory; otherwise ``ep.info["host"]`` says why not (a WARNING where it should have
        worked: the peer is on this host and offered it)."""
        expected = cma_lane.token(conn.binding, conn.peer)
        pid, why, loud = cma_lane.check(self._cma, conn.peer_caps.get(cma_lane.KEY), expected)
        if pid is None:
            if loud:
                logger.warning("endpoint to %s: no same-host lane, host memory goes over %s: "
                               "%s", conn.peer, lane.name, why)
            return lane, {"host": why}
        if self._cma_pool is None:
            self._cma_pool = cma_lane.make_pool()
        return cma_lane.CmaLane(lane, conn, pid, self._cma_pool), {}

    def _with_cuda_ipc(self, conn: Connection, lane: DataLane) -> DataLane:
        """Same-host peers that both use CUDA get the CUDA IPC lane for GPU memory."""
        theirs = conn.peer_caps.get(cuda_ipc_lane.KEY)
        if not (self._cuda_ipc and isinstance(theirs, dict) and _cuda.available()):
            return lane
        pid = theirs.get("pid")
        if theirs.get("host") != host_id() or not isinstance(pid, int):
            return lane
        return cuda_ipc_lane.CudaIpcLane(lane, pid)

    def _factory_gpu(self) -> bool:
        """Whether the UCX factory can register and move GPU memory."""
        return bool(getattr(self._factory, "gpu_memory", True))

    async def _try_ucx(self, conn: Connection, timeout: float | None) -> DataLane | None:
        peer_info = conn.peer_caps.get("ucx")
        if self._factory is None or not isinstance(peer_info, dict):
            return None
        try:
            lane = await self._factory.open_lane(peer_info, peer=conn.peer, timeout=timeout)
            if _cuda.available() and (not self._factory_gpu() or peer_info.get("gpu") is False):
                return GpuViaTcp(lane, TcpLane(conn, "GPU memory UCX cannot move"),
                                 self._factory_gpu())
            return lane
        except TransportUnavailableError as exc:
            if self.transport == "ucx" or self.require is not None:
                raise
            conn.peer_caps["ucx_error"] = str(exc)
            return None

    def _tcp_why(self, conn: Connection) -> str:
        if self._factory is None:
            return self._factory_why
        if "ucx_error" in conn.peer_caps:
            return f"UCX lane failed to open: {conn.peer_caps['ucx_error']}"
        return f"peer has no UCX (its transport={conn.peer_caps.get('transport')!r})"

    def _enforce_require(self, lane: DataLane) -> None:
        if self.require is None:
            return
        lanes = lane.info["lanes"]
        ok = lane.name == "ucx" if self.require == "ucx" else any(
            name.split("/")[0].startswith(RDMA_LANES) for name in lanes)
        if not ok:
            lane.abort()
            raise TransportUnavailableError(
                f"require={self.require!r} but this endpoint would use {lane.name} over "
                f"{', '.join(lanes) or 'no lanes'} ({lane.info['why']})")

    def _answer(self, what: str) -> dict[str, Any]:
        """What an authenticated peer may learn about this node (``Endpoint.query``)."""
        if what == "exports":
            return {"node": self.id, "exports": [
                {"region": f"{d.region_id:#x}", "nbytes": d.nbytes, "device": d.device,
                 "access": d.access, "transports": sorted(d.keys) or ["tcp"]}
                for d in self._exports.regions()]}
        if what == "endpoints":
            return {"node": self.id, "endpoints": [
                {k: v for k, v in ep.info.items() if k != "socket"} for ep in self._endpoints]}
        raise UsageError(f"unknown query {what!r}; ask for 'exports' or 'endpoints'")

    def _on_broken(self, ep: Endpoint, exc: BaseException | None) -> None:
        """The connection ended (peer left or broke, or we closed it): release the data
        lane too (a UCX endpoint would otherwise keep its socket and state forever)."""
        if exc is not None:
            logger.warning("endpoint to %s broke: %s", ep.peer, printable(str(exc)))
        ep._lane.peer_gone(str(exc or "the peer closed the endpoint"))
        ep._stream.end(exc)
        self._probes.pop(ep._conn, None)
        if ep in self._endpoints:
            self._endpoints.discard(ep)
            self.disconnected.put_nowait(ep)
        self._release_held(ep)

    def _forget(self, ep: Endpoint) -> None:
        self._endpoints.discard(ep)
        self._probes.pop(ep._conn, None)
        self._release_held(ep)

    def _release_held(self, ep: Endpoint) -> None:
        """``ep`` is gone, its UCX endpoint closed: it no longer holds any memory."""
        for region_id in list(self._held):
            self._revoke_acked(ep, region_id)
