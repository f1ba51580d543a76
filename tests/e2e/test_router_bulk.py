"""`POST /docs/_bulk` on a real router streaming to a real daemon: a result per line, bad lines
among good ones, read-your-writes with wait=visible, the body limit, tokens and peer ranges."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from indexer.router import Workload, generate
from indexer.router.documents import Document, vbucket_of
from tests.e2e.conftest import scan, wait_equal
from tests.harness import INDEXES, http, jsonl_lines, model

pytestmark = pytest.mark.e2e

# One client for the module's requests: a new one per call (httpx.get) builds its TLS
# context each time, which costs more than the request on a busy machine.
HTTP = http()  # the harness's client: no kept-alive connections


def bulk_body(documents: list[Document]) -> bytes:
    return "".join(jsonl_lines(documents)).encode()


def start(routers: Any, tmp_path: Path, daemon: Any, *extra: str) -> str:
    router = routers(
        "--state", str(tmp_path / "state"), "--to", daemon.address, "--http", "127.0.0.1:0",
        *extra,
    )  # fmt: skip
    url = router.wait_url()
    router.wait_log(r"connected; resuming")
    return url


def test_bulk_appends_good_lines_and_answers_each_bad_one(
    daemon_factory: Any, routers: Any, tmp_path: Path
) -> None:
    daemon = daemon_factory().start()
    url = start(routers, tmp_path, daemon)
    # More lines than the router parses in one slice (PARSE_SLICE_LINES): bad ones in each.
    documents = list(generate(Workload(5_000, 1_500, 0.1, 7)))
    lines = jsonl_lines(documents)
    bad = {
        3: "not json at all\n",
        10: '{"doc": {"age": 1}}\n',  # no id
        11: '{"id": "x::nan", "doc": {"age": NaN}}\n',
        500: '{"id": "x::exp", "doc": {"_exp": "tomorrow"}}\n',
        1999: '{"id": "", "doc": {}}\n',
        4097: "[4097]\n",
        5004: '{"id": "x::last", "doc": []}\n',
    }
    for number, line in sorted(bad.items()):
        lines.insert(number - 1, line)
    body = "".join(lines[:1000]) + "   \n" + "".join(lines[1000:])  # a blank line: no result
    answer = HTTP.post(f"{url}/docs/_bulk", content=body.encode(), timeout=60)
    assert answer.status_code == 200, answer.text
    result = answer.json()
    assert result["errors"] is True
    assert result["appended"] == len(documents) and result["failed"] == len(bad)
    items = result["items"]
    assert len(items) == len(lines)
    failed = {item["line"]: item for item in items if "error" in item}
    # Line numbers count the blank line: the bad lines after it are one further down.
    assert sorted(failed) == sorted(n if n <= 1000 else n + 1 for n in bad)
    assert "not JSON" in failed[3]["error"] and "NaN" in failed[11]["error"]
    assert failed[11]["id"] == "x::nan"
    assert "_exp" in failed[500]["error"]
    good = [item for item in items if "error" not in item]
    assert [item["id"] for item in good] == [d.docid for d in documents]
    for item in good:
        assert item["vbucket"] == vbucket_of(item["id"].encode(), 1024) and item["seqno"] > 0
    # Per vbucket, the seqnos follow line order; at_plus holds the last of each.
    last: dict[int, int] = {}
    for item in good:
        assert item["seqno"] > last.get(item["vbucket"], 0)
        last[item["vbucket"]] = item["seqno"]
    assert result["at_plus"] == {str(vb): seqno for vb, seqno in sorted(last.items())}
    wait_equal(daemon, documents)
    # A second bulk with every line bad appends nothing.
    answer = HTTP.post(f"{url}/docs/_bulk", content=b"[1]\n{}\n", timeout=30)
    assert answer.status_code == 200 and answer.json()["appended"] == 0
    assert answer.json()["at_plus"] == {}
    stats = HTTP.get(f"{url}/stats").json()["bulk"]
    assert stats == {
        "requests": 2,
        "lines": len(lines) + 2,
        "appended": len(documents),
        "failed": len(bad) + 2,
        "timeouts": 0,
    }


def test_wait_visible_answers_once_the_daemon_can_read_the_bulk(
    daemon_factory: Any, routers: Any, tmp_path: Path
) -> None:
    # Readable snapshots every 500 ms: without the wait, a scan right after would miss them.
    daemon = daemon_factory(snapshots={"in_memory_interval_ms": 500}).start()
    url = start(routers, tmp_path, daemon)
    documents: list[Document] = []
    with httpx.Client(base_url=url, timeout=60) as client:
        for round_ in range(5):
            batch = list(generate(Workload(300, 10_000, 0.0, 100 + round_)))
            batch = [Document(f"r{round_}::{d.docid}", d.body) for d in batch]
            documents += batch
            answer = client.post(
                "/docs/_bulk", content=bulk_body(batch), params={"wait": "visible"}
            )
            assert answer.status_code == 200, answer.text
            result = answer.json()
            assert result["wait"] == "visible" and result["appended"] == len(batch)
            # consistency=any: what is readable now, without waiting for anything.
            for name, paths in INDEXES.items():
                assert scan(daemon, name, "any") == model(documents, paths)
            # The at_plus vector is accepted as it is by the daemon's scans.
            at_plus = HTTP.get(
                f"{daemon.url}/indexes/by_age/count",
                params={"at_plus": json.dumps(result["at_plus"]), "timeout": "1"},
            )
            assert at_plus.status_code == 200, at_plus.text
            assert at_plus.json()["count"] == len(model(documents, INDEXES["by_age"]))


def test_wait_visible_with_the_node_down_times_out_with_504_and_keeps_the_lines(
    daemon_factory: Any, routers: Any, tmp_path: Path
) -> None:
    daemon = daemon_factory().start()
    url = start(routers, tmp_path, daemon)
    assert daemon.stop() == 0
    documents = [Document(f"d{i}", {"age": i, "address": {"city": "Lima"}}) for i in range(50)]
    answer = HTTP.post(
        f"{url}/docs/_bulk",
        content=bulk_body(documents),
        params={"wait": "visible", "timeout": "1"},
        timeout=30,
    )
    assert answer.status_code == 504, answer.text
    result = answer.json()
    assert result["appended"] == 50 and "not readable within 1 s" in result["error"]
    assert daemon.address in result["error"]
    daemon.start()  # the appended lines were kept: the node gets them when it is back
    wait_equal(daemon, documents)
    assert HTTP.get(f"{url}/stats").json()["bulk"]["timeouts"] == 1


def test_wait_visible_by_the_majority_rule_answers_with_one_of_three_owners_down(
    daemon_factory: Any, routers: Any, tmp_path: Path
) -> None:
    # Three nodes that each receive every vbucket: its three owners. One is stopped.
    daemons = [daemon_factory().start() for _ in range(3)]
    router = routers(
        "--state", str(tmp_path / "state"), *(a for d in daemons for a in ("--to", d.address)),
        "--http", "127.0.0.1:0", "--ack", "majority",
    )  # fmt: skip
    url = router.wait_url()
    for daemon in daemons:
        router.wait_log(rf"{daemon.address}.*connected; resuming")
    assert daemons[2].stop() == 0
    documents = [Document(f"m{i}", {"age": i, "address": {"city": "Oslo"}}) for i in range(200)]
    answer = HTTP.post(
        f"{url}/docs/_bulk",
        content=bulk_body(documents),
        params={"wait": "visible", "timeout": "20"},
        timeout=60,
    )
    assert answer.status_code == 200, answer.text  # two of the three owners read it
    for daemon in daemons[:2]:
        assert scan(daemon, "by_age", "any") == model(documents, INDEXES["by_age"])
    daemons[2].start()  # the third catches up from the router's log
    wait_equal(daemons[2], documents)


def test_bulk_refusals_name_the_limit_the_parameter_and_the_token(
    daemon_factory: Any, routers: Any, tmp_path: Path
) -> None:
    daemon = daemon_factory().start()
    url = start(routers, tmp_path, daemon, "--bulk-max-mb", "0.01")
    too_big = bulk_body([Document(f"big{i}", {"age": i, "pad": "x" * 200}) for i in range(100)])
    answer = HTTP.post(f"{url}/docs/_bulk", content=too_big, timeout=30)
    assert answer.status_code == 413
    assert f"the body is over the bulk limit of {int(0.01 * (1 << 20))} bytes" in answer.text
    for query, message in (
        ({"wait": "never"}, "wait must be persisted or visible"),
        ({"refresh": "true"}, "unknown parameter 'refresh'"),
        ({"timeout": "-1"}, "timeout must be above 0"),
    ):
        answer = HTTP.post(f"{url}/docs/_bulk", content=b"", params=query, timeout=30)
        assert answer.status_code == 400 and message in answer.json()["error"], answer.text
    # GET /docs/_bulk is no bulk; PUT /docs/_bulk is the document "_bulk".
    assert HTTP.put(f"{url}/docs/_bulk", json={"age": 3}).status_code == 200
    wait_equal(daemon, [Document("_bulk", {"age": 3})])
    assert HTTP.get(f"{url}/stats").json()["bulk"]["requests"] == 0


def test_bulk_needs_the_token_and_a_peer_refuses_lines_of_other_vbuckets(
    daemon_factory: Any, routers: Any, tmp_path: Path
) -> None:
    token = "bulk-secret-token-0123456789"
    daemon = daemon_factory(security={"token": token}).start()
    url = start(
        routers, tmp_path, daemon, "--token", token, "--vbucket-range", "0-511", "--vbuckets",
        "1024",
    )  # fmt: skip
    documents = [Document(f"p{i}", {"age": i % 50}) for i in range(400)]
    body = bulk_body(documents)
    refused = HTTP.post(f"{url}/docs/_bulk", content=body, timeout=30)
    assert refused.status_code == 401 and "Bearer" in refused.text
    answer = HTTP.post(
        f"{url}/docs/_bulk",
        content=body,
        headers={"authorization": f"Bearer {token}"},
        timeout=30,
    )
    assert answer.status_code == 200, answer.text
    mine = [d for d in documents if vbucket_of(d.docid.encode(), 1024) <= 511]
    result = answer.json()
    assert result["appended"] == len(mine) and result["failed"] == len(documents) - len(mine)
    for item in result["items"]:
        if "error" in item:
            assert "is not among this router's vbuckets 0-511" in item["error"], item
    wait_equal(daemon, mine)


def test_a_sharded_router_takes_a_bulk_at_the_parent_and_at_any_shard(
    daemon_factory: Any, routers: Any, tmp_path: Path
) -> None:
    token = "bulk-shards-token-0123456789"
    daemon = daemon_factory(security={"token": token}).start()
    router = routers(
        "--state", str(tmp_path / "state"), "--shards", "2", "--to", daemon.address,
        "--http", "127.0.0.1:0", "--token", token,
    )  # fmt: skip
    url = router.wait_url()
    router.wait_log(r"connected; resuming", 2)
    auth = {"authorization": f"Bearer {token}"}
    shards = HTTP.get(f"{url}/stats").json()["shards"]
    assert [s["vbuckets"] for s in shards] == ["vbuckets 0-511", "vbuckets 512-1023"]
    documents: list[Document] = []
    # The parent, then each shard, with lines of both shards and a bad line in the middle.
    for target, seed in ((url, 1), (shards[0]["url"], 2), (shards[1]["url"], 3)):
        batch = [
            Document(f"s{seed}::{d.docid}", d.body)
            for d in generate(Workload(600, 10_000, 0.0, seed))
        ]
        lines = jsonl_lines(batch)
        lines.insert(300, "{broken\n")
        answer = HTTP.post(
            f"{target}/docs/_bulk",
            content="".join(lines).encode(),
            params={"wait": "visible"},
            headers=auth,
            timeout=60,
        )
        assert answer.status_code == 200, answer.text
        result = answer.json()
        assert result["appended"] == len(batch) and result["failed"] == 1
        assert [i["line"] for i in result["items"]] == list(range(1, len(lines) + 1))
        assert result["items"][300] == {"line": 301, "error": result["items"][300]["error"]}
        assert {int(vb) // 512 for vb in result["at_plus"]} == {0, 1}  # both shards had lines
        documents += batch
        for name, paths in INDEXES.items():  # readable at once: both shards waited
            assert scan(daemon, name, "any") == model(documents, paths)
    refused = HTTP.post(f"{url}/docs/_bulk", content=b'{"id":"a","doc":{}}\n', timeout=30)
    assert refused.status_code == 401
    stats = HTTP.get(f"{url}/stats").json()
    # A shard's foreign lines went through the parent to the other shard: counted where appended.
    assert stats["bulk"]["appended"] == len(documents) and stats["bulk"]["failed"] == 3
    assert router.stop() == 0
    wait_equal(daemon, documents)
