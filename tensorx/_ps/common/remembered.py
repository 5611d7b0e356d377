"""Choices measured on this host, remembered for the next run of the same plan.

A shard measures whether its pipelined rounds should apply parts as they land, a worker
whether to push gradient buckets during backward (:mod:`tensorx._ps.common.abtimer`): both ways,
over the first eligible rounds, then the faster is kept. What is faster depends on the
machine, the plan and how the bytes move, not on the run, so each decision is kept in a
small file in the build cache (:mod:`tensorx._cache`: this user's alone, checked as the UCX
binding is), under a key naming the host, the plan's fingerprint and how the bytes move. A
run that finds a fresh entry starts with that choice and does not probe; it measures again
after :data:`~tensorx._ps.common.abtimer.RECHECK` rounds, as a long run always has, and that probe
refreshes the entry. An entry older than :data:`FRESH_S` is ignored (measured again), and
so is a file that is not valid or fails the cache's checks.

``TENSORX_REMEMBER=0`` turns it off (every run probes; nothing is written).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from collections.abc import Callable, Hashable
from typing import Any

from tensorx import _cache
from tensorx._ps.common.abtimer import EarlyChooser

__all__ = ["FILE", "FOLDER", "FRESH_S", "Memory", "key", "recall", "remember"]

logger = logging.getLogger(__name__)

FOLDER = "choices"
FILE = "choices.json"
FRESH_S = 7 * 24 * 3600.0  # older entries are measured again (a changed host, a new kernel)
MAX_BYTES = 256 << 10
MAX_ENTRIES = 256  # the least recently measured go first


def enabled() -> bool:
    return os.environ.get("TENSORX_REMEMBER", "1") != "0"


def key(what: str, fingerprint: str, how: str) -> str:
    """The entry of ``what`` ("pipelined", "overlap") for a plan, moved ``how``, here."""
    return f"{what} {socket.gethostname()} {fingerprint} {how}"


def recall(name: str, now: float | None = None) -> bool | None:
    """The choice remembered under ``name``, if there is a fresh one."""
    if not enabled():
        return None
    try:
        data = _cache.read_data(FOLDER, FILE, MAX_BYTES)
    except OSError as exc:
        logger.debug("cannot read the remembered choices: %s", exc)
        return None
    entry = _entries(data).get(name)
    if entry is None or not 0 <= (time.time() if now is None else now) - entry["at"] < FRESH_S:
        return None
    return bool(entry["choice"])


def remember(name: str, choice: bool, detail: str) -> None:
    """Keep ``choice`` under ``name`` (``detail``: the measurement, for whoever reads the
    file)."""
    if not enabled():
        return

    def edit(data: bytes | None) -> bytes:
        entries = _entries(data)
        entries[name] = {"choice": choice, "at": time.time(), "detail": detail[:200]}
        kept = sorted(entries.items(), key=lambda kv: kv[1]["at"])[-MAX_ENTRIES:]
        return json.dumps(dict(kept), indent=0).encode()

    try:
        _cache.update_data(FOLDER, FILE, MAX_BYTES, edit)
    except OSError as exc:  # a read-only home, a full disk: the next run measures again
        logger.debug("cannot remember a choice: %s", exc)


def _entries(data: bytes | None) -> dict[str, dict[str, Any]]:
    """The well-formed entries of the file's ``data`` (anything else is ignored)."""
    try:
        raw = json.loads(data) if data else {}
    except ValueError:
        return {}
    if not isinstance(raw, dict):
        return {}
    return {k: v for k, v in raw.items()
            if isinstance(k, str) and isinstance(v, dict) and isinstance(v.get("choice"), bool)
            and isinstance(v.get("at"), int | float) and not isinstance(v["at"], bool)
            and isinstance(v.get("detail", ""), str)}


class Memory:
    """One chooser's entry in the file: recalled when what it is keyed by changes
    (:meth:`keyed`), written when the chooser decides (:meth:`decided`)."""

    def __init__(self, what: str, chooser: EarlyChooser) -> None:
        self.what = what
        self.chooser = chooser
        self.name = ""  # the entry's key, once keyed
        self._sig: Hashable = None

    def keyed(self, sig: Hashable, how: Callable[[], tuple[str, str]]) -> bool:
        """The chooser now decides for ``sig`` (cheap to compare; ``how()``: the plan's
        fingerprint and how the bytes move, for the entry's name). True when it took a
        choice remembered for it."""
        if self.chooser.forced is not None or sig == self._sig:
            return False
        self._sig = sig
        self.name = key(self.what, *how())
        choice = recall(self.name)
        self.chooser.recall(choice)
        return choice is not None

    def decided(self) -> None:
        if self.name:
            remember(self.name, self.chooser.choice, self.chooser.decided or "")
