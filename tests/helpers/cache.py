"""A test's own empty cache: fetched files and the machine's table both start empty there
(conftest.py points the table at the suite's own folder; this points it at the test's)."""
from pathlib import Path


def fresh_cache(monkeypatch, path) -> Path:
    path = Path(path)
    monkeypatch.setenv("SPECENGINE_CACHE", str(path))
    monkeypatch.setenv("SPECENGINE_PLAN_DIR", str(path / "plan"))
    return path
