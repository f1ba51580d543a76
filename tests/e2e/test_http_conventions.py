"""The HTTP API's conventions against a real daemon: no parameter ignored silently, at_plus
alone implies its consistency, bounds written as numbers, GET /indexes/NAME and HEAD /health."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from indexer.router import Workload, generate
from indexer.router.documents import Document, vbucket_of
from tests.e2e.conftest import Daemon, free_port, model, run_feed, write_config, write_jsonl
from tests.harness import http

pytestmark = pytest.mark.e2e

# One client for the module's requests: a new one per call (httpx.get) builds its TLS
# context each time, which costs more than the request on a busy machine.
HTTP = http()  # the harness's client: no kept-alive connections


def ndjson(response: httpx.Response) -> list[dict[str, Any]]:
    return [json.loads(line) for line in response.text.splitlines() if line]


def module_daemon(tmp: Path) -> Daemon:
    """A daemon of its own in `tmp`, for the tests of this module, which only read."""
    port = free_port()
    config = write_config(tmp / "indexer.toml", tmp / "data", port)
    return Daemon(config, tmp / "daemon.log", port).start()


@pytest.fixture(scope="module")
def fed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Daemon, list[Document]]]:
    """One fed daemon the tests share; it must stop cleanly after them."""
    tmp = tmp_path_factory.mktemp("fed")
    documents = list(generate(Workload(3_000, 800, 0.1, 41)))
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
    """One daemon with nothing fed, shared by the tests of requests alone; it must stop
    cleanly after them."""
    daemon = module_daemon(tmp_path_factory.mktemp("idle"))
    try:
        yield daemon
        assert daemon.stop() == 0
    finally:
        daemon.kill()


def test_at_plus_alone_waits_for_its_vector(fed: tuple[Daemon, list[Document]]) -> None:
    daemon, documents = fed
    scan = daemon.url + "/indexes/by_age/scan"
    vb = vbucket_of(documents[0].docid.encode(), 1024)
    # A vector beyond what the daemon holds: without consistency=at_plus it still waits.
    future = HTTP.get(
        scan, params={"at_plus": json.dumps({vb: 10**6}), "timeout": "0.5"}, timeout=30
    )
    assert future.status_code == 504, future.text
    assert "timed out" in future.json()["error"] and "at_plus" in future.json()["error"]
    # A vector it holds answers with the rows.
    reached = HTTP.get(scan, params={"at_plus": json.dumps({vb: 1})}, timeout=30)
    assert reached.status_code == 200 and ndjson(reached) == model(documents, ["age"])
    # With another consistency at_plus would be ignored: a 400 naming both.
    mixed = HTTP.get(scan, params={"at_plus": json.dumps({vb: 1}), "consistency": "any"})
    assert mixed.status_code == 400
    assert "at_plus" in mixed.json()["error"] and "consistency=any" in mixed.json()["error"]
    daemon.check_alive()


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


def test_unknown_query_parameters_get_a_400_naming_them(idle: Daemon) -> None:
    daemon = idle
    for path, query, named in UNKNOWN:
        response = HTTP.get(f"{daemon.url}{path}?{query}")
        assert response.status_code == 400, (path, query, response.text)
        error = response.json()["error"]
        assert "unknown query parameter" in error, error
        for name in named:
            assert name in error, error
    # The same routes without them answer.
    for path in ("/indexes/by_age/scan", "/stats", "/metrics", "/health", "/indexes/by_age"):
        assert HTTP.get(daemon.url + path).status_code == 200, path
    daemon.check_alive()


def test_parameters_a_read_would_ignore_get_a_400(idle: Daemon) -> None:
    daemon = idle
    scan = daemon.url + "/indexes/by_age/scan"
    twice = HTTP.get(scan + "?limit=1&limit=2")
    assert twice.status_code == 400 and "limit: given more than once" in twice.json()["error"]
    pinned = HTTP.get(scan, params={"pin": "p1", "consistency": "request_plus"})
    assert pinned.status_code == 400
    assert "consistency" in pinned.json()["error"] and "pin" in pinned.json()["error"]
    daemon.check_alive()


def test_the_limit_bound_in_an_error_is_an_integer(idle: Daemon) -> None:
    daemon = idle
    scan = daemon.url + "/indexes/by_age/scan"
    for bad in ("-1", str(2**63)):  # not 4.61169e+18
        answer = HTTP.get(scan, params={"limit": bad})
        assert answer.status_code == 400
        error = answer.json()["error"]
        assert f"from 0 to {2**62}, not {bad!r}" in error, error
        assert "e+" not in error
    daemon.check_alive()


def test_get_one_index(fed: tuple[Daemon, list[Document]]) -> None:
    daemon, documents = fed
    answer = HTTP.get(daemon.url + "/indexes/by_city")
    assert answer.status_code == 200, answer.text
    index = answer.json()
    assert index["name"] == "by_city" and index["keys"] == ["address.city", "age"]
    assert index["state"] == "active"
    assert index["entries"] == len(model(documents, ["address.city", "age"]))
    listed = HTTP.get(daemon.url + "/indexes").json()["indexes"]
    assert {k: v for k, v in index.items() if k in listed[0]} in listed
    missing = HTTP.get(daemon.url + "/indexes/nope")
    assert missing.status_code == 404 and "nope" in missing.json()["error"]
    wrong = HTTP.post(daemon.url + "/indexes/by_city")
    assert wrong.status_code == 405 and wrong.headers["allow"] == "GET, DELETE"
    daemon.check_alive()


def test_head_health_answers_as_get_does_without_a_body(idle: Daemon) -> None:
    daemon = idle
    head = HTTP.head(daemon.url + "/health")
    assert head.status_code == 200 and head.content == b""
    assert head.headers["content-type"] == "application/json"
    assert HTTP.head(daemon.url + "/stats").status_code == 405
    assert HTTP.get(daemon.url + "/health").json() == {"status": "ok"}
    daemon.check_alive()


def test_a_kept_alive_connection_idle_past_a_clients_expiry_is_still_answered(
    idle: Daemon,
) -> None:
    """httpx drops an idle connection after 5 s; the server must not close one sooner or at
    the same moment, or a request sent on it as it closes gets no answer (the daemon's and the
    router's HTTP servers share indexer/asgi.py)."""
    daemon = idle
    host, port = daemon.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        answers = []
        sock.sendall(f"GET /health HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
        answers.append(whole_answer(sock))
        time.sleep(6.0)  # longer than httpx's idle expiry, and hypercorn's old default
        sock.sendall(f"GET /health HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
        answers.append(whole_answer(sock))
    assert all(a.startswith(b"HTTP/1.1 200") for a in answers), answers
    daemon.check_alive()


def whole_answer(sock: socket.socket) -> bytes:
    """One chunked answer, read to its last chunk (b"" if the server closed first)."""
    data = b""
    while not data.endswith(b"0\r\n\r\n"):
        more = sock.recv(65536)
        if not more:
            break
        data += more
    return data
