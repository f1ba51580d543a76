"""A router that keeps its source on disk (`indexer feed --state`) against the real daemon."""

from __future__ import annotations

import re
import signal
import subprocess
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from indexer.router import SourceLog, Workload, generate
from indexer.router.documents import Document, vbucket_of
from tests.e2e.conftest import INDEXES, Daemon, dump, indexer_command, model, write_jsonl

pytestmark = pytest.mark.e2e


def state_feed(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        indexer_command("feed", *args), capture_output=True, text=True, timeout=timeout
    )


def surviving(state: Path) -> list[Document]:
    with SourceLog(state, create=False) as log:
        return list(log.surviving_documents().values())


def assert_indexes_match(daemon: Daemon, state: Path) -> None:
    documents = surviving(state)
    for name, paths in INDEXES.items():
        got = dump(daemon, name)
        assert got == model(documents, paths), name


def sent(result: subprocess.CompletedProcess[str]) -> tuple[int, int]:
    """(mutations sent, already persisted) from the feed's summary line."""
    assert result.returncode == 0, result.stderr
    found = re.search(r"(\d+) mutations persisted over \d+ vbuckets \((\d+) already", result.stderr)
    assert found, result.stderr
    return int(found[1]), int(found[2])


def test_state_survives_restarts_and_a_rerun_sends_nothing(
    daemon_factory: Any, tmp_path: Path
) -> None:
    state = tmp_path / "router"
    first = list(generate(Workload(8_000, 1_500, 0.1, 31)))
    more = list(generate(Workload(4_000, 2_000, 0.2, 32)))
    daemon = daemon_factory().start()
    fed = state_feed("--state", str(state), "--jsonl", str(write_jsonl(tmp_path / "a", first)))
    assert fed.returncode == 0 and "appended 8000 documents" in fed.stderr  # no --to: kept only
    assert sent(state_feed("--state", str(state), "--to", daemon.address)) == (8_000, 0)
    assert daemon.stop(signal.SIGTERM) == 0
    assert_indexes_match(daemon, state)

    daemon.start()
    assert sent(state_feed("--state", str(state), "--to", daemon.address)) == (0, 8_000)
    jsonl = write_jsonl(tmp_path / "b", more)
    again = state_feed("--state", str(state), "--jsonl", str(jsonl), "--to", daemon.address)
    assert sent(again) == (4_000, 8_000) and "appended 4000 documents" in again.stderr
    # A killed daemon keeps what it acked: the rerun still has nothing to send.
    daemon.kill()
    daemon.start()
    assert sent(state_feed("--state", str(state), "--to", daemon.address)) == (0, 12_000)
    assert daemon.stop(signal.SIGTERM) == 0
    assert_indexes_match(daemon, state)
    with SourceLog(state, create=False) as log:
        assert sum(log.high_seqno(vb) for vb in log.vbuckets_with_history()) == 12_000
        assert all(len(log.failover_log(vb)) == 1 for vb in log.vbuckets_with_history())


def test_a_clean_failover_then_more_input_still_matches(
    daemon_factory: Any, tmp_path: Path
) -> None:
    state = tmp_path / "router"
    first = list(generate(Workload(6_000, 1_000, 0.1, 41)))
    daemon = daemon_factory().start()
    jsonl = write_jsonl(tmp_path / "a", first)
    fed = state_feed("--state", str(state), "--jsonl", str(jsonl), "--to", daemon.address)
    assert sent(fed) == (6_000, 0)
    # The busiest vbuckets, so the input after the failover surely writes to them.
    busy = Counter(vbucket_of(d.docid.encode(), 1024) for d in first)
    (vb, _), (vb2, _) = busy.most_common(2)
    with SourceLog(state, create=False) as log:
        high, old = log.high_seqno(vb), log.failover_log(vb)

    # A failover needs no daemon.
    assert daemon.stop(signal.SIGTERM) == 0
    failed = state_feed("--state", str(state), "--failover", str(vb))
    assert failed.returncode == 0, failed.stderr
    line = re.fullmatch(
        rf"vbucket {vb}: failed over to seqno {high} \(new vbuuid (0x[0-9a-f]{{16}})\)\n",
        failed.stderr,
    )
    assert line, failed.stderr
    with SourceLog(state, create=False) as log:
        assert log.failover_log(vb) == ((int(line[1], 16), high), *old)
        assert log.high_seqno(vb) == high

    daemon.start()
    assert sent(state_feed("--state", str(state), "--to", daemon.address)) == (0, 6_000)
    later = list(generate(Workload(3_000, 1_000, 0.1, 42)))  # the same ids: updates
    assert any(vbucket_of(d.docid.encode(), 1024) == vb for d in later)
    jsonl = write_jsonl(tmp_path / "b", later)
    fed = state_feed("--state", str(state), "--jsonl", str(jsonl), "--to", daemon.address)
    assert sent(fed) == (3_000, 6_000) and "rolled back" not in fed.stderr
    # Failover, input and stream in one command: they run in that order.
    last = list(generate(Workload(1_000, 1_000, 0.5, 43)))
    jsonl = write_jsonl(tmp_path / "c", last)
    both = state_feed(
        "--state", str(state), "--failover", str(vb2), "--jsonl", str(jsonl), "--to", daemon.address
    )
    assert sent(both) == (1_000, 9_000) and "rolled back" not in both.stderr
    assert both.stderr.startswith(f"vbucket {vb2}: failed over to seqno ")
    assert daemon.stop(signal.SIGTERM) == 0
    assert_indexes_match(daemon, state)
    with SourceLog(state, create=False) as log:
        assert len(log.failover_log(vb)) == 2 and len(log.failover_log(vb2)) == 2


def test_bad_state_commands_fail_with_one_line(tmp_path: Path) -> None:
    state = tmp_path / "router"
    missing = state_feed("--state", str(state), "--failover", "3")
    assert missing.returncode == 1 and missing.stderr.count("\n") == 1
    assert "no source log in" in missing.stderr and not state.exists()
    docs = [Document("a", {"x": 1}), Document("b", {"x": 2})]
    assert state_feed("--state", str(state), "--jsonl", str(write_jsonl(tmp_path / "a", docs)))
    vb = vbucket_of(b"a", 1024)
    unused = next(v for v in range(1024) if v not in {vb, vbucket_of(b"b", 1024)})
    for args, message in (
        (["--failover", "1024"], r"vbucket 1024 is not in 0\.\.1023"),
        (["--failover", "-2"], r"vbucket -2 is not in 0\.\.1023"),
        (["--failover", str(vb), "--failover-seqno", "5"], r"seqno 5 is not in 0\.\.\d+ "),
        (["--failover", str(unused)], f"vbucket {unused} has no history"),
        (["--vbuckets", "64", "--failover", str(vb)], "has 1024 vbuckets, not 64"),
        (["--failover-seqno", "1"], "--failover-seqno needs --failover VB"),
        ([], "give --to HOST:PORT, an input or --failover VB"),
    ):
        result = state_feed("--state", str(state), *args)
        assert result.returncode != 0, args
        assert result.stderr.count("\n") == 1 and re.search(message, result.stderr), result.stderr
    result = state_feed("--failover", "1", "--to", "127.0.0.1:1", "--jsonl", str(tmp_path / "a"))
    assert result.returncode == 2 and "--failover needs --state DIR" in result.stderr
    with SourceLog(state, create=False) as log:
        assert log.failover_log(vb) and len(log.failover_log(vb)) == 1 and log.high_seqno(vb) == 1
