"""Peer routers of one source (`indexer router --vbucket-range`): each reads the same input and
streams only its vbuckets into the same daemon; a router claiming vbuckets another one streams
is refused before anything of it is applied."""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from indexer.router import Workload, generate
from indexer.router.documents import Document, vbucket_of
from tests.e2e.conftest import wait_equal, write_jsonl
from tests.harness import http

pytestmark = pytest.mark.e2e

# One client for the module's requests: a new one per call (httpx.get) builds its TLS
# context each time, which costs more than the request on a busy machine.
HTTP = http()  # the harness's client: no kept-alive connections

HALVES = ("0-511", "512-1023")


def docid_in(half: int, prefix: str) -> str:
    """A document id whose vbucket is in the given half of 1024."""
    for i in range(10_000):
        docid = f"{prefix}-{i}"
        if (vbucket_of(docid.encode(), 1024) >= 512) == bool(half):
            return docid
    raise AssertionError("no such id")


def test_two_peers_split_one_input_and_a_third_claim_is_refused(
    daemon_factory: Any, routers: Any, tmp_path: Path
) -> None:
    daemon = daemon_factory().start()
    documents = list(generate(Workload(4_000, 1_500, 0.1, 31)))
    jsonl = write_jsonl(tmp_path / "in.jsonl", documents)
    source_id = uuid.uuid4().hex
    peers = []
    for i, half in enumerate(HALVES):
        peer = routers(
            "--state", str(tmp_path / f"peer{i}"), "--vbucket-range", half,
            "--source-id", source_id, "--jsonl", str(jsonl), "--to", daemon.address,
            "--http", "127.0.0.1:0",
        )  # fmt: skip
        peers.append(peer)
    urls = [peer.wait_log(r"router API on (http://\S+)")[0] for peer in peers]
    for peer in peers:
        peer.wait_log(r"in other routers' vbuckets: left to them")
    wait_equal(daemon, documents)
    stats = [HTTP.get(f"{url}/stats", timeout=30).json() for url in urls]
    assert [s["vbuckets"] for s in stats] == ["vbuckets 0-511", "vbuckets 512-1023"]
    assert sum(s["foreign_documents"] for s in stats) == len(documents)
    # PUT goes to the router that owns the document's vbucket; the other says which it is not.
    for half, url in enumerate(urls):
        mine, theirs = docid_in(half, "put"), docid_in(1 - half, "put")
        body = {"age": 40 + half, "address": {"city": "Lima"}}
        refused = HTTP.put(f"{url}/docs/{theirs}", json=body, timeout=30)
        assert refused.status_code == 421 and "not among this router's" in refused.text
        assert HTTP.put(f"{url}/docs/{mine}", json=body, timeout=30).status_code == 200
        documents.append(Document(mine, body))
        # A failover of one of its vbuckets, on the peer that owns it only.
        vb = vbucket_of(mine.encode(), 1024)
        assert HTTP.post(f"{urls[1 - half]}/failover/{vb}", timeout=30).status_code == 421
        assert HTTP.post(f"{url}/failover/{vb}", timeout=30).status_code == 200
    wait_equal(daemon, documents)
    # A third router of the same source claiming every vbucket: refused at its handshake.
    other = list(generate(Workload(500, 500, 0.0, 77)))
    third = routers(
        "--state", str(tmp_path / "third"), "--source-id", source_id,
        "--jsonl", str(write_jsonl(tmp_path / "other.jsonl", other)), "--to", daemon.address,
    )  # fmt: skip
    third.wait_log(r"streamed by another connection")
    time.sleep(1)
    wait_equal(daemon, documents)  # nothing of the third router's documents
    assert "STREAM_EXISTS" in daemon.log()
    assert third.stop() == 0
    for peer in peers:
        assert peer.stop() == 0
        assert "disconnected" not in peer.log()
    assert daemon.stop() == 0
