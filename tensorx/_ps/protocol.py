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
has landed and writes it back at once; ``params`` follows the last (see tensorx._ps.round)::

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

from tensorx.errors import ProtocolError, UsageError

__all__ = ["MAX_CONTROL", "PROTOCOL", "SHARE_OFFER", "check_hello", "decode", "encode",
           "optim_info", "share_offer"]

PROTOCOL = 7  # 7: pipelined rounds (parts); 6: sparse rows answered in an inbox; 5: share
MAX_CONTROL = 16 * 1024 * 1024  # a hello carries the whole plan

_OPT_INT = (int, type(None))
SCHEMAS: dict[str, dict[str, type | tuple[type, ...]]] = {
    # worker -> shard: who I am, what I planned, where my parameter arena is; `share`: I
    # would map your arenas if you are on my host; optional `shards`: every shard's address,
    # in shard order (how shards find each other to exchange gradient norms)
    "hello": {"proto": int, "rank": int, "num_workers": int, "shard": int, "num_shards": int,
              "fingerprint": str, "plan": bytes, "params": bytes, "verify": bool,
              "share": bool},
    # shard -> worker: your gradient slot; your arena now holds parameters `version`
    # (and, with sparse tensors, your header region for the dynamic path; else b"");
    # `share`: {} or the offer to map (see SHARE_OFFER); `optim`: this shard's optimizer,
    # {"defaults": {hyperparameters}, "groups": [{"hp": {...}, "params": [labels]}],
    #  "flat": its parameters span several entries (no state transfer)};
    # `parts`: [[offset, nbytes], ...] of the slot, when this shard applies a sync update
    # part by part as the gradient lands (push them as `part` messages); [] otherwise
    "welcome": {"slot": bytes, "headers": bytes, "version": int, "mode": str,
                "checksum": _OPT_INT, "share": dict, "optim": dict, "parts": list},
    # shard -> worker: the handshake or a step failed; `code` names the error class
    "error": {"code": str, "msg": str},
    # worker -> shard: my slot holds the gradient of my step `step`, computed on `version`;
    # `staging`: {tensor name: descriptor} of sparse staging regions that are new;
    # `mapped`: my slot and arena are the ones you offered, nothing was (or is to be) written;
    # `hyper`: per param group, the hyperparameters I changed for this update ([]: none;
    # see tensorx._ps.hyper); `inbox`: the descriptor of a new region for the changed rows
    # of sparse tables in your answers (b"": the one I lent before; see tensorx._ps.rowpull);
    # `parts`: with welcome `parts`, the parts of the slot already written (the others
    # follow, each with a `part` message); ignored otherwise
    "push": {"step": int, "version": int, "staging": dict, "mapped": bool, "hyper": list,
             "inbox": bytes, "parts": list},
    # worker -> shard, after a push, when the welcome listed parts: part `k` of my slot
    # holds this step's gradient (carried by the write of that part: never ahead of it)
    "part": {"k": int},
    # shard -> worker: your arena now holds parameters `version` (its checksum, see
    # tensorx._ps.checksum, if asked), once you scattered the `rows` bytes of sparse-table
    # rows I wrote into your inbox (0: none); `rows_want`: the inbox size that would have
    # taken this answer's rows (0: yours did, or none was worth it);
    # `hyper`: the groups' hyperparameters now, when they changed since I last told you
    "params": {"version": int, "step": int, "checksum": _OPT_INT, "hyper": list,
               "rows": int, "rows_want": int},
    # worker -> shard: lend me your optimizer's state (see tensorx._ps.optim_state)
    "state_get": {},
    # shard -> worker: it is packed in `region` (readable by you), laid out as `manifest`
    "state": {"manifest": dict, "region": bytes},
    # worker -> shard: I have read it; free the region
    "state_done": {},
    # worker -> shard: load the optimizer state packed in my `region`, laid out as `manifest`
    "state_put": {"manifest": dict, "region": bytes},
    # shard -> worker: loaded; `hyper`: the groups' hyperparameters now
    "state_loaded": {"hyper": list},
    # shard -> worker, while your push waits at the sync barrier for absent ranks: which
    # ones and why (named in the worker's error if it gives up waiting)
    "waiting": {"why": str},
    # worker -> shard: I am leaving (finished: sync barriers go on without me)
    "bye": {},
    # shard -> shard (clip_grad_norm): the sum of squares of my part of the gradient that
    # makes `version`, averaged over `ranks` (see tensorx._ps.normx)
    "gnorm": {"shard": int, "version": int, "ranks": list, "sumsq": float},
}
# welcome["share"] when the shard offers mapping: the descriptors of its parameter arena
# (exported read-only) and of this worker's gradient slot, both in shared memory, for the
# worker's Node.attach (see tensorx._ps.shared)
SHARE_OFFER: dict[str, type] = {"params": bytes, "slot": bytes}


def share_offer(welcome: dict[str, Any]) -> dict[str, Any] | None:
    """The welcome's mapping offer, checked; None when there is none."""
    offer = welcome["share"]
    if not offer:
        return None
    if set(offer) != set(SHARE_OFFER) or not all(
            isinstance(offer[k], t) and not isinstance(offer[k], bool)
            for k, t in SHARE_OFFER.items()):
        raise ProtocolError(f"welcome message: malformed share offer {offer!r}")
    return dict(offer)


def optim_info(welcome: dict[str, Any]) -> dict[str, Any]:
    """The welcome's description of the shard's optimizer, checked (groups may be [] for a
    shard without parameters)."""
    info = welcome["optim"]
    groups = info.get("groups")
    if set(info) != {"defaults", "groups", "flat"} or not isinstance(info["flat"], bool) \
            or not isinstance(info["defaults"], dict) \
            or not isinstance(groups, list) or not all(
                isinstance(g, dict) and set(g) == {"hp", "params"} and isinstance(g["hp"], dict)
                and isinstance(g["params"], list)
                and all(isinstance(n, str) for n in g["params"]) for g in groups):
        raise ProtocolError("welcome message: malformed optimizer description")
    return dict(info)


def check_hello(msg: dict[str, Any], shard: int, num_shards: int, num_workers: int) -> None:
    """A decoded hello agrees with this shard (ProtocolError, or UsageError for a worker
    started with other settings)."""
    if msg["proto"] != PROTOCOL:
        raise ProtocolError(f"worker speaks ps protocol {msg['proto']}, this server {PROTOCOL}")
    if (msg["shard"], msg["num_shards"]) != (shard, num_shards):
        raise UsageError(f"worker thinks this is shard {msg['shard']} of "
                         f"{msg['num_shards']}; it is shard {shard} of "
                         f"{num_shards} (order the ps list by shard)")
    if msg["num_workers"] != num_workers:
        raise UsageError(f"worker says num_workers={msg['num_workers']}, "
                         f"this server has {num_workers}")
    if not 0 <= msg["rank"] < num_workers:
        raise UsageError(f"rank {msg['rank']} outside 0..{num_workers - 1}")


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
        raise ProtocolError(f"unknown control message type {kind!r}")
    for name, typ in schema.items():
        value = msg.get(name)
        if not isinstance(value, typ) or (isinstance(value, bool) and typ is int):
            raise ProtocolError(f"{kind} message: field {name!r} missing or of the wrong type")
        if isinstance(value, int) and not isinstance(value, bool) and not 0 <= value < 2**63:
            raise ProtocolError(f"{kind} message: field {name!r} out of range")
