"""The long-running router (`indexer router`) against real daemons: a followed JSONL file, the
documents API, a daemon killed and restarted under it, bad input."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from indexer.collector import THRESHOLDS
from indexer.router import Workload, generate
from indexer.router.documents import Document, vbucket_of
from indexer.routes import DAEMON_ROUTES, ROUTER_ROUTES
from indexer.storage import COMPACTION_NICE
from tests.e2e.conftest import (
    WAIT_S,
    http,
    indexer_command,
    model,
    scan,
    thread_nices,
    wait_active,
    wait_equal,
    write_jsonl,
)

pytestmark = pytest.mark.e2e

# One client for the module's requests: a new one per call (httpx.get) builds its TLS
# context each time, which costs more than the request on a busy machine.
HTTP = http()  # the harness's client: no kept-alive connections


def test_a_followed_file_reaches_two_daemons(
    daemon_factory: Any, routers: Any, tmp_path: Path
) -> None:
    first, second = daemon_factory().start(), daemon_factory().start()
    documents = list(generate(Workload(3_000, 800, 0.1, 51)))
    jsonl = write_jsonl(tmp_path / "in.jsonl", documents)
    router = routers(
        "--state", str(tmp_path / "state"), "--jsonl", str(jsonl), "--follow",
        "--to", first.address, "--to", second.address,
    )  # fmt: skip
    router.wait_log(r"connected; resuming", 2)
    for round_ in range(3):
        more = list(generate(Workload(1_000, 1_200, 0.2, 60 + round_)))
        write_jsonl(jsonl, more, append=True)
        documents += more
        time.sleep(0.1)
    # A line written in two pieces: the router waits for its newline.
    last = Document("late", {"age": 77, "address": {"city": "Oslo"}})
    line = json.dumps({"id": last.docid, "doc": last.body}) + "\n"
    with open(jsonl, "a") as f:
        f.write(line[:10])
        f.flush()
        time.sleep(0.5)
        f.write(line[10:])
    documents.append(last)
    wait_equal(first, documents)
    wait_equal(second, documents)
    assert router.stop() == 0
    text = router.log()
    assert "ERROR" not in text and text.count("disconnected") == 0, text
    assert "SIGTERM received: stopping" in text and text.rstrip().endswith("stopped")
    assert first.stop() == 0 and second.stop() == 0


def test_the_documents_api_puts_and_deletes(
    daemon_factory: Any, routers: Any, tmp_path: Path
) -> None:
    daemon = daemon_factory().start()
    router = routers(
        "--state", str(tmp_path / "state"), "--to", daemon.address, "--http", "127.0.0.1:0"
    )
    (url,) = router.wait_log(r"router API on (http://\S+)")
    router.wait_log(r"connected; resuming")
    documents = []
    seqnos: dict[int, int] = {}
    with httpx.Client(base_url=url, timeout=30) as client:
        for i in range(40):
            body = {"age": i % 7, "address": {"city": ["Oslo", "Paris", "Rome"][i % 3]}}
            document = Document(f"user::{i % 25}", body)
            answer = client.put(f"/docs/{document.docid}", json=body)
            assert answer.status_code == 200, answer.text
            vb = vbucket_of(document.docid.encode(), 1024)
            seqnos[vb] = seqnos.get(vb, 0) + 1
            assert answer.json() == {"vbucket": vb, "seqno": seqnos[vb]}
            documents.append(document)
        for i in (3, 4, 17, 99):
            answer = client.delete(f"/docs/user::{i}")
            assert answer.status_code == 200 and set(answer.json()) == {"vbucket", "seqno"}
            documents.append(Document(f"user::{i}", None))
        # An id with a slash and a space, percent-encoded in the path.
        answer = client.put("/docs/a%2Fb%20c", json={"age": 1})
        assert answer.status_code == 200
        assert answer.json()["vbucket"] == vbucket_of(b"a/b c", 1024)
        documents.append(Document("a/b c", {"age": 1}))
        for method, path, body, status, message in (
            ("PUT", "/docs/x", b"{not json", 400, "the body is not JSON"),
            ("PUT", "/docs/x", b"[1, 2]", 400, "must be a JSON object"),
            ("PUT", "/docs/x", b"", 400, "the body is not JSON"),
            ("PUT", "/docs/" + "x" * 251, b"{}", 400, "1 to 250 bytes"),
            ("PUT", "/docs/", b"{}", 400, "1 to 250 bytes"),
            ("GET", "/docs/x", b"", 405, "not allowed"),
            ("PUT", "/other", b"{}", 404, "not found"),
            ("PUT", "/docs/x", b'{"a": "' + b"x" * (1 << 20) + b'"}', 413, "over"),
        ):
            answer = client.request(method, path, content=body)
            assert answer.status_code == status, (path, answer.text)
            assert message in answer.json()["error"], answer.text
    wait_equal(daemon, documents)
    # A new index: the daemon asks for a new handshake and the router reconnects at once.
    created = HTTP.post(f"{daemon.url}/indexes", json={"name": "by_zip", "keys": ["zip"]})
    assert created.status_code == 201, created.text
    router.wait_log(rf"{daemon.address}: disconnected: .*INDEXES_CHANGED")
    router.wait_log(r"connected; resuming", 2)
    zipped = [Document(f"z{i}", {"zip": f"{i:05}", "age": i}) for i in range(5)]
    for document in zipped:
        assert HTTP.put(f"{url}/docs/{document.docid}", json=document.body).status_code == 200
    documents += zipped
    wait_equal(daemon, documents)
    wait_active(daemon, "by_zip")
    assert scan(daemon, "by_zip") == model(documents, ["zip"])
    # Both run under the collector policy of indexer/collector.py, and time its pauses.
    for stats_url in (url, daemon.url):
        collector = HTTP.get(f"{stats_url}/stats").json()["collector"]
        assert collector["thresholds"] == list(THRESHOLDS), (stats_url, collector)
        assert len(collector["pause_s_longest"]) == 3, collector
    # Both run LevelDB's compactions at a lower priority than their own threads (storage.py).
    for pid in (router.proc.pid, daemon.proc.pid):
        nices = thread_nices(pid)
        assert nices[pid] == 0 and list(nices.values()).count(COMPACTION_NICE) == 1, nices
    assert router.stop() == 0
    assert daemon.stop() == 0


def test_a_killed_daemon_catches_up_after_its_restart(
    daemon_factory: Any, routers: Any, tmp_path: Path
) -> None:
    steady, victim = daemon_factory().start(), daemon_factory().start()
    documents = list(generate(Workload(4_000, 1_000, 0.1, 71)))
    jsonl = write_jsonl(tmp_path / "in.jsonl", documents)
    router = routers(
        "--state", str(tmp_path / "state"), "--jsonl", str(jsonl), "--follow",
        "--to", steady.address, "--to", victim.address,
    )  # fmt: skip
    wait_equal(victim, documents)
    # Persisted (every mutation has its own seqno: the sum counts them), then killed.
    deadline = time.monotonic() + WAIT_S
    while HTTP.get(f"{victim.url}/stats").json()["persisted"]["seqno_sum"] < len(documents):
        assert time.monotonic() < deadline, "the daemon did not persist in time"
        time.sleep(0.1)
    victim.kill()
    router.wait_log(rf"{victim.address}: disconnected")
    more = list(generate(Workload(2_000, 1_500, 0.2, 72)))
    write_jsonl(jsonl, more, append=True)
    documents += more
    wait_equal(steady, documents)  # the other node is not held up
    victim.start()
    # It resumes from what the killed daemon had persisted, not from zero.
    resumed = router.wait_log(
        rf"{victim.address}: connected; resuming from restart seqno sum (\d+)", 2
    )
    assert int(resumed[-1]) >= 4_000
    later = list(generate(Workload(1_000, 1_500, 0.2, 73)))
    write_jsonl(jsonl, later, append=True)
    documents += later
    wait_equal(victim, documents)
    wait_equal(steady, documents)
    assert router.stop() == 0
    assert router.log().count(f"{steady.address}: connected") == 1
    assert steady.stop() == 0 and victim.stop() == 0


def test_a_bad_line_is_logged_and_skipped(
    daemon_factory: Any, routers: Any, tmp_path: Path
) -> None:
    daemon = daemon_factory().start()
    good = list(generate(Workload(500, 200, 0.1, 81)))
    jsonl = write_jsonl(tmp_path / "in.jsonl", good)
    router = routers(
        "--state", str(tmp_path / "state"), "--jsonl", str(jsonl), "--follow",
        "--to", daemon.address,
    )  # fmt: skip
    wait_equal(daemon, good)
    with open(jsonl, "a") as f:
        f.write('{"id": "broken", "doc": \n')
    more = list(generate(Workload(300, 400, 0.1, 82)))
    write_jsonl(jsonl, more, append=True)
    (error,) = router.wait_log(r"ERROR indexer\.router: (.*)")
    assert (
        error
        == f"skipped a bad input line: {jsonl}:501: not JSON: " + error.split("not JSON: ", 1)[1]
    )
    wait_equal(daemon, good + more)
    assert router.proc.poll() is None
    assert router.log().count("ERROR") == 1
    assert router.stop() == 0
    assert daemon.stop() == 0


def test_the_generator_input_reaches_the_daemon_at_its_rate(
    daemon_factory: Any, routers: Any, tmp_path: Path
) -> None:
    daemon = daemon_factory().start()
    workload = Workload(3_000, 700, 0.1, 61)
    started = time.monotonic()
    router = routers(
        "--state", str(tmp_path / "state"), "--to", daemon.address,
        "--generate", "3000", "--keys", "700", "--seed", "61", "--rate", "3000",
    )  # fmt: skip
    router.wait_log(r"generated 3000 documents")
    # About a second at 3,000 a second: not all at once, and not stalled.
    assert 0.7 < time.monotonic() - started < 30
    wait_equal(daemon, list(generate(workload)))
    assert router.stop() == 0
    assert daemon.stop() == 0


def test_bad_router_commands_fail_with_one_line(tmp_path: Path) -> None:
    for args, message in (
        (
            ["--state", str(tmp_path / "s")],
            "give the nodes with --to HOST:PORT, --cluster-map FILE or --cluster",
        ),
        (
            ["--state", str(tmp_path / "s"), "--cluster-map", str(tmp_path / "none.toml")],
            "none.toml",
        ),
        (["--state", str(tmp_path / "s"), "--to", "nowhere"], "--to: 'nowhere' is not HOST:PORT"),
        (["--state", str(tmp_path / "s"), "--to", "h:1", "--to", "h:1"], "h:1 is given twice"),
        (["--state", str(tmp_path / "s"), "--to", "h:1", "--follow"], "--follow needs --jsonl"),
        (["--state", str(tmp_path / "s"), "--to", "h:1", "--rate", "5"], "--rate needs --generate"),
        (["--state", str(tmp_path / "s"), "--to", "h:1", "--memory-mb", "0"], "--memory-mb"),
    ):
        result = subprocess.run(
            indexer_command("router", *args), capture_output=True, text=True, timeout=30
        )
        assert result.returncode == 2, result.stderr
        assert message in result.stderr, result.stderr


def test_every_route_the_help_lists_is_served(
    daemon_factory: Any, routers: Any, tmp_path: Path
) -> None:
    """Each route of `indexer serve --help` and `indexer router --help` (indexer/routes.py)
    answers a request as it should: no route is listed that is not served."""
    daemon = daemon_factory().start()
    router = routers(
        "--state", str(tmp_path / "state"), "--to", daemon.address, "--http", "127.0.0.1:0"
    )  # fmt: skip
    url = router.wait_url()
    bodies: dict[tuple[str, str], Any] = {
        ("PUT", "/docs/ID"): {"age": 30},
        ("POST", "/indexes"): {"name": "by_zip", "keys": ["zip"], "defer_build": True},
        ("POST", "/indexes/_build"): {"indexes": ["by_zip"]},
        ("POST", "/snapshots/pin"): {"snapshot": "persisted", "lease_s": 60},
        ("POST", "/snapshots/ID/renew"): {"lease_s": 60},
    }
    answered: dict[str, int] = {}
    failed: list[str] = []
    with httpx.Client(base_url=url, timeout=60) as client:
        for route in ROUTER_ROUTES:
            vb = vbucket_of(b"user::1", 1024)  # a failover keeping all its history
            path = route.path.replace("/ID", "/user::1").replace("/VB", f"/{vb}")
            if route.path == "/docs/_bulk":
                answer = client.post(path, content=b'{"id": "b1", "doc": {"age": 3}}\n')
            else:
                answer = client.request(
                    route.method, path, json=bodies.get((route.method, route.path))
                )
            answered[f"router {route.method} {route.path}"] = answer.status_code
            failed += [] if answer.status_code < 300 else [f"{route.path}: {answer.text}"]
        unknown = client.put("/other", json={})
        assert all(f"{r.method} {r.path}" in unknown.json()["error"] for r in ROUTER_ROUTES)
    wait_equal(daemon, [Document("user::1", None), Document("b1", {"age": 3})])
    pin = HTTP.post(f"{daemon.url}/snapshots/pin", json={"lease_s": 60}).json()["id"]
    with httpx.Client(base_url=daemon.url, timeout=60) as client:
        for route in DAEMON_ROUTES:
            if route.path == "/indexes/NAME" and route.method == "DELETE":
                continue  # last, below: the other routes read the index
            path = route.path.replace("NAME", "by_city").replace("/docs/ID", "/docs/b1")
            path = path.replace("/snapshots/ID", f"/snapshots/{pin}")
            body = bodies.get((route.method, route.path))
            answer = client.request(route.method, path, json=body)
            answered[f"daemon {route.method} {route.path}"] = answer.status_code
        dropped = client.delete("/indexes/by_zip")
        answered["daemon DELETE /indexes/NAME"] = dropped.status_code
    assert failed == [], answered
    assert len(answered) == len(ROUTER_ROUTES) + len(DAEMON_ROUTES)
    assert router.stop() == 0 and daemon.stop() == 0
