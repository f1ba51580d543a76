"""Expiry end to end: documents with `_exp` leave every index once they expire, with no delete
in the router's input (the router's expiry pager deletes them). Real processes."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from indexer.router import Workload, generate
from indexer.router.documents import Document
from tests.e2e.conftest import wait_equal, write_jsonl
from tests.harness import http

pytestmark = pytest.mark.e2e


def test_expired_documents_leave_every_index_without_a_delete_in_the_input(
    daemon_factory: Any, routers: Any, tmp_path: Path
) -> None:
    daemon = daemon_factory().start()
    lasting = list(generate(Workload(2_000, 800, 0.1, 501)))
    # 200 documents expire 4 s after they are appended; "exp:keep" in 60 s, but gets a version
    # without expiry before that, which stays.
    expiring = [
        Document(f"exp:{i}", {"age": i % 90, "address": {"city": "Oslo"}, "_exp": 4})
        for i in range(200)
    ]
    keep = Document("exp:keep", {"age": 5, "address": {"city": "Rome"}, "_exp": 60})
    documents = lasting + expiring + [keep]
    jsonl = write_jsonl(tmp_path / "in.jsonl", documents)
    router = routers(
        "--state", str(tmp_path / "state"), "--jsonl", str(jsonl), "--follow",
        "--http", "127.0.0.1:0", "--to", daemon.address,
    )  # fmt: skip
    (url,) = router.wait_log(r"router API on (http://\S+)")
    started = time.monotonic()
    wait_equal(daemon, documents)  # readable before they expire
    assert time.monotonic() - started < 4, "too slow to see them before they expire"
    kept = Document("exp:keep", {"age": 6, "address": {"city": "Rome"}})
    answer = http().put(f"{url}/docs/exp:keep", json=kept.body)
    assert answer.status_code == 200, answer.text
    bad = http().put(f"{url}/docs/x", json={"_exp": "soon"})
    assert bad.status_code == 400 and "_exp" in bad.json()["error"]
    gone = [Document(d.docid, None) for d in expiring]
    wait_equal(daemon, lasting + gone + [kept])
    stats = http().get(f"{url}/stats").json()["expiry"]
    assert stats["expired"] == len(expiring) and stats["pending"] == 0, stats
    assert "expired" in router.log()
    with open(jsonl) as f:  # the input never deleted them
        lines = [json.loads(line) for line in f]
    assert not any(item.get("deleted") for item in lines if item["id"].startswith("exp:"))
    assert router.stop() == 0
    assert daemon.stop() == 0
