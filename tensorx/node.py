"""Node: one process's presence on the network. Exports regions, makes and accepts endpoints.

A node holds its lane factories in a list, fastest first (same-host lanes, UCX, TCP last);
the lanes are chosen per endpoint by what both peers can do (``transport/auto.py``) and
always reported: one INFO line per endpoint naming transport, lanes and why.
"""

from __future__ import annotations

import asyncio
import importlib.util
import ipaddress
import logging
import os
import secrets
import socket
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import urlsplit

from tensorx import _auth, _wire
from tensorx._deadline import Deadline, wait_for
from tensorx._exports import ExportTable
from tensorx._peers import Peers
from tensorx._queues import LatestQueue, NotificationQueue
from tensorx._text import gist, printable
from tensorx.endpoint import DEFAULT, Connection, Endpoint
from tensorx.errors import (
    ClosedError,
    TensorxError,
    TimeoutError,
    TransportUnavailableError,
    UsageError,
)
from tensorx.memregion import MemoryRegion, RegionDescriptor, check_name, host_id
from tensorx.transport import auto, handshake
from tensorx.transport._sock import TcpListener, open_socket
from tensorx.transport._ucx_later import UcxLater
from tensorx.transport.base import LaneFactory, Link
from tensorx.transport.cma import CmaFactory
from tensorx.transport.cma import enabled as same_host_enabled
from tensorx.transport.control import ControlChannel
from tensorx.transport.cuda_ipc import CudaIpcFactory
from tensorx.transport.cuda_ipc import enabled as cuda_ipc_enabled
from tensorx.transport.gate import Gate
from tensorx.transport.owner import OwnerService
from tensorx.transport.tcp import TcpFactory

__all__ = ["Node"]

logger = logging.getLogger(__name__)

SHM_KEY = "shm"  # a descriptor's /dev/shm name and host, for Node.attach

TRANSPORTS = ("auto", "tcp", "ucx")
MAX_DISCONNECTED = 1024  # disconnect events kept for a user who never reads them


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _installed(module: str) -> bool:
    """Whether ``module`` is installed (without importing it)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


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
    ``timeout``: default seconds for every wait (``None``: forever), and what a peer has
    to acknowledge a revocation (see :meth:`unexport`; five minutes where ``None``).
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

    def __init__(self, listen: str | None = "tcp://127.0.0.1:0", *, transport: str = "auto",  # noqa: PLR0913 (the public constructor's keyword options)
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
        if require not in auto.REQUIREMENTS:
            raise UsageError(f"require must be one of {auto.REQUIREMENTS}, got {require!r}")
        self.id = secrets.token_hex(8)
        self.transport = transport
        self.require = require
        self.timeout = timeout
        self._listen = listen
        self._given_token = _auth.resolve_token(token)
        self._token = b""
        self._gate = Gate(self.id, handshake_timeout, max_handshakes)
        self._ucx_options = dict(ucx_options or {})
        self._insecure = insecure
        self._cuda_ipc = cuda_ipc_enabled(cuda_ipc)
        self._same_host = same_host_enabled(same_host, transport)
        self._exports = ExportTable(self.id)
        self._factories: list[LaneFactory] = []  # fastest first, TCP last
        self._unavailable: dict[str, str] = {}  # factories this node could not start: why
        self._ucx_later: UcxLater | None = None  # UCX, until a peer offers it (see there)
        self._listener: TcpListener | None = None
        self._handler = handler
        self._handling: set[asyncio.Task[None]] = set()  # handler(ep) tasks
        self._state = "new"
        self.notifications: asyncio.Queue[tuple[Endpoint, bytes]] = NotificationQueue(
            *notify_queue)
        self.disconnected: asyncio.Queue[Endpoint] = LatestQueue(
            MAX_DISCONNECTED, f"node {self.id}: disconnected endpoints")
        # our endpoints and what we keep for them; what they report to (see _peers.py)
        self._peers = Peers(self.id, lambda: self._factories, dial=self._dial,
                            timeout=lambda: self.timeout, notifications=self.notifications,
                            disconnected=self.disconnected)

    def __repr__(self) -> str:
        return f"<Node {self.id} {self._state} {self.address if self._listener else ''}>"

    # -- lifecycle ----------------------------------------------------------------------
    async def start(self) -> Node:
        if self._state != "new":
            raise UsageError(f"this node is {self._state} already: start() it once (`async "
                             "with Node(...)` starts it); a closed node cannot start again")
        self._state = "starting"
        self._token = self._resolve_secret()
        self._gate.credential = _auth.credential(self._given_token, self._insecure)
        self._factories = self._make_factories()
        if self._listen is not None:
            scheme, host, port = parse_address(self._listen)
            self._check_exposure(host)
            if scheme == "ucx" and not self._one_sided():
                raise TransportUnavailableError(
                    f"cannot listen on ucx://: {self._unavailable.get('ucx', 'no UCX')}")
            self._listener = await TcpListener.start(host, port, self._on_accept)
        self._state = "running"
        logger.info("node %s up: %s; lanes %s%s", self.id,
                    self.address if self._listener else "client only",
                    ", ".join(f.name for f in self._factories),
                    "".join(f"; no {name}: {gist(why)}"
                            for name, why in self._unavailable.items())
                    + ("; ucx once a peer offers it" if self._ucx_later else ""))
        if self._unavailable:
            logger.debug("node %s: lane factories not started: %s", self.id,
                         "; ".join(f"{k}: {v}" for k, v in self._unavailable.items()))
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

    def _make_factories(self) -> list[LaneFactory]:
        """The lane factories, fastest first: the same-host lanes (each says why it is off,
        where it is), UCX where it starts, TCP."""
        factories: list[LaneFactory] = [CudaIpcFactory(self._cuda_ipc),
                                        CmaFactory(self.id, self._same_host)]
        ucx = self._make_ucx()
        if ucx is not None:
            factories.append(ucx)
        factories.append(TcpFactory())
        return sorted(factories, key=lambda f: -f.caps.rank)

    def _make_ucx(self) -> LaneFactory | None:
        if self.transport == "tcp":
            self._unavailable["ucx"] = "off (asked for transport='tcp')"
            return None
        if (self._listen is None and self.transport == "auto" and self.require is None
                and _installed("ucxx")):
            later = UcxLater(self._ucx_options)  # see transport/_ucx_later.py
            why = later.prepare()
            if why:
                self._unavailable["ucx"] = why
            else:
                self._ucx_later = later
            self._peers.ucx_expected = True  # TCP is a fallback
            return None
        try:
            from tensorx.transport.ucx import UcxFactory  # noqa: PLC0415 (UCX code loads only when UCX is chosen)

            self._peers.ucx_expected = self.transport == "auto" and _installed("ucxx")
            UcxFactory.check_settings(self._ucx_options)
            return UcxFactory(**self._ucx_options)
        except (ImportError, TransportUnavailableError) as exc:
            why = f"UCX unavailable ({exc})"
            if self.transport == "ucx" or self.require is not None:
                raise TransportUnavailableError(why) from exc
            self._unavailable["ucx"] = why
            return None

    def _one_sided(self) -> bool:
        """Whether this node offers a one-sided lane between hosts (a ``ucx://`` address)."""
        return any(f.caps.one_sided and not f.caps.same_host for f in self._factories)

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
            await asyncio.gather(*(ep.aclose() for ep in list(self._peers.endpoints)),
                                 return_exceptions=True)
        finally:
            for factory in self._factories:  # every lane has waited for its ops
                await factory.aclose()
            if self._ucx_later is not None:
                await self._ucx_later.aclose()

    def abort(self) -> None:
        for task in list(self._handling):
            task.cancel()
        for ep in list(self._peers.endpoints):
            ep.abort()
        for factory in self._factories:
            factory.abort()
        if self._ucx_later is not None:
            self._ucx_later.abort()
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
        scheme = "ucx" if self._one_sided() else "tcp"
        return f"{scheme}://{host}:{port}"

    @property
    def endpoints(self) -> list[Endpoint]:
        return list(self._peers.endpoints)

    # -- memory -------------------------------------------------------------------------
    def export(self, region: MemoryRegion | Any, access: str = "rw", *,
               name: str | None = None) -> RegionDescriptor:
        """Make ``region`` reachable by authenticated peers with ``access`` ("r", "w", "rw").
        Returns the descriptor to hand to peers. Closing the region unexports it.

        ``region``: a :class:`MemoryRegion`, or an object to register (a tensor or array
        gives the descriptor its dtype and shape, for :meth:`Endpoint.read_rows`).
        ``name``: a peer may then get the descriptor with ``await ep.lookup(name)`` (1 to
        64 printable characters). The name belongs to this export: exporting another
        region under it unexports the region that had it (as :meth:`unexport` does; its
        peers then look the name up again), and :meth:`unexport` frees it.

        Each export has a descriptor of its own (a fresh cookie). Exporting a region again
        (after :meth:`unexport`, or while it is exported) gives peers a new descriptor that
        they may use at once; the earlier export is revoked as :meth:`unexport` does, so
        its descriptor stays refused (and its name is dropped unless given again)."""
        self._check_running()
        if name is not None:
            check_name(name)
        if not isinstance(region, MemoryRegion):
            region = MemoryRegion.register(region, writable="w" in access)
        keys: dict[str, Any] = {}
        for factory in self._factories:
            mine = factory.register(region)
            if mine is not None:
                keys[factory.name] = mine
        created = region.backing.created_file  # a /dev/shm file of ours: peers may map it
        if created is not None:
            keys[SHM_KEY] = {"host": host_id(), "name": created}
        holder = self._exports.holder(name) if name is not None else None
        if holder is not None and holder is not region:
            self.unexport(holder)
        replaced = self._exports.remove(region)
        desc = self._exports.add(region, access, keys, name)
        if replaced is not None:
            self._peers.revoke(region, replaced)
        region.add_close_callback(self.unexport)
        logger.debug("exported %r as %s%s", region, access,
                     "" if name is None else f" under the name {printable(name)!r}")
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
        a late write lands in the old memory, never in memory reused for something else.
        A peer that has not acknowledged within the node's ``timeout`` is cut off (its
        connection ended as broken, a WARNING logged), and then the memory goes."""
        exported = self._exports.remove(region)
        if exported is not None:
            self._peers.revoke(region, exported)

    def exports(self) -> list[RegionDescriptor]:
        """Descriptors of every region this node exports now."""
        return self._exports.regions()

    # -- endpoints ----------------------------------------------------------------------
    def _caps_for(self, bindings: list[bytes], channel: ControlChannel
                  ) -> Callable[[bytes], dict[str, Any]]:
        """Our capabilities for one connection, given its handshake binding: each factory's
        offer under its name. The binding is kept in ``bindings``, so what the factories
        keep for it can be forgotten if the connection fails before it has an endpoint.
        The same-host lanes' offers (our pid, a probe's address) go only to a peer whose
        end of the connection the kernel shows to be a socket of this user on this host:
        nobody else could use them, and an address helps an attacker aim."""

        def caps(binding: bytes) -> dict[str, Any]:
            bindings.append(binding)
            offers = {f.name: f.offer(binding) for f in self._factories}
            near = [f.name for f in self._factories
                    if f.caps.same_host and offers[f.name] is not None]
            if near and channel.other_end.same_user():
                offers.update(dict.fromkeys(near))
            return {"transport": self.transport,
                    **{name: offer for name, offer in offers.items() if offer is not None}}

        return caps

    async def connect(self, address: str, *, timeout: float | None = DEFAULT,
                      reconnect: float | None = None) -> Endpoint:
        """Connect and authenticate to the node at ``address``; ``timeout`` is one budget for
        connecting, the handshake and opening the data lanes.

        ``reconnect``: seconds. The endpoint then outlives its connection: when the
        connection ends (the peer closed, died or restarted, the link broke), ops in
        flight fail with BrokenError and it connects to ``address`` again, retrying with
        backoff (0.1 s doubling to 2 s, with jitter, as ``Worker(reconnect=)``) for up to
        that many seconds; ops issued meanwhile wait for it. A restarted peer is a new
        node with new descriptors: look them up again (``ep.lookup(name)``). See
        :class:`Endpoint` and docs/faults.md."""
        self._check_running()
        if reconnect is not None and (not isinstance(reconnect, int | float)
                                      or isinstance(reconnect, bool) or reconnect <= 0):
            raise UsageError(f"reconnect is seconds to keep trying (a number > 0) or None, "
                             f"not {reconnect!r}")
        conn = await self._dial(address, self.timeout if timeout is DEFAULT else timeout)
        ep = Endpoint(self._peers, conn, address=address, reconnect=reconnect)
        self._peers.adopt(ep, conn.binding)
        return ep

    async def _dial(self, address: str, timeout: float | None) -> Connection:
        """Connect, authenticate and open the lanes to ``address``, within ``timeout``."""
        self._check_running()
        deadline = Deadline(timeout)
        _, host, port = parse_address(address)
        try:
            sock = await wait_for(open_socket(host, port), deadline.left())
        except asyncio.TimeoutError:
            raise TimeoutError(f"connecting to {address} timed out after {timeout:g} s "
                               "(no answer: a firewall, or a host that is down?)") from None
        channel = ControlChannel(sock, f"{self.id}->{address}")
        bindings: list[bytes] = []
        try:
            hello = await handshake.initiate(
                channel, self.id, self._token, self._caps_for(bindings, channel),
                deadline.left(), _auth.refused(self._gate.credential, self._given_token),
                prepare=self._meet)
            conn = await self._finish(channel, hello, deadline.left())
            self._peers.met(address, conn.peer)
            return conn
        except BaseException:
            self._peers.forget_offers(bindings)
            channel.abort()
            raise

    async def _meet(self, caps: dict[str, Any]) -> None:
        """A peer we connect to offered ``caps``, before we say what we offer: a node that
        starts UCX late starts it now if the peer offers UCX (see ``_ucx_later.py``)."""
        later = self._ucx_later
        if later is None or not later.offered(caps):
            return
        factory = await later.start()  # closed by later.aclose() if never ours
        self._check_running()
        if self._ucx_later is later:  # not yet taken by another connection's start
            self._ucx_later = None
            if factory is None:
                self._unavailable["ucx"] = later.why
                return
            self._factories = sorted([*self._factories, factory], key=lambda f: -f.caps.rank)
            self._exports.add_keys(factory.name, factory.register)

    async def _on_accept(self, sock: socket.socket) -> None:
        try:
            peer = "{}:{}".format(*sock.getpeername()[:2])
        except OSError:  # already gone
            sock.close()
            return
        channel = ControlChannel(sock, f"{self.id}<-{peer}")
        deadline = Deadline(self.timeout)  # one budget for the handshake and the lanes
        bindings: list[bytes] = []
        try:
            hello = await self._gate.admit(channel, peer, self._token,
                                           self._caps_for(bindings, channel), deadline)
            conn = await self._finish(channel, hello, deadline.left())
            ep = Endpoint(self._peers, conn, address=f"tcp://{peer}",
                          claimed=self._handler is not None)
            self._peers.adopt(ep, conn.binding, accepted=True)
            if self._handler is not None:
                self._handle(ep, self._handler)
        except TensorxError as exc:
            self._gate.refused(channel, peer, exc)
            self._peers.forget_offers(bindings)
            channel.abort()
        except BaseException:
            self._peers.forget_offers(bindings)
            channel.abort()
            raise
        finally:
            self._gate.done(channel)

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

    async def _finish(self, channel: ControlChannel, hello: handshake.Hello,
                      timeout: float | None) -> Connection:
        """Open the lanes and end the handshake: the connection's parts, for an endpoint
        to serve the peer on. Lanes that will not do (``require``) refuse the peer,
        telling it why."""
        deadline = Deadline(timeout)
        link = Link(hello.peer, hello.caps, hello.binding, channel)
        try:
            choice = await auto.choose(
                self._factories, link, require=self.require,
                skipped=self._unavailable if self._ucx_later is None
                else {**self._unavailable, "ucx": self._ucx_later.not_offered(link)},
                strict=self.transport == "ucx" or self.require is not None,
                timeout=deadline.left())
        except TensorxError as exc:
            await channel.refuse(exc)
            raise
        try:
            await handshake.conclude(channel, deadline.left())
        except BaseException:
            choice.lane.abort()
            raise
        bypassed = any(f.reaches(link.offer(f.name)) for f in self._factories)
        addresses = any(f.tells_addresses(link) for f in self._factories)
        owner = OwnerService(channel, self._exports, self._answer, addresses)
        return Connection(channel, owner, choice.lane, hello.peer,
                          {**choice.notes, "skipped": choice.skipped}, bypassed,
                          hello.binding)

    def _answer(self, what: str, name: str | None = None, start: int = 0) -> dict[str, Any]:
        """What an authenticated peer may learn about this node (``Endpoint.query``: one
        page of it, from item ``start`` on, see :func:`tensorx._wire.page`), and the
        descriptor of an export it names (``Endpoint.lookup``)."""
        if what == "lookup":
            return {"node": self.id, "desc": self._exports.named(check_name(name)).to_bytes()}
        if what == "exports":
            return _wire.page({"node": self.id, "exports": [
                {"region": f"{d.region_id:#x}", "nbytes": d.nbytes, "device": d.device,
                 "access": d.access, "transports": sorted(d.keys) or ["tcp"],
                 **{k: v for k, v in (("name", d.name), ("dtype", d.dtype),
                                      ("shape", None if d.shape is None else list(d.shape)))
                    if v is not None}}
                for d in self._exports.regions()]}, "exports", start)
        if what == "endpoints":
            return _wire.page({"node": self.id, "endpoints": [
                {k: v for k, v in ep.info.items() if k != "socket"}
                for ep in self._peers.endpoints]}, "endpoints", start)
        raise UsageError(f"unknown query '{printable(what)}'; ask for 'exports' or "
                         "'endpoints'")

