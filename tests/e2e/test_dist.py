"""The distribution: its name everywhere a user reads it, and the wheel check CI runs.

``make check-dist`` (.ci/check_dist.py) builds and installs the real wheel; these tests keep
its file checks honest (they fail on a wheel that lacks a file) without building anything.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]


def _check_dist() -> ModuleType:
    spec = importlib.util.spec_from_file_location("check_dist", ROOT / ".ci" / "check_dist.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_the_distribution_is_not_pypis_tensorx() -> None:
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.findall(r'^name = "(.*)"$', pyproject, re.MULTILINE) == ["tensorx-rdma"]
    assert _check_dist().DIST == "tensorx-rdma"
    assert '\ntensorx = "tensorx.cli:main"\n' in pyproject  # the command keeps its name


def test_no_text_tells_users_to_install_pypis_tensorx() -> None:
    """`pip install tensorx` and `tensorx[extra]` install an unrelated TensorFlow library."""
    wrong = re.compile(r"pip install ['\"]?tensorx(?![-\w])|(?<![-\w])tensorx\[")
    texts = [ROOT / "README.md", ROOT / "Makefile", *sorted((ROOT / "docs").glob("*.md")),
             *sorted((ROOT / "tensorx").rglob("*.py"))]
    found = [f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
             for path in texts
             for number, line in enumerate(path.read_text().splitlines(), 1)
             if wrong.search(line)]
    assert not found, "\n".join(found)


def test_the_package_files_include_py_typed() -> None:
    files = _check_dist().package_files()
    assert {"tensorx/__init__.py", "tensorx/py.typed", "tensorx/transport/_ucp_build.py"} <= files
    assert not [name for name in files if "__pycache__" in name]


def test_a_complete_wheel_passes() -> None:
    check = _check_dist()
    expected = {"tensorx/__init__.py", "tensorx/py.typed", "tensorx/transport/_ucp_build.py"}
    names = expected | {"tensorx_rdma-0.1.0.dist-info/METADATA",
                        "tensorx_rdma-0.1.0.dist-info/RECORD"}
    assert check.wheel_problems(names, expected) == []


def test_a_wheel_without_py_typed_or_a_module_fails() -> None:
    check = _check_dist()
    expected = {"tensorx/__init__.py", "tensorx/py.typed", "tensorx/cli.py",
                "tensorx/transport/_ucp_build.py"}
    names = {"tensorx/__init__.py", "tensorx/transport/_ucp_build.py",
             "tensorx_rdma-0.1.0.dist-info/RECORD"}
    assert check.wheel_problems(names, expected) == ["the wheel lacks tensorx/cli.py",
                                                     "the wheel lacks tensorx/py.typed"]


def test_a_wheel_with_files_outside_the_package_fails() -> None:
    check = _check_dist()
    expected = {"tensorx/__init__.py", "tensorx/py.typed", "tensorx/transport/_ucp_build.py"}
    names = expected | {"tests/test_node.py", "tensorx/transport/_ucp_cffi.so",
                        "tensorx-0.1.0.dist-info/RECORD"}
    assert check.wheel_problems(names, expected) == [
        "the wheel holds tensorx-0.1.0.dist-info/RECORD, outside the package",
        "the wheel holds tests/test_node.py, outside the package",
        "the wheel holds a compiled file tensorx/transport/_ucp_cffi.so",
    ]


def test_an_sdist_without_the_changelog_fails() -> None:
    check = _check_dist()
    expected = {"tensorx/__init__.py"}
    names = {"pyproject.toml", "README.md", "PKG-INFO", "tensorx/__init__.py"}
    assert check.sdist_problems(names, expected) == ["the sdist lacks CHANGELOG.md"]
