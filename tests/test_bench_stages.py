"""bench/stages.py: a py-spy profile's samples charged to the project's innermost module."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from stages import RUNTIME, read_samples, stages, table

SITE = "/srv/venv/lib/python3.11/site-packages"
LINES = [
    # A C call of orjson made by the router's document parser: the parser's module.
    f"run (trio/_core/_run.py:2000);parse (/src/indexer/router/documents.py:40);"
    f"loads ({SITE}/orjson/__init__.py:1) 30",
    # The flush calling plyvel: the flush.
    "main (/src/indexer/cli/serve.py:10);apply (/src/workers/flush.py:300) 50",
    # A package's __init__ is the package.
    "x (/src/slab/__init__.py:3) 5",
    # trio's scheduler, started by the daemon's entry point: the runtime.
    "serve (/src/indexer/cli/serve.py:9);run (/v/trio/_core/_run.py:2300);"
    "unrolled_run (/v/trio/_core/_run.py:2600);get_events (/v/trio/_core/_io_epoll.py:9) 7",
    # A task's own frames under the scheduler: the task's module.
    "serve (/src/indexer/cli/serve.py:9);run (/v/trio/_core/_run.py:2300);"
    "read (/src/indexer/reader.py:50) 3",
    # Nothing of the project: the runtime.
    f"run (trio/_core/_run.py:2000);select ({SITE}/trio/_core/_io_epoll.py:9) 15",
    # A site-packages module named like the project's is not the project's.
    f"f ({SITE}/indexer/keys.py:1) 1",
    "",
]


def test_samples_go_to_the_innermost_project_module_and_cpu_is_shared_by_them() -> None:
    counts = read_samples(LINES)
    assert counts == {
        "indexer.router.documents": 30,
        "workers.flush": 50,
        "slab": 5,
        "indexer.reader": 3,
        RUNTIME: 23,
    }
    found = stages(counts, cpu_s=1.11, documents=1000)  # 1,110 µs per document in all
    names = ["workers.flush", "indexer.router.documents", RUNTIME, "slab", "indexer.reader"]
    assert [s.name for s in found] == names
    assert abs(sum(s.us_per_document for s in found) - 1110.0) < 1e-6
    assert abs(found[0].us_per_document - 500.0) < 1e-6
    by_function = read_samples(LINES, depth=1)
    assert by_function["workers.flush:apply"] == 50
    lines = table(found, limit=2).splitlines()
    assert lines[-2].endswith("(3 more)") and lines[-1].endswith("all")
