"""Build the sdist and the wheel, check what they hold, and install the wheel into a new venv.

Run by ``make check-dist`` (and so by CI) with the project's venv. What it proves:

* ``python -m build`` makes an sdist, and a wheel from that sdist (so the sdist holds what
  the build needs);
* the wheel holds every file of the ``tensorx`` package in the checkout (``py.typed``
  included) and nothing outside the package and its ``.dist-info``; the sdist holds the
  package and the files the build and users read (``pyproject.toml``, README, CHANGELOG);
* a venv with nothing but the wheel and its declared dependencies (numpy, msgpack: no torch)
  imports ``tensorx`` from that venv and runs ``tensorx info``.

It builds without isolation (this venv's setuptools, no download) and installs numpy and
msgpack at the versions this venv has, so pip takes them from its cache: it takes seconds.
"""

from __future__ import annotations

import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DIST = "tensorx-rdma"
PACKAGE = "tensorx"
# Files the package reads at run time or that type checkers need; the rest is its source.
REQUIRED = ("tensorx/py.typed", "tensorx/__init__.py", "tensorx/transport/_ucp_build.py")
SDIST_FILES = ("pyproject.toml", "README.md", "CHANGELOG.md", "PKG-INFO")
RUNTIME_DEPENDENCIES = ("numpy", "msgpack")
# Run from outside the checkout, so that the import cannot find ./tensorx instead.
SMOKE = (
    "import importlib.util, sys, tensorx\n"
    "assert tensorx.__file__.startswith(sys.prefix), tensorx.__file__\n"
    "assert importlib.util.find_spec('torch') is None, 'torch came with the wheel'\n"
    "print('imported', tensorx.__version__, 'from', tensorx.__file__)\n"
)


def package_files(root: Path = ROOT) -> set[str]:
    """The package's files in the checkout: tracked by git, or every file git would track."""
    listed = subprocess.run(["git", "ls-files", "-z", "--", PACKAGE], cwd=root,
                            capture_output=True, check=False)
    if listed.returncode == 0 and listed.stdout:
        return {name for name in listed.stdout.decode().split("\0") if name}
    return {str(p.relative_to(root)) for p in (root / PACKAGE).rglob("*")
            if p.suffix == ".py" or p.name == "py.typed"}


def wheel_problems(names: set[str], expected: set[str]) -> list[str]:
    """What is wrong with a wheel whose archive lists ``names``; empty when nothing is."""
    problems = [f"the wheel lacks {name}" for name in sorted(expected | set(REQUIRED))
                if name not in names]
    info = f"{DIST.replace('-', '_')}-"
    problems += [f"the wheel holds {name}, outside the package" for name in sorted(names)
                 if not name.startswith(f"{PACKAGE}/")
                 and not (name.startswith(info) and ".dist-info/" in name)]
    problems += [f"the wheel holds a compiled file {name}" for name in sorted(names)
                 if name.endswith((".pyc", ".so", ".o"))]
    return problems


def sdist_problems(names: set[str], expected: set[str]) -> list[str]:
    """What is wrong with an sdist whose members (without the top folder) are ``names``."""
    return [f"the sdist lacks {name}" for name in sorted(expected | set(SDIST_FILES))
            if name not in names]


def build(outdir: Path) -> tuple[Path, Path]:
    _run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(outdir), str(ROOT)],
         quiet=True)
    (sdist,), (wheel,) = outdir.glob("*.tar.gz"), outdir.glob("*.whl")
    return sdist, wheel


def check_archives(sdist: Path, wheel: Path) -> int:
    expected = package_files()
    with zipfile.ZipFile(wheel) as archive:
        in_wheel = set(archive.namelist())
        entry_points = next(archive.read(n).decode() for n in in_wheel
                            if n.endswith(".dist-info/entry_points.txt"))
    with tarfile.open(sdist) as archive:
        in_sdist = {m.name.split("/", 1)[1] for m in archive.getmembers() if "/" in m.name}
    problems = wheel_problems(in_wheel, expected) + sdist_problems(in_sdist, expected)
    if "tensorx = tensorx.cli:main" not in entry_points:
        problems.append("the wheel installs no `tensorx` command")
    if problems:
        sys.exit("check-dist: " + "\n  ".join(["the archives are wrong:", *problems]))
    return len(in_wheel)


def install(wheel: Path, venv: Path) -> None:
    """The wheel and its dependencies only, numpy and msgpack at this venv's versions."""
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    pins = venv / "pins.txt"
    pins.write_text("".join(f"{name}=={metadata.version(name)}\n"
                            for name in RUNTIME_DEPENDENCIES))
    _run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install",
          "--quiet", "-c", str(ROOT / "constraints.txt"), "-c", str(pins), str(wheel)],
         quiet=True)


def smoke(venv: Path) -> None:
    _run([str(venv / "bin" / "python"), "-c", SMOKE], cwd=venv)
    _run([str(venv / "bin" / PACKAGE), "info"], cwd=venv)


def _run(argv: list[str], cwd: Path | None = None, quiet: bool = False) -> None:
    done = subprocess.run(argv, cwd=cwd, capture_output=quiet, text=True, check=False)
    if done.returncode != 0:
        output = f"\n{done.stdout}\n{done.stderr}" if quiet else ""
        sys.exit(f"check-dist: `{' '.join(argv)}` exited {done.returncode}{output}")


def main() -> None:
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="tensorx-dist-") as scratch:
        sdist, wheel = build(Path(scratch) / "dist")
        files = check_archives(sdist, wheel)
        built = time.monotonic()
        install(wheel, Path(scratch) / "venv")
        smoke(Path(scratch) / "venv")
    print(f"check-dist: {sdist.name} and {wheel.name} ({files} files) built and checked in "
          f"{built - started:.1f} s; installed into a new venv, imported and ran "
          f"`tensorx info` in {time.monotonic() - built:.1f} s")


if __name__ == "__main__":
    main()
