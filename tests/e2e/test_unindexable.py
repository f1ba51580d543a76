"""Documents no index key can hold (NaN, infinities, numbers beyond a double, deep nesting) and
keys over a node's frame: refused at every input with the line or status that says why, and
never a stream stopped by one, even when an older source log holds such a version."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from indexer.router.documents import Document
from indexer.router.source.log import SourceLog
from tests.e2e.conftest import (
    INDEXES,
    WAIT_S,
    indexer_command,
    model,
    run_feed,
    scan,
    wait_equal,
    write_jsonl,
)

pytestmark = pytest.mark.e2e

# Each value, written as Python's JSON parser accepts it, at an index path and elsewhere.
BAD_VALUES = ["NaN", "Infinity", "-Infinity", "1e400", "-1e400", "9" * 400]


def bad_lines(prefix: str) -> list[str]:
    lines = []
    for i, value in enumerate(BAD_VALUES):
        lines.append(f'{{"id": "{prefix}-age-{i}", "doc": {{"age": {value}}}}}')
        lines.append(
            f'{{"id": "{prefix}-extra-{i}", "doc": {{"age": 3, "extra": {{"deep": [{value}]}}}}}}'
        )
    lines.append(f'{{"id": "{prefix}-nested", "doc": {{"age": 1, "x": {"[" * 200}{"]" * 200}}}}}')
    return lines


def good(prefix: str, count: int) -> list[Document]:
    return [
        Document(f"{prefix}-{i}", {"age": i, "address": {"city": ["Oslo", "Rome"][i % 2]}})
        for i in range(count)
    ]


def as_line(document: Document) -> str:
    return json.dumps({"id": document.docid, "doc": document.body})


def test_the_router_refuses_them_on_every_input_and_streams_the_rest(
    daemon_factory: Any, routers: Any, tmp_path: Path
) -> None:
    daemon = daemon_factory().start()
    first = good("file", 20)
    bad = bad_lines("file")
    jsonl = tmp_path / "in.jsonl"
    jsonl.write_text("\n".join([*bad, *map(as_line, first)]) + "\n")
    router = routers(
        "--state", str(tmp_path / "state"), "--jsonl", str(jsonl), "--follow",
        "--to", daemon.address, "--http", "127.0.0.1:0",
    )  # fmt: skip
    (url,) = router.wait_log(r"router API on (http://\S+)")
    errors = router.wait_log(rf"ERROR .*{jsonl.name}:(\d+): ", len(bad))
    assert sorted(map(int, errors)) == list(range(1, len(bad) + 1))
    assert "NaN is not a value an index key can hold" in router.log()
    assert "1e400 is beyond a double" in router.log()
    assert "nest deeper than 128 levels" in router.log()
    # A followed file: bad lines appended later are refused the same way.
    followed = bad_lines("followed")
    more = good("followed", 10)
    with open(jsonl, "a") as f:
        f.write("\n".join([*followed, *map(as_line, more)]) + "\n")
    router.wait_log(rf"ERROR .*{jsonl.name}:(\d+): ", len(bad) + len(followed))
    # PUT: 400 with the reason, nothing appended.
    put = good("put", 5)
    with httpx.Client(base_url=url, timeout=30) as client:
        for line in bad_lines("put"):
            item = json.loads(line.replace("NaN", "0").replace("Infinity", "0"))  # the id
            body = line.split('"doc": ', 1)[1][:-1]
            answer = client.put(f"/docs/{item['id']}", content=body)
            assert answer.status_code == 400, (body, answer.text)
            assert "cannot be indexed" in answer.json()["error"]
        for document in put:
            assert client.put(f"/docs/{document.docid}", json=document.body).status_code == 200
    wait_equal(daemon, first + more + put)
    assert router.stop() == 0
    assert "disconnected" not in router.log()
    assert daemon.stop() == 0


def lines_for(stateful: bool, every: bool) -> list[str]:
    """The bad lines one feed mode is given. Both modes read the input with the same parser
    (read_jsonl): unless `every`, each value goes to each mode once, at an index path in one and
    elsewhere in the other (lines 4k and 4k+3 without state, 4k+1 and 4k+2 with it)."""
    lines = bad_lines("x")
    if every:
        return lines
    return [line for j, line in enumerate(lines) if (j % 4 in (1, 2)) == stateful]


@pytest.mark.parametrize("every", [pytest.param(False), pytest.param(True, marks=pytest.mark.soak)])
def test_feed_refuses_them_with_the_line_and_goes_on_after_a_fix(
    daemon_factory: Any, tmp_path: Path, every: bool
) -> None:
    daemon = daemon_factory().start()
    documents = good("doc", 30)
    for stateful in (False, True):
        state = ["--state", str(tmp_path / "state")] if stateful else []
        for line in lines_for(stateful, every):
            jsonl = tmp_path / "bad.jsonl"
            jsonl.write_text(as_line(documents[0]) + "\n" + line + "\n")
            out = run_feed(daemon, jsonl, *state)
            assert out.returncode != 0, out
            (message,) = out.stderr.strip().splitlines()
            assert message.startswith(f"indexer: error: {jsonl}:2: "), message
        fixed = write_jsonl(tmp_path / "fixed.jsonl", documents)
        out = run_feed(daemon, fixed, *state)
        if stateful:  # the stateless feed's numbering is the daemon's: the same ids again
            assert out.returncode == 0, out.stderr
        out = run_feed(daemon, fixed, *state)
        assert out.returncode == 0, out.stderr
        if not stateful:
            daemon.stop()
            daemon = daemon_factory().start()
    wait_equal(daemon, documents)
    # Invalid UTF-8: one line naming the place, as the router says it.
    raw = tmp_path / "latin1.jsonl"
    raw.write_bytes(b'{"id": "a", "doc": {"age": 1}}\n{"id": "b", "doc": {"city": "Z\xfcrich"}}\n')
    out = run_feed(daemon, raw, "--state", str(tmp_path / "state"))
    assert out.returncode != 0
    (message,) = out.stderr.strip().splitlines()
    assert message.startswith(f"indexer: error: {raw}:2: not UTF-8"), message
    assert daemon.stop() == 0


def test_a_source_log_holding_such_versions_streams_past_them(
    daemon_factory: Any, routers: Any, tmp_path: Path
) -> None:
    """A log written before the input checks: its unindexable versions are left out of the
    indexes they cannot go in, one line per document, and every stream goes on."""
    state = tmp_path / "state"
    documents = good("doc", 40)
    poison = [
        Document("doc-3", {"age": float("nan"), "address": {"city": "Oslo"}}),
        Document("doc-4", {"age": 2**1100 + 1}),
        Document("inf", {"age": float("inf")}),
        Document("elsewhere", {"age": 7, "note": float("-inf")}),  # not in any key: indexed
    ]
    with SourceLog(state, 1024) as log:
        log.append(documents[:20])
        log.append(poison)
        log.append(documents[20:])
    first = daemon_factory().start()
    router = routers("--state", str(state), "--to", first.address, "--http", "127.0.0.1:0")
    (url,) = router.wait_log(r"router API on (http://\S+)")
    left_out = router.wait_log(r"document '([^']+)' \(seqno \d+\) left out of index", 3)
    assert sorted(left_out) == ["doc-3", "doc-4", "inf"]
    # doc-3 and doc-4 are left out of both indexes (their `age` is in both keys).
    expected = [d for d in documents if d.docid not in ("doc-3", "doc-4")]
    elsewhere = Document("elsewhere", {"age": 7})
    wait_equal(first, [*expected, elsewhere])
    # A fixed version replaces the bad one.
    fix = Document("doc-3", {"age": 33, "address": {"city": "Rome"}})
    with httpx.Client(base_url=url, timeout=30) as client:
        assert client.put(f"/docs/{fix.docid}", json=fix.body).status_code == 200
    wait_equal(first, [*expected, elsewhere, fix])
    assert router.stop() == 0
    text = router.log()
    assert "disconnected" not in text and text.count("left out of index") == 3, text
    # The one-shot feed of the same log, to another daemon, twice: exit 0 both times.
    second = daemon_factory().start()
    for _ in range(2):
        out = subprocess.run(
            indexer_command("feed", "--state", str(state), "--to", second.address),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 0, out.stderr
    wait_equal(second, [*expected, elsewhere, fix])
    assert first.stop() == 0 and second.stop() == 0


def test_a_key_over_the_nodes_frame_is_left_out_and_the_limit_named(
    daemon_factory: Any, routers: Any, tmp_path: Path
) -> None:
    # Frames of 4 KiB: smaller than the router's handshake, which a node takes all the same.
    daemon = daemon_factory(server={"max_frame_bytes": 4096}).start()
    documents = good("doc", 30)
    huge = Document("huge", {"age": 1, "address": {"city": "x" * 10_000}})
    jsonl = write_jsonl(tmp_path / "in.jsonl", [*documents[:10], huge, *documents[10:]])
    router = routers(
        "--state", str(tmp_path / "state"), "--jsonl", str(jsonl), "--to", daemon.address
    )  # fmt: skip
    (line,) = router.wait_log(r"document 'huge' .*")
    assert "left out of index by_city" in line and "server.max_frame_bytes = 4,096" in line
    # by_age's key is small: the document stays in that index.
    want_by_age = model([*documents, Document("huge", {"age": 1})], ["age"])
    deadline = time.monotonic() + WAIT_S
    while scan(daemon, "by_age") != want_by_age:
        assert time.monotonic() < deadline, scan(daemon, "by_age")
        time.sleep(0.2)
    assert scan(daemon, "by_city") == model(documents, INDEXES["by_city"])
    assert router.stop() == 0
    assert "disconnected" not in router.log()
    assert daemon.stop() == 0
