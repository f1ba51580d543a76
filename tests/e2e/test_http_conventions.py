"""The HTTP API's conventions against a real daemon: no parameter ignored silently, at_plus
alone implies its consistency, bounds written as numbers, GET /indexes/NAME and HEAD /health."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from indexer.router import Workload, generate
from indexer.router.documents import Document, vbucket_of
from tests.e2e.conftest import Daemon, model, run_feed, write_jsonl

pytestmark = pytest.mark.e2e


def ndjson(response: httpx.Response) -> list[dict[str, Any]]:
    return [json.loads(line) for line in response.text.splitlines() if line]


@pytest.fixture
def fed(daemon_factory: Any, tmp_path: Path) -> tuple[Daemon, list[Document]]:
    documents = list(generate(Workload(3_000, 800, 0.1, 41)))
    daemon = daemon_factory().start()
    fed = run_feed(daemon, write_jsonl(tmp_path / "docs.jsonl", documents))
    assert fed.returncode == 0, fed.stderr
    return daemon, documents


def test_at_plus_alone_waits_for_its_vector(fed: tuple[Daemon, list[Document]]) -> None:
    daemon, documents = fed
    scan = daemon.url + "/indexes/by_age/scan"
    vb = vbucket_of(documents[0].docid.encode(), 1024)
    # A vector beyond what the daemon holds: without consistency=at_plus it still waits.
    future = httpx.get(
        scan, params={"at_plus": json.dumps({vb: 10**6}), "timeout": "0.5"}, timeout=30
    )
    assert future.status_code == 504, future.text
    assert "timed out" in future.json()["error"] and "at_plus" in future.json()["error"]
    # A vector it holds answers with the rows.
    reached = httpx.get(scan, params={"at_plus": json.dumps({vb: 1})}, timeout=30)
    assert reached.status_code == 200 and ndjson(reached) == model(documents, ["age"])
    # With another consistency at_plus would be ignored: a 400 naming both.
    mixed = httpx.get(scan, params={"at_plus": json.dumps({vb: 1}), "consistency": "any"})
    assert mixed.status_code == 400
    assert "at_plus" in mixed.json()["error"] and "consistency=any" in mixed.json()["error"]
    assert daemon.stop() == 0


UNKNOWN = [  # (path, query string, the parameters the error must name)
    ("/indexes/by_age/scan", "bogus=1", ["'bogus'"]),
    ("/indexes/by_age/scan", "low=10&hihg=20&colour=", ["'colour'", "'hihg'"]),
    ("/indexes/by_age/count", "limit=5", ["'limit'"]),  # a count has no limit
    ("/indexes/by_age/splits", "eq=3", ["'eq'"]),
    ("/indexes/by_age", "verbose=1", ["'verbose'"]),
    ("/stats", "verbose=1", ["'verbose'"]),
    ("/metrics", "name=x", ["'name'"]),
    ("/health", "probe", ["'probe'"]),
    ("/indexes", "state=active", ["'state'"]),
    ("/snapshots", "all=1", ["'all'"]),
]


def test_unknown_query_parameters_get_a_400_naming_them(daemon_factory: Any) -> None:
    daemon = daemon_factory().start()
    for path, query, named in UNKNOWN:
        response = httpx.get(f"{daemon.url}{path}?{query}")
        assert response.status_code == 400, (path, query, response.text)
        error = response.json()["error"]
        assert "unknown query parameter" in error, error
        for name in named:
            assert name in error, error
    # The same routes without them answer.
    for path in ("/indexes/by_age/scan", "/stats", "/metrics", "/health", "/indexes/by_age"):
        assert httpx.get(daemon.url + path).status_code == 200, path
    assert daemon.stop() == 0


def test_parameters_a_read_would_ignore_get_a_400(daemon_factory: Any) -> None:
    daemon = daemon_factory().start()
    scan = daemon.url + "/indexes/by_age/scan"
    twice = httpx.get(scan + "?limit=1&limit=2")
    assert twice.status_code == 400 and "limit: given more than once" in twice.json()["error"]
    pinned = httpx.get(scan, params={"pin": "p1", "consistency": "request_plus"})
    assert pinned.status_code == 400
    assert "consistency" in pinned.json()["error"] and "pin" in pinned.json()["error"]
    assert daemon.stop() == 0


def test_the_limit_bound_in_an_error_is_an_integer(daemon_factory: Any) -> None:
    daemon = daemon_factory().start()
    scan = daemon.url + "/indexes/by_age/scan"
    for bad in ("-1", str(2**63)):  # not 4.61169e+18
        answer = httpx.get(scan, params={"limit": bad})
        assert answer.status_code == 400
        error = answer.json()["error"]
        assert f"from 0 to {2**62}, not {bad!r}" in error, error
        assert "e+" not in error
    assert daemon.stop() == 0


def test_get_one_index(fed: tuple[Daemon, list[Document]]) -> None:
    daemon, documents = fed
    answer = httpx.get(daemon.url + "/indexes/by_city")
    assert answer.status_code == 200, answer.text
    index = answer.json()
    assert index["name"] == "by_city" and index["keys"] == ["address.city", "age"]
    assert index["state"] == "active"
    assert index["entries"] == len(model(documents, ["address.city", "age"]))
    listed = httpx.get(daemon.url + "/indexes").json()["indexes"]
    assert {k: v for k, v in index.items() if k in listed[0]} in listed
    missing = httpx.get(daemon.url + "/indexes/nope")
    assert missing.status_code == 404 and "nope" in missing.json()["error"]
    wrong = httpx.post(daemon.url + "/indexes/by_city")
    assert wrong.status_code == 405 and wrong.headers["allow"] == "GET, DELETE"
    assert daemon.stop() == 0


def test_head_health_answers_as_get_does_without_a_body(daemon_factory: Any) -> None:
    daemon = daemon_factory().start()
    head = httpx.head(daemon.url + "/health")
    assert head.status_code == 200 and head.content == b""
    assert head.headers["content-type"] == "application/json"
    assert httpx.head(daemon.url + "/stats").status_code == 405
    assert httpx.get(daemon.url + "/health").json() == {"status": "ok"}
    assert daemon.stop() == 0


def test_a_kept_alive_connection_idle_past_a_clients_expiry_is_still_answered(
    daemon_factory: Any,
) -> None:
    """httpx drops an idle connection after 5 s; the server must not close one sooner or at
    the same moment, or a request sent on it as it closes gets no answer (the daemon's and the
    router's HTTP servers share indexer/asgi.py)."""
    daemon = daemon_factory().start()
    host, port = daemon.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        answers = []
        for _ in range(2):
            sock.sendall(f"GET /health HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
            answers.append(whole_answer(sock))
            time.sleep(6.0)  # longer than httpx's idle expiry, and hypercorn's old default
        sock.sendall(f"GET /health HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
        answers.append(whole_answer(sock))
    assert all(a.startswith(b"HTTP/1.1 200") for a in answers), answers


def whole_answer(sock: socket.socket) -> bytes:
    """One chunked answer, read to its last chunk (b"" if the server closed first)."""
    data = b""
    while not data.endswith(b"0\r\n\r\n"):
        more = sock.recv(65536)
        if not more:
            break
        data += more
    return data
