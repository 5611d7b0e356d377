"""Checkpoint files: durable, private, kept in generations, refused when others could plant.

A checkpoint holds the model's parameters, so it is treated as sensitive and, since
whoever can replace it decides what the next run resumes from, as untrusted unless only we
could have written it:

* the directory is created 0700 and each file written 0600 (whatever the umask); a
  directory or file owned by another user, or writable by group or others, is refused with
  a :class:`~tensorx.errors.UsageError` before anything is read or written (a shared
  ``/tmp`` is not a place for checkpoints);
* a checkpoint is written to a fresh temporary file (``O_CREAT | O_EXCL``: a planted link
  is never followed), flushed and fsynced, renamed over the newest one and the directory
  fsynced, so a crash or a full disk leaves the previous checkpoint intact;
* the last ``keep`` checkpoints are kept (``NAME``, ``NAME.1``, ...): loading falls back
  from a damaged newest one to the one before it, with a one-line WARNING saying why.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from tensorx._owned import Kind, why_not_ours
from tensorx.errors import UsageError

__all__ = ["KEEP", "check_schedule", "load", "path_for", "prepare_dir", "save"]

logger = logging.getLogger(__name__)

KEEP = 2  # checkpoints kept by default: the newest and the one before it
_REQUIRED = {"plan": bytes, "version": int, "params": dict}


def check_schedule(every: int | None, keep: int) -> None:
    """``checkpoint_every`` (updates, or None) and ``checkpoint_keep`` make sense."""
    if every is not None and every < 1:
        raise UsageError(f"checkpoint_every must be >= 1 update or None, got {every}")
    if keep < 1:
        raise UsageError(f"checkpoint_keep must be >= 1, got {keep}")


def path_for(directory: str | os.PathLike[str], shard: int, num_shards: int) -> Path:
    """The newest checkpoint of one shard; older generations are ``PATH.1``, ``PATH.2``..."""
    return Path(directory) / f"ps-shard{shard}-of{num_shards}.pt"


def generations(path: Path, keep: int) -> list[Path]:
    """``path`` and its older generations, newest first."""
    return [path, *(path.with_name(f"{path.name}.{i}") for i in range(1, keep))]


def prepare_dir(directory: str | os.PathLike[str]) -> Path:
    """Create ``directory`` 0700 if it is missing; refuse one that others control."""
    path = Path(directory)
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        info = path.stat()
    except OSError as exc:
        raise UsageError(f"checkpoint directory {str(path)!r}: {exc.strerror}") from exc
    _check_ours(path, info, "directory", "checkpoint directory")
    return path


def _check_ours(path: Path, info: os.stat_result, kind: Kind, what: str) -> None:
    why = why_not_ours(info, kind)
    if why is not None:
        raise UsageError(f"{what} {str(path)!r} {why}: refusing to use it")


def _check_file(path: Path) -> bool:
    """Does a checkpoint file exist at ``path``? Refuses one that is not ours alone."""
    try:
        info = path.lstat()
    except FileNotFoundError:
        return False
    except OSError as exc:
        raise UsageError(f"checkpoint {str(path)!r}: {exc.strerror}") from exc
    _check_ours(path, info, "regular file", "checkpoint")
    return True


def save(path: Path, write: Callable[[IO[bytes]], None], keep: int = KEEP) -> None:
    """Write a new newest checkpoint with ``write(file)``; durable and atomic. Raises
    OSError (disk full, ...) with the previous checkpoints untouched, or UsageError."""
    if keep < 1:
        raise UsageError(f"keep must be >= 1 checkpoint, got {keep}")
    directory = prepare_dir(path.parent)
    chain = generations(path, keep)
    for old in chain:
        _check_file(old)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as file:  # mkstemp: O_EXCL, mode 0600
            write(file)
            file.flush()
            os.fsync(file.fileno())
        for older, newer in zip(reversed(chain[1:]), reversed(chain[:-1]), strict=True):
            if newer.exists():
                os.replace(newer, older)  # rename never follows a link at the target
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_dir(directory)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def load(path: Path, read: Callable[[Path], Any], keep: int = KEEP) -> dict[str, Any] | None:
    """The newest readable checkpoint of ``path``'s chain (None: there is none), read with
    ``read`` (which raises UsageError for a file it can read but not use). A damaged one
    is skipped with a WARNING naming the file and why; UsageError when every one that
    exists is damaged, or one is not ours alone."""
    prepare_dir(path.parent)
    damaged: list[str] = []
    for candidate in generations(path, keep):
        if not _check_file(candidate):
            continue
        why = _read(candidate, read)
        if isinstance(why, dict):
            if damaged:
                logger.warning("resuming from the older checkpoint %s", candidate)
            return why
        logger.warning("checkpoint %s is damaged, trying the one before it: %s", candidate,
                       why)
        damaged.append(f"{candidate.name}: {why}")
    if damaged:
        raise UsageError(f"no usable checkpoint in {str(path.parent)!r} "
                         f"({'; '.join(damaged)})")
    return None


def _read(path: Path, read: Callable[[Path], Any]) -> dict[str, Any] | str:
    """The checkpoint's contents, or a one-line reason why it cannot be used."""
    try:
        state = read(path)
    except UsageError:
        raise  # readable, but not for this version or setup: no older one will do either
    except Exception as exc:  # torch.load raises many kinds on a truncated or foreign file
        first = str(exc).strip().splitlines()
        return f"unreadable ({type(exc).__name__}{': ' + first[0] if first else ''})"
    if not isinstance(state, dict):
        return "not a tensorx checkpoint"
    for key, typ in _REQUIRED.items():
        if not isinstance(state.get(key), typ):
            return f"field {key!r} missing or of the wrong type"
    return state
