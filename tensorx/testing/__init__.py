"""Test helpers: the lane conformance suite, a real owner process, links that misbehave.

:func:`check_lane` runs the data-lane conformance suite (sizes, offsets, concurrency,
ordering, cancellation, timeouts, peer death, revoked, re-exported and forged descriptors,
leaks) over any lane, each check against a fresh :class:`OwnerProcess`: a spawned process
running a :class:`tensorx.Node` that exports regions on command (each surrounded by guard
bands, so a check can prove no byte outside an exported range changed); it can also connect
to another node and time transfers (the client side of a fault test), optionally inside a
network namespace. :class:`FaultyProxy` stalls or cuts a TCP link on loopback;
``raw_socket``, ``authenticate``, ``recv_frame`` and ``recv_refusal`` speak the protocol by
hand; :mod:`tensorx._netns` makes two network namespaces joined by a veth pair whose link
can be slowed, cut or made lossy.
"""

from __future__ import annotations

from ._lanes import (
    LANE_CHECKS,
    LanePair,
    MakePair,
    check_lane,
    check_timed_out_reads,
    owner_pair,
    wait_until,
)
from ._owner import GUARD, OwnerProcess, digest, pattern
from ._raw import FaultyProxy, authenticate, raw_socket, recv_frame, recv_refusal

__all__ = ["GUARD", "LANE_CHECKS", "FaultyProxy", "LanePair", "MakePair", "OwnerProcess",
           "authenticate", "check_lane", "check_timed_out_reads", "digest", "owner_pair",
           "pattern", "raw_socket", "recv_frame", "recv_refusal", "wait_until"]
