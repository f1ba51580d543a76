"""A router as several processes (`indexer router --shards K`): the parent hands each input line
to the shard of its vbucket and serves the API in front of them; a shard killed mid-feed is
started again, a parent killed mid-feed resumes, and either way every line is in exactly one
shard's source log once."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from indexer.router import SourceLog, Workload, generate
from indexer.router.documents import Document, vbucket_of
from indexer.router.shards.messages import InputPosition
from tests.e2e.conftest import WAIT_S, indexer_command, model, scan, wait_equal, write_jsonl
from tests.e2e.test_cluster import owned_by, write_map
from tests.e2e.test_index_build import ZIP, wait_active
from tests.harness import http

pytestmark = pytest.mark.e2e

# One client for the module's requests: a new one per call (httpx.get) builds its TLS
# context each time, which costs more than the request on a busy machine.
HTTP = http()  # the harness's client: no kept-alive connections


def docid_in(first: int, last: int, prefix: str) -> str:
    """A document id whose vbucket (of 1024) is in first..last."""
    for i in range(100_000):
        docid = f"{prefix}-{i}"
        if first <= vbucket_of(docid.encode(), 1024) <= last:
            return docid
    raise AssertionError("no such id")


def versions_in_logs(state: Path, shards: int) -> int:
    """The document versions the shards' source logs hold, all together."""
    total = 0
    for i in range(shards):
        with SourceLog(state / f"shard-{i}") as log:
            total += sum(log.high_seqno(vb) for vb in log.vbuckets_with_history())
    return total


def wait_progress(url: str, at_least: int) -> dict[str, Any]:
    """The parent's /stats once its shards acknowledged `at_least` documents."""
    deadline = time.monotonic() + WAIT_S
    while True:
        stats = HTTP.get(f"{url}/stats", timeout=30).json()
        if sum(shard["appended"] for shard in stats["shards"]) >= at_least:
            return stats
        assert time.monotonic() < deadline, stats
        time.sleep(0.01)


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_shards_split_the_input_and_the_api_routes_to_them(
    daemon_factory: Any, routers: Any, tmp_path: Path
) -> None:
    daemon = daemon_factory().start()
    documents = list(generate(Workload(6_000, 2_000, 0.1, 5)))
    jsonl = write_jsonl(tmp_path / "in.jsonl", documents)
    state = tmp_path / "router"
    router = routers(
        "--state", str(state), "--shards", "2", "--jsonl", str(jsonl),
        "--to", daemon.address, "--http", "127.0.0.1:0",
    )  # fmt: skip
    url = router.wait_log(r"router API on (http://\S+)")[0]
    assert router.wait_log(r"read (\d+) documents from") == [str(len(documents))]
    wait_equal(daemon, documents)
    stats = HTTP.get(f"{url}/stats", timeout=30).json()
    assert [s["vbuckets"] for s in stats["shards"]] == ["vbuckets 0-511", "vbuckets 512-1023"]
    assert [s["stats"]["vbuckets"] for s in stats["shards"]] == [
        "vbuckets 0-511",
        "vbuckets 512-1023",
    ]
    assert len({s["stats"]["source_id"] for s in stats["shards"]}) == 1
    assert stats["source"]["high_seqno_sum"] == len(documents)
    per_shard = [sum(1 for d in documents if (vbucket_of(d.docid.encode(), 1024) >= 512) == bool(i))
                 for i in range(2)]  # fmt: skip
    assert [s["appended"] for s in stats["shards"]] == per_shard
    # PUT and DELETE go to the shard of the id's vbucket, failover to the vbucket's shard.
    for first, last in ((0, 511), (512, 1023)):
        docid = docid_in(first, last, "put")
        body = {"age": 41, "address": {"city": "Quito"}}
        answer = HTTP.put(f"{url}/docs/{docid}", json=body, timeout=30)
        assert answer.status_code == 200, answer.text
        assert answer.json()["vbucket"] == vbucket_of(docid.encode(), 1024)
        documents.append(Document(docid, body))
        gone_id = documents[0].docid if first == 0 else documents[1].docid
        assert HTTP.delete(f"{url}/docs/{gone_id}", timeout=30).status_code == 200
        documents.append(Document(gone_id, None))
        vb = vbucket_of(docid.encode(), 1024)
        answer = HTTP.post(f"{url}/failover/{vb}", timeout=30)
        assert answer.status_code == 200 and answer.json()["vbucket"] == vb, answer.text
    assert HTTP.post(f"{url}/failover/1024", timeout=30).status_code == 400
    assert HTTP.put(f"{url}/docs/x", content=b"[1]", timeout=30).status_code == 400
    too_big = HTTP.put(f"{url}/docs/x", content=b"x" * (2 << 20), timeout=30)
    assert too_big.status_code == 413 and "bytes" in too_big.json()["error"]
    wait_equal(daemon, documents)
    metrics = HTTP.get(f"{url}/metrics", timeout=30).text
    assert 'shard="0"' in metrics and 'shard="1"' in metrics
    assert router.stop() == 0
    assert "Traceback" not in router.log()


def test_a_killed_shard_is_started_again_and_nothing_is_lost_or_doubled(
    daemon_factory: Any, routers: Any, tmp_path: Path
) -> None:
    daemon = daemon_factory().start()
    documents = list(generate(Workload(150_000, 30_000, 0.1, 9)))
    jsonl = write_jsonl(tmp_path / "in.jsonl", documents)
    state = tmp_path / "router"
    router = routers(
        "--state", str(state), "--shards", "2", "--jsonl", str(jsonl),
        "--to", daemon.address, "--http", "127.0.0.1:0", "--memory-mb", "16",
    )  # fmt: skip
    url = router.wait_log(r"router API on (http://\S+)")[0]
    stats = wait_progress(url, 1)
    victim = stats["shards"][1]["pid"]
    os.kill(victim, signal.SIGKILL)
    restarts = router.wait_log(r"shard 1 \(vbuckets 512-1023, pid (\d+)\) was killed by SIGKILL")
    assert restarts == [str(victim)]
    router.wait_log(r"read \d+ documents from")
    wait_equal(daemon, documents)
    stats = HTTP.get(f"{url}/stats", timeout=30).json()
    assert [s["starts"] for s in stats["shards"]] == [1, 2]
    assert router.stop() == 0
    assert versions_in_logs(state, 2) == len(documents)  # every line once, none twice
    assert len(router.log().split("was killed by")) == 2  # one line for the one death


def test_a_killed_parent_resumes_where_its_shards_are(
    daemon_factory: Any, routers: Any, tmp_path: Path
) -> None:
    daemon = daemon_factory().start()
    documents = list(generate(Workload(150_000, 30_000, 0.1, 13)))
    jsonl = write_jsonl(tmp_path / "in.jsonl", documents)
    state = tmp_path / "router"
    args = ("--state", str(state), "--shards", "2", "--jsonl", str(jsonl),
            "--to", daemon.address, "--http", "127.0.0.1:0", "--memory-mb", "8")  # fmt: skip
    first = routers(*args)
    url = first.wait_log(r"router API on (http://\S+)")[0]
    stats = wait_progress(url, 1)
    pids = [s["pid"] for s in stats["shards"]]
    # Shard 0 stopped, shard 1 goes on ahead of it: the parent dies with the two at different
    # places in the input, so the restart must resend lines shard 1 already holds.
    os.kill(pids[0], signal.SIGSTOP)
    time.sleep(1.0)
    first.proc.kill()
    first.proc.wait()
    os.kill(pids[0], signal.SIGCONT)
    deadline = time.monotonic() + WAIT_S
    while not all(gone(pid) for pid in pids):  # their pipe closed: they stop
        assert time.monotonic() < deadline, "the shards outlived their parent"
        time.sleep(0.05)
    positions = []
    for i in range(2):
        with SourceLog(state / f"shard-{i}") as log:
            position = InputPosition.decode(log.input_position)
            assert position is not None
            positions.append(position.offset)
    assert positions[0] < positions[1] < jsonl.stat().st_size, positions
    held = versions_in_logs(state, 2)
    second = routers(*args)
    resumed = second.wait_log(r"resuming at line (\d+) \(byte (\d+)\)")
    assert int(resumed[0][1]) == positions[0]
    assert second.wait_log(r"read (\d+) documents from") == [str(len(documents) - held)]
    wait_equal(daemon, documents)
    assert second.stop() == 0
    assert versions_in_logs(state, 2) == len(documents)  # shard 1 skipped what it had


def test_a_state_directory_keeps_its_layout(tmp_path: Path) -> None:
    """A directory of a router without shards, or made with another count: one line, exit 1."""
    single = tmp_path / "single"
    SourceLog(single).close()
    sharded = tmp_path / "sharded"
    (sharded).mkdir()
    (sharded / "shards.json").write_text('{"identity": "ab", "vbuckets": 1024, "shards": 3}')
    for state, wanted in ((single, "without --shards"), (sharded, "was made with --shards 3")):
        command = indexer_command(
            "router", "--state", str(state), "--shards", "2", "--to", "127.0.0.1:1"
        )  # fmt: skip
        result = subprocess.run(
            command,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == 1, result.stderr
        assert wanted in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_generated_documents_go_to_the_shards_too(
    daemon_factory: Any, routers: Any, tmp_path: Path
) -> None:
    daemon = daemon_factory().start()
    router = routers(
        "--state", str(tmp_path / "router"), "--shards", "3", "--generate", "5000",
        "--keys", "1200", "--seed", "8", "--to", daemon.address,
    )  # fmt: skip
    assert router.wait_log(r"generated (\d+) documents") == ["5000"]
    wait_equal(daemon, list(generate(Workload(5_000, 1_200, 0.1, 8))))
    assert router.stop() == 0
    assert versions_in_logs(tmp_path / "router", 3) == 5_000


def test_a_router_state_is_split_into_shards_and_its_node_goes_on_without_a_rollback(
    daemon_factory: Any, routers: Any, tmp_path: Path
) -> None:
    daemon = daemon_factory().start()
    old, new = tmp_path / "old", tmp_path / "new"
    first = list(generate(Workload(4_000, 1_000, 0.1, 21)))
    single = routers("--state", str(old), "--to", daemon.address,
                     "--jsonl", str(write_jsonl(tmp_path / "a.jsonl", first)))  # fmt: skip
    single.wait_log(r"read 4000 documents")
    wait_equal(daemon, first)
    assert single.stop() == 0
    command = indexer_command(
        "shard-state", "--from", str(old), "--into", str(new), "--shards", "2"
    )  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "copied" in result.stdout
    again = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert again.returncode == 2 and "exists already" in again.stderr
    # Every vbucket's history as it was: its seqnos, failover log and versions.
    with SourceLog(old) as log:
        want = {vb: (log.failover_log(vb), list(log.read(vb)))
                for vb in log.vbuckets_with_history()}  # fmt: skip
        identity = log.identity
    got = {}
    for i, (first_vb, last_vb) in enumerate(((0, 511), (512, 1023))):
        with SourceLog(new / f"shard-{i}") as log:
            assert log.identity == identity
            assert log.vbuckets == tuple(range(first_vb, last_vb + 1))
            got.update({vb: (log.failover_log(vb), list(log.read(vb)))
                        for vb in log.vbuckets_with_history()})  # fmt: skip
    assert got == want
    more = list(generate(Workload(3_000, 1_000, 0.1, 22)))
    sharded = routers("--state", str(new), "--shards", "2", "--to", daemon.address,
                      "--jsonl", str(write_jsonl(tmp_path / "b.jsonl", more)))  # fmt: skip
    sharded.wait_log(r"read 3000 documents")
    wait_equal(daemon, first + more)
    assert sharded.stop() == 0
    assert "rolled back" not in sharded.log()


def test_shards_across_the_slices_of_a_cluster_map(
    daemon_factory: Any, routers: Any, tmp_path: Path
) -> None:
    """Three shards (0-340, 341-681, 682-1023) over two nodes (0-511, 512-1023): the middle
    shard streams to both, each node only its slice."""

    a, b = daemon_factory(), daemon_factory()
    cluster_map = write_map(tmp_path / "cluster.toml", {"a": (a, "0-511"), "b": (b, "512-1023")})
    for daemon, name in ((a, "a"), (b, "b")):
        daemon.args = ["--cluster-map", str(cluster_map), "--node", name]
        daemon.start()
    documents = list(generate(Workload(9_000, 3_000, 0.1, 23)))
    router = routers(
        "--state", str(tmp_path / "router"), "--shards", "3", "--cluster-map", str(cluster_map),
        "--jsonl", str(write_jsonl(tmp_path / "in.jsonl", documents)),
    )  # fmt: skip
    router.wait_log(r"read 9000 documents")
    wait_equal(a, owned_by(documents, 0, 511))
    wait_equal(b, owned_by(documents, 512, 1023))
    assert router.stop() == 0
    assert "NOT_MY_SLICE" not in router.log() and "Traceback" not in router.log()


def test_a_build_and_expiry_work_through_the_shards(
    daemon_factory: Any, routers: Any, tmp_path: Path
) -> None:

    daemon = daemon_factory().start()
    documents = list(generate(Workload(20_000, 4_000, 0.1, 37)))
    # Expiring documents in both shards' vbuckets: each shard's pager deletes its own.
    expiring = [Document(docid_in(first, last, f"exp{i}"), {"age": i, "_exp": 2})
                for i, (first, last) in enumerate(((0, 511), (512, 1023)))]  # fmt: skip
    jsonl = write_jsonl(tmp_path / "in.jsonl", documents + expiring)
    router = routers(
        "--state", str(tmp_path / "router"), "--shards", "2", "--jsonl", str(jsonl),
        "--follow", "--to", daemon.address,
    )  # fmt: skip
    wait_equal(daemon, documents + expiring)
    created = HTTP.post(f"{daemon.url}/indexes", json={"name": "by_zip", "keys": ZIP}, timeout=30)
    assert created.status_code == 201, created.text
    assert wait_active(daemon, "by_zip")[-1] == "active"
    router.wait_log(r"\[shard 0/2\] .*build:by_zip: the build stream is done")
    router.wait_log(r"\[shard 1/2\] .*build:by_zip: the build stream is done")
    gone = [Document(d.docid, None) for d in expiring]
    wait_equal(daemon, documents + expiring + gone)
    assert scan(daemon, "by_zip") == model(documents + expiring + gone, ZIP)
    assert router.stop() == 0
