"""A stage's event loop, on a daemon thread of its own, and the hand-over of a coroutine to
it from the caller's thread."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from tensorx.errors import ClosedError, TensorxError, TimeoutError

__all__ = ["LoopThread"]

T = TypeVar("T")


class LoopThread:
    """``loop`` running on the daemon thread ``name``; ``what`` (e.g. ``"stage 1"``) names
    its owner in errors."""

    def __init__(self, name: str, what: str) -> None:
        self.what = what
        # asyncio's loop, not uvloop: uvloop's refuse to start subprocesses from two
        # threads at once (stages in one process each have a loop; UCX's address probe
        # starts one)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True, name=name)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def call(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the loop and wait for its result (ClosedError once the loop is
        stopped; TimeoutError, the coroutine cancelled, after ``timeout`` seconds)."""
        if not self._thread.is_alive():
            coro.close()
            raise ClosedError(f"{self.what} is closed")
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(timeout)
        except TensorxError:  # (our TimeoutError is a builtins.TimeoutError too)
            raise
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(f"{self.what}: a call into its loop took over {timeout} s"
                               ) from None

    def stop(self) -> None:
        """Stop the loop (waiting up to 10 s for its thread) and close it; idempotent."""
        if self._thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10.0)
        if not self._thread.is_alive() and not self.loop.is_closed():
            self.loop.close()
