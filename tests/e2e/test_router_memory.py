"""The long-running router's Mutation Manager with real processes: a stalled indexer dropped to
the source log and caught up, and a failover of a running router rolling an indexer back."""

from __future__ import annotations

import signal
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from indexer.router import Workload, generate
from indexer.router.documents import Document, vbucket_of
from tests.e2e.conftest import WAIT_S, Daemon, wait_equal, write_jsonl
from tests.harness import http

pytestmark = pytest.mark.e2e

# One client for the module's requests: a new one per call (httpx.get) builds its TLS
# context each time, which costs more than the request on a busy machine.
HTTP = http()  # the harness's client: no kept-alive connections

NUM_VBUCKETS = 1024


def router_stats(url: str) -> dict[str, Any]:
    answer = HTTP.get(f"{url}/stats", timeout=10)
    assert answer.status_code == 200, answer.text
    stats: dict[str, Any] = answer.json()
    return stats


def wait_persisted(daemon: Daemon, seqno_sum: int) -> None:
    deadline = time.monotonic() + WAIT_S
    while HTTP.get(f"{daemon.url}/stats").json()["persisted"]["seqno_sum"] < seqno_sum:
        assert time.monotonic() < deadline, "the daemon did not persist in time"
        time.sleep(0.1)


def test_a_stalled_indexer_is_dropped_to_the_log_and_catches_up(
    daemon_factory: Any, routers: Any, tmp_path: Path
) -> None:
    steady = daemon_factory().start()
    # A small flow-control window: a stalled daemon holds up its cursor after 16 KiB.
    stalled = daemon_factory(server={"max_frame_bytes": 16384, "flow_control_bytes": 16384}).start()
    documents = list(generate(Workload(2_000, 1_000, 0.1, 81)))
    jsonl = write_jsonl(tmp_path / "in.jsonl", documents)
    router = routers(
        "--state", str(tmp_path / "state"), "--jsonl", str(jsonl), "--follow",
        "--http", "127.0.0.1:0", "--memory-mb", "0.05",
        "--to", steady.address, "--to", stalled.address,
    )  # fmt: skip
    (url,) = router.wait_log(r"router API on (http://\S+)")
    wait_equal(stalled, documents)
    assert stalled.proc is not None
    stalled.proc.send_signal(signal.SIGSTOP)
    try:
        for round_ in range(4):
            more = list(generate(Workload(5_000, 3_000, 0.1, 82 + round_)))
            write_jsonl(jsonl, more, append=True)
            documents += more
            time.sleep(0.3)
        wait_equal(steady, documents)  # the other node is not held up
        stats = router_stats(url)
        manager = stats["mutation_manager"]
        assert manager["cursors_dropped"] > 0, manager
        assert manager["memory"] <= manager["capacity"] == int(0.05 * (1 << 20)), manager
    finally:
        stalled.proc.send_signal(signal.SIGCONT)
    wait_equal(stalled, documents)
    progress = router_stats(url)["nodes"][stalled.address]
    assert progress["backfilled"] > 0 and progress["connected"], progress
    assert f"{stalled.address} fell behind on vbucket" in router.log()
    # Back in memory: what comes now reaches both without reading the log again.
    later = list(generate(Workload(500, 3_000, 0.1, 90)))
    write_jsonl(jsonl, later, append=True)
    documents += later
    wait_equal(stalled, documents)
    wait_equal(steady, documents)
    assert router.stop() == 0
    assert "disconnected" not in router.log()
    assert steady.stop() == 0 and stalled.stop() == 0


def surviving(documents: list[Document], vbucket: int, seqno: int) -> list[Document]:
    """`documents` in append order without those of `vbucket` above `seqno` (lost in a
    failover of that vbucket at `seqno`)."""
    seqnos: Counter[int] = Counter()
    kept = []
    for document in documents:
        vb = vbucket_of(document.docid.encode(), NUM_VBUCKETS)
        seqnos[vb] += 1
        if vb != vbucket or seqnos[vb] <= seqno:
            kept.append(document)
    return kept


def test_a_failover_of_a_running_router_rolls_the_indexer_back(
    daemon_factory: Any, routers: Any, tmp_path: Path
) -> None:
    daemon = daemon_factory().start()
    first = list(generate(Workload(3_000, 600, 0.1, 91)))
    jsonl = write_jsonl(tmp_path / "in.jsonl", first)
    router = routers(
        "--state", str(tmp_path / "state"), "--jsonl", str(jsonl), "--follow",
        "--http", "127.0.0.1:0", "--to", daemon.address,
    )  # fmt: skip
    (url,) = router.wait_log(r"router API on (http://\S+)")
    wait_equal(daemon, first)
    wait_persisted(daemon, len(first))  # a recovery point the rollback can go back to
    second = list(generate(Workload(2_000, 600, 0.1, 92)))
    write_jsonl(jsonl, second, append=True)
    documents = first + second
    wait_equal(daemon, documents)
    # The vbucket the second batch wrote most to fails over where the first batch ended.
    in_first = Counter(vbucket_of(d.docid.encode(), NUM_VBUCKETS) for d in first)
    in_second = Counter(vbucket_of(d.docid.encode(), NUM_VBUCKETS) for d in second)
    vbucket, lost = in_second.most_common(1)[0]
    answer = HTTP.post(f"{url}/failover/{vbucket}", json={"seqno": in_first[vbucket]})
    assert answer.status_code == 200, answer.text
    assert answer.json()["seqno"] == in_first[vbucket]
    documents = surviving(documents, vbucket, in_first[vbucket])
    assert len(documents) == len(first) + len(second) - lost
    router.wait_log(rf"vbucket {vbucket}: the indexer rolled back to seqno \d+")
    third = list(generate(Workload(1_000, 600, 0.1, 93)))
    write_jsonl(jsonl, third, append=True)
    documents += third
    wait_equal(daemon, documents)
    assert "rolled back to recovery point" in daemon.log()
    # Bad admin calls get a clear answer and change nothing.
    for path, body, status in [
        ("/failover/x", None, 400),
        (f"/failover/{NUM_VBUCKETS}", None, 400),
        (f"/failover/{vbucket}", {"seqno": 10**9}, 400),
        (f"/failover/{vbucket}", {"seqno": -1}, 400),
        (f"/failover/{vbucket}", {"to": 1}, 400),
    ]:
        bad = HTTP.post(f"{url}{path}", json=body)
        assert bad.status_code == status and "error" in bad.json(), (path, bad.text)
    assert HTTP.get(f"{url}/failover/1").status_code == 405
    wait_equal(daemon, documents)
    assert router.stop() == 0
    assert daemon.stop() == 0
