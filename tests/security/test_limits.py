"""The limits against abuse, each against a real daemon: frame size, feed connections and the
handshake deadline, concurrent scans, rows per scan, and the validation of index names and
paths (HTTP 400, CLI exit 2)."""

from __future__ import annotations

import json
import struct
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from indexer import protocol as p
from indexer.router import Workload, generate
from tests.e2e.conftest import INDEXES, Daemon, indexer_command, model, run_feed, write_jsonl
from tests.security.conftest import RawFeed, TlsFiles, scan_rows, wait_log

pytestmark = pytest.mark.e2e


def stats(daemon: Daemon) -> dict[str, Any]:
    answer: dict[str, Any] = httpx.get(f"{daemon.url}/stats", timeout=30).json()
    return answer


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(indexer_command(*args), capture_output=True, text=True, timeout=120)


def test_a_frame_over_max_frame_bytes_is_refused_from_its_header(
    daemon_factory: Any, tmp_path: Path
) -> None:
    daemon = daemon_factory(server={"max_frame_bytes": 4096}).start()
    feed = RawFeed(daemon.port)
    reply = feed.handshake()
    assert isinstance(reply, p.HandshakeReply) and reply.max_frame_bytes == 4096
    # Only the 6-byte header of a 1 MiB frame: the answer must not wait for its payload.
    feed.send(struct.pack(">IBB", 1 << 20, p.VERSION, p.MessageType.MUTATIONS))
    started = time.monotonic()
    error = feed.error()
    assert time.monotonic() - started < 5
    assert error.code is p.ErrorCode.FRAME_TOO_LARGE
    assert error.message == "frame of 1048576 bytes exceeds the maximum of 4096"
    wait_log(daemon, f"refused: {error.message} (FRAME_TOO_LARGE)")
    assert stats(daemon)["reader"]["mutations"] == 0
    # The reference router keeps its frames within the advertised maximum.
    documents = list(generate(Workload(1_500, 500, 0.1, 23)))
    fed = run_feed(daemon, write_jsonl(tmp_path / "docs.jsonl", documents))
    assert fed.returncode == 0, fed.stderr
    for name, paths in INDEXES.items():
        assert scan_rows(daemon.url, name) == model(documents, paths)
    assert daemon.stop() == 0


def test_connections_over_the_limit_and_silent_ones_are_closed(
    daemon_factory: Any, tmp_path: Path
) -> None:
    daemon = daemon_factory(
        limits={"max_feed_connections": 2, "handshake_timeout_ms": 1000}
    ).start()
    first, second = RawFeed(daemon.port), RawFeed(daemon.port)
    # Disjoint vbuckets: a node refuses a second claim on a vbucket (STREAM_EXISTS).
    assert isinstance(first.handshake(vbuckets=range(512)), p.HandshakeReply)
    assert isinstance(second.handshake(vbuckets=range(512, 1024)), p.HandshakeReply)
    third = RawFeed(daemon.port)
    error = third.error()  # at once, without sending anything
    assert error.code is p.ErrorCode.TOO_MANY_CONNECTIONS
    assert "limits.max_feed_connections" in error.message
    third.close()
    wait_log(daemon, "(limits.max_feed_connections) (TOO_MANY_CONNECTIONS)")
    jsonl = write_jsonl(tmp_path / "docs.jsonl", list(generate(Workload(50, 50, 0.0, 1))))
    full = run_feed(daemon, jsonl)
    assert full.returncode == 1 and "TOO_MANY_CONNECTIONS" in full.stderr
    first.close()
    deadline = time.monotonic() + 10
    while stats(daemon)["reader"]["connections"] != 1:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    # A connection that never handshakes holds its slot only until the deadline.
    silent = RawFeed(daemon.port)
    started = time.monotonic()
    error = silent.error()
    waited = time.monotonic() - started
    assert error.code is p.ErrorCode.BAD_HANDSHAKE
    assert error.message.startswith("no HANDSHAKE within 1 s of connecting")
    assert 0.8 < waited < 8, waited
    silent.close()
    wait_log(daemon, "no HANDSHAKE within 1 s of connecting (limits.handshake_timeout_ms)")
    fourth = RawFeed(daemon.port)
    assert isinstance(fourth.handshake(vbuckets=range(512)), p.HandshakeReply)  # first's
    for feed in (second, fourth):
        feed.close()
    assert daemon.stop() == 0


def test_scans_over_max_concurrent_scans_get_429(daemon_factory: Any, tmp_path: Path) -> None:
    daemon = daemon_factory(limits={"max_concurrent_scans": 1}).start()
    documents = list(generate(Workload(500, 300, 0.0, 29)))
    assert run_feed(daemon, write_jsonl(tmp_path / "docs.jsonl", documents)).returncode == 0
    scan = f"{daemon.url}/indexes/by_age/scan"
    answers: list[httpx.Response] = []

    def waiting_scan() -> None:  # holds the only place until its 5 s timeout
        params = {"consistency": "at_plus", "at_plus": '{"0": 1000000000}', "timeout": "5"}
        answers.append(httpx.get(scan, params=params, timeout=30))

    holder = threading.Thread(target=waiting_scan)
    holder.start()
    try:
        deadline = time.monotonic() + 10
        while stats(daemon)["scans_in_flight"] != 1:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        for path in ("scan", "count", "splits"):
            answer = httpx.get(f"{daemon.url}/indexes/by_age/{path}", timeout=30)
            assert answer.status_code == 429, answer.text
            assert answer.headers["retry-after"] == "1"
            assert "limits.max_concurrent_scans" in answer.json()["error"]
        assert httpx.get(f"{daemon.url}/stats").status_code == 200  # not a scan: served
    finally:
        holder.join()
    assert answers[0].status_code == 504
    assert scan_rows(daemon.url, "by_age") == model(documents, INDEXES["by_age"])
    assert stats(daemon)["refused"]["too_many_scans"] == 3
    wait_log(daemon, "scan refused: 1 scans running (limits.max_concurrent_scans)")
    assert daemon.stop() == 0


def test_scans_over_max_scan_rows_are_refused_up_front_with_413(
    daemon_factory: Any, tmp_path: Path
) -> None:
    daemon = daemon_factory(limits={"max_scan_rows": 100}).start()
    documents = list(generate(Workload(1_500, 800, 0.1, 31)))
    assert run_feed(daemon, write_jsonl(tmp_path / "docs.jsonl", documents)).returncode == 0
    want = model(documents, INDEXES["by_age"])
    assert len(want) > 100
    scan = f"{daemon.url}/indexes/by_age/scan"
    over = httpx.get(scan, params={"limit": "101", "consistency": "request_plus"})
    assert over.status_code == 413
    assert over.json()["error"].startswith("limit=101 is over the 100 rows a scan may return")
    for headers in ({}, {"Accept": "application/vnd.apache.arrow.stream"}):
        whole = httpx.get(scan, params={"consistency": "request_plus"}, headers=headers)
        assert whole.status_code == 413 and whole.headers["content-type"] == "application/json"
        assert "the range holds more than the 100 rows" in whole.json()["error"]
    at_most = httpx.get(scan, params={"limit": "100"})
    assert [json.loads(line) for line in at_most.text.splitlines()] == want[:100]
    # A range holding fewer rows needs no limit; counts are not limited.
    age = want[0]["key"][0]
    narrow = httpx.get(scan, params={"eq": json.dumps(age)})
    assert narrow.status_code == 200, narrow.text
    assert [json.loads(line) for line in narrow.text.splitlines()] == [
        e for e in want if e["key"] == [age]
    ]
    count = httpx.get(f"{daemon.url}/indexes/by_age/count").json()["count"]
    assert count == len(want)
    refused = cli("scan", "by_age", "--url", daemon.url)
    assert refused.returncode == 1 and "HTTP 413: the range holds more than" in refused.stderr
    limited = cli("scan", "by_age", "--url", daemon.url, "--limit", "100")
    assert limited.returncode == 0 and len(limited.stdout.splitlines()) == 100
    assert stats(daemon)["refused"]["too_many_rows"] == 4
    assert daemon.stop() == 0


def test_index_names_and_paths_are_checked_with_clear_errors(
    daemon_factory: Any, tmp_path: Path
) -> None:
    daemon = daemon_factory().start()
    url = daemon.url
    long_name = "a" * 65
    for method, path, shown in (
        ("GET", "/indexes/bad-name/scan", "'bad-name'"),
        ("GET", f"/indexes/{long_name}/count", f"'{long_name}'"),
        ("GET", "/indexes/%2E%2E/scan", "'..'"),  # decoded to ".." by the server
        ("DELETE", "/indexes/1abc", "'1abc'"),
        ("DELETE", "/indexes/..%2Fcompact", "'..'"),
    ):
        answer = httpx.request(method, url + path)
        assert answer.status_code == 400, (path, answer.text)
        message = answer.json()["error"]
        assert message == (
            f"index name {shown}: a letter, then up to 63 letters, digits or _ (or #primary)"
        )
    assert httpx.get(f"{url}/indexes/by_age/other").status_code == 404
    made = httpx.post(f"{url}/indexes", json={"name": "../x", "keys": ["a"]})
    assert made.status_code == 400 and made.json()["error"].startswith("name:")
    assert [i["name"] for i in httpx.get(f"{url}/indexes").json()["indexes"]] == list(INDEXES)
    # The CLI refuses such names before any request (exit 2, one line).
    for args in (
        ("drop-index", "../compact", "--url", url),
        ("create-index", "a/b", "--keys", "x", "--url", url),
        ("scan", "x..y", "--url", url),
        ("dump", "../etc"),
    ):
        answer = cli(*args)
        assert answer.returncode == 2, args
        assert answer.stderr.startswith(f"indexer: error: index name '{args[1]}': a letter")
    assert daemon.stop() == 0
    # Data directories and security files may not climb out with "..".
    for args, key in (
        (("serve", "--data-dir", "data/../../elsewhere"), "--data-dir"),
        (("compact", "--data-dir", "../data"), "--data-dir"),
        (("dump", "by_age", "--data-dir", "x/../../y"), "--data-dir"),
    ):
        answer = cli(*args)
        assert answer.returncode == 2, (args, answer.stderr)
        assert f"indexer: error: {key}: " in answer.stderr and "contains '..'" in answer.stderr
    for section, key, value in (
        ("server", "data_dir", "../outside"),
        ("security", "token_file", "secrets/../../token"),
        ("security", "tls_ca", "../ca.pem"),
    ):
        config = tmp_path / f"{key}.toml"
        config.write_text(f'[{section}]\n{key} = "{value}"\n')
        answer = cli("serve", "--config", str(config))
        assert answer.returncode == 2, answer.stderr
        assert answer.stderr == (
            f"indexer: error: {section}.{key}: '{value}' contains '..': give the path without "
            "parent steps (an absolute path, or one below the working directory)\n"
        )


def test_a_silent_plain_connection_is_closed_on_a_tls_port_too(
    daemon_factory: Any, tls_files: TlsFiles
) -> None:
    security = {"tls_cert": str(tls_files.cert), "tls_key": str(tls_files.key)}
    daemon = daemon_factory(security=security, limits={"handshake_timeout_ms": 500}).start()
    silent = RawFeed(daemon.port)  # neither a TLS nor a protocol handshake
    started = time.monotonic()
    with pytest.raises((EOFError, ConnectionError)):
        silent.read()
    assert time.monotonic() - started < 8
    silent.close()
    wait_log(daemon, "no HANDSHAKE within 0.5 s of connecting")
    assert daemon.stop() == 0
