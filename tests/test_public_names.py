"""``tensorx`` shows its public names alone: ``__all__``, ``dir()``, ``import *``, lazy names."""

from __future__ import annotations

import subprocess
import sys
from types import ModuleType

import pytest

import tensorx


def _dunder(name: str) -> bool:
    return name.startswith("__") and name.endswith("__")


def test_dir_lists_the_public_names_and_dunders_only() -> None:
    shown = dir(tensorx)
    assert shown == sorted(shown)
    assert {name for name in shown if not _dunder(name)} == set(tensorx.__all__) - {"__version__"}
    assert "__version__" in shown and "__doc__" in shown
    assert not {"Any", "TYPE_CHECKING", "importlib", "annotations", "errors"} & set(shown)


def test_every_public_name_resolves() -> None:
    for name in tensorx.__all__:
        assert getattr(tensorx, name) is not None, name


def test_the_lazy_names_are_public() -> None:
    assert set(tensorx._LAZY) <= set(tensorx.__all__)


def test_the_module_binds_no_other_public_helper() -> None:
    """Beyond ``__all__``: submodules (``tensorx.errors``) and the future import only."""
    extra = [name for name, value in vars(tensorx).items()
             if not name.startswith("_") and name not in tensorx.__all__
             and not isinstance(value, ModuleType) and name != "annotations"]
    assert not extra


def test_star_import_gives_all_and_loads_the_lazy_names() -> None:
    namespace: dict[str, object] = {}
    exec("from tensorx import *", namespace)
    assert set(namespace) - {"__builtins__"} == set(tensorx.__all__)
    assert namespace["Worker"] is tensorx.Worker


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="has no attribute 'Any'"):
        _ = tensorx.Any  # type: ignore[attr-defined]
    assert not hasattr(tensorx, "importlib")


def test_a_lazy_subpackage_is_the_module_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    """``_LAZY = {"sub": "tensorx.sub"}`` makes ``tensorx.sub`` import on first use."""
    monkeypatch.delattr(tensorx, "errors")
    monkeypatch.setitem(tensorx._LAZY, "errors", "tensorx.errors")
    assert tensorx.errors is sys.modules["tensorx.errors"]


def test_the_transport_layer_imports_without_the_lazy_modules() -> None:
    """Importing tensorx (and dir() on it) loads neither torch nor the planning modules."""
    code = ("import sys, tensorx; dir(tensorx); "
            "print(sorted(m for m in ('torch', 'tensorx.worker', 'tensorx.ps') "
            "if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, check=True)
    assert done.stdout.strip() == "[]"


def test_the_remote_optimizer_is_no_longer_served_by_the_worker_module() -> None:
    """Its one place is ``tensorx.RemoteOptimizer``; old code fails saying so."""
    import tensorx.worker

    with pytest.raises(AttributeError, match=r"use tensorx\.RemoteOptimizer"):
        _ = tensorx.worker.RemoteOptimizer  # type: ignore[attr-defined]
    with pytest.raises(ImportError, match="cannot import name 'RemoteOptimizer'"):
        exec("from tensorx.worker import RemoteOptimizer", {})
