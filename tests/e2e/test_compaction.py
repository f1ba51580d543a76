"""Compaction of a running daemon's store (POST /compact, `indexer compact`) and of a data
directory no daemon holds, with real processes and LevelDB directories."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from indexer.router import Workload, generate
from tests.e2e.conftest import indexer_command, run_feed, scan, thread_nices, write_jsonl
from tests.harness import http

pytestmark = pytest.mark.e2e


def compact_command(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        indexer_command("compact", *args), capture_output=True, text=True, timeout=120
    )


def test_compaction_on_demand_frees_space_and_changes_no_answer(
    daemon_factory: Any, tmp_path: Path
) -> None:
    daemon = daemon_factory(compaction={"interval_minutes": 0}).start()
    # Many updates of few documents: every update leaves an old entry behind in LevelDB.
    documents = list(generate(Workload(60_000, 2_000, 0.1, 5)))
    jsonl = write_jsonl(tmp_path / "in.jsonl", documents)
    feed = run_feed(daemon, jsonl)
    assert feed.returncode == 0, feed.stderr
    before = {name: scan(daemon, name) for name in ("by_city", "by_age")}
    stats = http().get(f"{daemon.url}/stats").json()["compaction"]
    assert stats["interval_s"] == 0 and stats["runs"] == 0 and stats["last"] is None

    answer = http().post(f"{daemon.url}/compact", timeout=120)
    assert answer.status_code == 200, answer.text
    result = answer.json()
    assert result["reason"] == "requested"
    assert 0 < result["bytes_after"] < result["bytes_before"], result
    assert {name: scan(daemon, name) for name in ("by_city", "by_age")} == before
    stats = http().get(f"{daemon.url}/stats").json()
    assert stats["compaction"]["runs"] == 1 and stats["compaction"]["last"] == result
    # A full compaction leaves nothing in LevelDB's level 0.
    assert stats["storage"]["level0_files"] == 0
    # It ran in LevelDB's thread, at the default [compaction] thread_nice; the daemon's own
    # threads keep their priority.
    nices = thread_nices(daemon.proc.pid)
    assert nices[daemon.proc.pid] == 0
    assert sorted(nices.values()).count(10) == 1, nices
    assert "LevelDB compactions run at nice 10" in daemon.log()
    assert "compacted the store (requested)" in daemon.log()

    # The CLI wrapper; in-process compaction is refused while the daemon holds the store.
    cli = compact_command("--url", daemon.url)
    assert cli.returncode == 0, cli.stderr
    assert set(json.loads(cli.stdout)) >= {"bytes_before", "bytes_after", "seconds"}
    data_dir = tmp_path / "data0"
    held = compact_command("--data-dir", str(data_dir))
    assert held.returncode == 1
    assert held.stderr.count("\n") == 1 and "while a daemon runs" in held.stderr, held.stderr
    assert http().get(f"{daemon.url}/compact").status_code == 405
    assert daemon.stop() == 0

    offline = compact_command("--data-dir", str(data_dir))
    assert offline.returncode == 0, offline.stderr
    assert json.loads(offline.stdout)["bytes_after"] > 0
    missing = compact_command("--data-dir", str(tmp_path / "nowhere"))
    assert missing.returncode == 1 and "no store" in missing.stderr, missing.stderr
    daemon.start()
    assert {name: scan(daemon, name) for name in ("by_city", "by_age")} == before
    assert daemon.stop() == 0
