"""Peer-supplied text made safe to log. Pure."""

from __future__ import annotations

__all__ = ["gist", "printable"]

LIMIT = 200
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def printable(value: object, limit: int = LIMIT) -> str:
    """``value`` as one line of printable ASCII: newlines, escape sequences and every other
    control or non-ASCII character are escaped (``\\n``, ``\\x1b``, ``\\u2028``) and it is
    cut at ``limit`` characters, so a peer can neither forge nor flood log lines.
    Idempotent: text that went through it once comes out unchanged."""
    text = value if isinstance(value, str) else repr(value)
    out = "".join(c if " " <= c <= "~" else _escape(c) for c in text[:limit + 1])
    return out if len(text) <= limit else out[:limit] + f"...({len(text) - limit} more)"


def _escape(c: str) -> str:
    if c in _NAMED:
        return _NAMED[c]
    code = ord(c)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 \
        else f"\\U{code:08x}"


def gist(reason: str) -> str:
    """The first clause of a lane's reason (``ep.info["skipped"]``), for a short line:
    ``"UCX unavailable (UCX here has no RDMA device (it has ...), so ...)"`` -> ``"UCX
    here has no RDMA device"``. Pure."""
    text = reason.strip()
    if text.startswith("UCX unavailable (") and text.endswith(")"):
        text = text[len("UCX unavailable ("):-1]
    for stop in (" (", "; ", ", which", ", so "):
        cut = text.find(stop)
        if cut > 0:
            text = text[:cut]
    return text
