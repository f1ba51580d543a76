"""TLS on both ports with a certificate the test makes (a throwaway CA): plain clients and
clients that do not trust the CA are refused; feed, router, CLI, cluster scan and the Spark
source work end to end when given the CA (and the token)."""

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
from indexer.spark import Access, index_keys
from tests.e2e.conftest import INDEXES, Daemon, indexer_command, model, run_feed, write_jsonl
from tests.security.conftest import (
    TOKEN,
    RawFeed,
    TlsFiles,
    bearer,
    https_url,
    scan_rows,
    wait_log,
    wait_rows,
    write_token,
)

pytestmark = pytest.mark.e2e


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if k != "INDEXER_TOKEN"}
    return subprocess.run(
        indexer_command(*args), capture_output=True, text=True, timeout=120, env=environ
    )


def tls_daemon(daemon_factory: Any, tls: TlsFiles, secret: Path) -> Daemon:
    security = {
        "token_file": str(secret),
        "tls_cert": str(tls.cert),
        "tls_key": str(tls.key),
        "tls_ca": str(tls.ca),  # what the CLI trusts when it reads this configuration
    }
    daemon: Daemon = daemon_factory(security=security).start()
    return daemon


def test_both_ports_speak_tls_only_and_clients_given_the_ca_work(
    daemon_factory: Any, tls_files: TlsFiles, tmp_path: Path
) -> None:
    documents = list(generate(Workload(2_500, 800, 0.1, 13)))
    secret = write_token(tmp_path / "token")
    daemon = tls_daemon(daemon_factory, tls_files, secret)
    log = wait_log(daemon, "HTTP API on https://127.0.0.1:")
    assert f"TLS with {tls_files.cert}" in log
    # Feed port: a plain client gets no frame at all, only a closed connection.
    plain = RawFeed(daemon.port)
    plain.send(p.encode(p.Handshake("plain", 1024, (), token=TOKEN)))
    with pytest.raises((EOFError, ConnectionError, p.ProtocolError)):
        plain.read()
    plain.close()
    wait_log(daemon, "refused: TLS handshake failed")
    # Over TLS the daemon speaks the protocol: the token is still required, then accepted.
    secure = RawFeed(daemon.port, tls_files.client_context())
    secure.send(p.encode(p.Handshake("tls", 1024, ())))
    assert secure.error().code is p.ErrorCode.UNAUTHORIZED
    secure.close()
    secure = RawFeed(daemon.port, tls_files.client_context())
    reply = secure.handshake(TOKEN)
    assert isinstance(reply, p.HandshakeReply) and reply.num_vbuckets == 1024
    secure.close()
    # The one-shot feed: plain, or trusting only the system's CAs, it fails with one line.
    jsonl = write_jsonl(tmp_path / "docs.jsonl", documents)
    no_tls = run_feed(daemon, jsonl, "--token-file", str(secret))
    assert no_tls.returncode == 1 and "indexer: error:" in no_tls.stderr
    untrusted = run_feed(daemon, jsonl, "--tls", "--token-file", str(secret))
    assert untrusted.returncode == 1
    assert "TLS handshake with the indexer" in untrusted.stderr
    assert "CERTIFICATE_VERIFY_FAILED" in untrusted.stderr
    fed = run_feed(daemon, jsonl, "--tls-ca", str(tls_files.ca), "--token-file", str(secret))
    assert fed.returncode == 0, fed.stderr
    # HTTP port: HTTPS only, with a certificate that chains to the test CA.
    url = https_url(daemon)
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://127.0.0.1:{daemon.http_port}/health", timeout=10)
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        httpx.get(f"{url}/health", timeout=10)
    verify = tls_files.client_context()
    assert httpx.get(f"{url}/health", verify=verify).json() == {"status": "ok"}
    want = {name: model(documents, paths) for name, paths in INDEXES.items()}
    assert scan_rows(url, "by_city", verify) == want["by_city"]
    # The CLI: from the daemon's configuration (address, token, CA), or from options.
    from_config = cli("scan", "by_age", "--config", str(daemon.config))
    assert from_config.returncode == 0, from_config.stderr
    assert [json.loads(line) for line in from_config.stdout.splitlines()] == want["by_age"]
    made = cli(
        "create-index", "by_zip", "--keys", "address.zip", "--url", url,
        "--tls-ca", str(tls_files.ca), "--token-file", str(secret),
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    unverified = cli("list-indexes", "--url", url)
    assert unverified.returncode == 1 and "CERTIFICATE_VERIFY_FAILED" in unverified.stderr
    listed = cli("list-indexes", "--url", url, "--tls-ca", str(tls_files.ca))
    assert listed.returncode == 0 and "by_zip\taddress.zip" in listed.stdout
    # A cluster scan over HTTPS.
    cluster = tmp_path / "cluster.toml"
    cluster.write_text(
        f'[nodes.a]\nfeed = "{daemon.address}"\nhttp = "127.0.0.1:{daemon.http_port}"\n'
        'vbuckets = ["0-1023"]\n'
    )
    fanned = cli("scan", "by_age", "--cluster-map", str(cluster), "--tls-ca", str(tls_files.ca))
    assert fanned.returncode == 0, fanned.stderr
    assert [json.loads(line) for line in fanned.stdout.splitlines()] == want["by_age"]
    # The Spark source's HTTP calls check the certificate with the CA they are given.
    ca_pem = tls_files.ca.read_text()
    assert index_keys(url, "by_age", access=Access(ca_pem=ca_pem)) == ["age"]
    assert daemon.stop() == 0


def test_the_router_streams_over_tls_with_the_ca_and_token(
    daemon_factory: Any, routers: Any, tls_files: TlsFiles, tmp_path: Path
) -> None:
    documents = list(generate(Workload(2_000, 600, 0.1, 17)))
    secret = write_token(tmp_path / "token")
    daemon = tls_daemon(daemon_factory, tls_files, secret)
    router = routers(
        "--state", str(tmp_path / "router"), "--to", daemon.address,
        "--jsonl", str(write_jsonl(tmp_path / "docs.jsonl", documents)),
        "--tls-ca", str(tls_files.ca), "--token-file", str(secret),
    )  # fmt: skip
    router.wait_log(rf"{daemon.address}: connected")
    verify = tls_files.client_context()
    for name, paths in INDEXES.items():
        wait_rows(https_url(daemon), name, model(documents, paths), verify)
    assert router.stop() == 0
    assert "(indexer-router) connected" in daemon.log()
    assert daemon.stop() == 0


@pytest.mark.spark
def test_spark_reads_over_tls_with_the_token(
    daemon_factory: Any, tls_files: TlsFiles, tmp_path: Path
) -> None:
    from tests.spark.stream_driver import shared_session

    documents: list[Document] = list(generate(Workload(3_000, 1_000, 0.1, 19)))
    secret = write_token(tmp_path / "token")
    security = {
        "token_file": str(secret),
        "scan_token_required": True,
        "tls_cert": str(tls_files.cert),
        "tls_key": str(tls_files.key),
    }
    daemon = daemon_factory(security=security).start()
    fed = run_feed(
        daemon, write_jsonl(tmp_path / "docs.jsonl", documents),
        "--tls-ca", str(tls_files.ca), "--token-file", str(secret),
    )  # fmt: skip
    assert fed.returncode == 0, fed.stderr
    spark = shared_session()  # the test process's (TLS and token are options of each read)

    def load(**options: str) -> Any:
        reader = spark.read.format("indexer")
        for key, value in {
            "url": https_url(daemon),
            "index": "by_age",
            "columns": "json",
            **options,
        }.items():
            reader = reader.option(key, value)
        return reader.load()

    rows = load(token_file=str(secret), tls_ca=str(tls_files.ca)).collect()
    want = model(documents, INDEXES["by_age"])
    assert len(rows) == len(want)
    assert {r["id"]: json.loads(r["age"]) for r in rows} == {e["id"]: e["key"][0] for e in want}
    with pytest.raises(Exception, match="HTTP 401"):
        load(tls_ca=str(tls_files.ca)).collect()
    with pytest.raises(Exception, match="CERTIFICATE_VERIFY_FAILED"):
        load(token=TOKEN).collect()
    assert TOKEN not in daemon.log()
    assert daemon.stop() == 0


def test_router_shards_stream_over_tls_and_the_api_checks_the_token(
    daemon_factory: Any, routers: Any, tls_files: TlsFiles, tmp_path: Path
) -> None:
    documents = list(generate(Workload(3_000, 900, 0.1, 29)))
    secret = write_token(tmp_path / "token")
    daemon = tls_daemon(daemon_factory, tls_files, secret)
    router = routers(
        "--state", str(tmp_path / "router"), "--shards", "2", "--to", daemon.address,
        "--jsonl", str(write_jsonl(tmp_path / "docs.jsonl", documents)),
        "--tls-ca", str(tls_files.ca), "--token-file", str(secret), "--http", "127.0.0.1:0",
    )  # fmt: skip
    url = router.wait_log(r"router API on (http://\S+)")[0]
    router.wait_log(rf"\[shard [01]/2\] indexer.router: {daemon.address}: connected", count=2)
    verify = tls_files.client_context()
    for name, paths in INDEXES.items():
        wait_rows(https_url(daemon), name, model(documents, paths), verify)
    # Changes through the parent need the token: the shard that owns the id checks it.
    body = {"age": 7, "address": {"city": "Oslo"}}
    without = httpx.put(f"{url}/docs/tls-1", json=body, timeout=30)
    assert without.status_code == 401 and "Bearer" in without.headers["www-authenticate"]
    with_token = httpx.put(f"{url}/docs/tls-1", json=body, headers=bearer(), timeout=30)
    assert with_token.status_code == 200, with_token.text
    documents.append(Document("tls-1", body))
    for name, paths in INDEXES.items():
        wait_rows(https_url(daemon), name, model(documents, paths), verify)
    # The shards got the token in their environment, never on their command line.
    stats = httpx.get(f"{url}/stats", timeout=30).json()
    for shard in stats["shards"]:
        with open(f"/proc/{shard['pid']}/cmdline", "rb") as f:
            assert TOKEN.encode() not in f.read()
    assert router.stop() == 0
    assert TOKEN not in router.log()
    assert daemon.stop() == 0
