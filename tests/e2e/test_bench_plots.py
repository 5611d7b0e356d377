"""Each benchmark's chart, drawn from synthetic rows in the shape its ``table()`` reads
(no benchmark is run): a PNG is written, rows missing keys are skipped, no rows draw nothing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("matplotlib", reason="matplotlib (the bench extra) draws the charts")
pytest.importorskip("torch", reason="the benchmark modules import torch")

PNG = b"\x89PNG"


def _png(path: Path) -> None:
    data = path.read_bytes()
    assert data.startswith(PNG) and len(data) > 1000


def test_train_throughput_plot(tmp_path: Path) -> None:
    from benchmarks import train_throughput as t

    def row(place: str, key: str, rate: float, vs: float | None) -> dict[str, Any]:
        # summarise()'s keys
        return {"placement": place, "key": key, "system": t.ALL[key].label,
                "steps_per_s": rate, "median_step_s": 1 / rate, "steps": 24, "vs_rpc": vs}

    rows = [row("same host", "tensorx-defaults", 30.0, 3.0), row("same host", "rpc", 10.0, 1.0),
            row("two namespaces (veth)", "tensorx-tcp", 12.0, None)]
    assert "30.00" in t.table(rows)
    t.plot([*rows, {"placement": "same host"}], tmp_path / "train_throughput.png")
    _png(tmp_path / "train_throughput.png")
    t.plot([], tmp_path / "none.png")
    assert not (tmp_path / "none.png").exists()


def test_sparse_plot(tmp_path: Path) -> None:
    from benchmarks import sparse as t

    def row(place: str, model: str, key: str, ms: float) -> dict[str, Any]:
        # measure()'s keys
        return {"placement": place, "model": model, "key": key, "system": t.SYSTEMS[key].label,
                "ms": ms, "vs_rpc": None, "steps": 80, "lanes": None, "host": "", "rows": 4096}

    rows = [row("same host", m, k, ms) for m in t.MODELS
            for k, ms in (("tensorx", 10.0), ("rpc", 30.0), ("local", 6.0))]
    rows.append(row("two namespaces (veth)", "dlrm", "tensorx", 14.0))
    assert "DLRM-shaped" in t.table(rows)
    t.plot([*rows, {"placement": "same host", "model": "dlrm"}], tmp_path / "sparse.png")
    _png(tmp_path / "sparse.png")
    t.plot([], tmp_path / "none.png")
    assert not (tmp_path / "none.png").exists()


def test_pipeline_plot(tmp_path: Path) -> None:
    from benchmarks import pipeline as t

    def row(case: str, system: str, place: str, ms: float,
            model_ms: float | None) -> dict[str, Any]:
        # main()'s keys
        return {"case": case, "system": system, "place": place, "step_s": ms / 1e3,
                "model_s": None if model_ms is None else model_ms / 1e3,
                "registered": [1, 2] if model_ms else None, "lane": None}

    rows = [row(case, s, "one host", ms * k, 1.5 * k) for case, k in (("t1-64K", 1),
                                                                        ("t1-16M", 100))
            for s, ms in (("tensorx", 2.0), ("torch", 4.0), ("rpc", 9.0))]
    rows += [row("t1-64K", "tensorx", "two namespaces", 3.0, None),
             row("t1-64K", "torch", "two namespaces", 5.0, None),
             row("t2-dynamic", "tensorx", "one host", 50.0, 40.0)]
    assert "t1-16M" in t.table(rows)
    t.plot([*rows, {"case": "t1-64K", "system": "rpc"}], tmp_path / "pipeline.png")
    _png(tmp_path / "pipeline.png")
    t.plot(rows[-1:], tmp_path / "none.png")  # no T1 row: nothing to draw
    assert not (tmp_path / "none.png").exists()


def test_transfer_plot(tmp_path: Path) -> None:
    from benchmarks import transfer as t

    sizes = [64 << 10, 16 << 20]

    def res(scale: float) -> dict[str, object]:
        # merge()'s keys: seconds per "write N" / "read N", and the round trip
        return {**{f"{op} {n}": scale * n / 5e9 for op in ("write", "read") for n in sizes},
                "latency": scale * 2e-5}

    systems = {"raw socket": res(1.0), "memcpy": res(0.2), "tensorx tcp": res(1.1)}
    assert "raw socket" in t.table(sizes, systems)
    path = tmp_path / "sub" / "transfer.png"
    t.plot(sizes, {**systems, "half a run": {"latency": 1.0}}, str(path))
    _png(path)
    t.plot(sizes, {}, str(tmp_path / "none.png"))
    assert not (tmp_path / "none.png").exists()
