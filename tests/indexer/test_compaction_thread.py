"""LevelDB's compaction thread starts at a lower priority than the process (storage.py).

The thread is one per process and starts once, so each case runs in a fresh interpreter."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="threads have their own nice values on Linux only"
)

PROGRAM = """
import json, os, sys, threading
from pathlib import Path
from indexer.router.source.log import SourceLog
from indexer.storage import IndexStore, thread_nice

def cpu(tid):
    with open(f"/proc/self/task/{tid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])

root = Path(sys.argv[1])
store = IndexStore(root / "a", compaction_nice=int(sys.argv[2]))
tid = store.compaction_thread
before = cpu(tid)
# Enough writes for several level-0 files, then a full compaction: LevelDB's thread does it.
for n in range(40):
    with store.db.write_batch() as batch:
        for i in range(5_000):
            batch.put(os.urandom(16), os.urandom(64))
store.db.compact_range()
second = IndexStore(root / "b", compaction_nice=5)
log = SourceLog(root / "c", 16, compaction_nice=5)
print(json.dumps({
    "thread": tid,
    "nice": thread_nice(tid),
    "main_nice": thread_nice(threading.get_native_id()),
    "cpu": cpu(tid) - before,
    "second": second.compaction_thread,
    "threads_at_5": sum(thread_nice(int(t)) == 5 for t in os.listdir("/proc/self/task")),
}))
"""


def run(tmp_path: Path, nice: int) -> dict[str, int | None]:
    done = subprocess.run(
        [sys.executable, "-c", PROGRAM, str(tmp_path), str(nice)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert done.returncode == 0, done.stderr
    result: dict[str, int | None] = json.loads(done.stdout)
    return result


def test_the_compaction_thread_runs_at_the_nice_value_and_the_process_does_not(
    tmp_path: Path,
) -> None:
    result = run(tmp_path, 7)
    assert result["thread"] is not None
    assert result["nice"] == 7
    assert result["main_nice"] == 0
    # It is the thread that compacted: the full compaction's work shows in its CPU time.
    assert result["cpu"] is not None and result["cpu"] > 0
    # One thread serves every database of the process: later stores find it running.
    assert result["second"] is None
    assert result["threads_at_5"] == 0
