"""Building the shard's small C kernels: compiled on first use with the host's C compiler
(``$CC``, else ``cc``) into ``$TENSORX_CACHE_DIR`` (else ``~/.cache/tensorx``), once per
machine, source and flags, and loaded with ctypes, only as :mod:`tensorx._cache` allows.
Each kernel module says what it does and what serves where it cannot be built."""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shlex
import subprocess
from pathlib import Path

from tensorx import _cache

__all__ = ["CFLAGS", "ERRORS", "build"]

# -ffp-contract=off: no multiply-add the source does not write (a plain update must round
# twice, as torch's unfused kernels do)
CFLAGS = ("-O3", "-ffp-contract=off", "-fno-fast-math", "-fPIC", "-shared")
# what build() raises where the kernel cannot be had (no compiler, a read-only cache...)
ERRORS = (OSError, subprocess.SubprocessError, AttributeError)


def build(name: str, source: str, what: str) -> tuple[ctypes.CDLL, _cache.Built]:
    """``source`` compiled as ``name``.so and loaded; ``what`` names it in log lines.
    Raises one of :data:`ERRORS` where it cannot be."""
    cc = shlex.split(os.environ.get("CC") or "cc")
    tag = hashlib.sha256("\0".join([source, *CFLAGS, *cc]).encode()).hexdigest()[:12]
    built = _cache.built(f"{name}-{platform.machine()}-{tag}", f"{name}.so",
                         functools.partial(_compile, cc, name, source), what)
    return ctypes.CDLL(built.path), built


def _compile(cc: list[str], name: str, source: str, tmp: Path) -> Path:
    """The shared library, compiled in the private folder ``tmp``."""
    src = tmp / f"{name}.c"
    src.write_text(source)
    out = tmp / f"{name}.so"
    done = subprocess.run([*cc, *CFLAGS, "-o", str(out), str(src)],
                          capture_output=True, text=True, timeout=120, check=False)
    if done.returncode != 0:
        raise OSError(f"{' '.join(cc)} failed: {done.stderr.strip()[-2000:]}")
    return out
