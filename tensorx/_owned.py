"""Is a file or folder this user's alone? The one check behind everything tensorx trusts
because only this user could have written it: checkpoints, the build cache."""

from __future__ import annotations

import os
import stat
from typing import Literal

__all__ = ["Kind", "why_not_ours"]

Kind = Literal["directory", "regular file"]
_IS = {"directory": stat.S_ISDIR, "regular file": stat.S_ISREG}


def why_not_ours(info: os.stat_result, kind: Kind) -> str | None:
    """None where ``info`` (of ``lstat`` or ``fstat``: a link is itself, never what it
    points at) is a ``kind`` owned by this process's effective uid that no group or other
    user may write (a POSIX ACL granting anyone else write shows in the group bits); else
    why not, as a phrase to follow the path: ``is owned by uid 65534, not by this user
    (uid 1000)``."""
    if stat.S_ISLNK(info.st_mode):
        return f"is a symbolic link, not a {kind}"
    if not _IS[kind](info.st_mode):
        return f"is not a {kind}"
    if info.st_uid != os.geteuid():
        return f"is owned by uid {info.st_uid}, not by this user (uid {os.geteuid()})"
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"is writable by other users (mode {stat.S_IMODE(info.st_mode):04o})"
    return None
