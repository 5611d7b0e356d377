"""Who holds the other end of a TCP connection on this host, as the kernel says.

A unix socket tells its peer's pid and uid (``SO_PEERCRED``); TCP has no such option, and
the control channel is TCP. So we ask the kernel the long way: its socket table
(``sock_diag`` netlink, what ``ss`` uses; one exact lookup, about 20 us) names the socket
at the other end of ours in this network namespace (addresses swapped) with its owner's
uid and inode, and ``/proc/PID/fd`` says whether process PID holds that socket. A peer can
forge neither: what it says about itself (its node id, pid or host) is a claim to check
against them, never a proof. A peer on another host or in another network namespace, or
one behind a relay (a proxy, NAT), has no such socket here, so nothing it says places it in
a process of this host.

Listing ``/proc/PID/fd`` needs the permission that reading the process's memory map
needs (same uid); the same-host lanes need more (ptrace rights), so a process whose files
we cannot list could not be reached by them anyway.
"""

from __future__ import annotations

import os
import socket
import struct

__all__ = ["OtherEnd"]

NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
NLM_F_REQUEST = 1
NLMSG_ERROR = 2
NO_COOKIE = 0xFFFFFFFF
HEADER = struct.Struct("=IHHII")  # struct nlmsghdr
REQUEST = struct.Struct("=BBBBI")  # struct inet_diag_req_v2, up to its socket id
OWNER = struct.Struct("=II")  # uid, inode: the end of struct inet_diag_msg
OWNER_AT = HEADER.size + 4 + 48 + 12  # family..retrans, the socket id, expires..wqueue
TIMEOUT = 1.0  # the kernel answers at once; a bound all the same


def _address(family: int, host: str) -> bytes:
    packed = socket.inet_pton(family, host.split("%", 1)[0])  # (an IPv6 scope)
    return packed.ljust(16, b"\0")


def _lookup(family: int, src: tuple[str, int], dst: tuple[str, int]) -> tuple[int, int] | str:
    """(uid, inode) of the TCP socket whose local address is ``src`` and remote ``dst``, in
    this network namespace; else why not. (IPv4 addresses mapped into IPv6 find their
    socket in either family: the kernel looks both up.)"""
    sockid = (struct.pack("!HH", src[1], dst[1]) + _address(family, src[0])
              + _address(family, dst[0]) + struct.pack("=III", 0, NO_COOKIE, NO_COOKIE))
    body = REQUEST.pack(family, socket.IPPROTO_TCP, 0, 0, 0xFFFFFFFF) + sockid
    try:
        with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, NETLINK_SOCK_DIAG) as nl:
            nl.settimeout(TIMEOUT)
            nl.send(HEADER.pack(HEADER.size + len(body), SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST,
                                1, 0) + body)
            answer = nl.recv(8192)
    except OSError as exc:
        return f"the kernel's socket table cannot be asked ({exc.strerror or exc})"
    if len(answer) < HEADER.size + 4:
        return "the kernel's socket table gave no answer"
    kind = HEADER.unpack_from(answer)[1]
    if kind == NLMSG_ERROR:
        code = -struct.unpack_from("=i", answer, HEADER.size)[0]
        if code == 2:  # ENOENT
            return "its end is no socket of this host (another host or network namespace, " \
                   "or a relay between us)"
        return f"the kernel's socket table says: {os.strerror(code)}"
    if kind != SOCK_DIAG_BY_FAMILY or len(answer) < OWNER_AT + OWNER.size:
        return "the kernel's socket table gave a malformed answer"
    uid, inode = OWNER.unpack_from(answer, OWNER_AT)
    return (uid, inode) if inode else "its end is held by no process"


class OtherEnd:
    """What the kernel says about the other end of one connection (looked up on first use,
    then kept: a connection's ends do not change)."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._end: tuple[int, int] | str | None = None
        self._held: dict[int, str] = {}

    def _find(self) -> tuple[int, int] | str:
        if self._end is None:
            sock = self._sock
            if sock.family not in (socket.AF_INET, socket.AF_INET6) \
                    or sock.type != socket.SOCK_STREAM:
                self._end = "not a TCP connection"
            else:
                try:
                    ours, theirs = sock.getsockname(), sock.getpeername()
                except OSError as exc:
                    return f"the connection is gone ({exc.strerror or exc})"
                self._end = _lookup(sock.family, theirs[:2], ours[:2])
        return self._end

    def same_user(self) -> str:
        """'' when the other end is a socket of this host (this network namespace) that a
        process of this user opened; else why not."""
        end = self._find()
        if isinstance(end, str):
            return end
        return "" if end[0] == os.geteuid() else f"its end belongs to another user (uid {end[0]})"

    def held_by(self, pid: int) -> str:
        """'' when process ``pid`` (of this pid namespace), running as this user, holds the
        other end; else why not."""
        if pid not in self._held:
            if len(self._held) >= 4:  # a peer asks about its one pid (one per lane)
                self._held.clear()
            why = self.same_user()
            self._held[pid] = why or _holds(pid, self._find())
        return self._held[pid]


def _holds(pid: int, end: tuple[int, int] | str) -> str:
    if isinstance(end, str):
        return end
    folder, wanted = f"/proc/{pid}/fd", f"socket:[{end[1]}]"
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return f"no process {pid} here (another pid namespace?)"
    except OSError as exc:
        return f"process {pid}'s files cannot be listed ({exc.strerror or exc})"
    for name in names:
        try:
            if os.readlink(f"{folder}/{name}") == wanted:
                return ""
        except OSError:  # closed meanwhile
            continue
    return f"process {pid} does not hold its end"
