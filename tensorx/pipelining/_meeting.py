"""How a stage meets the others: its node, where each stage listens (explicit ``peers`` or
the launcher's store), the endpoints it opens to later stages and accepts from earlier ones,
and the messages read from each. It tells its stage what happens through :class:`Events`,
one way: the stage never reaches into it but through the methods below."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Coroutine, Mapping
from typing import Any, Protocol

from tensorx._deadline import Deadline, wait_for
from tensorx._ps.common.rendezvous import Store, advertised, connect_store, wait_keys
from tensorx._text import printable
from tensorx.endpoint import Endpoint
from tensorx.errors import BrokenError, ClosedError, ProtocolError, TensorxError, TimeoutError
from tensorx.node import Node
from tensorx.pipelining._boundary import Routes, quietly, retrieved_future
from tensorx.pipelining._protocol import decode, encode, integer

__all__ = ["Events", "Meeting"]

logger = logging.getLogger("tensorx.pipelining")

STORE_KEY = "tensorx/pp/{}"


class Events(Protocol):
    """What a :class:`Meeting` tells its stage."""

    def message(self, stage: int, msg: dict[str, Any], who: str) -> None:
        """A message from ``stage`` (not a hello or a bye); may raise ProtocolError."""

    def lost(self, stage: int, address: str, how: str) -> None:
        """The link to ``stage`` ended while the stage still needed it."""

    def failed(self, exc: BaseException) -> None:
        """Something a peer sent cannot be served: the stage fails with ``exc``."""

    def check_failed(self) -> None:
        """Raise the stage's failure, if it has one."""


class Meeting:
    """The links of stage ``me`` of ``num_stages`` to the stages ``routes`` names, on the
    stage's loop ``loop``; ``peers``: every stage's address (None: the launcher's store)."""

    def __init__(self, me: int, num_stages: int, routes: Routes, timeout: float,
                 events: Events, loop: asyncio.AbstractEventLoop,
                 peers: Mapping[int, str] | None, store: Store | None) -> None:
        self.me = me
        self.num_stages = num_stages
        self.timeout = timeout
        self._routes = routes
        self._events = events
        self._loop = loop
        self._peers = dict(peers) if peers is not None else None
        self._store = store
        self.node: Node | None = None
        self.links: dict[int, Endpoint] = {}
        self.lanes: dict[int, dict[str, Any]] = {}  # per peer stage, as linked
        self.gone: dict[int, str] = {}  # stages that said bye, or whose link ended
        self.closing = False
        self._waits: dict[int, asyncio.Future[Endpoint]] = {}
        self._addresses: dict[int, str] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._connected = False

    # -- where each stage listens ------------------------------------------------------------
    async def start(self, listen: str | None, transport: str, require: str | None,
                    token: str | bytes | None) -> Node:
        if listen is None:
            if self._peers is not None:
                listen = self._peers[self.me]
            else:
                master = os.environ.get("MASTER_ADDR", "127.0.0.1")
                loopback = master in ("127.0.0.1", "localhost", "::1")
                listen = "tcp://127.0.0.1:0" if loopback else "tcp://0.0.0.0:0"
        node = Node(listen, transport=transport, require=require, token=token,
                    timeout=self.timeout, handler=self._accepted)
        await node.start()
        self.node = node
        return node

    def publish(self) -> None:
        """Say where this stage listens (caller's thread: the store blocks)."""
        if self._peers is not None:
            self._addresses = dict(self._peers)
            return
        assert self.node is not None
        if self._store is None:
            self._store = connect_store(self.timeout)
        self._store.set(STORE_KEY.format(self.me), advertised(self.node.address))

    def _address_of(self, stage: int) -> str:
        if stage not in self._addresses:
            key = STORE_KEY.format(stage)
            # publish() connected it: a stage given peers= has every neighbour's address
            assert self._store is not None
            self._addresses[stage] = wait_keys(
                self._store, [key], self.timeout,
                f"stage {self.me}: stage {stage} did not publish its address ({key})",
                "is it running?")[0]
        return self._addresses[stage]

    # -- links ------------------------------------------------------------------------------
    async def connect(self) -> None:
        """Open the endpoints to the later stages this one shares a boundary with (an
        earlier stage opens the one to us), retrying while they are not up yet."""
        if self._connected:
            return
        for stage in self._routes.neighbours:
            if stage > self.me:
                address = await asyncio.to_thread(self._address_of, stage)
                await self._open(stage, address)
        self._connected = True

    async def _open(self, stage: int, address: str) -> None:
        assert self.node is not None
        deadline = Deadline(self.timeout)
        delay = 0.05
        while True:
            try:
                ep = await self.node.connect(address, timeout=deadline.least(10.0))
                break
            except (BrokenError, TimeoutError, ClosedError) as exc:
                if deadline.expired:
                    raise TimeoutError(f"stage {self.me} could not reach stage {stage} at "
                                       f"{address} within {self.timeout} s: {exc}") from None
                await asyncio.sleep(min(delay, deadline.left() or 0.0))
                delay = min(delay * 2, 1.0)
        messages = ep.messages
        await ep.notify(encode("hello", stage=self.me, stages=self.num_stages))
        self._linked(stage, ep)
        self.watch(self._read(stage, ep, messages))

    async def _accepted(self, ep: Endpoint) -> None:
        """An earlier stage opened an endpoint to us: its first message says which."""
        messages = ep.messages
        try:
            first = decode(await messages.get(self.timeout), f"peer {ep.peer}")
        except TensorxError as exc:
            logger.warning("stage %d: a peer at %s did not introduce itself: %s",
                           self.me, printable(ep.address), exc)
            ep.abort()
            return
        peer = f"peer {printable(ep.peer)}"
        stage = integer(first, "stage", peer, 0, self.num_stages - 1) \
            if first["t"] == "hello" else -1
        if (first["t"] != "hello" or stage >= self.me
                or stage not in self._routes.neighbours or stage in self.links
                or first.get("stages") != self.num_stages):
            logger.warning("stage %d: refused %s at %s: it introduced itself as %s",
                           self.me, peer, printable(ep.address),
                           printable(repr({k: first.get(k) for k in ("t", "stage", "stages")})))
            ep.abort()
            return
        self._linked(stage, ep)
        await self._read(stage, ep, messages)

    def _linked(self, stage: int, ep: Endpoint) -> None:
        self.links[stage] = ep
        info = ep.info
        self.lanes[stage] = {"address": ep.address, "transport": info.get("transport"),
                             "host": info.get("host"), "lanes": info.get("lanes"),
                             "gpu": info.get("gpu")}
        host = f", host memory {info['host']}" if info.get("host") else ""
        logger.info("stage %d <-> stage %d at %s: %s%s", self.me, stage,
                    printable(ep.address), info.get("transport"), printable(host, 120))
        waiter = self._waits.pop(stage, None)
        if waiter is not None and not waiter.done():
            waiter.set_result(ep)

    async def link(self, stage: int, deadline: Deadline, why: str) -> Endpoint:
        """The endpoint to ``stage``, waiting (within ``deadline``) for it to connect."""
        if stage in self.links:
            return self.links[stage]
        self._events.check_failed()
        waiter = self._waits.setdefault(stage, retrieved_future(self._loop))
        try:
            return await wait_for(asyncio.shield(waiter), deadline.left())
        except asyncio.TimeoutError:
            raise TimeoutError(f"stage {self.me} waited {self.timeout:g} s for stage {stage} "
                               f"to connect ({why}); is it running, with "
                               f"num_stages={self.num_stages} and the same peers?") from None

    def address(self, stage: int) -> str:
        return str(self.lanes.get(stage, {}).get("address", "?"))

    def watch(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run ``coro`` on the loop until it ends or the meeting closes."""
        task = self._loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- messages ---------------------------------------------------------------------------
    async def _read(self, stage: int, ep: Endpoint, messages: Any) -> None:
        who = f"stage {stage}"
        try:
            while True:
                payload = await messages.get(None)
                msg = decode(payload, who)
                if msg["t"] == "bye":
                    self.gone[stage] = "closed"
                    continue
                if msg["t"] == "hello":
                    raise ProtocolError(f"{who} introduced itself twice")
                self._events.message(stage, msg, who)
        except ClosedError:
            self._lost(stage, ep, None)
        except BrokenError as exc:
            self._lost(stage, ep, exc)
        except ProtocolError as exc:
            logger.error("stage %d: %s", self.me, exc)
            self._events.failed(exc)
            ep.abort()

    def _lost(self, stage: int, ep: Endpoint, exc: BaseException | None) -> None:
        self.links.pop(stage, None)
        if stage in self.gone or self.closing:
            self.gone.setdefault(stage, "closed")
            return
        how = f"broke ({exc})" if exc is not None else "closed"
        self.gone[stage] = how
        self._events.lost(stage, printable(ep.address), how)

    # -- failing and closing ---------------------------------------------------------------
    def fail(self, exc: BaseException, origin: int, why: str) -> None:
        """Fail every wait for a link with ``exc``; tell every linked stage but ``origin``
        (the one that failed first) that ``origin`` failed, and ``why``. (A stage two
        boundaries away learns who failed, not only that its neighbour stopped.)"""
        for waiter in self._waits.values():
            if not waiter.done():
                waiter.set_exception(exc)
        for stage, ep in list(self.links.items()):
            if stage != origin:
                self.watch(quietly(ep.notify(encode("abort", origin=origin, why=why[:1500]),
                                             timeout=2.0)))

    async def aclose(self) -> None:
        """Say goodbye to every linked stage, stop reading and close the node."""
        self.closing = True
        for ep in list(self.links.values()):
            await quietly(ep.notify(encode("bye"), timeout=1.0))
        for task in list(self._tasks):
            task.cancel()
        if self.node is not None:
            await self.node.aclose()
