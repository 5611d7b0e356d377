"""Where tensorx keeps what it builds on first use (the UCX binding, the sparse SGD kernel):
``$TENSORX_CACHE_DIR``, else ``$XDG_CACHE_HOME/tensorx``, else ``~/.cache/tensorx``."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["cache_root"]


def cache_root() -> Path:
    base = os.environ.get("TENSORX_CACHE_DIR")
    if base:
        return Path(base)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "tensorx"
