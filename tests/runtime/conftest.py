"""The runtime tests compile into their own program cache, never the user's."""

from __future__ import annotations

import pytest

from anygpu import config


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """A program cache of the test's own, with the disk cache on."""
    monkeypatch.setenv("ANYGPU_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("ANYGPU_DISK_CACHE", "1")
    config.reload()
    yield tmp_path
    monkeypatch.undo()
    config.reload()
