"""The HTTP API and its CLI wrappers against a real daemon fed by the real router."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pyarrow as pa
import pytest

from indexer.cluster.scan import row_order
from indexer.router import Workload, generate
from indexer.router.documents import Document, vbucket_of
from tests.e2e.conftest import (
    Daemon,
    free_port,
    http,
    indexer_command,
    model,
    run_feed,
    write_config,
    write_jsonl,
)

pytestmark = pytest.mark.e2e

# One client for the module's requests: a new one per call (httpx.get) builds its TLS
# context each time, which costs more than the request on a busy machine.
HTTP = http()  # the harness's client: no kept-alive connections


def ndjson(response: httpx.Response) -> list[dict[str, Any]]:
    return [json.loads(line) for line in response.text.splitlines() if line]


def module_daemon(tmp: Path) -> Daemon:
    """A daemon of its own in `tmp`, for the tests of this module that only read."""
    port = free_port()
    config = write_config(tmp / "indexer.toml", tmp / "data", port)
    return Daemon(config, tmp / "daemon.log", port).start()


@pytest.fixture(scope="module")
def fed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Daemon, list[Document]]]:
    """One fed daemon that the read-only tests share; it must stop cleanly after them."""
    tmp = tmp_path_factory.mktemp("fed")
    documents = list(generate(Workload(8_000, 1_500, 0.1, 11)))
    daemon = module_daemon(tmp)
    try:
        fed = run_feed(daemon, write_jsonl(tmp / "docs.jsonl", documents))
        assert fed.returncode == 0, fed.stderr
        yield daemon, documents
        assert daemon.stop() == 0
    finally:
        daemon.kill()


@pytest.fixture(scope="module")
def idle(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """One daemon with nothing fed, shared by the bad requests; it must stop cleanly after."""
    daemon = module_daemon(tmp_path_factory.mktemp("idle"))
    try:
        yield daemon
        assert daemon.stop() == 0
    finally:
        daemon.kill()


def test_health_stats_metrics_and_indexes(fed: tuple[Daemon, list[Document]]) -> None:
    daemon, documents = fed
    assert HTTP.get(daemon.url + "/health").json() == {"status": "ok"}
    stats = HTTP.get(daemon.url + "/stats").json()
    assert stats["vbuckets"]["hwt_seqno_sum"] == len(documents)
    assert stats["persisted"]["seqno_sum"] == len(documents)
    assert len(stats["queues"]) == 8 and stats["slab"]["total_bytes"] > 0
    assert stats["throttle"]["paused"] is False
    want = {
        name: len(model(documents, paths))
        for name, paths in (("by_city", ["address.city", "age"]), ("by_age", ["age"]))
    }
    assert {name: i["entries"] for name, i in stats["indexes"].items()} == want
    metrics = HTTP.get(daemon.url + "/metrics").text
    assert f'indexer_index_entries{{index="by_age"}} {float(want["by_age"])}' in metrics
    assert 'indexer_gc_pause_longest_seconds{generation="0"}' in metrics
    listed = subprocess.run(
        indexer_command("list-indexes", "--url", daemon.url), capture_output=True, text=True
    )
    assert listed.returncode == 0
    assert f"by_city\taddress.city,age\tactive\t{want['by_city']}" in listed.stdout
    daemon.check_alive()


def test_scans_ranges_limits_and_arrow_equal_the_model(fed: tuple[Daemon, list[Document]]) -> None:
    daemon, documents = fed
    want = model(documents, ["address.city", "age"])
    full = HTTP.get(daemon.url + "/indexes/by_city/scan")
    assert full.status_code == 200 and ndjson(full) == want
    assert int(full.headers["x-indexer-seqno-sum"]) == len(documents)
    # What a merge of several nodes compares: each row's key as the index orders it, in hex.
    collated = ndjson(HTTP.get(daemon.url + "/indexes/by_city/scan?collation=hex&limit=500"))
    assert [r.pop("collation") for r in collated] == [
        row_order(e)[0].hex() + " " + e["id"] for e in want[:500]
    ]
    assert collated == want[:500]
    bad = HTTP.get(daemon.url + "/indexes/by_city/scan?collation=raw")
    assert bad.status_code == 400 and "collation: hex" in bad.json()["error"], bad.text
    # A range on the leading key, both ends inclusive, and the same by the CLI.
    rng = [e for e in want if "Berlin" <= e["key"][0] <= "Oslo"]
    got = HTTP.get(
        daemon.url + "/indexes/by_city/scan", params={"low": '"Berlin"', "high": '"Oslo"'}
    )
    assert ndjson(got) == rng
    cli = subprocess.run(
        indexer_command(
            "scan", "by_city", "--url", daemon.url, "--low", '"Berlin"', "--high", '"Oslo"'
        ),
        capture_output=True,
        text=True,
    )
    assert cli.returncode == 0 and [json.loads(x) for x in cli.stdout.splitlines()] == rng
    exclusive = HTTP.get(
        daemon.url + "/indexes/by_city/scan",
        params={"low": '"Berlin"', "high": '"Oslo"', "inclusion": "neither"},
    )
    assert ndjson(exclusive) == [e for e in rng if e["key"][0] not in ("Berlin", "Oslo")]
    # Equality on a composite prefix, a limit, and the count.
    eq = [e for e in want if e["key"][:2] == ["Paris", 30]]
    got = HTTP.get(daemon.url + "/indexes/by_city/scan", params={"eq": '["Paris", 30]'})
    assert ndjson(got) == eq
    got = HTTP.get(daemon.url + "/indexes/by_city/scan", params={"limit": "5"})
    assert ndjson(got) == want[:5]
    count = HTTP.get(daemon.url + "/indexes/by_city/count", params={"eq": '"Paris"'}).json()
    assert count["count"] == sum(1 for e in want if e["key"][0] == "Paris")
    # Arrow: the same rows, key values as JSON text, MISSING as null.
    arrow = HTTP.get(
        daemon.url + "/indexes/by_city/scan",
        headers={"Accept": "application/vnd.apache.arrow.stream"},
    )
    table = pa.ipc.open_stream(arrow.content).read_all()
    assert table.schema.names == ["id", "address.city", "age"]
    assert table.schema.metadata[b"indexer.seqno_sum"] == str(len(documents)).encode()
    rows = table.to_pylist()
    assert [r["id"] for r in rows] == [e["id"] for e in want]
    for r, e in zip(rows, want, strict=True):
        assert json.loads(r["address.city"]) == e["key"][0]
        assert (r["age"] is None) == (1 in e.get("missing", []))
    # collation=hex in Arrow: a last column of each row's encoded key, as bytes.
    arrow = HTTP.get(
        daemon.url + "/indexes/by_city/scan?collation=hex",
        headers={"Accept": "application/vnd.apache.arrow.stream"},
    )
    table = pa.ipc.open_stream(arrow.content).read_all()
    assert table.schema.names == ["id", "address.city", "age", "collation"]
    assert table.column("collation").to_pylist() == [row_order(e)[0] for e in want]
    daemon.check_alive()


def test_request_plus_sees_the_last_mutation_and_at_plus_times_out(
    daemon_factory: Any, tmp_path: Path
) -> None:
    daemon = daemon_factory(snapshots={"in_memory_interval_ms": 300}).start()
    documents = list(generate(Workload(3_000, 3_000, 0.0, 12)))
    last = Document("the-last-one", {"age": 1234, "address": {"city": "Zz"}})
    fed = run_feed(daemon, write_jsonl(tmp_path / "d.jsonl", [*documents, last]), "--wait", "none")
    assert fed.returncode == 0, fed.stderr
    # Right after the feed returns, request_plus must wait for the snapshot holding it.
    got = HTTP.get(
        daemon.url + "/indexes/by_age/scan",
        params={"eq": "1234", "consistency": "request_plus"},
        timeout=30,
    )
    assert got.status_code == 200 and [e["id"] for e in ndjson(got)] == ["the-last-one"]
    # `any` never blocks, whatever the daemon holds.
    started = time.monotonic()
    assert HTTP.get(daemon.url + "/indexes/by_age/count").status_code == 200
    assert time.monotonic() - started < 1
    vb = vbucket_of(b"the-last-one", 1024)
    future = HTTP.get(
        daemon.url + "/indexes/by_age/scan",
        params={"consistency": "at_plus", "at_plus": json.dumps({vb: 10**6}), "timeout": "0.5"},
        timeout=30,
    )
    assert future.status_code == 504 and "timed out" in future.json()["error"]
    assert daemon.stop() == 0


def test_a_pinned_snapshot_is_unchanged_by_later_writes(
    daemon_factory: Any, tmp_path: Path
) -> None:
    daemon = daemon_factory().start()
    first = list(generate(Workload(4_000, 800, 0.1, 13)))
    assert run_feed(daemon, write_jsonl(tmp_path / "a.jsonl", first)).returncode == 0
    pin = HTTP.post(daemon.url + "/snapshots/pin", json={"snapshot": "persisted"}).json()
    before = ndjson(HTTP.get(daemon.url + "/indexes/by_age/scan", params={"pin": pin["id"]}))
    more = list(generate(Workload(4_000, 800, 0.5, 14)))  # same ids: updates and deletes
    assert run_feed(daemon, write_jsonl(tmp_path / "b.jsonl", first + more)).returncode == 0
    after_pinned = ndjson(HTTP.get(daemon.url + "/indexes/by_age/scan", params={"pin": pin["id"]}))
    latest = ndjson(HTTP.get(daemon.url + "/indexes/by_age/scan"))
    assert after_pinned == before == model(first, ["age"])
    assert latest == model(first + more, ["age"]) != before
    listed = HTTP.get(daemon.url + "/snapshots").json()["pinned"]
    assert [p["id"] for p in listed] == [pin["id"]]
    assert listed[0]["expires_in_s"] <= 600
    renewed = HTTP.post(f"{daemon.url}/snapshots/{pin['id']}/renew", json={"lease_s": 3600})
    assert renewed.status_code == 200
    listed = HTTP.get(daemon.url + "/snapshots").json()["pinned"]
    assert 600 < listed[0]["expires_in_s"] <= 3600
    assert HTTP.delete(f"{daemon.url}/snapshots/{pin['id']}").status_code == 204
    gone = HTTP.get(daemon.url + "/indexes/by_age/scan", params={"pin": pin["id"]})
    assert gone.status_code == 404
    assert HTTP.post(f"{daemon.url}/snapshots/{pin['id']}/renew", json={}).status_code == 404
    assert HTTP.get(daemon.url + "/stats").json()["snapshots"]["pins"] == 0
    assert daemon.stop() == 0


@pytest.mark.parametrize(
    "path, params, status",
    [
        ("/indexes/nope/scan", {}, 404),
        ("/indexes/..%2Fetc/scan", {}, 400),  # not an index name
        ("/indexes/by_age/scan", {"low": "[1, 2, 3]"}, 400),
        ("/indexes/by_age/scan", {"low": "{not json"}, 400),
        ("/indexes/by_age/scan", {"consistency": "sometimes"}, 400),
        ("/indexes/by_age/scan", {"limit": "-1"}, 400),
        ("/indexes/by_age/scan", {"limit": "2.5"}, 400),
        ("/indexes/by_age/scan", {"eq": "1", "low": "0"}, 400),
        ("/indexes/by_age/scan", {"consistency": "at_plus"}, 400),
        ("/indexes/by_age/scan", {"inclusion": "maybe", "low": "1"}, 400),
        ("/indexes/by_age/scan", {"pin": "p999"}, 404),
        ("/nothing", {}, 404),
    ],
)
def test_bad_requests_get_a_4xx_with_a_message(
    idle: Daemon, path: str, params: dict[str, str], status: int
) -> None:
    daemon = idle
    response = HTTP.get(daemon.url + path, params=params)
    assert response.status_code == status
    assert response.json()["error"]
    assert HTTP.post(daemon.url + "/indexes/by_age/scan").status_code == 405
    assert HTTP.get(daemon.url + "/health").status_code == 200
    daemon.check_alive()


def test_under_memory_pressure_scans_get_503_and_reads_pause(
    daemon_factory: Any, tmp_path: Path
) -> None:
    # A quota far below the daemon's own size: the throttle pauses at once and stays paused.
    daemon = daemon_factory(memory={"quota": "8MiB"}).start()
    deadline = time.monotonic() + 30
    while "memory throttle: pausing reads" not in daemon.log():
        assert time.monotonic() < deadline, daemon.log()[-2000:]
        time.sleep(0.05)
    response = HTTP.get(daemon.url + "/indexes/by_age/scan")
    assert response.status_code == 503
    assert response.headers["retry-after"] and "memory" in response.json()["error"]
    stats = HTTP.get(daemon.url + "/stats").json()["throttle"]
    assert stats["paused"] is True and stats["pauses"] >= 1
    assert "memory throttle: pausing reads" in daemon.log()
    assert daemon.stop() == 0
