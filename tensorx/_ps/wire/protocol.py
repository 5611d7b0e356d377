"""The control messages between a worker and a parameter-server shard. Pure: no asyncio.

They travel as ``Endpoint.notify`` payloads: msgpack maps with a type field ``"t"``, each
validated against its schema before anything acts on it (no pickle anywhere). The data
itself never travels here: gradients are one-sided writes into the worker's slot on the
shard, and fresh parameters are one-sided writes into the worker's parameter arena.

One step, seen from a worker::

    worker: write(grads -> slot); notify(push)       # notify is ordered after the write
    shard:  apply when the mode allows; write(params -> worker arena); notify(params)

Pipelined (sync, a shard whose welcome lists ``parts``): the push comes first, then each
part of the slot with a ``part`` message; the shard applies each part once every rank's
has landed and writes it back at once; ``params`` follows the last (see tensorx._ps.service.round)::

    worker: notify(push); write(part k -> slot) + part(k), for every k not written yet
    shard:  per part: apply, write(params part -> worker arena); after the last: params

Same host, sync mode: a worker that asks (hello ``share``) may be offered the shard's
parameter arena and its own slot as /dev/shm files (welcome ``share``); once it has mapped
them its model's tensors *are* that memory, it says so on each push (``mapped``), and both
writes above are skipped: a step is two notifications.
"""

from __future__ import annotations

from typing import Any

import msgpack

from tensorx._schema import Field, Record, blob, flag, real, seq, table, text, uint
from tensorx._text import printable
from tensorx.errors import ProtocolError, UsageError
from tensorx.memregion import MAX_DESCRIPTOR

__all__ = ["MAX_CONTROL", "PROTOCOL", "SCHEMAS", "SHARE_OFFER", "check_hello", "decode",
           "encode", "optim_info", "share_offer"]

PROTOCOL = 8  # 8: optimizer-state loads in two phases (state_checked, state_commit) with a
# digest; 7: pipelined rounds (parts); 6: sparse rows answered in an inbox; 5: share
MAX_CONTROL = 16 * 1024 * 1024  # a hello carries the whole plan
ITEMS = 1 << 20  # entries of one list or map (tensors, groups, ranks, parts)

_N, _OPT_N = uint(63), uint(63) | None  # counts, ranks, versions, steps, checksums
_DESC = blob(MAX_DESCRIPTOR)  # a RegionDescriptor.to_bytes() (b"": none)
_NAME, _TEXT = text(1024), text(1 << 20)  # an address, a label; free text
_HYPER = seq(ITEMS)  # per param group, a map of hyperparameters (see tensorx._ps.wire.hyper)
_FIELDS: dict[str, dict[str, Field]] = {
    # worker -> shard: who I am, what I planned, where my parameter arena is; `share`: I
    # would map your arenas if you are on my host; optional `shards`: every shard's address,
    # in shard order (how shards find each other to exchange gradient norms)
    "hello": {"proto": _N, "rank": _N, "num_workers": _N, "shard": _N, "num_shards": _N,
              "fingerprint": _NAME, "plan": blob(MAX_CONTROL), "params": _DESC,
              "verify": flag(), "share": flag(), "shards": seq(ITEMS, _NAME) | None},
    # shard -> worker: your gradient slot; your arena now holds parameters `version`
    # (and, with sparse tensors, your header region for the dynamic path; else b"");
    # `share`: {} or the offer to map (see SHARE_OFFER); `optim`: this shard's optimizer,
    # {"defaults": {hyperparameters}, "groups": [{"hp": {...}, "params": [labels]}],
    #  "flat": its parameters span several entries (no state transfer)} (see OPTIM);
    # `parts`: [[offset, nbytes], ...] of the slot, when this shard applies a sync update
    # part by part as the gradient lands (push them as `part` messages); [] otherwise
    "welcome": {"slot": _DESC, "headers": _DESC, "version": _N, "mode": _NAME,
                "checksum": _OPT_N, "share": table(2), "optim": table(3),
                "parts": seq(ITEMS, seq(2, _N))},
    # shard -> worker: the handshake or a step failed; `code`: the error's class, from
    # tensorx.errors.CODES
    "error": {"code": _NAME, "msg": _TEXT},
    # worker -> shard: my slot holds the gradient of my step `step`, computed on `version`;
    # `staging`: {tensor name: descriptor} of sparse staging regions that are new;
    # `mapped`: my slot and arena are the ones you offered, nothing was (or is to be) written;
    # `hyper`: per param group, the hyperparameters I changed for this update ([]: none;
    # see tensorx._ps.wire.hyper); `inbox`: the descriptor of a new region for the changed rows
    # of sparse tables in your answers (b"": the one I lent before; see tensorx._ps.rows.pull);
    # `parts`: with welcome `parts`, the parts of the slot already written (the others
    # follow, each with a `part` message); ignored otherwise
    "push": {"step": _N, "version": _N, "staging": table(ITEMS), "mapped": flag(),
             "hyper": _HYPER, "inbox": _DESC, "parts": seq(ITEMS, _N)},
    # worker -> shard, after a push, when the welcome listed parts: part `k` of my slot
    # holds this step's gradient (carried by the write of that part: never ahead of it)
    "part": {"k": _N},
    # shard -> worker: your arena now holds parameters `version` (its checksum, see
    # tensorx._ps.wire.checksum, if asked), once you scattered the `rows` bytes of sparse-table
    # rows I wrote into your inbox (0: none); `rows_want`: the inbox size that would have
    # taken this answer's rows (0: yours did, or none was worth it);
    # `hyper`: the groups' hyperparameters now, when they changed since I last told you
    "params": {"version": _N, "step": _N, "checksum": _OPT_N, "hyper": _HYPER,
               "rows": _N, "rows_want": _N},
    # worker -> shard: lend me your optimizer's state (see tensorx._ps.wire.optim_state)
    "state_get": {},
    # shard -> worker: it is packed in `region` (readable by you), laid out as `manifest`
    "state": {"manifest": table(ITEMS), "region": _DESC},
    # worker -> shard: I have read it; free the region
    "state_done": {},
    # worker -> shard: load the optimizer state packed in my `region`, laid out as
    # `manifest`; `digest`: BLAKE2b-256 of the region's bytes (every rank sends the same
    # state: see tensorx._ps.service.optim_load)
    "state_put": {"manifest": table(ITEMS), "region": _DESC, "digest": blob(32)},
    # shard -> worker: every rank's put arrived, the same; I read and checked it and keep it
    "state_checked": {},
    # worker -> shard: `load`: every shard checked its part (load it); else drop it
    "state_commit": {"load": flag()},
    # shard -> worker: loaded; `hyper`: the groups' hyperparameters now
    "state_loaded": {"hyper": _HYPER},
    # shard -> worker, while your push waits at the sync barrier for absent ranks: which
    # ones and why (named in the worker's error if it gives up waiting)
    "waiting": {"why": _TEXT},
    # worker -> shard: I am leaving (finished: sync barriers go on without me)
    "bye": {},
    # shard -> shard (clip_grad_norm): the sum of squares of my part of the gradient that
    # makes `version`, averaged over `ranks` (see tensorx._ps.service.norm_exchange)
    "gnorm": {"shard": _N, "version": _N, "ranks": seq(ITEMS, _N), "sumsq": real()},
}
SCHEMAS: dict[str, Record] = {kind: Record(f"{kind} message", fields)
                              for kind, fields in _FIELDS.items()}
# welcome["share"] when the shard offers mapping: the descriptors of its parameter arena
# (exported read-only) and of this worker's gradient slot, both in shared memory, for the
# worker's Node.attach (see tensorx._ps.worker.samehost)
SHARE_OFFER = Record("welcome message: share offer", {"params": _DESC, "slot": _DESC},
                     strict=True)
# welcome["optim"]: the shard's optimizer (groups may be [] for a shard without parameters)
OPTIM = Record("welcome message: optimizer", {
    "defaults": table(ITEMS), "flat": flag(),
    "groups": seq(ITEMS, table(2, Record("group", {
        "hp": table(ITEMS), "params": seq(ITEMS, _NAME)}, strict=True))),
}, strict=True)


def share_offer(welcome: dict[str, Any]) -> dict[str, Any] | None:
    """The welcome's mapping offer, checked; None when there is none."""
    offer = welcome["share"]
    return dict(SHARE_OFFER.check(offer)) if offer else None


def optim_info(welcome: dict[str, Any]) -> dict[str, Any]:
    """The welcome's description of the shard's optimizer, checked."""
    return dict(OPTIM.check(welcome["optim"]))


def check_hello(msg: dict[str, Any], shard: int, num_shards: int, num_workers: int) -> None:
    """A decoded hello agrees with this shard (ProtocolError, or UsageError for a worker
    started with other settings)."""
    if msg["proto"] != PROTOCOL:
        raise ProtocolError(f"worker speaks ps protocol {msg['proto']}, this server {PROTOCOL}: "
                            "run the same tensorx version on workers and servers")
    if (msg["shard"], msg["num_shards"]) != (shard, num_shards):
        raise UsageError(f"worker thinks this is shard {msg['shard']} of "
                         f"{msg['num_shards']}; it is shard {shard} of "
                         f"{num_shards} (order the ps list by shard)")
    if msg["num_workers"] != num_workers:
        raise UsageError(f"worker says num_workers={msg['num_workers']}, "
                         f"this server has {num_workers}: start both with the same count")
    if not 0 <= msg["rank"] < num_workers:
        raise UsageError(f"rank {msg['rank']} is not one of 0..{num_workers - 1} "
                         f"(num_workers={num_workers}; ranks count from 0)")


def encode(kind: str, **fields: Any) -> bytes:
    """The payload of one control message; fields are checked against the schema."""
    msg = {"t": kind, **fields}
    _validate(msg)
    raw: bytes = msgpack.packb(msg, use_bin_type=True)
    return raw


def decode(payload: bytes) -> dict[str, Any]:
    """Unpack and validate one control message; ProtocolError if it is not one."""
    if len(payload) > MAX_CONTROL:
        raise ProtocolError(f"control message of {len(payload)} B exceeds {MAX_CONTROL} B")
    try:
        msg = msgpack.unpackb(payload, raw=False, strict_map_key=True)
    except Exception as exc:
        raise ProtocolError(f"undecodable control message: {exc}") from exc
    if not isinstance(msg, dict):
        raise ProtocolError("control message is not a map")
    _validate(msg)
    return msg


def _validate(msg: dict[str, Any]) -> None:
    kind = msg.get("t")
    schema = SCHEMAS.get(kind) if isinstance(kind, str) else None
    if schema is None:
        raise ProtocolError(f"unknown control message type {printable(kind)}")
    schema.check(msg)
