"""A node indexes one source's history: a router or feed of another source is refused with one
line on both sides and nothing rolled back, and a takeover is an explicit operator action."""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from indexer.router import Workload, generate
from tests.e2e.conftest import indexer_command, run_feed, wait_equal, write_jsonl
from tests.harness import http

pytestmark = pytest.mark.e2e

# One client for the module's requests: a new one per call (httpx.get) builds its TLS
# context each time, which costs more than the request on a busy machine.
HTTP = http()  # the harness's client: no kept-alive connections


def feed_state(state: Path, jsonl: Path, address: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        indexer_command("feed", "--state", str(state), "--jsonl", str(jsonl), "--to", address),
        capture_output=True,
        text=True,
        timeout=120,
    )


def loaded(daemon_factory: Any, tmp_path: Path, workload: Workload) -> tuple[Any, list[Any], str]:
    """A daemon that `indexer feed --state` loaded: it, the documents and its source."""
    daemon = daemon_factory().start()
    documents = list(generate(workload))
    fed = feed_state(tmp_path / "a", write_jsonl(tmp_path / "a.jsonl", documents), daemon.address)
    assert fed.returncode == 0, fed.stderr
    wait_equal(daemon, documents)
    return daemon, documents, daemon.stats(HTTP)["source"]


def test_a_router_of_another_source_is_refused_and_nothing_is_rolled_back(
    daemon_factory: Any, routers: Any, tmp_path: Path
) -> None:
    daemon, first, source = loaded(daemon_factory, tmp_path, Workload(3_000, 900, 0.1, 1))
    assert re.fullmatch(r"[0-9a-f]{32}", source), source
    # A fresh router state is another source, though its documents overlap.
    second = list(generate(Workload(2_000, 900, 0.1, 2)))
    router = routers(
        "--state", str(tmp_path / "b"), "--jsonl", str(write_jsonl(tmp_path / "b.jsonl", second)),
        "--to", daemon.address, "--http", "127.0.0.1:0",
    )  # fmt: skip
    (url,) = router.wait_log(r"router API on (http://\S+)")
    (line,) = router.wait_log(r"stopped streaming to this node: .*")
    assert f"indexes the history of source log {source}" in line and "--adopt-source" in line
    node = HTTP.get(f"{url}/stats", timeout=30).json()["nodes"][daemon.address]
    assert node["stopped"] is True and source in node["last_error"]
    metrics = HTTP.get(f"{url}/metrics", timeout=30).text
    assert f'indexer_router_node_stopped{{node="{daemon.address}"}} 1.0' in metrics
    time.sleep(6)  # longer than the longest backoff: no retry loop
    assert router.log().count(daemon.address) <= 3, router.log()
    assert len(re.findall(r"stopped streaming", router.log())) == 1
    assert daemon.log().count("SOURCE_MISMATCH") == 1
    assert "rolled back to" not in daemon.log() and "diverged" not in daemon.log()
    wait_equal(daemon, first)  # what the first source gave is all there
    # The stateless feed is a source of its own: refused too, with a non-zero exit.
    extra = write_jsonl(tmp_path / "c.jsonl", second[:10])
    out = run_feed(daemon, extra)
    assert out.returncode != 0
    (message,) = out.stderr.strip().splitlines()
    assert "the stateless feed" in message and source in message, message
    wait_equal(daemon, first)
    assert router.stop() == 0 and daemon.stop() == 0


def test_a_stateless_feed_is_refused_by_a_node_that_a_router_feeds(
    daemon_factory: Any, routers: Any, tmp_path: Path
) -> None:
    daemon = daemon_factory().start()
    router = routers(
        "--state", str(tmp_path / "state"), "--to", daemon.address, "--http", "127.0.0.1:0"
    )
    (url,) = router.wait_log(r"router API on (http://\S+)")
    router.wait_log(r"connected; resuming")
    documents = list(generate(Workload(200, 100, 0.0, 5)))
    with httpx.Client(base_url=url, timeout=30) as client:
        for document in documents[:100]:
            assert client.put(f"/docs/{document.docid}", json=document.body).status_code == 200
    wait_equal(daemon, documents[:100])
    out = run_feed(daemon, write_jsonl(tmp_path / "one.jsonl", documents[100:101]))
    assert out.returncode != 0 and "refused" in out.stderr, out
    # The router's later writes, in the same vbuckets or not, are all indexed.
    with httpx.Client(base_url=url, timeout=30) as client:
        for document in documents[100:]:
            assert client.put(f"/docs/{document.docid}", json=document.body).status_code == 200
    wait_equal(daemon, documents)
    assert "stopped streaming" not in router.log()
    assert router.stop() == 0 and daemon.stop() == 0


def test_adopt_source_takes_a_node_over_explicitly(
    daemon_factory: Any, routers: Any, tmp_path: Path
) -> None:
    daemon, old, old_source = loaded(daemon_factory, tmp_path, Workload(2_000, 700, 0.1, 11))
    assert daemon.stop() == 0
    daemon.args = ["--adopt-source"]
    daemon.start()
    # The node says what it will drop before anything is dropped.
    (entries,) = re.findall(r"--adopt-source: .* the (\d+) index entries it holds", daemon.log())
    assert int(entries) > 0
    new = list(generate(Workload(1_500, 500, 0.1, 12)))
    router = routers(
        "--state", str(tmp_path / "b"), "--jsonl", str(write_jsonl(tmp_path / "b.jsonl", new)),
        "--to", daemon.address,
    )  # fmt: skip
    wait_equal(daemon, new)  # only the new source's documents
    assert "takes this node over (--adopt-source)" in daemon.log()
    new_source = daemon.stats(HTTP)["source"]
    assert new_source != old_source
    assert router.stop() == 0 and daemon.stop() == 0
    # Taken over for good: the old source is refused after a restart without the flag.
    daemon.args = []
    daemon.start()
    again = feed_state(tmp_path / "a", write_jsonl(tmp_path / "a2.jsonl", old[:5]), daemon.address)
    assert again.returncode != 0 and new_source in again.stderr, again
    wait_equal(daemon, new)
    assert daemon.stop() == 0
