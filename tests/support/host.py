"""What a test needs of this host: another user to play (root only), a planted shared
object, the ``/dev/shm`` files memory lies in, and the C kernels (or a skip)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import pytest

from tensorx import _shm

if TYPE_CHECKING:
    import torch

    from tensorx._ps.update import foldkernel, rowkernel

K = TypeVar("K")
NOBODY = 65534  # "another user" (uid and gid of nobody)
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to play another user")


def plant(path: Path, marker: Path) -> None:
    """Put at ``path`` (a new file in place of whatever is there, as an attacker would)
    a shared object whose constructor creates ``marker``: if anything ever loads it, even
    to fail at once on a missing symbol, ``marker`` exists. Skips without a C compiler."""
    cc = shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler here to build a planted object")
    source = ("#include <fcntl.h>\n#include <unistd.h>\n"
              "__attribute__((constructor)) static void planted(void) {\n"
              f"    int fd = open({json.dumps(str(marker))}, O_CREAT | O_WRONLY, 0600);\n"
              "    if (fd >= 0) close(fd);\n}\n")
    with tempfile.TemporaryDirectory(prefix="tensorx-plant-") as tmp:
        (Path(tmp) / "planted.c").write_text(source)
        out = Path(tmp) / "planted.so"
        subprocess.run([cc, "-shared", "-fPIC", "-o", str(out), str(Path(tmp) / "planted.c")],
                       check=True, capture_output=True, timeout=60)
        path.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(out, path.with_name(path.name + ".planting"))
    os.replace(path.with_name(path.name + ".planting"), path)


def shm_files(tensors: Iterable[torch.Tensor]) -> set[str]:
    """The /dev/shm files (by name; "" for none) the tensors' memory lies in."""
    maps = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 6 and parts[5].startswith(_shm.SHM_DIR + "/tensorx-"):
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                maps.append((lo, hi, os.path.basename(parts[5])))
    return {next((n for lo, hi, n in maps if lo <= t.data_ptr() < hi), "") for t in tensors}


def kernel_or_skip() -> rowkernel.RowKernel:
    """The C kernel; a test fails if a C compiler is here and it did not build."""
    from tensorx._ps.update import rowkernel

    return built_or_skip(rowkernel.load(), "the sparse SGD kernel")


def fold_kernel_or_skip() -> foldkernel.FoldKernel:
    """The gradient fold kernel; a test fails if a C compiler is here and it did not
    build (or its probe found it differs from torch)."""
    from tensorx._ps.update import fold

    return built_or_skip(fold.kernel(), "the gradient fold kernel")


def built_or_skip(kernel: K | None, what: str) -> K:
    if kernel is None:
        if shutil.which(os.environ.get("CC") or "cc") is None:
            pytest.skip(f"no C compiler here: {what} is not built")
        raise AssertionError(f"a C compiler is here but {what} did not build")
    return kernel
