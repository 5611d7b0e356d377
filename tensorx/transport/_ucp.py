"""libucp RMA bindings: the cffi module is compiled on first use, cached per UCX, ABI and
source.

Nothing is built or loaded at import. :func:`load` compiles the C source in
``_ucp_build.py`` against the headers shipped in the ``libucx`` wheel, links it with an
rpath to the wheel's ``lib/`` (the very libucp ucxx uses, so ucxx's handles are valid here)
and caches it under ``$TENSORX_CACHE_DIR`` or ``~/.cache/tensorx``, loading from there only
as :mod:`tensorx._cache` allows (a cache other users could write is not loaded from: the
binding is built privately instead). Every failure becomes
:class:`~tensorx.errors.TransportUnavailableError`.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import re
import sys
import sysconfig
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

from tensorx import _cache
from tensorx._text import printable
from tensorx.errors import TransportUnavailableError
from tensorx.transport._exceptions import UCX_ERRORS, map_exceptions
from tensorx.transport._ucp_build import CDEF, SOURCE

__all__ = ["UCS_ERR_CANCELED", "UCS_OK", "UcpLib", "cache_dir", "lane_roles", "load",
           "prepare", "status_string", "ucx_paths", "ucxx_context"]

logger = logging.getLogger("tensorx.transport.ucx")

UCS_OK = 0
UCS_INPROGRESS = 1
UCS_ERR_CANCELED = -16
UCS_ERR_NO_MEMORY = -4
_MODULE = "_tensorx_ucp"
_lock = threading.Lock()
_loaded: UcpLib | None = None  # the binding, like an imported module: loaded once
# built and checked by prepare(), not loaded yet: (its cache folder, the object)
_prepared: tuple[Path, _cache.Built] | None = None


class UcpLib:
    """The compiled module: ``ffi`` and ``lib`` (functions named ``tx_*``). ``fd``: the
    descriptor it was loaded through (open for the life of the process), which a child
    process that loads the binding too is handed (:mod:`._ucx_probe`)."""

    def __init__(self, module: ModuleType, built: _cache.Built) -> None:
        self.ffi: Any = module.ffi
        self.lib: Any = module.lib
        self.fd = built.fd
        self.origin = built.origin

    def status_string(self, status: int) -> str:
        return str(self.ffi.string(self.lib.tx_status_string(status)).decode())

    def version(self) -> str:
        return str(self.ffi.string(self.lib.tx_version()).decode())


def ucx_paths() -> tuple[str, Path, Path]:
    """(version, include dir, lib dir) of the ``libucx`` wheel; TransportUnavailableError."""
    with map_exceptions("UCX is not installed (pip install 'tensorx-rdma[ucx]')", UCX_ERRORS):
        import libucx  # noqa: PLC0415 (optional dependency)
    root = Path(libucx.__file__).parent
    include, lib = root / "include", root / "lib"
    if not (include / "ucp" / "api" / "ucp.h").is_file() or not (lib / "libucp.so").exists():
        raise TransportUnavailableError(f"the libucx package at {root} lacks headers or libucp")
    return str(libucx.__version__), include, lib


def load() -> UcpLib:
    """Build (once per UCX version and Python ABI) and load the binding module."""
    global _loaded
    with _lock:
        if _loaded is None:
            _loaded = _import_or_build()
        return _loaded


def prepare() -> None:
    """Build the binding where it is not built yet, and check it, without loading UCX
    (libucs installs its memory hooks as it loads: 0.4 s here). A node that starts UCX
    only once a peer offers it builds at its own start, never inside a handshake, which
    the peer would time out while the compiler runs."""
    global _prepared
    with _lock:
        if _loaded is None and _prepared is None:
            version, include, lib = ucx_paths()
            _prepared = cache_dir(version, lib), _built(version, include, lib)


def status_string(status: int) -> str:
    try:
        return load().status_string(status)
    except TransportUnavailableError:
        return f"UCS status {status}"


def cache_dir(version: str, lib: Path) -> Path:
    """One build per UCX version, ABI, source and libucx location: the module's runpath
    names ``lib`` (a child process that loads it, see :mod:`._ucx_probe`, relies on it),
    so a build made for another environment, perhaps since deleted, is never reused."""
    abi = sysconfig.get_config_var("SOABI") or sys.implementation.cache_tag
    source = hashlib.sha256((CDEF + SOURCE + str(lib)).encode()).hexdigest()[:12]
    return _cache.cache_root() / f"ucp-{version}-{abi}-{source}"


def _import_or_build() -> UcpLib:
    global _prepared
    version, include, lib = ucx_paths()
    with map_exceptions("cannot load libucx", UCX_ERRORS):
        import libucx  # noqa: PLC0415 (optional dependency)

        libucx.load_library()
    ready, _prepared = _prepared, None
    built = ready[1] if ready and ready[0] == cache_dir(version, lib) else \
        _built(version, include, lib)
    return UcpLib(_import_from(built), built)


def _built(version: str, include: Path, lib: Path) -> _cache.Built:
    """The binding for this UCX, from the cache or built now; not loaded."""
    folder = cache_dir(version, lib)
    name = _MODULE + (sysconfig.get_config_var("EXT_SUFFIX") or ".so")
    with map_exceptions(f"cannot build the UCX binding into {printable(str(folder))}",
                        UCX_ERRORS):
        return _cache.built(folder.name, name, functools.partial(_build, include, lib),
                            "the UCX binding")


def _build(include: Path, lib: Path, tmp: Path) -> Path:
    """The binding, compiled in the private folder ``tmp``."""
    with map_exceptions("the UCX transport needs cffi (pip install cffi)", UCX_ERRORS):
        import cffi  # noqa: PLC0415 (optional dependency)
    ffi = cffi.FFI()
    ffi.cdef(CDEF)
    ffi.set_source(_MODULE, SOURCE, include_dirs=[str(include)], library_dirs=[str(lib)],
                   libraries=["ucp", "ucs", "dl"],
                   extra_link_args=[f"-Wl,-rpath,{lib}", "-pthread"],
                   extra_compile_args=["-O2", "-pthread"])
    logger.info("building the UCX RMA binding")
    output = tmp / "compiler.log"
    try:
        with _fds_to(output):
            built = Path(ffi.compile(tmpdir=str(tmp), verbose=False))
    except Exception as exc:
        said = output.read_text(errors="replace").strip()
        logger.error("compiling the UCX binding failed; the compiler said:\n%s", said)
        raise TransportUnavailableError(
            f"cannot compile the UCX binding (is a C compiler installed?): {exc}") from exc
    if logger.isEnabledFor(logging.DEBUG):
        logger.debug("the compiler said: %s", output.read_text(errors="replace"))
    return built


@contextlib.contextmanager
def _fds_to(path: Path) -> Iterator[None]:
    """Send this process's stdout and stderr (the compiler's, a child, writes to the fds,
    not to sys.stderr) to ``path`` meanwhile: a first run shows no pages of C warnings.
    Whatever else the process writes during the build lands there too: shown on failure,
    logged at DEBUG otherwise."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    try:
        with open(path, "wb") as sink:
            os.dup2(sink.fileno(), 1)
            os.dup2(sink.fileno(), 2)
            yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, copy in zip((1, 2), saved, strict=True):
            os.dup2(copy, fd)
            os.close(copy)


def _import_from(built: _cache.Built) -> ModuleType:
    """The module of ``built``, loaded through its checked descriptor."""
    with map_exceptions(f"cannot load the UCX binding {built.origin}", UCX_ERRORS):
        loader = importlib.machinery.ExtensionFileLoader(_MODULE, built.path)
        spec = importlib.util.spec_from_file_location(_MODULE, built.path, loader=loader)
        if spec is None:
            raise ImportError(f"no module spec for {built.path}")
        module = importlib.util.module_from_spec(spec)  # the object is mapped here
        loader.exec_module(module)
    return module


_LANE_LINE = re.compile(r"lane\[\d+\]:\s+\d+:(\S+?)\.\d+\s.*?->\s+\S+\s*(.*)$")


def lane_roles(description: str) -> dict[str, list[str]]:
    """``{"cma/memory": ["rma_bw"], "sysv/memory": ["am"]}`` from ``ucp_ep_print_info``."""
    roles: dict[str, list[str]] = {}
    for line in description.splitlines():
        m = _LANE_LINE.search(line)
        if m:
            words = [w for w in m.group(2).split() if not w.startswith(("seg", "md[")) and
                     not w.isdigit()]
            roles.setdefault(m.group(1), []).extend(w.split("#")[0] for w in words)
    return roles


def ucxx_context(defaults: Mapping[str, str], tls: str | None,
                 options: Mapping[str, str] | None) -> tuple[Any, bool]:
    """ucxx's per-process context, initialised with our settings if we are its first user,
    and whether we were (then tensorx may drive its progress, see ``_ucx_progress.py``).

    ``defaults`` yield to ``UCX_*`` environment variables; ``options`` and ``tls`` win
    over both. A context that already exists is used as it is (a differing ``tls`` is
    logged)."""
    with map_exceptions("ucxx is not usable here", UCX_ERRORS):
        import ucxx  # noqa: PLC0415 (optional dependency)
        from ucxx import core  # noqa: PLC0415 (optional dependency)
    wanted = {k: v for k, v in defaults.items() if f"UCX_{k}" not in os.environ}
    wanted.update(options or {})
    if tls is not None:
        wanted["TLS"] = tls
    with map_exceptions("cannot initialise UCX", UCX_ERRORS):
        created = core._ctx is None  # noqa: SLF001 (ucxx has no public way to share its context)
        if created:
            _init(ucxx, wanted, explicit={**(options or {}), **({"TLS": tls} if tls else {})})
        elif tls is not None and core._ctx.config.get("TLS") != tls:  # noqa: SLF001 (ucxx has no public way to share its context)
            logger.warning("UCX already initialised in this process with TLS=%s; tls=%r "
                           "is ignored", core._ctx.config.get("TLS"), tls)  # noqa: SLF001 (ucxx has no public way to share its context)
        return core._get_ctx(), created  # noqa: SLF001 (ucxx has no public way to share its context)


def _init(ucxx: Any, wanted: dict[str, str], explicit: Mapping[str, str]) -> None:
    try:
        ucxx.init(options=wanted, progress_mode="thread")
    except Exception as exc:  # e.g. a default names a transport this UCX was built without
        if dict(explicit) == wanted:
            raise
        logger.warning("UCX rejected tensorx's default settings (%s); using UCX's own", exc)
        ucxx.reset()
        ucxx.init(options=dict(explicit), progress_mode="thread")
