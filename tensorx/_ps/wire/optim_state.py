"""An optimizer's state between a shard and a worker: one packed region plus a manifest.

``RemoteOptimizer.state_dict()`` gathers the shards' optimizer state and
``load_state_dict()`` scatters it back. The state can be several times the model's size, so
its tensors never ride on the control channel: they are packed into one registered region,
which the other side reads one-sided; the control message carries only the manifest::

    {"groups":  [{"hp": {hyperparameters}, "params": [entry label, ...]}, ...],
     "tensors": {label: {key: [dtype, shape, offset]}},   # bytes in the packed region
     "values":  {label: {key: scalar}}}                   # e.g. a step kept as a float

Entries are named by their plan label (the parameter name, ``name[k]`` for chunk ``k`` of a
split tensor). Everything a peer sends is checked against what this side expects before a
byte is allocated or loaded. Pure: no I/O.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import torch

from tensorx._ps.wire import hyper
from tensorx.errors import ProtocolError, UsageError
from tensorx.memregion import MemoryRegion

__all__ = ["MAX_KEYS", "Packed", "bound", "check_manifest", "digest", "groups_of", "load_into",
           "pack", "state_of", "unpack"]

MAX_KEYS = 16        # state entries per parameter (Adam has 3, Adafactor 4)
ALIGN = 64
DTYPES = {str(t).removeprefix("torch."): t for t in (
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
    torch.float16, torch.bfloat16, torch.float32, torch.float64)}

State = dict[str, dict[str, Any]]  # label -> {key: tensor or scalar}


class Packed:
    """Per-label state laid out in one region: the manifest's tensors/values and the bytes."""

    def __init__(self, state: State) -> None:
        self.tensors: dict[str, dict[str, list[Any]]] = {}
        self.values: dict[str, dict[str, Any]] = {}
        self._place: list[tuple[int, torch.Tensor]] = []
        offset = 0
        for label, entry in state.items():
            for key, value in entry.items():
                if isinstance(value, torch.Tensor):
                    t = value.detach()
                    dtype = str(t.dtype).removeprefix("torch.")
                    if dtype not in DTYPES:
                        raise UsageError(f"optimizer state {label}.{key}: dtype {dtype} "
                                         "cannot be transferred")
                    self.tensors.setdefault(label, {})[key] = [dtype, list(t.shape), offset]
                    self._place.append((offset, t))
                    offset += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
                elif hyper.encodable(value) and not isinstance(value, tuple | list):
                    self.values.setdefault(label, {})[key] = value
                else:
                    raise UsageError(f"optimizer state {label}.{key} of type "
                                     f"{type(value).__name__} cannot be transferred")
        self.nbytes = offset

    def region(self) -> MemoryRegion:
        """A fresh region holding the tensors (at least one alignment unit long)."""
        region = MemoryRegion.allocate(max(self.nbytes, ALIGN))
        with torch.no_grad():
            for offset, t in self._place:
                flat = t.reshape(-1)
                region.view(t.dtype, (flat.numel(),), offset).copy_(flat)
        return region

    def manifest(self, groups: list[dict[str, Any]]) -> dict[str, Any]:
        return {"groups": groups, "tensors": self.tensors, "values": self.values}


def pack(state: State) -> Packed:
    return Packed(state)


def digest(region: MemoryRegion) -> bytes:
    """BLAKE2b-256 of a packed region's bytes: what two ranks compare to load one state."""
    return hashlib.blake2b(region.buffer(), digest_size=32).digest()


def bound(numels: Mapping[str, int]) -> int:
    """The most bytes a well-formed state for entries of ``numels`` elements can take."""
    return sum(MAX_KEYS * (-(-max(n, 1) * 16 // ALIGN) * ALIGN) for n in numels.values())


def check_manifest(manifest: object, numels: Mapping[str, int], nbytes: int,
                   num_groups: int | None = None) -> None:
    """``manifest`` describes state for (some of) the entries of ``numels`` inside a region
    of ``nbytes``; ProtocolError naming what is wrong otherwise."""
    if not isinstance(manifest, dict) or set(manifest) != {"groups", "tensors", "values"}:
        raise ProtocolError("optimizer state: malformed manifest")
    groups, tensors, values = manifest["groups"], manifest["tensors"], manifest["values"]
    if not isinstance(groups, list) or (num_groups is not None and len(groups) != num_groups):
        raise ProtocolError(f"optimizer state: expected {num_groups} param groups")
    for g in groups:
        if not isinstance(g, dict) or not isinstance(g.get("hp"), dict) \
                or not isinstance(g.get("params"), list):
            raise ProtocolError("optimizer state: malformed param group")
    hyper.check([g["hp"] for g in groups], [{} for _ in groups])
    for part in (tensors, values):
        if not isinstance(part, dict):
            raise ProtocolError("optimizer state: malformed manifest")
        for label, entry in part.items():
            if label not in numels:
                raise ProtocolError(f"optimizer state for {label!r}, not an entry here")
            if not isinstance(entry, dict) or len(entry) > MAX_KEYS or \
                    not all(isinstance(k, str) and len(k) <= hyper.MAX_KEY_LEN for k in entry):
                raise ProtocolError(f"optimizer state for {label!r}: malformed")
    for label, entry in values.items():
        if not all(hyper.encodable(v) and not isinstance(v, list) for v in entry.values()):
            raise ProtocolError(f"optimizer state for {label!r}: bad value")
    for label, entry in tensors.items():
        for spec in entry.values():
            _check_tensor(label, spec, numels[label], nbytes)


def _check_tensor(label: str, spec: object, numel: int, nbytes: int) -> None:
    """``spec`` (a peer's ``[dtype, shape, offset]``) is a tensor of at most ``numel``
    elements inside a region of ``nbytes``; ProtocolError otherwise."""
    if not isinstance(spec, list):
        raise ProtocolError(f"optimizer state for {label!r}: malformed tensor")
    if not (len(spec) == 3 and spec[0] in DTYPES
            and isinstance(spec[1], list) and len(spec[1]) <= 8
            and all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 2**40
                    for d in spec[1])
            and isinstance(spec[2], int) and not isinstance(spec[2], bool) and spec[2] >= 0):
        raise ProtocolError(f"optimizer state for {label!r}: malformed tensor")
    count = 1
    for d in spec[1]:
        count *= d
    size = count * torch.empty((), dtype=DTYPES[spec[0]]).element_size()
    itemsize = torch.empty((), dtype=DTYPES[spec[0]]).element_size()
    if count > max(numel, 1) or spec[2] + size > nbytes or spec[2] % itemsize:
        raise ProtocolError(f"optimizer state for {label!r}: a tensor of {count} elements at "
                            f"{spec[2]} does not fit (entry of {numel}, region of {nbytes} B)")


def unpack(manifest: dict[str, Any], region: MemoryRegion) -> State:
    """The state a checked ``manifest`` describes, copied out of ``region``."""
    out: State = {label: dict(entry) for label, entry in manifest["values"].items()}
    for label, entry in manifest["tensors"].items():
        for key, (dtype, shape, offset) in entry.items():
            count = 1
            for d in shape:
                count *= d
            view = region.view(DTYPES[dtype], (count,), offset)
            out.setdefault(label, {})[key] = view.clone().reshape(shape)
    return out


# -- a shard's optimizer, by entry label ----------------------------------------------------
def groups_of(optimizer: torch.optim.Optimizer, label_of: Mapping[int, str] | None,
              labels: list[str]) -> list[dict[str, Any]]:
    """The optimizer's groups: hyperparameters and entry labels. ``label_of`` maps
    ``id(param)`` to its label; None for a flat shard (every entry is in the first group)."""
    hps = hyper.snapshot(optimizer.param_groups)
    if label_of is None:
        return [{"hp": hp, "params": labels if i == 0 else []} for i, hp in enumerate(hps)]
    return [{"hp": hp, "params": [label_of[id(p)] for p in g["params"]]}
            for hp, g in zip(hps, optimizer.param_groups, strict=True)]


def state_of(optimizer: torch.optim.Optimizer, label_of: Mapping[int, str]) -> State:
    """The optimizer's per-parameter state, by entry label."""
    return {label_of[id(p)]: dict(s) for g in optimizer.param_groups for p in g["params"]
            if (s := optimizer.state.get(p))}


def load_into(optimizer: torch.optim.Optimizer, label_of: Mapping[int, str],
              hps: list[dict[str, Any]], state: State) -> None:
    """Load per-label ``state`` and the groups' hyperparameters ``hps`` through the
    optimizer's own ``load_state_dict`` (which casts to each parameter's dtype and device).
    A per-element tensor takes its parameter's shape; an entry absent from ``state`` starts
    afresh; a hyperparameter absent from ``hps`` keeps its value."""
    if len(hps) != len(optimizer.param_groups):
        raise UsageError(f"the state has {len(hps)} param groups, the server's optimizer "
                         f"{len(optimizer.param_groups)}")
    groups: list[dict[str, Any]] = []
    by_index: dict[int, dict[str, Any]] = {}
    index = 0
    for g, hp in zip(optimizer.param_groups, hps, strict=True):
        ids = list(range(index, index + len(g["params"])))
        index += len(ids)
        for i, p in zip(ids, g["params"], strict=True):
            saved = state.get(label_of[id(p)])
            if saved:
                by_index[i] = {k: _shaped(v, p) for k, v in saved.items()}
        groups.append({**{k: v for k, v in g.items() if k != "params"}, **hp, "params": ids})
    optimizer.load_state_dict({"state": by_index, "param_groups": groups})


def _shaped(value: object, p: torch.Tensor) -> object:
    if isinstance(value, torch.Tensor) and value.dim() > 0 and value.numel() == p.numel():
        return value.reshape(p.shape)
    return value
