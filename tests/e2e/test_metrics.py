"""/metrics and /stats of a real daemon and a real router: Prometheus names and types (counters
as counters with `_total`, histograms with buckets), build info, the process collector, and
the statistics an operator reads (uptime, version, per-index bytes on disk and scans)."""

from __future__ import annotations

import importlib.metadata
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from indexer.router import Workload, generate
from indexer.router.documents import Document
from tests.e2e.conftest import WAIT_S, Daemon, model, run_feed, wait_equal, write_jsonl
from tests.harness import http
from workers.flush import FAULT_ENOSPC_FILE

pytestmark = pytest.mark.e2e

# One client for the module's requests: a new one per call (httpx.get) builds its TLS
# context each time, which costs more than the request on a busy machine.
HTTP = http()  # the harness's client: no kept-alive connections

VERSION = importlib.metadata.version("indexer")


class Exposition:
    """A parsed Prometheus text exposition: families by name, with their type and samples."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.families = {f.name: f for f in text_string_to_metric_families(text)}

    def type_of(self, name: str) -> str:
        assert name in self.families, f"no {name} in:\n{self.text}"
        kind: str = self.families[name].type
        return kind

    def samples(self, name: str, suffix: str = "", **labels: str) -> list[Sample]:
        """Samples of family `name` named `name + suffix` having these labels."""
        assert name in self.families, f"no {name} in:\n{self.text}"
        return [
            s
            for s in self.families[name].samples
            if s.name == name + suffix and all(s.labels.get(k) == v for k, v in labels.items())
        ]

    def value(self, name: str, suffix: str = "", **labels: str) -> float:
        (sample,) = self.samples(name, suffix, **labels)
        return float(sample.value)


def wait_for(what: str, check: Callable[[], bool], timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def metrics(url: str) -> Exposition:
    answer = HTTP.get(url + "/metrics", timeout=30)
    assert answer.status_code == 200, answer.text
    assert answer.headers["content-type"].startswith("text/plain")
    return Exposition(answer.text)


@pytest.fixture
def fed(daemon_factory: Any, tmp_path: Path) -> tuple[Daemon, list[Document]]:
    documents = list(generate(Workload(6_000, 1_500, 0.1, 43)))
    daemon = daemon_factory().start()
    fed = run_feed(daemon, write_jsonl(tmp_path / "docs.jsonl", documents))
    assert fed.returncode == 0, fed.stderr
    return daemon, documents


def scan_some(daemon: Daemon) -> tuple[int, int]:
    """Three scans and a count of by_age, and a scan of by_city: (reads of by_age, rows)."""
    rows = 0
    for params in ({}, {"limit": "10"}, {"eq": "30", "consistency": "request_plus"}):
        answer = HTTP.get(daemon.url + "/indexes/by_age/scan", params=params, timeout=30)
        assert answer.status_code == 200, answer.text
        rows += len(answer.text.splitlines())
    assert HTTP.get(daemon.url + "/indexes/by_age/count").status_code == 200
    assert HTTP.get(daemon.url + "/indexes/by_city/scan", params={"limit": "1"}).status_code == 200
    return 4, rows


def test_daemon_metrics_have_prometheus_names_and_types(
    fed: tuple[Daemon, list[Document]],
) -> None:
    daemon, documents = fed
    reads, rows = scan_some(daemon)
    assert HTTP.post(daemon.url + "/compact", timeout=60).status_code == 200
    # An index created over data the one-shot feed cannot stream stays building: its progress.
    created = HTTP.post(daemon.url + "/indexes", json={"name": "by_zip", "keys": ["address.zip"]})
    assert created.status_code == 201, created.text
    m = metrics(daemon.url)

    # Counters are counters, exposed with _total.
    for name in (
        "indexer_mutations_received",
        "indexer_mutations_flushed",
        "indexer_protocol_errors",
        "indexer_throttle_pauses",
        "indexer_store_write_errors",
        "indexer_persist_errors",
        "indexer_http_refused",
        "indexer_scans",
        "indexer_scan_rows",
        "indexer_gc_collections",
        "process_cpu_seconds",
    ):
        assert m.type_of(name) == "counter", name
        assert m.samples(name, "_total"), name
        assert f"# TYPE {name}_total counter" in m.text or f"# TYPE {name} counter" in m.text
    assert m.value("indexer_mutations_received", "_total") == len(documents)
    assert m.value("indexer_mutations_flushed", "_total") == len(documents)
    assert m.value("indexer_scans", "_total", index="by_age") == reads
    assert m.value("indexer_scans", "_total", index="by_city") == 1
    assert m.value("indexer_scan_rows", "_total", index="by_age") == rows
    # No gauge poses as a counter any more.
    for family in m.families.values():
        if family.type == "gauge":
            assert not family.name.endswith("_total"), family.name
    assert "indexer_mutations_received " not in m.text  # the old gauge's sample

    # Histograms: scan latency per index, flush time, persisted-snapshot lag.
    assert m.type_of("indexer_scan_duration_seconds") == "histogram"
    assert m.value("indexer_scan_duration_seconds", "_count", index="by_age") == reads
    assert m.value("indexer_scan_duration_seconds", "_bucket", index="by_age", le="+Inf") == reads
    assert m.value("indexer_scan_duration_seconds", "_sum", index="by_age") > 0
    buckets = m.samples("indexer_scan_duration_seconds", "_bucket", index="by_age")
    assert len(buckets) > 5
    counts = [s.value for s in buckets]
    assert counts == sorted(counts)  # cumulative
    for name in ("indexer_flush_duration_seconds", "indexer_persist_lag_seconds"):
        assert m.type_of(name) == "histogram", name
        assert m.value(name, "_count") > 0, name
        assert m.value(name, "_bucket", le="+Inf") == m.value(name, "_count")

    # Gauges: build progress, a failing persist, a full disk, bytes on disk, scans in flight.
    assert m.type_of("indexer_build_progress_ratio") == "gauge"
    assert 0 <= m.value("indexer_build_progress_ratio", index="by_zip") <= 1
    assert m.value("indexer_persist_failing") == 0
    assert m.value("indexer_disk_full") == 0
    assert m.value("indexer_index_bytes_on_disk", index="by_age") > 0
    assert m.value("indexer_scans_in_flight") == 0
    assert m.type_of("indexer_index_entries") == "gauge"
    assert m.value("indexer_index_entries", index="by_age") == len(model(documents, ["age"]))

    # Build info and the process collector.
    assert m.value("indexer_build_info", version=VERSION) == 1
    assert m.type_of("process_resident_memory_bytes") == "gauge"
    assert m.value("process_resident_memory_bytes") > 0
    assert m.value("process_start_time_seconds") > 0
    assert daemon.stop() == 0


def test_daemon_stats_show_uptime_version_and_per_index_reads(
    fed: tuple[Daemon, list[Document]],
) -> None:
    daemon, documents = fed
    before = HTTP.get(daemon.url + "/stats").json()
    assert before["scans_served"] == 0 and before["scans_in_flight"] == 0
    assert "scan_requests" not in before  # renamed: it counted requests in flight
    reads, rows = scan_some(daemon)
    assert HTTP.post(daemon.url + "/compact", timeout=60).status_code == 200
    stats = HTTP.get(daemon.url + "/stats").json()
    assert stats["version"] == VERSION
    assert 0 < stats["uptime_s"] < 600
    assert stats["scans_served"] == reads + 1
    assert stats["scans_in_flight"] == 0
    by_age = stats["indexes"]["by_age"]
    assert by_age["entries"] == len(model(documents, ["age"]))
    assert by_age["bytes_on_disk"] > 0
    assert by_age["scans"] == reads and by_age["rows"] == rows
    latency = by_age["scan_latency_s"]
    assert latency["count"] == reads
    assert 0 < latency["mean"] <= latency["max"]
    assert latency["p50"] is not None and latency["p50"] <= latency["p99"] <= latency["max"]
    assert stats["indexes"]["by_city"]["scans"] == 1 and stats["indexes"]["by_city"]["rows"] == 1
    # GET /indexes/NAME shows the same.
    one = HTTP.get(daemon.url + "/indexes/by_age").json()
    assert one["scans"] == reads and one["rows"] == rows and one["bytes_on_disk"] > 0
    later = HTTP.get(daemon.url + "/stats").json()
    assert later["uptime_s"] >= stats["uptime_s"]
    assert daemon.stop() == 0


def test_a_full_disk_shows_in_the_gauge(
    daemon_factory: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    flag = tmp_path / "disk-full"
    monkeypatch.setenv(FAULT_ENOSPC_FILE, str(flag))
    daemon = daemon_factory().start()
    flag.touch()
    documents = list(generate(Workload(500, 500, 0.0, 44)))
    fed = run_feed(daemon, write_jsonl(tmp_path / "docs.jsonl", documents), "--wait", "none")
    assert fed.returncode == 0, fed.stderr
    wait_for("the disk-full gauge", lambda: metrics(daemon.url).value("indexer_disk_full") == 1)
    assert metrics(daemon.url).value("indexer_store_write_errors", "_total") > 0
    flag.unlink()
    wait_for(
        "the disk-full gauge to clear", lambda: metrics(daemon.url).value("indexer_disk_full") == 0
    )
    wait_equal(daemon, documents)
    assert daemon.stop() == 0


def test_router_metrics_and_stats(daemon_factory: Any, routers: Any, tmp_path: Path) -> None:
    daemon = daemon_factory().start()
    documents = list(generate(Workload(2_000, 500, 0.1, 45)))
    jsonl = write_jsonl(tmp_path / "docs.jsonl", documents)
    router = routers(
        "--state", str(tmp_path / "state"), "--jsonl", str(jsonl),
        "--to", daemon.address, "--http", "127.0.0.1:0",
    )  # fmt: skip
    (url,) = router.wait_log(r"router API on (http://\S+)")
    wait_equal(daemon, documents)

    stats = HTTP.get(url + "/stats").json()
    assert stats["version"] == VERSION
    assert 0 < stats["uptime_s"] < 600
    assert stats["nodes"][daemon.address]["connected"] is True

    m = metrics(url)
    assert m.value("indexer_router_build_info", version=VERSION) == 1
    for name in (
        "indexer_router_node_sent",
        "indexer_router_node_backfilled",
        "indexer_router_node_superseded",
        "indexer_router_node_connections",
        "indexer_router_cursors_dropped",
        "indexer_router_snapshots_collapsed",
        "indexer_router_items_expelled",
        "indexer_router_documents_expired",
        "indexer_router_http_refused",
        "indexer_router_gc_collections",
        "process_cpu_seconds",
    ):
        assert m.type_of(name) == "counter", name
        assert m.samples(name, "_total"), name
    node = daemon.address
    sent = m.value("indexer_router_node_sent", "_total", node=node)
    backfilled = m.value("indexer_router_node_backfilled", "_total", node=node)
    assert sent + backfilled >= len({d.docid for d in documents})
    assert sent >= stats["nodes"][node]["sent"]  # scraped after /stats: counters only grow
    assert m.value("indexer_router_node_connections", "_total", node=node) >= 1
    assert m.type_of("indexer_router_node_connected") == "gauge"
    assert m.value("indexer_router_node_connected", node=node) == 1
    assert m.value("indexer_router_source_high_seqno_sum") == len(documents)
    assert m.value("indexer_router_memory_capacity_bytes") > 0
    assert m.value("process_resident_memory_bytes") > 0
    for family in m.families.values():
        if family.type == "gauge":
            assert not family.name.endswith("_total"), family.name
    wrong = HTTP.post(url + "/metrics")
    assert wrong.status_code == 405 and wrong.json()["error"]
    assert router.stop() == 0
    assert daemon.stop() == 0
