"""Remembered choices (tensorx._ps.common.remembered): what is not fresh, well formed and this
user's alone is ignored, never trusted."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tensorx._ps.common import remembered
from tests.support.host import NOBODY, as_root

NAME = remembered.key("pipelined", "f00d", "tcp")


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A cache of this test's own; the file holding one fresh choice (True)."""
    monkeypatch.setenv("TENSORX_REMEMBER", "1")
    monkeypatch.setenv("TENSORX_CACHE_DIR", str(tmp_path))
    remembered.remember(NAME, True, "on 1 ms, off 2 ms")
    path = tmp_path / remembered.FOLDER / remembered.FILE
    assert remembered.recall(NAME) is True and oct(path.stat().st_mode)[-3:] == "600"
    return path


def test_a_choice_is_recalled_until_it_is_stale(cache: Path) -> None:
    assert remembered.recall(remembered.key("pipelined", "f00d", "ucx")) is None
    later = json.loads(cache.read_bytes())[NAME]["at"] + remembered.FRESH_S + 1
    assert remembered.recall(NAME, now=later) is None
    remembered.remember(NAME, False, "measured again")
    assert remembered.recall(NAME) is False


@pytest.mark.parametrize("data", [b"\x00not json", b"[1, 2]",
                                  json.dumps({NAME: {"choice": "yes", "at": 1}}).encode()])
def test_a_corrupt_file_is_ignored_and_replaced(cache: Path, data: bytes) -> None:
    cache.write_bytes(data)
    assert remembered.recall(NAME) is None
    remembered.remember(NAME, False, "")
    assert remembered.recall(NAME) is False


def test_a_file_others_may_write_or_a_link_is_ignored(
        cache: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cache.chmod(0o666)
    assert remembered.recall(NAME) is None
    assert "writable by other users" in caplog.text
    planted = tmp_path / "planted.json"
    planted.write_bytes(cache.read_bytes())
    cache.unlink()
    cache.symlink_to(planted)
    assert remembered.recall(NAME) is None
    assert "symbolic link" in caplog.text
    remembered.remember(NAME, False, "")  # replaces the link, never writes through it
    assert remembered.recall(NAME) is False and json.loads(planted.read_bytes())[NAME]["choice"]


@as_root
def test_a_file_or_folder_of_another_user_is_ignored(cache: Path) -> None:
    os.chown(cache, NOBODY, NOBODY)
    assert remembered.recall(NAME) is None
    os.chown(cache, 0, 0)
    os.chown(cache.parent, NOBODY, NOBODY)
    assert remembered.recall(NAME) is None
    remembered.remember(NAME, False, "")  # nor written there
    os.chown(cache.parent, 0, 0)
    assert remembered.recall(NAME) is True


def test_off_means_neither_read_nor_written(cache: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TENSORX_REMEMBER", "0")
    assert remembered.recall(NAME) is None
    remembered.remember(NAME, False, "")
    monkeypatch.setenv("TENSORX_REMEMBER", "1")
    assert remembered.recall(NAME) is True
