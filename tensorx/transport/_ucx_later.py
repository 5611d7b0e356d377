"""UCX for a node that only connects, started once the first peer offers it.

Loading libucs costs about 0.4 s of a process's start (it installs its memory-event hooks
as it loads), more than the rest of a worker's join together. A node that listens starts
UCX at once: its address and its first answer name UCX. A node that only connects
(``listen=None``) under ``transport="auto"`` without ``require`` learns in each handshake,
before it says what it offers, whether the peer offers UCX; it starts UCX then, and only
then, so its lanes are the ones it would have chosen with UCX started up front, and a node
that never meets a UCX peer never loads it. The binding is built (where it is not yet) at
the node's start, so no compiler runs inside a handshake.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping
from typing import Any

from tensorx.errors import TransportUnavailableError
from tensorx.transport import _ucp
from tensorx.transport.base import LaneFactory, Link

__all__ = ["UcxLater"]


class UcxLater:
    """A :class:`~tensorx.transport.ucx.UcxFactory` to be, built with ``options`` on the
    first :meth:`start`. The caller that installs the factory it gives owns it from then
    on and stops calling this; :meth:`aclose` closes it otherwise."""

    def __init__(self, options: Mapping[str, Any]) -> None:
        from tensorx.transport.ucx import UcxFactory  # noqa: PLC0415 (UCX code loads when UCX starts, not with the node)

        UcxFactory.check_settings(options)  # a bad setting fails now, not at the first peer
        self._options = dict(options)
        self._task: asyncio.Task[LaneFactory | None] | None = None
        self._taken = False
        self.why = ""  # why UCX did not start, once it did not

    @property
    def started(self) -> bool:
        """Whether a start was asked for (it may still be under way)."""
        return self._task is not None

    def prepare(self) -> str:
        """Build the binding where needed (see :func:`._ucp.prepare`): '', or why UCX is
        unavailable here."""
        try:
            _ucp.prepare()
        except TransportUnavailableError as exc:
            return f"UCX unavailable ({exc})"
        return ""

    @staticmethod
    def offered(caps: Any) -> bool:
        """Whether a peer's capabilities offer UCX."""
        return isinstance(caps, dict) and isinstance(caps.get("ucx"), dict)

    @staticmethod
    def not_offered(link: Link) -> str:
        """Why a link to a peer that offered no UCX has no UCX lane (``ep.info``)."""
        return (f"the peer offers no UCX (its transport={link.caps.get('transport')!r}: UCX "
                "not installed or not usable there); not started here")

    async def start(self) -> LaneFactory | None:
        """The factory (one for every caller), or None with :attr:`why` set. The load
        runs in a thread (the dynamic loader lets go of the interpreter meanwhile), so the
        node serves its other connections; a caller cancelled meanwhile leaves it running."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._start())
        return await asyncio.shield(self._task)

    async def _start(self) -> LaneFactory | None:
        try:
            await asyncio.to_thread(_ucp.load)
            from tensorx.transport.ucx import UcxFactory  # noqa: PLC0415 (UCX code loads when UCX starts, not with the node)

            return UcxFactory(**self._options)
        except (ImportError, TransportUnavailableError) as exc:
            self.why = f"UCX unavailable ({exc})"
            return None

    async def aclose(self) -> None:
        """Close a factory that was started but never taken. Idempotent."""
        if self._task is None or self._taken:
            return
        with contextlib.suppress(BaseException):
            factory = await asyncio.shield(self._task)
            self._taken = True
            if factory is not None:
                await factory.aclose()

    def abort(self) -> None:
        """As :meth:`aclose`, at once (a start under way is closed when it ends)."""
        if self._task is None or self._taken:
            return
        self._taken = True
        self._task.add_done_callback(_abort_result)


def _abort_result(task: asyncio.Task[LaneFactory | None]) -> None:
    if not task.cancelled() and task.exception() is None and task.result() is not None:
        factory = task.result()
        assert factory is not None
        factory.abort()
