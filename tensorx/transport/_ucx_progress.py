"""Who progresses the process's UCX worker: tensorx's driver thread or ucxx's own.

ucxx has one context and one worker per process, so their progress is a fact about the
process, not about a node: :class:`ProgressDriver` is the process's one driver
(``tx_driver_main`` in ``_ucp_build.py``), shared by every :class:`UcxRuntime` that wants
it and stopped when the last one lets go, which hands progress back to ucxx's thread. It
replaces ucxx's thread only where tensorx initialised ucxx itself: another user of ucxx in
the process keeps its own progress.

How long progress may sleep: the driver keeps polling for ``spin_ns`` after the last sign of
work, and for :data:`BUSY_SPIN_NS` while any op is in flight (a copy by cma or posix
happens inside a progress call, a CUDA copy ends on the device, and on some kernels the
worker's fd stays quiet after ``ucp_worker_arm``: none of them wakes a sleeper, and a 1 ms
epoll timeout per op made small UCX ops take milliseconds). Past that it sleeps in epoll on
the worker's fd, at most 1 ms while any op is in flight and 100 ms otherwise; ucxx's thread
sleeps at most 1 ms (its ``epoll_timeout``). :attr:`ProgressDriver.timeouts` counts the
sleeps an op in flight ended by timing out (none in steady state). Either way the event
loop never has to poll: a completion reaches it through the runtime's eventfd.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
from typing import Any, ClassVar

from tensorx import _cuda
from tensorx.errors import TensorxError
from tensorx.transport._ucp import UcpLib

__all__ = ["ProgressDriver"]

logger = logging.getLogger("tensorx.transport.ucx")

BUSY_SPIN_NS = 2_000_000
"""How long the driver keeps polling while an op is in flight and nothing moves (2 ms:
longer than a small op's round trip over tcp or a large device copy), before it sleeps in
epoll; ``$TENSORX_UCX_BUSY_SPIN_US`` overrides. Never less than ``spin_ns``, and none
where ``spin_ns`` is 0 (one core: polling only delays the threads that share it)."""


def busy_spin_ns(spin_ns: int) -> int:
    if spin_ns <= 0:
        return 0
    env = os.environ.get("TENSORX_UCX_BUSY_SPIN_US")
    busy = int(float(env) * 1000) if env else BUSY_SPIN_NS
    return max(spin_ns, busy)


class ProgressDriver:
    """The process's progress driver thread (see the module docstring)."""

    _lock = threading.Lock()
    _running: ClassVar[ProgressDriver | None] = None
    _ours: ClassVar[set[int]] = set()  # UCP contexts tensorx created (by handle)

    def __init__(self, ucp: UcpLib, ctx: Any, handle: Any) -> None:
        self._ucp = ucp
        self._ctx = ctx
        self._handle = handle
        self._users = 0
        self._cuda_device: int | None = None  # whose context the driver thread has

    @classmethod
    def created(cls, context: int) -> None:
        """tensorx initialised ucxx, whose UCP context is ``context``: it may drive it."""
        cls._ours.add(context)

    @classmethod
    def acquire(cls, ucp: UcpLib, ctx: Any, spin_ns: int) -> ProgressDriver | None:
        """The running driver, started (in place of ucxx's thread) if none runs; None
        where ucxx is another user's, or the driver failed to start (logged)."""
        with cls._lock:
            if int(ctx.context.handle) not in cls._ours:
                return None
            driver = cls._running
            if driver is None:
                driver = cls._start(ucp, ctx, spin_ns)
                if driver is None:
                    return None
            driver._users += 1  # noqa: SLF001 (same class: counts its instance's users)
            return driver

    @classmethod
    def _start(cls, ucp: UcpLib, ctx: Any, spin_ns: int) -> ProgressDriver | None:
        err = ucp.ffi.new("int *")
        ctx.worker.stop_progress_thread()
        handle = ucp.lib.tx_driver_start(int(ctx.worker.handle), spin_ns,
                                         busy_spin_ns(spin_ns), err)
        if handle == ucp.ffi.NULL:
            _start_ucxx_thread(ctx)
            logger.warning("UCX progress driver failed to start (%s); using ucxx's",
                           ucp.status_string(err[0]))
            return None
        driver = cls._running = cls(ucp, ctx, handle)
        atexit.register(driver._stop)  # before ucxx's teardown (atexit is LIFO)
        if _cuda.available():  # a CUDA process: its context, on the driver thread too
            driver._apply_cuda(_cuda_device())
        return driver

    def release(self) -> None:
        """One user less; the last one stops the driver and gives progress back to ucxx."""
        with self._lock:
            self._users -= 1
            if self._users or self._handle is None:
                return
            self._stop()
            _start_ucxx_thread(self._ctx)

    def _stop(self) -> None:
        """Stop the thread (at exit, or when the last user is gone)."""
        self._cuda_device = None
        if self._handle is not None:
            self._ucp.lib.tx_driver_stop(self._handle)
            self._handle = None
            atexit.unregister(self._stop)
        if ProgressDriver._running is self:
            ProgressDriver._running = None

    def set_cuda(self, device: int) -> None:
        """Make ``device``'s primary context current on the driver thread (UCX's CUDA
        transports progress in the thread's current context). Idempotent per device."""
        with self._lock:
            self._apply_cuda(device)

    def _apply_cuda(self, device: int) -> None:
        if self._handle is None or self._cuda_device == device:
            return
        try:
            context = _cuda.primary_context(device)
        except TensorxError as exc:
            logger.warning("UCX progress thread gets no CUDA context: %s", exc)
            return
        self._ucp.lib.tx_driver_set_cuda(self._handle, context)
        self._cuda_device = device

    @property
    def sleeps(self) -> int:
        """Times the driver slept in epoll since it started."""
        return 0 if self._handle is None else int(self._ucp.lib.tx_driver_sleeps(self._handle))

    @property
    def timeouts(self) -> int:
        """Sleeps that an op in flight ended by timing out: it completed, or was seen to,
        only up to 1 ms late (zero in steady state; see the module docstring)."""
        if self._handle is None:
            return 0
        return int(self._ucp.lib.tx_driver_timeouts(self._handle))

    def cuda_status(self) -> int:
        """-1 pending, 0 current, -2 no libcuda, >0 a CUresult."""
        return -1 if self._handle is None else int(self._ucp.lib.tx_driver_cuda(self._handle))


def _cuda_device() -> int:
    import torch  # noqa: PLC0415 (optional dependency)

    return int(torch.cuda.current_device())


def _context_on_thread(device: int) -> None:
    try:
        _cuda.make_current(device)
    except TensorxError as exc:  # never raise inside ucxx's thread
        logger.warning("UCX progress thread gets no CUDA context: %s", exc)


def _start_ucxx_thread(ctx: Any) -> None:
    """Give progress (back) to ucxx's thread, with the CUDA context made current on it
    first when this process uses CUDA, as ucxx does when it starts that thread itself."""
    if _cuda.available():
        device = _cuda_device()
        ctx.worker.set_progress_thread_start_callback(_context_on_thread, cb_args=(device,))
    ctx.worker.start_progress_thread(False, 1)
