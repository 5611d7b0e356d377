"""The owner's table of exported regions: its authority on what peers may touch. Every
remote op on this node's memory is resolved here (rights and bounds) before it lands.

Above :mod:`tensorx.memregion`: a region knows nothing of the table; the table tells a
region its latest export (what ``region.descriptor()`` returns) through one method.
"""

from __future__ import annotations

import dataclasses
import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from tensorx._text import printable
from tensorx.errors import RegionError, UsageError
from tensorx.memregion import ACCESS_MODES, MemoryRegion, RegionDescriptor

MAX_LISTED = 16  # names of exports an unknown name's error lists

__all__ = ["ExportTable", "check_bounds"]


@dataclass
class _Export:
    region: MemoryRegion
    descriptor: RegionDescriptor


class ExportTable:
    """The owner's authority on what peers may touch: every remote op is resolved here."""

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self._by_id: dict[int, _Export] = {}
        self._by_name: dict[str, int] = {}  # the region id exported under each name

    def add(self, region: MemoryRegion, access: str,
            keys: Mapping[str, Any] | None = None, name: str | None = None
            ) -> RegionDescriptor:
        """Export ``region`` (not exported now) as ``access``, under ``name`` if given
        (which no other export holds now: see :meth:`holder`)."""
        if access not in ACCESS_MODES:
            raise UsageError(f"access must be one of {ACCESS_MODES}, got {access!r}")
        if "w" in access and region.readonly:
            raise UsageError("cannot export read-only memory for writing; use access='r'")
        desc = RegionDescriptor(self.owner, region.region_id, secrets.randbits(63), region.nbytes,
                                "cuda" if region.is_cuda else "cpu", access, dict(keys or {}),
                                name=name, dtype=region.dtype, shape=region.shape)
        self._by_id[region.region_id] = _Export(region, desc)
        if name is not None:
            self._by_name[name] = region.region_id
        region._exported(desc)  # noqa: SLF001 (the export table tells its region (the region's hook))
        return desc

    def add_keys(self, backend: str,
                 register: Callable[[MemoryRegion], Mapping[str, Any] | None]) -> None:
        """A backend started after some exports: each export's descriptor gets its keys
        (``register(region)``, under ``backend``), the same cookie, so one given out
        before stays good (its ops take the lanes that need no such keys)."""
        for export in self._by_id.values():
            keys = None if export.region.closed else register(export.region)
            if keys is not None:
                export.descriptor = dataclasses.replace(
                    export.descriptor, keys={**export.descriptor.keys, backend: keys})
                export.region._exported(export.descriptor)  # noqa: SLF001 (the export table tells its region (the region's hook))

    def remove(self, region: MemoryRegion) -> RegionDescriptor | None:
        """Stop serving ``region`` (and free its name); the descriptor of its export here,
        if it had one."""
        export = self._by_id.pop(region.region_id, None)
        if export is None:
            return None
        if export.descriptor.name is not None:
            del self._by_name[export.descriptor.name]
        return export.descriptor

    def holder(self, name: str) -> MemoryRegion | None:
        """The region exported under ``name`` now, if any."""
        rid = self._by_name.get(name)
        return None if rid is None else self._by_id[rid].region

    def named(self, name: str) -> RegionDescriptor:
        """The descriptor of the export named ``name``; RegionError (naming the exports
        there are, never their cookies) if there is none."""
        rid = self._by_name.get(name)
        if rid is not None:
            return self._by_id[rid].descriptor
        names = sorted(self._by_name)
        there = ", ".join(f"'{printable(n, 64)}'" for n in names[:MAX_LISTED]) + \
            (f" and {len(names) - MAX_LISTED} more" if len(names) > MAX_LISTED else "")
        raise RegionError(f"node {self.owner} exports no region named "
                          f"'{printable(name, 64)}'; "
                          + (f"its named exports: {there}" if names else
                             "it has no named exports (Node.export(region, name=...))"))

    def __len__(self) -> int:
        return len(self._by_id)

    def regions(self) -> list[RegionDescriptor]:
        return [e.descriptor for e in self._by_id.values()]

    def lookup(self, region_id: int, cookie: int) -> _Export:
        export = self._by_id.get(region_id)
        if export is None or export.descriptor.cookie != cookie:
            raise RegionError(f"region {region_id:#x} is not exported here under that descriptor "
                              "(unexported, closed or exported again by its owner, or forged): "
                              "get its current one (ep.lookup(name) for a named export)")
        if export.region.closed:
            raise RegionError(f"region {region_id:#x} was closed by its owner")
        return export

    def resolve(self, region_id: int, cookie: int, offset: int, nbytes: int,
                need: str) -> MemoryRegion:
        """Check rights and bounds for one remote op; return the region or raise RegionError."""
        export = self.lookup(region_id, cookie)
        if need not in export.descriptor.access:
            verb = "written" if need == "w" else "read"
            raise RegionError(f"region {region_id:#x} is exported "
                              f"'{export.descriptor.access}' and cannot be {verb}")
        check_bounds(export.descriptor.nbytes, offset, nbytes)
        return export.region


def check_bounds(size: int, offset: int, nbytes: int) -> None:
    """RegionError unless [offset, offset+nbytes) lies inside a region of ``size`` bytes."""
    if offset < 0 or nbytes < 0 or offset + nbytes > size:
        raise RegionError(f"range [{offset}, {offset + nbytes}) is outside the region of {size} B")
