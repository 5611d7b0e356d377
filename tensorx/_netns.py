"""Two "hosts" on one machine for fault tests: network namespaces joined by a veth pair.

``with two_hosts() as hosts:`` makes namespaces ``hosts.ns[0]`` (address ``hosts.ip[0]``)
and ``hosts.ns[1]`` (``hosts.ip[1]``) and removes them on exit, whatever happened; names
carry this process's id, and namespaces left behind by a killed run (their process is
gone) are removed on the next. Traffic only flows between these two namespaces. The link
can then be

* slowed: ``shape(rate, burst, latency)``, a tbf qdisc on both ends (kernels without netem
  cannot add a fixed delay; tbf queues, which delays, and caps the rate);
* cut: ``set_link(side, up=False)``, the interface down (a stall: TCP retransmits, the
  connection survives until it is brought up again);
* made lossy: ``drop(percent)``, nftables dropping that share of the packets arriving on
  both ends (needs the ``nft`` tool: ``apt-get install nftables``).

Processes enter a namespace with ``ip netns exec NS ...`` (:meth:`TwoHosts.prefix`) or, for
a spawned Python child, :func:`enter_netns` before it opens any socket. Anything missing
(root, ``ip``, ``tc``, ``nft``, namespace support) raises :class:`Unavailable` with the
reason, for tests to skip with.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass

__all__ = ["TwoHosts", "Unavailable", "enter_netns", "two_hosts"]

PREFIX = "txt"   # namespace names: txt-<pid>-a, txt-<pid>-b
SUBNET = "10.204.0"
CLONE_NEWNET, CLONE_NEWNS = 0x40000000, 0x00020000
MS_REC, MS_SLAVE, MNT_DETACH = 0x4000, 0x80000, 2


class Unavailable(RuntimeError):
    """Network namespaces (or a tool a fault needs) cannot be used here; says why."""


def _run(*cmd: str, stdin: str | None = None) -> str:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=30, input=stdin)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise Unavailable(f"`{' '.join(cmd)}` failed: {exc}") from exc
    if done.returncode != 0:
        raise Unavailable(f"`{' '.join(cmd)}` failed: {done.stderr.strip()}")
    return done.stdout


def _need(tool: str, package: str) -> None:
    if shutil.which(tool) is None:
        raise Unavailable(f"the `{tool}` command is missing (apt-get install {package})")


def enter_netns(name: str) -> None:
    """Do what ``ip netns exec`` does, for this process: join namespace ``name`` and see
    its interfaces in /sys (UCX finds its devices there). Call it first thing in a fresh,
    single-threaded process; every socket and thread made afterwards lives there."""
    libc = ctypes.CDLL(None, use_errno=True)

    def check(result: int, what: str) -> None:
        if result != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"{what} for netns {name}: {os.strerror(err)}")

    with open(f"/run/netns/{name}") as f:
        check(libc.setns(f.fileno(), CLONE_NEWNET), "setns")
    check(libc.unshare(CLONE_NEWNS), "unshare")  # a private view of the mounts, then
    check(libc.mount(b"none", b"/", None, MS_REC | MS_SLAVE, None), "mount --make-rslave /")
    check(libc.umount2(b"/sys", MNT_DETACH), "umount /sys")
    check(libc.mount(b"sysfs", b"/sys", b"sysfs", 0, None), "mount sysfs")  # this netns's


@dataclass(frozen=True)
class TwoHosts:
    ns: tuple[str, str]
    dev: tuple[str, str]
    ip: tuple[str, str] = (f"{SUBNET}.1", f"{SUBNET}.2")

    def prefix(self, side: int) -> list[str]:
        """Command prefix that runs a program in namespace ``side`` (0 or 1)."""
        return ["ip", "netns", "exec", self.ns[side]]

    def set_link(self, side: int, up: bool) -> None:
        _run("ip", "-n", self.ns[side], "link", "set", self.dev[side], "up" if up else "down")

    def shape(self, rate: str, burst: str = "64kb", latency: str = "100ms") -> None:
        """Cap both directions at ``rate`` (tc syntax: "40mbit"); packets queue up to
        ``latency`` (then drop), so a busy link also delays."""
        _need("tc", "iproute2")
        for ns, dev in zip(self.ns, self.dev, strict=True):
            _run("tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate,
                 "burst", burst, "latency", latency)

    def unshape(self) -> None:
        for ns, dev in zip(self.ns, self.dev, strict=True):
            _run("tc", "-n", ns, "qdisc", "del", "dev", dev, "root")

    def drop(self, percent: int) -> None:
        """Drop ``percent`` % of the packets arriving on either end, at random. Segmentation
        offload is turned off first, so a packet is one TCP segment (as on a wire), not a
        64 KiB batch of them."""
        _need("nft", "nftables")
        for side, dev in enumerate(self.dev):
            _run("ip", "-n", self.ns[side], "link", "set", dev, "gso_max_segs", "1")
            _run(*self.prefix(side), "nft", "-f", "-", stdin=(
                "table netdev txloss {\n chain ingress {\n"
                f'  type filter hook ingress device "{dev}" priority 0; policy accept;\n'
                f"  numgen random mod 100 < {percent} counter drop\n }}\n}}\n"))

    def dropped(self) -> int:
        """Packets the :meth:`drop` rules have dropped so far, both ends together."""
        total = 0
        for side in (0, 1):
            listing = json.loads(_run(*self.prefix(side), "nft", "-j", "list", "table",
                                      "netdev", "txloss"))
            for item in listing["nftables"]:
                for expr in item.get("rule", {}).get("expr", []):
                    total += expr.get("counter", {}).get("packets", 0)
        return total

    def undrop(self) -> None:
        for side in (0, 1):
            _run(*self.prefix(side), "nft", "delete", "table", "netdev", "txloss")


def _check_allowed() -> None:
    if os.geteuid() != 0:
        raise Unavailable("network namespaces need root")
    _need("ip", "iproute2")


def _names() -> tuple[tuple[str, str], tuple[str, str]]:
    tag = str(os.getpid())
    return (f"{PREFIX}-{tag}-a", f"{PREFIX}-{tag}-b"), (f"{PREFIX}{tag}a", f"{PREFIX}{tag}b")


def _remove_stale() -> None:
    """Namespaces of ours whose process is gone (a killed run) go now."""
    for line in _run("ip", "netns", "list").splitlines():
        parts = line.split()[0].split("-") if line.strip() else []
        if len(parts) == 3 and parts[0] == PREFIX and parts[1].isdigit() \
                and not os.path.exists(f"/proc/{parts[1]}"):
            with contextlib.suppress(Unavailable):
                _run("ip", "netns", "del", line.split()[0])


def _wire_up(hosts: TwoHosts) -> None:
    _run("ip", "link", "add", hosts.dev[0], "type", "veth", "peer", "name", hosts.dev[1])
    for ns, dev, addr in zip(hosts.ns, hosts.dev, hosts.ip, strict=True):
        _run("ip", "link", "set", dev, "netns", ns)
        _run("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
        _run("ip", "-n", ns, "link", "set", dev, "up")
        _run("ip", "-n", ns, "link", "set", "lo", "up")


@contextlib.contextmanager
def two_hosts() -> Iterator[TwoHosts]:
    """Make the two namespaces and their veth link; remove them afterwards."""
    _check_allowed()
    _remove_stale()
    ns, dev = _names()
    made: list[str] = []
    try:
        for name in ns:
            _run("ip", "netns", "add", name)
            made.append(name)
        hosts = TwoHosts(ns, dev)
        _wire_up(hosts)
        yield hosts
    finally:
        for name in made:  # deleting a namespace deletes its end of the veth pair too
            with contextlib.suppress(Unavailable):
                _run("ip", "netns", "del", name)
        if os.path.exists(f"/sys/class/net/{dev[0]}"):  # set-up failed before moving it
            with contextlib.suppress(Unavailable):
                _run("ip", "link", "del", dev[0])
