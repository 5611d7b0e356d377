"""Check a peer's UCX worker address where libucp cannot take the node down with it.

libucp trusts the worker address it is given: some malformed ones fail an assertion inside
``ucp_ep_create`` and abort the whole process (SIGABRT). A peer that passed the handshake
could kill a node that way. So before a node hands a peer's address to its own worker, a
throwaway child process (a bare interpreter that loads only the binding) opens an endpoint
to it in a UCX context of its own, configured like ours, and exits. A child that aborts or
fails tells us the address is malformed; the node refuses that peer and keeps serving.

Cost: one child per new address (about 0.1 s on a small host, see the UCX docs); an address
that passed is remembered, so reconnecting peers pay nothing. At most two probes run at once.
"""

from __future__ import annotations

import asyncio
import collections
import os
import signal
import sys
from collections.abc import Mapping

from tensorx._deadline import wait_for
from tensorx.errors import ProtocolError, TimeoutError, TransportUnavailableError

__all__ = ["MAX_ADDRESS", "AddressProbe"]

MAX_ADDRESS = 64 << 10  # far above any real worker address (a few hundred bytes)
_REMEMBERED = 256
UCS_ERR_INVALID_PARAM = -5
_CODE = """
import importlib.machinery, importlib.util, os, sys
sys.path[:0] = sys.argv[3:]  # where cffi's backend lives (-I drops PYTHONPATH and user sites)
path = "/proc/self/fd/" + sys.argv[1]  # the very file the parent checked and loaded
loader = importlib.machinery.ExtensionFileLoader("_tensorx_ucp", path)
mod = importlib.util.module_from_spec(importlib.util.spec_from_loader("_tensorx_ucp", loader))
loader.exec_module(mod)
address = sys.stdin.buffer.read()
st = mod.lib.tx_probe_address(mod.ffi.from_buffer(address), int(sys.argv[2]))
sys.stdout.write("\\n%d %s\\n" % (st, mod.ffi.string(mod.lib.tx_status_string(st)).decode()))
sys.stdout.flush()
os._exit(0 if st == 0 else 3)
"""


def _backend_dirs() -> list[str]:
    """The directory of cffi's ``_cffi_backend``, which the binding imports: the child runs
    isolated (``-I``), so a cffi installed through ``PYTHONPATH`` or a user site would be
    missing there and every probe would fail ("no answer")."""
    import _cffi_backend  # noqa: PLC0415 (optional dependency)

    where = getattr(_cffi_backend, "__file__", None)
    return [os.path.dirname(where)] if where else []


class AddressProbe:
    """Checks peers' worker addresses in child processes; remembers those that passed."""

    def __init__(self, binding: int, ucx_env: Mapping[str, str]) -> None:
        self._binding = binding  # a descriptor on the binding (UcpLib.fd), passed to children
        # no memory-event hooks: installing them is most of a bare libucp's start-up time
        self._env = {**os.environ, **ucx_env, "UCX_MEM_EVENTS": "no"}
        self._passed: collections.OrderedDict[tuple[bytes, bool], None] = (
            collections.OrderedDict())
        self._slots = asyncio.Semaphore(2)

    async def check(self, address: bytes, error_handling: bool, peer: str,
                    timeout: float | None) -> None:
        """ProtocolError if ``address`` is not a worker address libucp can open."""
        if not 0 < len(address) <= MAX_ADDRESS:
            raise ProtocolError(f"{peer} sent a UCX worker address of {len(address)} B")
        key = (address, error_handling)
        if key in self._passed:
            self._passed.move_to_end(key)
            return
        async with self._slots:
            code, status, text = await self._run(address, error_handling, timeout)
        if code < 0:
            raise ProtocolError(f"{peer} sent a malformed UCX worker address: UCX aborted "
                                f"on it ({signal.Signals(-code).name})")
        if code != 0 and status == UCS_ERR_INVALID_PARAM:
            raise ProtocolError(f"{peer} sent a malformed UCX worker address: {text}")
        if code != 0:  # well formed, but this process cannot reach it
            raise TransportUnavailableError(f"UCX cannot reach {peer}: {text}")
        self._passed[key] = None
        if len(self._passed) > _REMEMBERED:
            self._passed.popitem(last=False)

    async def _run(self, address: bytes, error_handling: bool,
                   budget: float | None) -> tuple[int, int, str]:
        """(exit code, negative: killed by that signal; UCS status; its text)."""
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-I", "-c", _CODE, str(self._binding), str(int(error_handling)),
            *_backend_dirs(), stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, env=self._env, pass_fds=(self._binding,))
        try:
            out, err = await wait_for(proc.communicate(address), budget)
        except asyncio.TimeoutError:
            raise TimeoutError(f"checking a peer's UCX address took over {budget} s") from None
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
        assert proc.returncode is not None
        last = out.decode(errors="replace").strip().rsplit("\n", 1)[-1].split(" ", 1)
        try:
            return proc.returncode, int(last[0]), last[-1][:200]
        except ValueError:
            why = err.decode(errors="replace").strip().rsplit("\n", 1)[-1][:200]
            return proc.returncode, 0, f"no answer ({why})" if why else "no answer"
