"""Two "hosts" on one machine: network namespaces joined by a veth pair.

``two_hosts()`` creates namespaces of its own (names carry this process's id), a veth pair
with 10.203.0.1/24 (server side) and 10.203.0.2/24 (client side), and removes everything on
exit, also on failure. Traffic only ever flows between these two namespaces. Where
namespaces cannot be made (no root, no ``ip``, a container without CAP_SYS_ADMIN) it raises
:class:`Unavailable` with the reason, and callers skip with a message.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator

from benchmarks.baselines.pair import NETWORK_ONLY, Placement

SERVER_IP = "10.203.0.1"
CLIENT_IP = "10.203.0.2"
PREFIX = 24


class Unavailable(RuntimeError):
    """Network namespaces cannot be used here; the message says why."""


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise Unavailable(f"`ip {' '.join(args)}` failed: {done.stderr.strip()}")


def _setup(ns: tuple[str, str], veth: tuple[str, str]) -> None:
    _ip("link", "add", veth[0], "type", "veth", "peer", "name", veth[1])
    for name, dev, addr in zip(ns, veth, (SERVER_IP, CLIENT_IP), strict=True):
        _ip("link", "set", dev, "netns", name)
        _ip("-n", name, "addr", "add", f"{addr}/{PREFIX}", "dev", dev)
        _ip("-n", name, "link", "set", dev, "up")
        _ip("-n", name, "link", "set", "lo", "up")


def _env(dev: str) -> dict[str, str]:
    # Two namespaces still share one kernel, so TensorPipe (shm, cma) and UCX (cma, posix)
    # would find same-host shortcuts that two real hosts do not have: network lanes only.
    # TensorPipe and its Gloo rendezvous also need the interface named (else: hostname).
    return {"TP_SOCKET_IFNAME": dev, "GLOO_SOCKET_IFNAME": dev, NETWORK_ONLY: "1",
            "UCX_TLS": "tcp"}


def _placement(ns: tuple[str, str], veth: tuple[str, str]) -> Placement:
    return Placement("two namespaces (veth)", SERVER_IP,
                     server_prefix=("ip", "netns", "exec", ns[0]),
                     client_prefix=("ip", "netns", "exec", ns[1]),
                     server_env=_env(veth[0]), client_env=_env(veth[1]))


@contextlib.contextmanager
def two_hosts() -> Iterator[Placement]:
    """Yield the two-namespace placement; tear it down afterwards whatever happened."""
    if shutil.which("ip") is None:
        raise Unavailable("the `ip` command is missing (apt-get install iproute2)")
    tag = f"{os.getpid() % 100000}"
    ns, veth = (f"txb-ps-{tag}", f"txb-wk-{tag}"), (f"txb{tag}a", f"txb{tag}b")
    made: list[str] = []
    try:
        for name in ns:
            _ip("netns", "add", name)
            made.append(name)
        _setup(ns, veth)
        yield _placement(ns, veth)
    finally:
        for name in made:  # deleting a namespace deletes its end of the veth pair too
            with contextlib.suppress(Unavailable, subprocess.TimeoutExpired):
                _ip("netns", "del", name)
