"""A node's endpoints and what it keeps for each: the side of the node an endpoint reports to.

:class:`Peers` is the node's :class:`~tensorx.endpoint.EndpointEvents`: an endpoint tells it
that its connection was lost, came back or ended, that its peer acknowledged a revocation,
or that it was closed; it asks it for the node's timeout, notification queue and dialer.
It keeps the endpoints with the binding of their connection's handshake (under which the
lane factories keep what they offered), the nodes met at each address, and the memory of
revoked exports that peers may still reach, until each has acknowledged.

What a peer can make the node hold this way is bounded in time: a peer that has not
acknowledged a revocation within the node's timeout (:data:`UNTIMED_ACK_DEADLINE` where it
has none) is cut off, as one that broke the protocol: its connection ends, which closes its
lanes (so they reach our memory no more), and then the memory is let go.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence

from tensorx._loud import fallback
from tensorx._redial import PeerHistory
from tensorx._text import gist, printable
from tensorx.endpoint import Connection, Endpoint
from tensorx.memregion import MemoryRegion, RegionDescriptor
from tensorx.transport.base import LaneFactory

__all__ = ["UNTIMED_ACK_DEADLINE", "Peers"]

logger = logging.getLogger("tensorx.node")  # its lines read as the node's

# Seconds a peer has to acknowledge a revocation where the node has no timeout: generous
# (its ops in flight finish first), yet a peer that never does costs memory for no longer.
UNTIMED_ACK_DEADLINE = 300.0


class Peers:
    """The endpoints of node ``node_id`` and what it keeps for them (see the module).

    ``factories``: the node's lane factories now (they grow when UCX starts late).
    ``dial``, ``timeout``, ``notifications``, ``disconnected``: the node's, for its
    endpoints. ``ucx_expected``: UCX is installed here and the node's transport is "auto",
    so an endpoint without it falls back (set by the node once it made its factories)."""

    def __init__(self, node_id: str, factories: Callable[[], Sequence[LaneFactory]], *,
                 dial: Callable[[str, float | None], Awaitable[Connection]],
                 timeout: Callable[[], float | None],
                 notifications: asyncio.Queue[tuple[Endpoint, bytes]],
                 disconnected: asyncio.Queue[Endpoint]) -> None:
        self._id = node_id
        self._factories = factories
        self._dial = dial
        self._timeout = timeout
        self.notifications = notifications
        self._disconnected = disconnected
        self.ucx_expected = False
        self.endpoints: dict[Endpoint, bytes] = {}  # and their connection's binding
        self._met = PeerHistory()  # which nodes we reached at each address
        # revoked exports, as (region id, cookie), whose memory peers may still reach:
        # the region and the peers yet to acknowledge that revocation
        self.held: dict[tuple[int, int], tuple[MemoryRegion, set[Endpoint]]] = {}
        self._overdue: dict[tuple[int, int], asyncio.TimerHandle] = {}  # each one's deadline
        self._loop: asyncio.AbstractEventLoop | None = None  # the endpoints', once one came

    # -- asked by endpoints -------------------------------------------------------------
    @property
    def timeout(self) -> float | None:
        return self._timeout()

    async def dial(self, address: str, timeout: float | None) -> Connection:
        return await self._dial(address, timeout)

    def met(self, address: str, peer: str) -> None:
        """We reached node ``peer`` at ``address``."""
        self._met.met(address, peer)

    def former_peers(self, address: str) -> list[str]:
        """The nodes this node reached at ``address`` before the one there now: a
        descriptor of theirs is one of a node that restarted."""
        return self._met.former(address)

    # -- endpoints come -----------------------------------------------------------------
    def adopt(self, ep: Endpoint, binding: bytes, accepted: bool = False) -> None:
        """``ep`` is ours, on a connection just made (under the handshake's ``binding``):
        one short INFO line says how it moves data (the reasons go to DEBUG and
        ``ep.info``), and the first fallback from UCX in this process is a WARNING (on
        the side that connected where the peer is the reason: a server is not made to
        warn by what its clients lack)."""
        self.endpoints[ep] = binding
        self._loop = asyncio.get_running_loop()
        info = ep.info
        skipped = info.get("skipped", {})
        missed = [f"{name} ({printable(gist(str(why)), 80)})" for name, why in skipped.items()
                  if not str(why).startswith("off")]
        logger.info("endpoint %s <-> %s (%s): transport=%s lanes=%s%s%s", self._id, ep.peer,
                    ep.address, info["transport"], ",".join(info["lanes"]),
                    f" gpu={gist(info['gpu'])}" if "gpu" in info else "",
                    f"; not used: {', '.join(missed)}" if missed else "")
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("endpoint %s <-> %s: why=%s; host=%s; gpu=%s; skipped=%s", self._id,
                         ep.peer, printable(info["why"], 2000),
                         printable(info.get("host", "none"), 2000),
                         info.get("gpu", "no GPU path"), printable(skipped, 4000))
        if self.ucx_expected and info["transport"] != "ucx":
            self._say_no_ucx(ep, str(skipped.get("ucx", "")), accepted)

    def _say_no_ucx(self, ep: Endpoint, why: str, accepted: bool) -> None:
        """UCX is installed here, yet ``ep`` moves data over tensorx's TCP lane."""
        peer_side = "the peer" in why
        if peer_side and accepted:
            logger.info("endpoint from %s: no UCX (%s)", ep.address, printable(gist(why)))
            return
        how = ("make it usable on the peer too (`tensorx info` there says why it is not: not "
               "installed, or no RDMA device without TENSORX_UCX_TCP=1)" if peer_side
               else "an RDMA NIC, or on a trusted network TENSORX_UCX_TCP=1 (or "
               "ucx_options={'allow_tcp': True})")
        fallback(logger, "ucx", "UCX is installed but unused (%s): data goes over tensorx's "
                 "TCP lane%s. To use UCX: %s; transport='tcp' chooses TCP without this "
                 "warning", printable(gist(why) or "it did not open", 160),
                 ", host memory to same-host peers by CMA" if "cma" in ep.info["lanes"]
                 else "", how)

    def relinked(self, ep: Endpoint, binding: bytes) -> None:
        """``ep`` reconnected, under the handshake's ``binding``."""
        if ep in self.endpoints:
            self.adopt(ep, binding)

    # -- endpoints go -------------------------------------------------------------------
    def lost(self, ep: Endpoint, exc: BaseException | None) -> None:
        """``ep``'s connection ended and it reconnects: it stays ours, but what was kept
        for that connection (offers, memory held for its peer) goes."""
        logger.warning("endpoint to %s (%s) lost its connection (%s); reconnecting",
                       ep.peer, ep.address, printable(str(exc or "the peer closed it")))
        binding = self.endpoints.get(ep)
        if binding:
            self.forget_offers([binding])
        self.endpoints[ep] = b""
        self._release_held(ep)

    def ended(self, ep: Endpoint, exc: BaseException | None) -> None:
        """``ep``'s connection ended (the peer left or broke it, or we closed it); it has
        released its lanes."""
        if exc is not None:
            logger.warning("endpoint to %s broke: %s", ep.peer, printable(str(exc)))
        if ep in self.endpoints:
            self.closed(ep)
            self._disconnected.put_nowait(ep)
        self._release_held(ep)

    def closed(self, ep: Endpoint) -> None:
        """``ep`` is closed or gone: no longer ours, and it holds no memory of ours."""
        binding = self.endpoints.pop(ep, None)
        if binding is not None:
            self.forget_offers([binding])
        self._release_held(ep)

    def forget_offers(self, bindings: list[bytes]) -> None:
        """What the lane factories offered under these handshakes' bindings goes."""
        for binding in bindings:
            for factory in self._factories():
                factory.forget(binding)

    # -- revocations --------------------------------------------------------------------
    def revoke(self, region: MemoryRegion, export: RegionDescriptor) -> None:
        """Tell every connected peer that ``export`` of ``region`` is gone, and hold the
        memory for those that may reach it without us until each has acknowledged this
        revocation (see ``Node.unexport``), or has been cut off for not doing so in time."""
        holders = set()
        for ep in list(self.endpoints):  # a peer found gone as it is told leaves the dict
            ep.tell_unexported(export)
            if ep.bypassed and not ep.closed:
                holders.add(ep)
        if not holders:
            return
        for factory in self._factories():
            factory.hold(region)
        key = (export.region_id, export.cookie)
        self.held[key] = (region, holders)
        assert self._loop is not None  # holders are endpoints, which adopt() saw
        timeout = self._timeout()
        deadline = UNTIMED_ACK_DEADLINE if timeout is None else timeout
        self._overdue[key] = self._loop.call_later(deadline, self._cut_off, key, deadline)

    def _cut_off(self, key: tuple[int, int], deadline: float) -> None:
        """The peers still holding ``key`` did not acknowledge its revocation within
        ``deadline`` seconds: end their connections. Each one's end closes its lanes, and
        then lets go of what it held (:meth:`ended`, :meth:`lost`)."""
        self._overdue.pop(key, None)
        if key not in self.held:
            return
        for ep in list(self.held[key][1]):
            logger.warning("peer %s (%s) did not acknowledge the revocation of region %#x "
                           "within %s s; cutting it off to release the memory",
                           printable(ep.peer), printable(ep.address), key[0], deadline)
            ep.cut_off(f"did not acknowledge the revocation of region {key[0]:#x} within "
                       f"{deadline} s")

    def revoke_acked(self, ep: Endpoint, region_id: int, cookie: int) -> None:
        """``ep``'s peer has no op on that export of the region in flight any more."""
        if (region_id, cookie) in self.held:
            self._release(ep, (region_id, cookie))

    def _release(self, ep: Endpoint, key: tuple[int, int]) -> None:
        region, holders = self.held[key]
        holders.discard(ep)
        if not holders:
            del self.held[key]
            overdue = self._overdue.pop(key, None)
            if overdue is not None:
                overdue.cancel()
            for factory in self._factories():
                factory.release(region)

    def _release_held(self, ep: Endpoint) -> None:
        """``ep`` is gone, its UCX endpoint closed: it no longer holds any memory."""
        for key in list(self.held):
            self._release(ep, key)
