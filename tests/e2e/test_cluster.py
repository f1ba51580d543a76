"""Two daemons sharing the vbuckets by a cluster map, one router streaming to both, and a scan
fanned out over both and merged. Real processes on 127.0.0.1."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from indexer.changes import decode_cluster_token
from indexer.client import NEXT_HEADER
from indexer.router import Workload, generate
from indexer.router.documents import Document, vbucket_of
from tests.e2e.conftest import INDEXES, Daemon, indexer_command, model, wait_equal, write_jsonl
from tests.e2e.stream_client import FAST_PERSIST
from tests.e2e.test_changes import _entry, replay
from tests.harness import http, write_cluster_map

pytestmark = pytest.mark.e2e

# One client for the module's requests: a new one per call (httpx.get) builds its TLS
# context each time, which costs more than the request on a busy machine.
HTTP = http()  # the harness's client: no kept-alive connections


def write_map(path: Path, nodes: dict[str, tuple[Daemon, str]]) -> Path:
    """A cluster map of running daemons, each with its vbucket range."""
    return write_cluster_map(
        path, [(name, d.port, d.http_port, vbuckets) for name, (d, vbuckets) in nodes.items()]
    )


def owned_by(documents: list[Document], first: int, last: int) -> list[Document]:
    return [d for d in documents if first <= vbucket_of(d.docid.encode(), 1024) <= last]


def cluster_scan(cluster_map: Path, name: str, *extra: str) -> list[dict[str, Any]]:
    result = subprocess.run(
        indexer_command("scan", name, "--cluster-map", str(cluster_map), *extra),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    return [json.loads(line) for line in result.stdout.splitlines()]


def two_nodes(
    daemon_factory: Any, routers: Any, tmp_path: Path, workload: Workload, **config: Any
) -> tuple[Daemon, Daemon, Path, list[Document], Path, Any]:
    """Nodes a (vbuckets 0-511) and b (512-1023) of a cluster map, and a router following the
    map and a JSONL file that starts with `workload`."""
    a, b = daemon_factory(**config), daemon_factory(**config)
    cluster_map = write_map(tmp_path / "cluster.toml", {"a": (a, "0-511"), "b": (b, "512-1023")})
    for daemon, name in ((a, "a"), (b, "b")):
        daemon.args = ["--cluster-map", str(cluster_map), "--node", name]
        daemon.start()
    documents = list(generate(workload))
    jsonl = write_jsonl(tmp_path / "in.jsonl", documents)
    router = routers(
        "--state", str(tmp_path / "state"), "--jsonl", str(jsonl), "--follow",
        "--cluster-map", str(cluster_map),
    )  # fmt: skip
    return a, b, cluster_map, documents, jsonl, router


def test_two_nodes_share_the_vbuckets_and_a_merged_scan_equals_the_model(
    daemon_factory: Any, routers: Any, tmp_path: Path
) -> None:
    a, b, cluster_map, documents, _, router = two_nodes(
        daemon_factory, routers, tmp_path, Workload(12_000, 3_000, 0.1, 401)
    )
    # Each node holds exactly the documents of its slice.
    wait_equal(a, owned_by(documents, 0, 511))
    wait_equal(b, owned_by(documents, 512, 1023))
    for daemon, count in ((a, 512), (b, 512)):
        stats = HTTP.get(f"{daemon.url}/stats").json()
        assert stats["vbuckets"]["owned"] == count, stats["vbuckets"]
    # The fanned-out scan merges both in index order and equals the model of everything.
    for name, paths in INDEXES.items():
        assert cluster_scan(cluster_map, name, "--consistency", "request_plus") == model(
            documents, paths
        )
    ranged = cluster_scan(cluster_map, "by_age", "--low", "30", "--high", "40", "--limit", "25")
    everything = model(documents, INDEXES["by_age"])
    in_range = [
        row
        for row in everything
        if isinstance(row["key"][0], int | float) and 30 <= row["key"][0] <= 40
    ]
    assert len(in_range) > 25 and ranged == in_range[:25]
    # A node that is down makes the merged scan fail with one line naming it.
    assert b.stop() == 0
    down = subprocess.run(
        indexer_command("scan", "by_age", "--cluster-map", str(cluster_map)),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert down.returncode == 1 and "node b (http://127.0.0.1:" in down.stderr, down.stderr
    assert down.stderr.count("\n") == 1
    assert router.stop() == 0
    assert "NOT_MY_SLICE" not in router.log()
    assert a.stop() == 0


def test_bad_cluster_map_commands_fail_with_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('[nodes.a]\nfeed = "127.0.0.1:1"\nhttp = "127.0.0.1:2"\nvbuckets = ["0-9"]\n')
    for args, message in (
        (["serve", "--cluster-map", str(bad), "--node", "a"], "vbuckets have no node"),
        (["serve", "--cluster-map", str(bad)], "--node goes with --cluster-map or --cluster"),
        (["scan", "x", "--cluster-map", str(bad)], "vbuckets have no node"),
        (["scan", "x", "--cluster-map", str(tmp_path / "none.toml")], "cannot read"),
    ):
        result = subprocess.run(indexer_command(*args), capture_output=True, text=True, timeout=30)
        assert result.returncode == 2, (args, result.stderr)
        assert message in result.stderr and result.stderr.count("\n") == 1, result.stderr


def test_moving_vbuckets_between_nodes_loses_nothing(
    daemon_factory: Any, routers: Any, tmp_path: Path
) -> None:
    a, b, cluster_map, documents, jsonl, router = two_nodes(
        daemon_factory, routers, tmp_path, Workload(8_000, 3_000, 0.1, 411)
    )
    wait_equal(a, owned_by(documents, 0, 511))
    wait_equal(b, owned_by(documents, 512, 1023))
    name = next(iter(INDEXES))
    before = HTTP.get(f"{a.url}/indexes/{name}/changes", params={"since": "latest"})
    assert before.status_code == 200, before.text
    # Rebalance: vbuckets 256-511 move from a to b while documents keep coming.
    write_map(tmp_path / "cluster.toml", {"a": (a, "0-255"), "b": (b, "256-1023")})
    more = list(generate(Workload(4_000, 3_000, 0.1, 412)))
    write_jsonl(jsonl, more, append=True)
    documents += more
    wait_equal(a, owned_by(documents, 0, 255))
    wait_equal(b, owned_by(documents, 256, 1023))
    assert HTTP.get(f"{a.url}/stats").json()["vbuckets"]["owned"] == 256
    assert HTTP.get(f"{b.url}/stats").json()["vbuckets"]["owned"] == 768
    for name, paths in INDEXES.items():
        assert cluster_scan(cluster_map, name, "--consistency", "request_plus") == model(
            documents, paths
        )
    assert "cluster map: now 256 vbuckets here (+0, -256" in a.log()
    # a deleted the entries of the vbuckets it gave away without history: its feed from
    # before the move would miss those deletes, so it answers 410.
    token = before.headers[NEXT_HEADER]
    gone = HTTP.get(f"{a.url}/indexes/{name}/changes", params={"since": token})
    assert gone.status_code == 410 and "starts at snapshot" in gone.text, gone.text
    assert "cluster map: now 768 vbuckets here (+256, -0" in b.log()
    # After a restart, a keeps only its new slice (what it deleted stays deleted).
    assert a.stop() == 0
    a.start()
    wait_equal(a, owned_by(documents, 0, 255))
    assert router.stop() == 0
    assert a.stop() == 0 and b.stop() == 0


def cluster_changes(cluster_map: Path, *extra: str) -> tuple[list[dict[str, Any]], str]:
    """The rows `indexer changes --cluster-map` prints, and the last token it gave."""
    result = subprocess.run(
        indexer_command("changes", "by_city", "--cluster-map", str(cluster_map), *extra),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    token = result.stderr.strip().splitlines()[-1].removeprefix("next: ")
    return [json.loads(line) for line in result.stdout.splitlines()], token


def test_the_changes_of_a_cluster_are_read_from_every_node_with_a_vector_token(
    daemon_factory: Any, routers: Any, tmp_path: Path
) -> None:
    a, b, cluster_map, documents, jsonl, router = two_nodes(
        daemon_factory, routers, tmp_path, Workload(6_000, 2_000, 0.1, 421), **FAST_PERSIST
    )
    want = {"a": (a, 0, 511), "b": (b, 512, 1023)}

    def caught_up(entries: set[str], token: str, *extra: str) -> str:
        """Read on from `token` until the replayed entries equal the model (each node's
        persisted snapshot may lag what it holds by one persist)."""
        for daemon, first, last in want.values():
            wait_equal(daemon, owned_by(documents, first, last))
        wanted = {_entry(e) for e in model(documents, INDEXES["by_city"])}
        deadline = time.monotonic() + 30
        while entries != wanted and time.monotonic() < deadline:
            time.sleep(0.3)
            rows, token = cluster_changes(cluster_map, "--since", token, *extra)
            replay(entries, rows)
        assert entries == wanted
        return token

    rows, token = cluster_changes(cluster_map, "--since", "snapshot")
    entries: set[str] = set()
    replay(entries, rows)
    token = caught_up(entries, token)
    assert sorted(decode_cluster_token(token)) == ["a", "b"]
    more = list(generate(Workload(3_000, 2_000, 0.2, 422)))  # updates and deletes
    write_jsonl(jsonl, more, append=True)
    documents += more
    token = caught_up(entries, token, "--limit", "100")
    for name, (daemon, _, _) in want.items():  # each part is that node's own token
        latest = HTTP.get(f"{daemon.url}/stats").json()["changes"]["latest"].split(".")
        part = decode_cluster_token(token)[name].split(".")
        assert part[0] == latest[0] and 1 < int(part[1]) <= int(latest[1])
    bad = subprocess.run(
        indexer_command(
            "changes", "by_city", "--cluster-map", str(cluster_map), "--since", "c:x.1"
        ),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "nodes the cluster map does not have: c" in bad.stderr
    assert bad.stderr.count("\n") == 1
    assert router.stop() == 0
