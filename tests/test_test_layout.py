"""The tests' own layout (STYLE.md 21): helpers shared between test modules live in
``tests/support/``; no module of the tests imports a test module or ``conftest`` (pytest
shares the fixtures of ``conftest.py`` on its own). Read from the source, like
``tests/test_layers.py``: every import counts, lazy ones too.
"""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent


def _module(path: Path) -> str:
    """The module's name; a package's ``__init__`` is ``package.__init__`` here, so that its
    relative imports resolve against the package itself."""
    return ".".join(path.relative_to(ROOT).with_suffix("").parts)


def imported(source: str, module: str) -> list[tuple[str, int]]:
    """(module or ``package.name`` imported, line) for every import in ``source``, the
    source of ``module``; relative imports resolved."""
    package = module.rsplit(".", 1)[0] if "." in module else ""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            found.append((base, node.lineno))
            found += [(f"{base}.{alias.name}", node.lineno) for alias in node.names]
    return found


def is_test_module(name: str) -> bool:
    """A module of the tests that is a test module (``test_*``) or ``conftest``."""
    parts = name.split(".")
    return parts[0] == "tests" and any(p.startswith("test_") or p == "conftest"
                                       for p in parts[1:])


def offences(source: str, module: str) -> list[str]:
    """One line per offending import statement."""
    lines = {line: name for name, line in reversed(imported(source, module))
             if is_test_module(name)}
    return [f"{module}:{line} imports {name}" for line, name in sorted(lines.items())]


def test_no_module_of_the_tests_imports_a_test_module() -> None:
    found = [o for path in sorted(TESTS.rglob("*.py"))
             for o in offences(path.read_text(), _module(path))]
    assert not found, ("move what they share into tests/support/:\n" + "\n".join(found))


def test_the_check_sees_every_way_of_importing_one() -> None:
    module = "tests.test_a"
    for source in ["from .test_b import helper", "from . import test_b",
                   "from tests.test_b import helper", "from tests import test_b",
                   "import tests.test_b", "from .conftest import HAVE_UCX",
                   "def f():\n    from tests.conftest import x\n"]:
        assert offences(source, module), source
    assert offences("from ..test_b import x", "tests.support.clusters")
    assert offences("from ..conftest import x", "tests.support.__init__")
    for source in ["from tests.support.lanes import lanes", "from tests.support import models",
                   "from .support.data import batches", "import tensorx.testing",
                   "from tensorx.testing import OwnerProcess"]:
        assert not offences(source, module), source
