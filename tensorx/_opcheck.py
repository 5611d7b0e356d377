"""The checks an endpoint makes of an op before it reaches a lane (the local side, the
arguments), and how its messages name a remote region and what to do when its descriptor
is no longer good. Pure: no I/O."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from tensorx._text import printable
from tensorx.errors import ClosedError, UsageError
from tensorx.memregion import MemoryRegion, RegionDescriptor

__all__ = ["OpSpec", "check_local", "check_payload", "descriptor", "foreign", "get_again",
           "is_cuda", "named", "spec"]

OpSpec = tuple[MemoryRegion, "RegionDescriptor | bytes", int, int, "int | None"]


def named(desc: RegionDescriptor) -> str:
    """A region as a message names it: its id, and its export's name if it has one."""
    name = "" if desc.name is None else f" ('{printable(desc.name, 64)}')"
    return f"{desc.region_id:#x}{name}"


def get_again(desc: RegionDescriptor) -> str:
    """What to do about a descriptor that is no longer good: get the current one."""
    if desc.name is not None:
        return f"look it up again (await ep.lookup('{printable(desc.name, 64)}'))"
    return ("get its current descriptor from its owner (export it under a name to look it "
            "up with ep.lookup(name))")


def foreign(desc: RegionDescriptor, peer: str, address: str, former: Sequence[str]) -> str:
    """Why a descriptor of another node than ``peer`` (reached at ``address``, where the
    ``former`` nodes were before it) cannot be used on an endpoint to it."""
    owner = printable(desc.owner, 64)
    if desc.owner in former:
        return (f"region {named(desc)} was exported by node {owner}, the node at {address} "
                f"before it restarted (it is node {peer} now); a restarted node's regions "
                "have new descriptors: " + get_again(desc))
    if desc.cookie == 0:  # MemoryRegion.descriptor() of a region nobody exported
        return (f"region {named(desc)} was never exported: its descriptor comes from "
                "region.descriptor(), not from node.export(region) on its owner")
    return (f"region {named(desc)} belongs to node {owner}, but this endpoint reaches node "
            f"{peer} at {address}: use the descriptor on an endpoint to its owner, or look "
            "the region up on this one (ep.lookup(name))")


def is_cuda(region: Any) -> bool:
    return isinstance(region, MemoryRegion) and region.is_cuda


def check_payload(payload: Any) -> None:
    if not isinstance(payload, bytes | bytearray | memoryview):
        raise UsageError(f"notify payload must be bytes, not {type(payload).__name__}")


def descriptor(remote: RegionDescriptor | bytes) -> RegionDescriptor:
    if isinstance(remote, RegionDescriptor):
        return remote
    if isinstance(remote, bytes | bytearray):
        return _decoded(bytes(remote))
    raise UsageError(f"expected a RegionDescriptor (or its bytes), got {type(remote).__name__}")


@functools.lru_cache(maxsize=256)
def _decoded(raw: bytes) -> RegionDescriptor:
    """A descriptor's bytes decoded and checked once: callers pass the same bytes on every
    op (decoding took a fifth of an 8-byte write). Bounded; a refusal is not kept."""
    return RegionDescriptor.from_bytes(raw)


def check_local(region: MemoryRegion, offset: int, nbytes: int | None, need: str) -> None:
    if not isinstance(region, MemoryRegion):
        raise UsageError(f"expected a MemoryRegion, got {type(region).__name__}; "
                         "wrap it with tx.MemoryRegion.register(obj)")
    if region.closed:
        raise ClosedError(f"local region {region.region_id:#x} is closed")
    if need == "r" and region.readonly:
        raise UsageError("cannot read into a read-only region")
    n = region.nbytes - offset if nbytes is None else nbytes
    # one cheap test on every op (a loop over the two took 0.9 us); the exact checks and
    # their messages only when it fails
    if type(offset) is not int or type(n) is not int or offset < 0 or n < 0:
        check_count("offset", offset)
        check_count("nbytes", n)
    if offset + n > region.nbytes:
        raise UsageError(f"local range [{offset}, {offset + n}) bytes is outside the local "
                         f"region of {region.nbytes} B")


def check_count(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise UsageError(f"{name} must be a non-negative int (bytes), got {value!r}")


def spec(op: Sequence[Any]) -> OpSpec:
    if not 2 <= len(op) <= 5:
        raise UsageError("write_many takes (region, desc[, offset[, remote_offset[, nbytes]]])")
    full: list[Any] = [*op, *[0, 0, None][len(op) - 2:]]
    region, desc, offset, remote_offset, nbytes = full
    return region, desc, offset, remote_offset, nbytes
