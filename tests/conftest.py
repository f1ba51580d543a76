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


# The files that take longest (docs/testing.md keeps their table), in that order. `make test`
# hands whole files to its test processes in collection order (--dist loadfile), so these go
# first: a long file started last would run on alone after the others finish.
LONGEST_FIRST = (
    "tests/e2e/test_power_loss.py",
    "tests/spark/test_stream.py",
    "tests/spark/test_spark.py",
    "tests/spark/test_writer.py",
    "tests/spark/test_standalone_cluster.py",
    "tests/test_packaging.py",
    "tests/e2e/test_postgres_source.py",
    "tests/e2e/test_faults.py",
    "tests/e2e/test_router_shards.py",
    "tests/e2e/test_etcd_cluster.py",
    "tests/e2e/test_ingest.py",
    "tests/e2e/test_deferred_build.py",
    "tests/e2e/test_rollback.py",
    "tests/e2e/test_operator_cli.py",
    "tests/test_pure_python.py",
    "tests/fuzz/test_protocol_model.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The longest files first."""
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}

    def file_of(item: pytest.Item) -> str:
        return Path(item.path).relative_to(ROOT).as_posix()

    # sort is stable: within a file, and among the other files, collection order stays.
    items.sort(key=lambda item: rank.get(file_of(item), len(rank)))
