"""A cluster whose map is in etcd: `indexer cluster` changes it in transactions, daemons
register under leases and follow it, and a router and scans watch it. A real etcd (Debian's
etcd-server) and real processes on 127.0.0.1."""

from __future__ import annotations

import contextlib
import json
import logging
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pyarrow as pa
import pytest

from indexer.client import ACTIVE_HEADER
from indexer.cluster.map import parse_vbuckets
from indexer.cluster.scan import scan_the_cluster
from indexer.router import Workload, generate
from indexer.router.documents import Document, vbucket_of
from tests.e2e.conftest import INDEXES, indexer_command, model, wait_equal, write_jsonl
from tests.e2e.test_cluster import write_map
from tests.harness import Etcd

pytestmark = pytest.mark.e2e


@pytest.fixture
def etcd() -> Iterator[Etcd]:
    server = Etcd().start()
    yield server
    server.stop()


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(indexer_command(*args), capture_output=True, text=True, timeout=120)


def status(url: str) -> dict[str, Any]:
    done = cli("cluster", "status", "--cluster", url, "--json")
    assert done.returncode == 0, done.stderr
    found: dict[str, Any] = json.loads(done.stdout)
    return found


def add_node(url: str, name: str, daemon: Any, *extra: str) -> None:
    """`indexer cluster add-node` of a daemon under `name`, at its addresses."""
    args = ["--feed", daemon.address, "--http", f"127.0.0.1:{daemon.http_port}"]
    done = cli("cluster", "add-node", "--cluster", url, name, *extra, *args)
    assert done.returncode == 0, done.stderr


def owned(documents: list[Document], vbuckets: set[int]) -> list[Document]:
    return [d for d in documents if vbucket_of(d.docid.encode(), 1024) in vbuckets]


def slices(url: str) -> dict[str, set[int]]:
    """Each node's vbuckets, as `cluster status` gives them."""
    nodes = status(url)["nodes"]
    return {
        name: set(parse_vbuckets(node["vbucket_ranges"], 1024, name)) if node["vbuckets"] else set()
        for name, node in nodes.items()
    }


def scan_equals_the_model(url: str, documents: list[Document]) -> None:
    for name, paths in INDEXES.items():
        done = cli("scan", name, "--cluster", url, "--consistency", "request_plus")
        assert done.returncode == 0, done.stderr
        assert [json.loads(line) for line in done.stdout.splitlines()] == model(documents, paths)


def serve_and_route(
    url: str, nodes: dict[str, Any], routers: Any, tmp_path: Path, workload: Workload
) -> tuple[list[Document], Path, Any]:
    """Start each daemon as its node of the map at `url`, and a router following the map and
    a JSONL file that starts with `workload`."""
    for name, daemon in nodes.items():
        daemon.args = ["--cluster", url, "--node", name]
        daemon.start()
    documents = list(generate(workload))
    jsonl = write_jsonl(tmp_path / "in.jsonl", documents)
    router = routers(
        "--state", str(tmp_path / "state"), "--jsonl", str(jsonl), "--follow", "--cluster", url
    )
    return documents, jsonl, router


def test_a_cluster_in_etcd_routes_scans_and_rebalances_onto_a_new_node(
    daemon_factory: Any, routers: Any, tmp_path: Path, etcd: Etcd
) -> None:
    url = etcd.url("indexer/test")
    a, b, c = daemon_factory(), daemon_factory(), daemon_factory()
    start = write_map(tmp_path / "cluster.toml", {"a": (a, "0-511"), "b": (b, "512-1023")})
    done = cli("cluster", "init", "--cluster", url, "--from", str(start))
    assert done.returncode == 0 and "revision" in done.stdout, done.stderr
    again = cli("cluster", "init", "--cluster", url, "--from", str(start))
    assert again.returncode == 1 and "has a map already" in again.stderr, again.stderr
    documents, jsonl, router = serve_and_route(
        url, {"a": a, "b": b}, routers, tmp_path, Workload(6_000, 2_000, 0.1, 511)
    )
    for name, vbuckets in slices(url).items():
        wait_equal({"a": a, "b": b}[name], owned(documents, vbuckets))
    scan_equals_the_model(url, documents)
    found = status(url)
    assert {n: (v["vbuckets"], v["alive"]) for n, v in found["nodes"].items()} == {
        "a": (512, True),
        "b": (512, True),
    }
    # A third node, added with nothing, then given its share: the nodes and the router follow
    # the map's watch while documents keep coming.
    add_node(url, "c", c)
    c.args = ["--cluster", url, "--node", "c"]
    c.start()
    done = cli("cluster", "rebalance", "--cluster", url)
    assert done.returncode == 0 and "c (341 vbuckets)" in done.stdout, done.stdout
    more = list(generate(Workload(3_000, 2_000, 0.1, 512)))
    write_jsonl(jsonl, more, append=True)
    documents += more
    now = slices(url)
    assert sorted(len(v) for v in now.values()) == [341, 341, 342]
    assert set().union(*now.values()) == set(range(1024))
    assert now["a"] <= set(range(512)) and now["b"] <= set(range(512, 1024))  # few moves
    for name, vbuckets in now.items():
        wait_equal({"a": a, "b": b, "c": c}[name], owned(documents, vbuckets))
    scan_equals_the_model(url, documents)
    assert all(node["alive"] for node in status(url)["nodes"].values())
    # etcd is killed under the feed: the data plane goes on with the last map, and a change
    # of the map fails in one line until etcd is back; then the watches and leases resume.
    etcd.kill()
    more = list(generate(Workload(2_000, 2_000, 0.1, 513)))
    write_jsonl(jsonl, more, append=True)
    documents += more
    for name, vbuckets in now.items():
        wait_equal({"a": a, "b": b, "c": c}[name], owned(documents, vbuckets))
    down = cli("cluster", "rebalance", "--cluster", url)
    lines = down.stderr.strip().splitlines()
    assert down.returncode == 1 and len(lines) == 1 and "cannot be reached" in lines[0], lines
    etcd.start()
    assert slices(url) == now and all(node["alive"] for node in status(url)["nodes"].values())
    scan_equals_the_model(url, documents)
    # A node stopped cleanly leaves its registration at once (a killed one at its lease's end).
    assert c.stop() == 0
    assert status(url)["nodes"]["c"]["alive"] is False
    assert router.stop() == 0


def receives(url: str) -> dict[str, set[int]]:
    """What each node holds (active, replica or building), as `cluster status` gives it."""
    found = {}
    for name, node in status(url)["nodes"].items():
        ranges = [*node["vbucket_ranges"], *node["replica_ranges"], *node["building_ranges"]]
        found[name] = set(parse_vbuckets(ranges, 1024, name)) if ranges else set()
    return found


@contextlib.contextmanager
def small_receive_buffers() -> Iterator[None]:
    """New connections (urllib's, the Spark source's) with a receive buffer kept at 64 KB, so that
    a node's answer larger than its send buffer is still streaming when it is killed."""
    connect = socket.create_connection

    def small(*args: Any, **kwargs: Any) -> socket.socket:
        sock = connect(*args, **kwargs)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
        return sock

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(socket, "create_connection", small)
        yield


def spark_read_killing(
    url: str, index: str, node: str, kill: Callable[[], None]
) -> list[list[str]]:
    """The ids each partition of a Spark source's read of `index` gives (its reader, as an
    executor calls it), with `kill` called after the first batch of `node`'s first one."""
    from indexer.spark.source import IndexerDataSource, IndexerPartition

    given = {"cluster": url, "index": index, "snapshot": "stable", "partitions": "6"}
    source = IndexerDataSource(given)
    reader = source.reader(source.schema())
    parts = reader.partitions()
    assert sum(isinstance(p, IndexerPartition) and p.node == node for p in parts) > 1
    killed = False
    found = []
    for part in parts:
        assert isinstance(part, IndexerPartition)
        ids: list[str] = []
        for batch in reader.read(part):
            assert isinstance(batch, pa.RecordBatch)
            ids += batch.column("id").to_pylist()
            if part.node == node and not killed:
                kill()
                killed = True
        found.append(ids)
    return found


def merged_scan(url: str) -> list[dict[str, Any]]:
    with scan_the_cluster(url, "by_age", {"consistency": "request_plus"}, 60) as found:
        return list(found)


def test_three_nodes_with_a_replica_survive_a_killed_and_a_stopped_node(
    daemon_factory: Any, routers: Any, tmp_path: Path, etcd: Etcd, caplog: pytest.LogCaptureFixture
) -> None:
    url = etcd.url("indexer/failover")
    ttl = 2
    a, b, c = (daemon_factory(server={"cluster_lease_s": ttl}) for _ in range(3))
    nodes = {"a": a, "b": b, "c": c}
    start = write_map(tmp_path / "cluster.toml", {"a": (a, "0-511"), "b": (b, "512-1023")})
    assert cli("cluster", "init", "--cluster", url, "--from", str(start)).returncode == 0
    add_node(url, "c", c)
    documents, jsonl, router = serve_and_route(
        url, nodes, routers, tmp_path, Workload(6_000, 2_000, 0.1, 521)
    )
    done = cli("cluster", "rebalance", "--cluster", url, "--replicas", "1")
    assert done.returncode == 0, done.stderr
    found = status(url)
    assert found["num_replicas"] == 1 and found["moves_in_progress"] == 0
    counts = [0] * 1024
    for node in found["nodes"].values():
        for vb in parse_vbuckets(node["replica_ranges"], 1024, ""):
            counts[vb] += 1
    assert counts == [1] * 1024 and sorted(n["replicas"] for n in found["nodes"].values()) == [
        341,
        341,
        342,
    ]
    for name, held in receives(url).items():  # a replica gets its vbuckets' stream too
        wait_equal(nodes[name], owned(documents, held))
    assert merged_scan(url) == model(documents, INDEXES["by_age"])  # each vbucket once
    # c is killed while documents keep coming; scans wait for the failover, then answer whole.
    was_active = slices(url)["c"]
    c.kill()
    killed_at = time.monotonic()
    more = list(generate(Workload(3_000, 2_000, 0.1, 522)))
    write_jsonl(jsonl, more, append=True)
    documents += more
    want = model(documents, INDEXES["by_age"])
    while (rows := merged_scan(url)) != want:
        ids = [row["id"] for row in rows]
        assert len(ids) == len(set(ids)), "a row came twice"
        assert time.monotonic() - killed_at < ttl + 15, "no complete scan after the failover"
        time.sleep(0.2)
    failover_s = time.monotonic() - killed_at
    assert slices(url)["c"] == set() and "c" in status(url)["nodes"]  # fenced, kept as a replica
    assert "failover: node c's lease expired" in a.log() + b.log()
    assert was_active <= receives(url)["c"]
    # c comes back under its name: a replica of what it lost, it catches up from the routers.
    c.start()
    for name, held in receives(url).items():
        wait_equal(nodes[name], owned(documents, held))
    assert status(url)["nodes"]["c"]["role"] == "replica" and status(url)["nodes"]["c"]["alive"]
    # a dies while a merged scan streams from it: cities of 6 KB make each node's answer (6 MB)
    # more than the kernel's buffers hold (a send buffer of at most 4 MB, and a receive buffer
    # kept at 64 KB: one of 2 KB stalls loopback's 64 KB segments). Its replicas answer the
    # rest, after its last row, and no row comes twice.
    wide = [Document(f"wide{i}", {"age": i % 90, "address": {"city": f"{i:05}" + "x" * 6000}})
            for i in range(3000)]  # fmt: skip
    write_jsonl(jsonl, wide, append=True)
    documents += wide
    want = model(documents, INDEXES["by_age"])
    for name, held in receives(url).items():
        wait_equal(nodes[name], owned(documents, held))
    small = httpx.HTTPTransport(socket_options=[(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)])
    params = {"consistency": "request_plus"}
    with (
        caplog.at_level(logging.WARNING, "indexer.cluster"),
        scan_the_cluster(url, "by_city", params, 60, transport=small) as streamed,
    ):
        rows = [next(streamed) for _ in range(5)]
        a.kill()
        rows += list(streamed)
    assert rows == model(documents, INDEXES["by_city"])
    assert "node a failed during the scan" in caplog.text, caplog.text
    a.start()
    for name, held in receives(url).items():
        wait_equal(nodes[name], owned(documents, held))
    # c dies while the Spark source reads its partitions: the first one part way (the same
    # buffers), the others before they start. Its replicas answer for it, each row once.
    assert slices(url)["c"], "c took some of a's vbuckets over"
    caplog.clear()
    with caplog.at_level(logging.WARNING, "indexer.spark"), small_receive_buffers():
        parts = spark_read_killing(url, "by_city", "c", c.kill)
    taken = [r.getMessage() for r in caplog.records if r.name == "indexer.spark"]
    assert any("the scan stream broke off" in m for m in taken), taken
    assert any("cannot reach" in m for m in taken), taken
    read = [i for part in parts for i in part]
    city_rows = model(documents, INDEXES["by_city"])
    assert sorted(read) == sorted(r["id"] for r in city_rows)  # each row once
    place = {r["id"]: n for n, r in enumerate(city_rows)}
    for part in parts:  # each partition in index order
        assert [place[i] for i in part] == sorted(place[i] for i in part)
    c.start()
    for name, held in receives(url).items():
        wait_equal(nodes[name], owned(documents, held))
    # b is stopped past its lease: its replicas take over. Woken, it must not answer as active.
    b_active = slices(url)["b"]
    assert b_active
    b.proc.send_signal(signal.SIGSTOP)
    try:
        deadline = time.monotonic() + ttl + 30
        while slices(url)["b"]:
            assert time.monotonic() < deadline, status(url)
            time.sleep(0.2)
        assert merged_scan(url) == want
    finally:
        b.proc.send_signal(signal.SIGCONT)
    woken = httpx.get(f"{b.url}/indexes/by_age/scan", params={"consistency": "any"}, timeout=30)
    if woken.status_code == 200:  # it read the map first: it is active for nothing of its own
        active = woken.headers[ACTIVE_HEADER]
        assert not (set(parse_vbuckets(active.split(","), 1024, "")) if active else set())
    else:
        assert woken.status_code == 503 and "lease" in woken.json()["error"], woken.text
    assert merged_scan(url) == want
    deadline = time.monotonic() + 30
    while httpx.get(f"{b.url}/indexes/by_age/scan?limit=1", timeout=30).status_code != 200:
        assert time.monotonic() < deadline, b.log()[-2000:]
        time.sleep(0.2)
    for name, held in receives(url).items():
        wait_equal(nodes[name], owned(documents, held))
    assert router.stop() == 0
    print(f"failover: the first complete scan {failover_s:.1f} s after the kill (TTL {ttl} s)")


def test_bad_cluster_addresses_and_changes_fail_with_one_line(tmp_path: Path, etcd: Etcd) -> None:
    empty = etcd.url("indexer/empty")
    for args, code, message in (
        (["cluster", "status", "--cluster", empty], 1, "no cluster map yet"),
        (["cluster", "rebalance", "--cluster", empty], 1, "no map yet"),
        (["cluster", "status", "--cluster", "etcd://127.0.0.1:1/x"], 1, "cannot be reached"),
        (["cluster", "status", "--cluster", "http://127.0.0.1:1/x"], 2, "is not etcd://"),
        (["cluster", "status", "--cluster", f"etcd://{etcd.endpoint}"], 2, "a prefix"),
        (["scan", "by_age", "--cluster", empty], 2, "no cluster map yet"),
        (["serve", "--cluster", empty, "--node", "a"], 2, "no cluster map yet"),
    ):
        done = cli(*args)
        assert done.returncode == code, (args, done.stderr)
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and message in lines[0], (args, done.stderr)


def first_versions(documents: list[Document], seen: set[str]) -> list[Document]:
    """Each document id once, in order, leaving out ids in `seen` (which it adds to): an
    insert-only feed, so a vbucket's documents reach a node in the order they were written."""
    fresh = []
    for document in documents:
        if document.docid not in seen and document.body is not None:
            seen.add(document.docid)
            fresh.append(document)
    return fresh


def check_scan_at_a_snapshot(
    rows: list[dict[str, Any]], documents: list[Document], must: set[str], paths: list[str]
) -> None:
    """`rows` are an insert-only feed's index at some snapshot: no row twice, all of `must`,
    and of every vbucket the documents written first (a seqno cut), with the model's keys."""
    ids = [str(row["id"]) for row in rows]
    assert len(ids) == len(set(ids)), "a row came twice"
    present = set(ids)
    indexed = {row["id"] for row in model(documents, paths)}
    assert must & indexed <= present, f"{len(must & indexed - present)} documents missing"
    by_vbucket: dict[int, list[str]] = {}
    for document in documents:
        if document.docid in indexed:
            by_vbucket.setdefault(vbucket_of(document.docid.encode(), 1024), []).append(
                document.docid
            )
    for vb, order in by_vbucket.items():
        k = sum(1 for docid in order if docid in present)
        assert set(order[:k]) == {d for d in order if d in present}, f"vbucket {vb} has a gap"
    assert rows == model([d for d in documents if d.docid in present], paths)


def test_a_rebalance_under_a_feed_hands_over_without_a_gap_in_merged_scans(
    daemon_factory: Any, routers: Any, tmp_path: Path, etcd: Etcd
) -> None:
    url = etcd.url("indexer/moves")
    a, b, c = daemon_factory(), daemon_factory(), daemon_factory()
    start = write_map(tmp_path / "cluster.toml", {"a": (a, "0-511"), "b": (b, "512-1023")})
    assert cli("cluster", "init", "--cluster", url, "--from", str(start)).returncode == 0
    seen: set[str] = set()
    documents = first_versions(list(generate(Workload(8_000, 400_000, 0.0, 531))), seen)
    jsonl = write_jsonl(tmp_path / "in.jsonl", documents)  # the feed: each id once
    for name, daemon in (("a", a), ("b", b)):
        daemon.args = ["--cluster", url, "--node", name]
        daemon.start()
    router = routers(
        "--state", str(tmp_path / "state"), "--jsonl", str(jsonl), "--follow", "--cluster", url
    )
    for name, vbuckets in slices(url).items():
        wait_equal({"a": a, "b": b}[name], owned(documents, vbuckets))
    scan_equals_the_model(url, documents)
    before = {d.docid for d in documents}
    add_node(url, "c", c)
    c.args = ["--cluster", url, "--node", "c"]
    stop = threading.Event()
    failed: list[BaseException] = []
    written: list[Document] = list(documents)
    scans: list[tuple[float, list[dict[str, Any]], list[Document]]] = []

    def feed() -> None:  # more documents while the vbuckets move
        for round_ in range(40):
            if stop.is_set():
                return
            more = first_versions(list(generate(Workload(300, 300_000, 0.0, 600 + round_))), seen)
            written.extend(more)  # before the router can read them: a scan may show them
            write_jsonl(jsonl, more, append=True)
            time.sleep(0.25)

    def scan_loop() -> None:
        try:
            while not stop.is_set():
                params = {"consistency": "request_plus"}
                with scan_the_cluster(url, "by_age", params, 60) as found:
                    rows = list(found)
                so_far = list(written)  # every row is one of these, written before it ended
                scans.append((time.monotonic(), rows, so_far))
                time.sleep(0.2)  # scans in a loop, leaving the nodes' cores to the move
        except BaseException as exc:
            failed.append(exc)

    threads = [threading.Thread(target=feed), threading.Thread(target=scan_loop)]
    for thread in threads:
        thread.start()
    try:
        # A rebalance plans the move and hands it over; another one meanwhile fails in a line.
        first = subprocess.Popen(
            indexer_command("cluster", "rebalance", "--cluster", url),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert first.stdout is not None
        planned_line = first.stdout.readline()
        moving_at = time.monotonic()
        assert "take them over once caught up" in planned_line, first.communicate()
        # c is not up yet, so the move waits for it: a second rebalance finds it in progress.
        second = cli("cluster", "rebalance", "--cluster", url)
        c.start()
        out, err = first.communicate(timeout=180)
        handed_at = time.monotonic()
    finally:
        time.sleep(1.0)  # a few scans after the hand-over too
        stop.set()
        for thread in threads:
            thread.join(timeout=120)
    assert not failed, failed
    assert first.returncode == 0 and "c (341 vbuckets)" in out, (out, err)
    lines = second.stderr.strip().splitlines()
    assert second.returncode == 1 and len(lines) == 1 and "in progress" in lines[0], second.stderr
    during = [s for s in scans if moving_at <= s[0] <= handed_at + 1.0]
    assert len(during) >= 3, len(scans)
    for _, rows, so_far in scans:
        check_scan_at_a_snapshot(rows, so_far, before, INDEXES["by_age"])
    now = slices(url)
    assert sorted(len(v) for v in now.values()) == [341, 341, 342]
    assert status(url)["moves_in_progress"] == 0
    for name, vbuckets in now.items():
        wait_equal({"a": a, "b": b, "c": c}[name], owned(written, vbuckets))
    scan_equals_the_model(url, written)
    assert router.stop() == 0
