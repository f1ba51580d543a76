"""The hot modules run as plain Python too (scripts/compile.py compiles them with mypyc in
place): their unit tests pass on a copy of the sources without the extension modules, so the
two cannot drift apart."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from tests import budget

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("indexer", "workers", "slab", "config", "tests", "scripts")
# Beside the packages: the project's metadata, and the mypyc build scripts/compile.py reads.
FILES = ("pyproject.toml", "setup.py")
# The share of their hypothesis budgets they run here: the compiled run (the same files, in
# the same test run) takes the whole budget; this one checks that the plain Python agrees.
SHARE = 0.25
# The unit tests of the compiled modules (scripts/compile.py's COMPILED).
UNIT_TESTS = (
    "tests/indexer/test_keys.py",
    "tests/indexer/test_protocol.py",
    "tests/indexer/test_mutations.py",
    "tests/indexer/test_source.py",
    "tests/indexer/test_record_encoder.py",
    "tests/indexer/test_pgoutput.py",
    "tests/slab/test_pool.py",
    "tests/slab/test_ring.py",
    "tests/workers/test_flush.py",
    "tests/workers/test_array_flush.py",
)
WHERE = (
    "import indexer.keys, indexer.protocol, workers.flush, slab.pool, slab.ring, "
    "indexer.router.source.mutations as m, indexer.router.source.log as l, "
    "indexer.router.streams.records as r, indexer.router.inputs.postgres.pgoutput as p; "
    "print(*(x.__file__ for x in (indexer.keys, indexer.protocol, workers.flush, slab.pool, "
    "slab.ring, m, l, r, p)))"
)


def test_the_compiled_modules_unit_tests_pass_as_plain_python(tmp_path: Path) -> None:
    for package in PACKAGES:
        shutil.copytree(
            ROOT / package,
            tmp_path / package,
            ignore=shutil.ignore_patterns("*.so", "__pycache__"),
        )
    for name in FILES:
        if (ROOT / name).exists():
            shutil.copy(ROOT / name, tmp_path)
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    where = subprocess.run(
        [sys.executable, "-c", WHERE], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert where.returncode == 0, where.stderr
    files = where.stdout.split()
    assert len(files) == 9 and all(f.endswith(".py") and f.startswith(str(tmp_path)) for f in files)
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *UNIT_TESTS],
        cwd=tmp_path,
        env={**env, budget.ENV: str(budget.factor() * SHARE)},
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and " failed" not in run.stdout
