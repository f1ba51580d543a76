"""The shared token against a real daemon: router handshakes and HTTP calls without it (or with
a wrong one) are refused, logged without the token, and change nothing; with it, everything
works end to end (feed, router, CLI, cluster scan, Spark helpers)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest

from indexer import protocol as p
from indexer.router import Workload, generate
from indexer.router.documents import Document
from indexer.spark import Access, IndexerSourceError, index_keys, pinned
from tests.e2e.conftest import INDEXES, Daemon, indexer_command, model, run_feed, write_jsonl
from tests.harness import http
from tests.security.conftest import (
    TOKEN,
    WRONG_TOKEN,
    RawFeed,
    bearer,
    mutation_frames,
    scan_rows,
    wait_log,
    wait_rows,
    write_token,
)

pytestmark = pytest.mark.e2e

# One client for the module's requests: a new one per call (httpx.get) builds its TLS
# context each time, which costs more than the request on a busy machine.
HTTP = http()  # the harness's client: no kept-alive connections


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if k != "INDEXER_TOKEN"}
    return subprocess.run(
        indexer_command(*args),
        capture_output=True,
        text=True,
        timeout=120,
        env={**environ, **(env or {})},
    )


def assert_empty(daemon: Daemon) -> None:
    """Nothing was applied: both indexes are empty and no mutation was taken."""
    for name in INDEXES:
        assert scan_rows(daemon.url, name, **bearer()) == []
    stats = HTTP.get(daemon.url + "/stats", headers=bearer()).json()
    assert stats["reader"]["mutations"] == 0
    assert stats["vbuckets"]["received_seqno_sum"] == 0


def test_a_handshake_without_the_token_is_refused_and_nothing_of_it_is_applied(
    daemon_factory: Any, tmp_path: Path
) -> None:
    documents = list(generate(Workload(300, 200, 0.0, 3)))
    secret = write_token(tmp_path / "token")
    daemon = daemon_factory(security={"token_file": str(secret)}).start()
    frames = mutation_frames(documents)
    for given, says in (("", "requires a token"), (WRONG_TOKEN, "token is wrong")):
        feed = RawFeed(daemon.port)
        # The handshake and the mutations behind it in one send: none may be taken.
        feed.send(p.encode(p.Handshake("intruder", 1024, (), token=given)) + frames)
        error = feed.error()
        assert error.code is p.ErrorCode.UNAUTHORIZED and says in error.message
        feed.close()
        wait_log(daemon, f"refused: {error.message} (UNAUTHORIZED)")
    assert_empty(daemon)
    # The one-shot feed: refused with one line, then accepted with the token file.
    jsonl = write_jsonl(tmp_path / "docs.jsonl", documents)
    refused = run_feed(daemon, jsonl, "--token", WRONG_TOKEN)
    assert refused.returncode == 1
    assert "UNAUTHORIZED: the handshake's token is wrong" in refused.stderr
    assert_empty(daemon)
    fed = run_feed(daemon, jsonl, "--token-file", str(secret))
    assert fed.returncode == 0, fed.stderr
    for name, paths in INDEXES.items():
        assert scan_rows(daemon.url, name) == model(documents, paths)
    log = daemon.log()
    assert log.count("(UNAUTHORIZED)") == 3
    assert TOKEN not in log and WRONG_TOKEN not in log
    assert daemon.stop() == 0


def test_the_router_streams_with_the_token_from_its_environment(
    daemon_factory: Any, routers: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    documents = list(generate(Workload(2_000, 700, 0.1, 5)))
    jsonl = write_jsonl(tmp_path / "docs.jsonl", documents)
    # The daemon reads its token from a variable named in the configuration (token_env).
    monkeypatch.setenv("TEST_DAEMON_SECRET", TOKEN)
    daemon = daemon_factory(security={"token_env": "TEST_DAEMON_SECRET"}).start()
    monkeypatch.delenv("TEST_DAEMON_SECRET")
    monkeypatch.delenv("INDEXER_TOKEN", raising=False)
    args = ["--to", daemon.address, "--jsonl", str(jsonl)]
    without = routers("--state", str(tmp_path / "r1"), *args)
    without.wait_log(r"UNAUTHORIZED: this indexer requires a token")
    wait_log(daemon, "requires a token in the handshake", count=2)  # it retries, refused again
    assert without.stop() == 0
    assert_empty(daemon)
    monkeypatch.setenv("INDEXER_TOKEN", TOKEN)
    router = routers("--state", str(tmp_path / "r2"), *args)
    router.wait_log(rf"{daemon.address}: connected")
    for name, paths in INDEXES.items():
        wait_rows(daemon.url, name, model(documents, paths))
    assert router.stop() == 0
    assert TOKEN not in daemon.log() and TOKEN not in router.log()
    assert daemon.stop() == 0


def refused(answer: httpx.Response, error: str = "") -> str:
    """The 401 answer's message, after checking its status, challenge and JSON body."""
    assert answer.status_code == 401, answer.text
    challenge = answer.headers["www-authenticate"]
    assert challenge.startswith('Bearer realm="indexer"')
    assert (f'error="{error}"' in challenge) if error else ("error=" not in challenge)
    message: str = answer.json()["error"]
    assert "Authorization: Bearer TOKEN" in message
    return message


def test_http_changes_need_the_bearer_token_and_reads_do_not(
    daemon_factory: Any, tmp_path: Path
) -> None:
    daemon = daemon_factory(security={"token": TOKEN}).start()
    url = daemon.url
    body = {"name": "by_zip", "keys": ["address.zip"]}
    assert "no Authorization header" in refused(HTTP.post(f"{url}/indexes", json=body))
    wrong = HTTP.post(f"{url}/indexes", json=body, headers=bearer(WRONG_TOKEN))
    assert "token is wrong" in refused(wrong, "invalid_token")
    basic = HTTP.post(f"{url}/indexes", json=body, headers={"Authorization": f"Basic {TOKEN}"})
    assert "not Bearer TOKEN" in refused(basic, "invalid_request")
    refused(HTTP.delete(f"{url}/indexes/by_age"))
    refused(HTTP.post(f"{url}/compact"))
    refused(HTTP.post(f"{url}/snapshots/pin", json={"snapshot": "stable"}))
    # Nothing changed, and reads need no token on this daemon.
    listed = HTTP.get(f"{url}/indexes").json()["indexes"]
    assert [i["name"] for i in listed] == list(INDEXES)
    assert HTTP.get(f"{url}/snapshots").json()["pinned"] == []
    assert HTTP.get(f"{url}/stats").json()["refused"]["unauthorized"] == 6
    log = wait_log(daemon, "refused: the Authorization header is not Bearer TOKEN")
    assert "HTTP POST '/indexes' from 127.0.0.1:" in log
    assert "HTTP DELETE '/indexes/by_age' from" in log and "HTTP POST '/compact' from" in log
    assert TOKEN not in log and WRONG_TOKEN not in log
    # The CLI: refused without the token, then with each way of giving it.
    secret = write_token(tmp_path / "token")
    no_token = cli("create-index", "by_zip", "--keys", "address.zip", "--url", url)
    assert no_token.returncode == 1 and "HTTP 401: no Authorization header" in no_token.stderr
    made = cli(
        "create-index", "by_zip", "--keys", "address.zip", "--url", url, "--token-file", str(secret)
    )
    assert made.returncode == 0 and "created by_zip(address.zip)" in made.stdout
    compacted = cli("compact", "--url", url, env={"INDEXER_TOKEN": TOKEN})
    assert compacted.returncode == 0 and "bytes_before" in json.loads(compacted.stdout)
    dropped = cli("drop-index", "by_zip", "--url", url, "--token", TOKEN)
    assert dropped.returncode == 0, dropped.stderr
    # A configuration holding the token gives the CLI its address and token at once.
    assert cli("drop-index", "by_city", "--config", str(daemon.config)).returncode == 0
    listed = cli("list-indexes", "--url", url)
    assert listed.returncode == 0 and listed.stdout.startswith("by_age\tage\tactive")
    assert "by_zip" not in listed.stdout and "by_city" not in listed.stdout
    assert TOKEN not in daemon.log()
    assert daemon.stop() == 0


def test_scan_token_required_closes_every_read_but_health(
    daemon_factory: Any, tmp_path: Path
) -> None:
    documents = list(generate(Workload(3_000, 900, 0.1, 9)))
    secret = write_token(tmp_path / "token")
    daemon = daemon_factory(
        security={"token_file": str(secret), "scan_token_required": True}
    ).start()
    fed = run_feed(
        daemon, write_jsonl(tmp_path / "docs.jsonl", documents), "--token-file", str(secret)
    )
    assert fed.returncode == 0, fed.stderr
    url = daemon.url
    for path in (
        "/indexes/by_age/scan",
        "/indexes/by_age/count",
        "/indexes/by_age/splits",
        "/indexes",
        "/stats",
        "/metrics",
        "/snapshots",
    ):
        refused(HTTP.get(url + path))
        assert HTTP.get(url + path, headers=bearer()).status_code == 200, path
    assert HTTP.get(f"{url}/health").status_code == 200
    want = model(documents, INDEXES["by_age"])
    assert scan_rows(url, "by_age", **bearer()) == want
    # The CLI scan, single node and over a one-node cluster map, with and without the token.
    plain = cli("scan", "by_age", "--url", url)
    assert plain.returncode == 1 and "HTTP 401" in plain.stderr
    scanned = cli("scan", "by_age", "--url", url, "--token-file", str(secret))
    assert scanned.returncode == 0, scanned.stderr
    assert [json.loads(line) for line in scanned.stdout.splitlines()] == want
    cluster = tmp_path / "cluster.toml"
    cluster.write_text(
        f'[nodes.a]\nfeed = "{daemon.address}"\nhttp = "127.0.0.1:{daemon.http_port}"\n'
        'vbuckets = ["0-1023"]\n'
    )
    fanned = cli("scan", "by_age", "--cluster-map", str(cluster), env={"INDEXER_TOKEN": TOKEN})
    assert fanned.returncode == 0, fanned.stderr
    assert [json.loads(line) for line in fanned.stdout.splitlines()] == want
    closed = cli("scan", "by_age", "--cluster-map", str(cluster))
    assert closed.returncode == 1 and "node a" in closed.stderr and "HTTP 401" in closed.stderr
    # The Spark source's calls carry the token too.
    assert index_keys(url, "by_age", access=Access(token=TOKEN)) == ["age"]
    with pytest.raises(IndexerSourceError, match="HTTP 401"):
        index_keys(url, "by_age")
    with pinned(url, access=Access(token=TOKEN)) as pin:
        assert pin.seqno_sum == len(documents)
        pinned_rows = HTTP.get(
            f"{url}/indexes/by_age/count", params={"pin": pin.id}, headers=bearer()
        ).json()
        assert pinned_rows["count"] == len(want)
    assert HTTP.get(f"{url}/snapshots", headers=bearer()).json()["pinned"] == []  # released
    assert TOKEN not in daemon.log()
    assert daemon.stop() == 0


def test_the_routers_own_http_changes_need_its_token(
    daemon_factory: Any, routers: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`indexer router --http` with a token: PUT, DELETE and failover need it as a bearer
    token (401, logged, nothing appended otherwise); GET /stats does not."""
    daemon = daemon_factory(security={"token": TOKEN}).start()
    monkeypatch.setenv("INDEXER_TOKEN", TOKEN)
    router = routers(
        "--state", str(tmp_path / "state"), "--to", daemon.address, "--http", "127.0.0.1:0"
    )
    (url,) = router.wait_log(r"router API on (http://\S+)")
    good = {"authorization": f"Bearer {TOKEN}"}
    doc = {"address": {"city": "Oslo"}, "age": 3}
    with httpx.Client(base_url=url, timeout=30) as client:
        for headers in ({}, {"authorization": f"Bearer {WRONG_TOKEN}"}, {"authorization": TOKEN}):
            put = client.put("/docs/a", json=doc, headers=headers)
            assert put.status_code == 401, put.text
            assert put.headers["www-authenticate"].startswith("Bearer")
            assert client.delete("/docs/a", headers=headers).status_code == 401
            assert client.post("/failover/1", headers=headers).status_code == 401
        stats = client.get("/stats").json()
        assert stats["http_refused"] == 9 and stats["source"]["high_seqno_sum"] == 0
        put = client.put("/docs/a", json=doc, headers=good)
        assert put.status_code == 200, put.text
        assert client.get("/stats").json()["source"]["high_seqno_sum"] == 1
    wait_rows(daemon.url, "by_age", model([Document("a", doc)], INDEXES["by_age"]))
    assert router.stop() == 0
    log = router.log()
    assert "refused PUT /docs/a" in log and TOKEN not in log and WRONG_TOKEN not in log
    assert daemon.stop() == 0
