"""The transport contract. These docstrings are the spec every backend implements.

A *connection* between two nodes has two parts:

* a **control channel** (always the tensorx TCP protocol, see ``tcp.py``): authentication,
  descriptor validation, notifications, error reports;
* a **data lane** (:class:`DataLane`): the one-sided reads and writes. The TCP lane sends
  frames over the control socket; the UCX lane issues ``ucp_put_nbx``/``ucp_get_nbx``.

Every method that waits takes ``timeout`` (seconds, ``None`` = wait forever) and raises
:class:`tensorx.errors.TimeoutError` when it runs out. Backends raise only
:mod:`tensorx.errors` types; backend exceptions are chained with ``raise ... from exc``.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tensorx.memregion import MemoryRegion, RegionDescriptor

__all__ = ["DataLane", "LaneFactory", "Op"]


@dataclass(frozen=True)
class Op:
    """One one-sided transfer between a local region and a remote descriptor."""

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
    """Transport name reported in ``ep.info["transport"]``: ``"tcp"`` or ``"ucx"``."""

    bypasses_owner = False
    """Whether the peer's ops reach this side's memory without this side's code checking
    them (one-sided RMA): the owner then holds a closed region's memory until the peer
    acknowledged the revocation (its ops on it are done)."""

    @property
    @abc.abstractmethod
    def info(self) -> dict[str, Any]:
        """``{"transport": ..., "lanes": [...], "why": ...}`` - what this lane really uses."""

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

    @abc.abstractmethod
    def abort(self) -> None:
        """Close at once; pending operations fail with ``ClosedError``. Idempotent."""

    def peer_gone(self, why: str) -> None:
        """The connection to the peer ended (it left, died or the link broke): release the
        lane at once; pending operations fail with ``BrokenError``. Idempotent."""
        self.abort()


class LaneFactory(abc.ABC):
    """A node-wide backend that registers memory and opens lanes to peers.

    One instance per :class:`tensorx.Node`. Constructing it may apply backend settings
    (environment variables, contexts) - never at import time.
    """

    name: str

    @abc.abstractmethod
    def register(self, region: MemoryRegion) -> dict[str, Any]:
        """Register ``region`` for remote access (cached per region) and return the keys a
        peer needs (they travel in ``RegionDescriptor.keys[self.name]``). Deregisters when
        the region is closed."""

    def hold(self, region: MemoryRegion) -> None:
        """Keep ``region``'s memory mapped and registered, even once it is closed, until
        :meth:`release`: peers may still have ops on it in flight."""
        region._pin()

    def release(self, region: MemoryRegion) -> None:
        """Undo one :meth:`hold`; a closed region is deregistered once nothing holds it."""
        region._unpin()

    @abc.abstractmethod
    def local_info(self) -> dict[str, Any]:
        """What a peer needs to open a lane to us (e.g. a UCX worker address); sent in the
        authenticated handshake, so it never reaches an unauthenticated peer."""

    @abc.abstractmethod
    async def open_lane(self, peer_info: dict[str, Any], *, peer: str,
                        timeout: float | None) -> DataLane:
        """Open a lane to the peer that sent ``peer_info``. Raises TransportUnavailableError
        if it cannot be reached this way (the node then falls back, or fails under
        ``require``)."""

    @abc.abstractmethod
    async def aclose(self) -> None:
        """Release every registration and the backend context. Idempotent."""
