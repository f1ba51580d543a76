"""Every test session: the compiled hot modules must not be older than their sources."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _compile_script():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("compile_script", ROOT / "scripts/compile.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def pytest_sessionstart(session: pytest.Session) -> None:
    """A source edited after its compiled module would not run: stop with one line."""
    stale = _compile_script().stale()
    if stale:
        pytest.exit(
            f"compiled modules older than their sources ({', '.join(stale)}): run make compiled, "
            "or python scripts/compile.py --clean for the pure-Python modules",
            returncode=2,
        )
