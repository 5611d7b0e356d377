"""The transport contract. These docstrings are the spec every backend implements.

A *connection* between two nodes has two parts:

* a **control channel** (always the tensorx TCP protocol, see ``control.py``):
  authentication, descriptor validation, notifications, error reports;
* **data lanes** (:class:`DataLane`): the one-sided reads and writes. The TCP lane sends
  frames over the control socket; the UCX lane issues ``ucp_put_nbx``/``ucp_get_nbx``; the
  same-host lanes copy straight between the two processes.

A node holds a list of :class:`LaneFactory`, one per backend, each declaring what its
lanes can do (:class:`Capabilities`); ``auto.py`` opens, per endpoint, the lanes both peers
can use and sends each op to the fastest lane that :meth:`DataLane.carries` it.

Every method that waits takes ``timeout`` (seconds, ``None`` = wait forever) and raises
:class:`tensorx.errors.TimeoutError` when it runs out. Backends raise only
:mod:`tensorx.errors` types; backend exceptions are chained with ``raise ... from exc``.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from tensorx.memregion import MemoryRegion, RegionDescriptor

if TYPE_CHECKING:
    from tensorx.transport.control import ControlChannel

__all__ = ["CUDA", "HOST", "Capabilities", "DataLane", "LaneFactory", "Link", "Op"]

HOST, CUDA = "host", "cuda"  # the memory kinds a lane may move


@dataclass(frozen=True)
class Capabilities:
    """What a factory's lanes can do: lanes are chosen by these, never by name."""

    memory: frozenset[str]
    """The memory kinds its lanes move (:data:`HOST`, :data:`CUDA`), on both sides of an op."""
    one_sided: bool
    """True: the owner's code never runs for an op (RMA, cross-memory attach); False:
    emulated, the owner serves each op (the TCP lane)."""
    peer_death: bool
    """A peer that dies fails the lane's ops with ``BrokenError``; False: it can abort or
    hang this process (UCX without error handling)."""
    same_host: bool
    """Only between two processes of one host."""
    rank: int
    """Speed: ``auto`` tries factories from the highest rank down."""


@dataclass(frozen=True)
class Link:
    """One authenticated peer, as a factory sees it when it opens a lane there."""

    peer: str
    """The peer node's id."""
    caps: dict[str, Any]
    """What the peer offered in the handshake: each of its factories' offer under the
    factory's name (see :meth:`LaneFactory.offer`), and its ``"transport"`` setting."""
    binding: bytes
    """Both handshake nonces: unique to this connection, known to both ends only."""
    channel: ControlChannel
    """The control channel to the peer (descriptor checks, the TCP lane's frames)."""

    def offer(self, name: str) -> Any:
        """What the peer's factory called ``name`` offered (None: it offered nothing)."""
        return self.caps.get(name)

    def held_by(self, pid: int) -> str:
        """'' when the kernel says that process ``pid`` of this host (and pid namespace),
        running as this user, holds the peer's end of this connection; else why not.

        What a same-host lane may trust about its peer. Never the peer's word: its node id,
        pid and host are claims it can copy from us (we tell them to every peer), and a
        relay between two nodes can pass each one's claims to the other."""
        return self.channel.other_end.held_by(pid)


class Op(NamedTuple):
    """One one-sided transfer between a local region and a remote descriptor.

    Immutable as a frozen dataclass would be, but one is made per op: a named tuple is
    built in about a third of the time (0.45 against 1.2 us here)."""

    local: MemoryRegion
    remote: RegionDescriptor
    local_offset: int
    remote_offset: int
    nbytes: int


class DataLane(abc.ABC):
    """One-sided data movement to one peer.

    Callers (the endpoint) have already checked, before calling, that the local range lies
    inside ``local`` and the remote range inside ``remote.nbytes`` and that ``remote.access``
    allows the op. A lane must still never touch memory outside the ranges it is given.
    """

    name: str
    """Reported in ``ep.info["transport"]`` for a lane that carries ops between hosts
    (``"tcp"`` or ``"ucx"``) and in ``repr``; never used to choose or route."""

    rdma = False
    """Whether the lane runs on RDMA hardware (``require="rdma"``)."""

    bypasses_owner = False
    """Whether the peer's ops reach this side's memory without this side's code checking
    them (one-sided RMA): the owner then holds a closed region's memory until the peer
    acknowledged the revocation (its ops on it are done)."""

    @property
    @abc.abstractmethod
    def info(self) -> dict[str, Any]:
        """What this lane really uses, for ``ep.info``: ``{"transport", "lanes", "why"}``
        for a lane between hosts; a same-host lane says how it moves the memory kind it
        takes (``{"host": ...}``, ``{"gpu": ...}``)."""

    def carries(self, op: Op) -> bool:
        """Whether this lane moves ``op`` (its memory kinds, the keys its descriptor
        carries). An endpoint sends each op to the fastest of its lanes that carries it;
        the last one (the TCP lane) carries every op. Cheap: asked for every op."""
        return True

    @abc.abstractmethod
    async def write(self, op: Op, *, timeout: float | None) -> None:
        """Copy ``op.nbytes`` from the local region into the remote region.

        Returns once the data is in the remote memory (the write is *complete*, not just
        issued). Raises ``RegionError`` if the owner refuses it (closed, forged, out of range,
        read-only), ``BrokenError`` if the peer or link dies, ``ClosedError`` if the lane was
        closed. If cancelled or timed out, any part of the range (none, all, or pieces: a
        large op may travel in pieces) may have been written; the lane stays
        usable.
        """

    @abc.abstractmethod
    async def read(self, op: Op, *, timeout: float | None) -> None:
        """Copy ``op.nbytes`` from the remote region into the local region.

        Returns once the data is in local memory. Errors as for :meth:`write`. If cancelled,
        any part of the local range may have been overwritten; the lane stays usable.
        """

    @abc.abstractmethod
    async def write_many(self, ops: Sequence[Op], *, timeout: float | None) -> None:
        """Issue all writes, then wait for one completion covering every one of them.

        Raises the first error if any op failed; the other ops may or may not have landed.
        """

    @abc.abstractmethod
    async def flush(self, *, timeout: float | None) -> None:
        """Return once every write issued earlier on this lane is in the remote memory.

        The endpoint calls this before sending a notification, which is how a notification
        is never observed before the data of earlier writes.
        """

    @abc.abstractmethod
    async def aclose(self) -> None:
        """Close gracefully. Idempotent; releases resources even when it fails."""

    async def write_notify(self, ops: Sequence[Op], payload: bytes, *,
                           timeout: float | None) -> bool:
        """Write ``ops`` and have the peer notified with ``payload`` once all of them have
        landed (write with immediate data), where the lane can carry the notification with
        the data itself: then no round trip separates the two, and a write the owner refuses
        is never followed by its notification. Returns False, having done nothing, where it
        cannot (the endpoint then writes, flushes and notifies). Errors as for
        :meth:`write_many`."""
        return False

    async def write_then_notify(self, ops: Sequence[Op], payload: bytes, *,
                                timeout: float | None) -> bool:
        """Write ``ops``, carrying ``payload`` with them where the lane can
        (:meth:`write_notify`, then True); else write them and return False (the endpoint
        then flushes and notifies). One call on the endpoint's hot path in place of two."""
        if await self.write_notify(ops, payload, timeout=timeout):
            return True
        await self.write_many(ops, timeout=timeout)
        return False

    @abc.abstractmethod
    def abort(self) -> None:
        """Close at once; pending operations fail with ``ClosedError``. Idempotent."""

    def peer_gone(self, why: str) -> None:
        """The connection to the peer ended (it left, died or the link broke): release the
        lane at once; pending operations fail with ``BrokenError``. Idempotent."""
        self.abort()


class LaneFactory(abc.ABC):
    """A node-wide backend that registers memory and opens lanes to peers.

    One instance per :class:`tensorx.Node` and backend; the node keeps them in a list
    ordered by :attr:`Capabilities.rank`. Constructing one may apply backend settings
    (environment variables, contexts) - never at import time.
    """

    name: str
    """The key of its offer in the handshake and of its keys in a descriptor."""
    caps: Capabilities

    note = ""
    """The ``ep.info`` key that says why this factory's lane is not used, where it is not
    (the same-host lane for host memory: ``"host"``); empty: none."""

    def register(self, region: MemoryRegion) -> dict[str, Any] | None:
        """Register ``region`` for remote access (cached per region) and return the keys a
        peer needs (they travel in ``RegionDescriptor.keys[self.name]``), or None where
        this backend has nothing to register for it. Deregisters when the region is
        closed."""
        return None

    def hold(self, region: MemoryRegion) -> None:
        """Keep ``region``'s memory mapped and registered, even once it is closed, until
        :meth:`release`: peers may still have ops on it in flight."""
        region.backing.pin()

    def release(self, region: MemoryRegion) -> None:
        """Undo one :meth:`hold`; a closed region is deregistered once nothing holds it."""
        region.backing.unpin()

    def offer(self, binding: bytes) -> Any:
        """What a peer needs to open a lane to us (e.g. a UCX worker address), for the
        connection with ``binding``; sent in the authenticated handshake, so it never
        reaches an unauthenticated peer. None: nothing to offer."""
        return None

    def forget(self, binding: bytes) -> None:
        """The connection with ``binding`` ended: drop what :meth:`offer` kept for it."""
        return None

    def tells_addresses(self, link: Link) -> bool:
        """Whether a lane of this factory from the peer of ``link`` to us needs the virtual
        addresses of our host regions (the answer to its descriptor checks then carries
        them) and the peer may have them. An address is what an attacker needs to aim a
        write, so only a peer that the kernel places on this host may (see
        :meth:`Link.held_by`). False: no address for this factory's sake."""
        return False

    def reaches(self, offer: Any) -> bool:
        """Whether a peer that offered ``offer`` may reach our memory without our code
        (it can open a one-sided lane to us): the node then holds a closed region's memory
        until that peer has acknowledged the revocation. Symmetric by construction: it
        depends only on what both sides offer."""
        return False

    @abc.abstractmethod
    async def open_lane(self, link: Link, *, timeout: float | None) -> DataLane:
        """Open a lane to the peer of ``link``. Raises TransportUnavailableError, saying
        why, if it cannot be reached this way (not offered, another host, refused): the
        node then uses the next factory, or fails under ``require``."""

    async def aclose(self) -> None:
        """Release every registration and the backend context. Idempotent."""
        return None

    def abort(self) -> None:
        """Release at once what :meth:`aclose` would (threads, pools). Idempotent."""
        return None
