"""Reverse scans (`order=desc`) and lookups by document id (`GET /indexes/NAME/docs/ID`) against
a real daemon fed by a real feed, checked against the model; and their CLI commands."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest

from indexer.router import Workload, generate
from indexer.router.documents import Document
from tests.e2e.conftest import INDEXES, indexer_command, model, run_feed, write_jsonl
from tests.harness import http

pytestmark = pytest.mark.e2e

# One client for the module's requests: a new one per call (httpx.get) builds its TLS
# context each time, which costs more than the request on a busy machine.
HTTP = http()  # the harness's client: no kept-alive connections


def ndjson(url: str, **params: Any) -> list[dict[str, Any]]:
    answer = HTTP.get(url, params=params, timeout=60)
    assert answer.status_code == 200, answer.text
    return [json.loads(line) for line in answer.text.splitlines() if line]


def test_desc_scans_and_lookups_equal_the_model(daemon_factory: Any, tmp_path: Path) -> None:
    daemon = daemon_factory().start()
    documents = list(generate(Workload(6_000, 1_500, 0.15, 77)))
    documents.append(Document("a/b c%", {"age": 41, "address": {"city": "Lima"}}))
    fed = run_feed(daemon, write_jsonl(tmp_path / "docs.jsonl", documents))
    assert fed.returncode == 0, fed.stderr
    base = f"{daemon.url}/indexes"
    for name, paths in INDEXES.items():
        want = model(documents, paths)
        assert ndjson(f"{base}/{name}/scan", order="desc") == want[::-1]
        assert ndjson(f"{base}/{name}/scan", order="desc", limit=7) == want[::-1][:7]
        assert ndjson(f"{base}/{name}/scan", order="asc", limit=7) == want[:7]
    # A range, the other way round.
    ages = model(documents, ["age"])
    ranged = [e for e in ages if isinstance(e["key"][0], int | float) and 30 <= e["key"][0] <= 40]
    assert ndjson(f"{base}/by_age/scan", low=30, high=40, order="desc") == ranged[::-1]

    # Lookups: the entry the model gives each document, none for a deleted or unindexed one.
    entries = {e["id"]: e for e in model(documents, INDEXES["by_city"])}
    latest = {d.docid: d.body for d in documents}
    checked = {"indexed": 0, "absent": 0}
    for docid in [*list(latest)[:300], "a/b c%", "never-written"]:
        answer = HTTP.get(f"{base}/by_city/docs/{quote(docid, safe='')}", timeout=30)
        assert answer.status_code == 200, answer.text
        got = answer.json()
        assert got["id"] == docid
        if docid in entries:
            assert got["entries"] == [entries[docid]]
            checked["indexed"] += 1
        else:
            assert got["entries"] == []
            checked["absent"] += 1
    assert checked["indexed"] > 100 and checked["absent"] > 10, checked

    # Bad requests name what is wrong.
    bad = HTTP.get(f"{base}/by_city/scan", params={"order": "sideways"})
    assert bad.status_code == 400 and "order: asc or desc" in bad.json()["error"]
    assert HTTP.get(f"{base}/by_city/docs/").status_code == 404
    assert HTTP.get(f"{base}/by_city/count", params={"order": "desc"}).status_code == 400

    # The CLI.
    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            indexer_command(*args, "--url", daemon.url), capture_output=True, text=True, timeout=60
        )

    scanned = cli("scan", "by_age", "--order", "desc", "--limit", "5")
    assert scanned.returncode == 0, scanned.stderr
    assert [json.loads(line) for line in scanned.stdout.splitlines()] == ages[::-1][:5]
    looked = cli("lookup", "by_city", "a/b c%")
    assert looked.returncode == 0, looked.stderr
    assert [json.loads(line) for line in looked.stdout.splitlines()] == [entries["a/b c%"]]
    missing = cli("lookup", "by_city", "never-written")
    assert missing.returncode == 0 and missing.stdout == ""
    assert daemon.stop() == 0


def pages(url: str, **params: Any) -> tuple[list[dict[str, Any]], int]:
    """Every row of the pages a scan gives, following each full page's token; and the pages."""
    rows: list[dict[str, Any]] = []
    count = 0
    while True:
        answer = HTTP.get(url, params=params, timeout=60)
        assert answer.status_code == 200, answer.text
        rows += [json.loads(line) for line in answer.text.splitlines() if line]
        count += 1
        token = answer.headers.get("x-indexer-next")
        if token is None:
            return rows, count
        kept = {k: v for k, v in params.items() if k in ("low", "high", "eq", "spans", "limit")}
        params = {**kept, "next": token}


def test_pages_read_one_snapshot_while_writes_go_on(daemon_factory: Any, tmp_path: Path) -> None:
    daemon = daemon_factory().start()
    first = list(generate(Workload(5_000, 2_000, 0.1, 78)))
    fed = run_feed(daemon, write_jsonl(tmp_path / "a.jsonl", first))
    assert fed.returncode == 0, fed.stderr
    url = f"{daemon.url}/indexes/by_city/scan"
    want = model(first, INDEXES["by_city"])
    # The first page, then writes, then the other pages: all from the first page's snapshot.
    answer = HTTP.get(url, params={"limit": 700, "consistency": "request_plus"}, timeout=60)
    assert answer.status_code == 200 and "x-indexer-next" in answer.headers
    got = [json.loads(line) for line in answer.text.splitlines()]
    more = first + list(generate(Workload(3_000, 2_000, 0.3, 79)))
    fed = run_feed(daemon, write_jsonl(tmp_path / "b.jsonl", more))
    assert fed.returncode == 0, fed.stderr
    rest, count = pages(url, limit=700, next=answer.headers["x-indexer-next"])
    assert got + rest == want and count == -(-len(want) // 700) - 1 + (len(want) % 700 == 0)
    # Pages the other way, a range, and offset.
    now = model(more, INDEXES["by_city"])
    assert pages(url, limit=333, order="desc")[0] == now[::-1]
    ranged = [e for e in now if e["key"][0] is not None and "B" <= str(e["key"][0]) <= "M"]
    assert pages(url, limit=250, low='"B"', high='"M"')[0] == [
        e for e in ranged if isinstance(e["key"][0], str)
    ]
    assert ndjson(url, offset=10, limit=5) == now[10:15]
    assert ndjson(url, offset=len(now) - 3) == now[-3:]
    # A last page that is exactly full gives a token, and its next page is empty.
    rows, _ = pages(url, limit=len(now))
    assert rows == now
    # Bad tokens and clashes are 400s that name them.
    token = HTTP.get(url, params={"limit": 5}).headers["x-indexer-next"]
    for params, message in (
        ({"next": "garbage"}, "next: not a token a page gave"),
        ({"next": token, "consistency": "any"}, "not taken with next"),
        ({"next": token, "order": "desc"}, "the pages keep the order of the first"),
    ):
        bad = HTTP.get(url, params=params)
        assert bad.status_code == 400 and message in bad.json()["error"], bad.text
    other = HTTP.get(f"{daemon.url}/indexes/by_age/scan", params={"next": token})
    assert other.status_code == 400 and "a token of index 'by_city'" in other.json()["error"]
    # The CLI follows the pages.
    listed = subprocess.run(
        indexer_command("scan", "by_city", "--all", "--limit", "900", "--url", daemon.url),
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert listed.returncode == 0, listed.stderr
    assert [json.loads(line) for line in listed.stdout.splitlines()] == now
    assert daemon.stop() == 0


def test_fields_choose_the_key_positions_and_the_id(daemon_factory: Any, tmp_path: Path) -> None:
    daemon = daemon_factory().start()
    documents = list(generate(Workload(2_000, 800, 0.1, 80)))
    fed = run_feed(daemon, write_jsonl(tmp_path / "docs.jsonl", documents))
    assert fed.returncode == 0, fed.stderr
    url = f"{daemon.url}/indexes/by_city/scan"
    full = model(documents, INDEXES["by_city"])

    def projected(entry: dict[str, Any], positions: list[int], with_id: bool) -> dict[str, Any]:
        missing = set(entry.get("missing", []))
        out: dict[str, Any] = {"key": [entry["key"][j] for j in positions]}
        if with_id:
            out["id"] = entry["id"]
        gone = [i for i, j in enumerate(positions) if j in missing]
        if gone:
            out["missing"] = gone
        return out

    for fields, positions, with_id in (
        ("age,id", [1], True),
        ("age,address.city", [1, 0], False),
        ("id", [], True),
    ):
        assert ndjson(url, fields=fields) == [projected(e, positions, with_id) for e in full]
    # Arrow: the columns asked for, in that order.
    arrow = HTTP.get(
        url,
        params={"fields": "age,id", "columns": "json,double"},
        headers={"accept": "application/vnd.apache.arrow.stream"},
        timeout=60,
    )
    assert arrow.status_code == 200, arrow.text
    import pyarrow as pa

    table = pa.ipc.open_stream(arrow.content).read_all()
    assert table.column_names == ["age", "id"] and table.schema.field("age").type == pa.float64()
    assert table.column("id").to_pylist() == [e["id"] for e in full]
    for bad in ("nope", "age,age", ""):
        answer = HTTP.get(url, params={"fields": bad})
        assert answer.status_code == 400 and "fields:" in answer.json()["error"], answer.text
    listed = subprocess.run(
        indexer_command("scan", "by_city", "--fields", "id", "--limit", "3", "--url", daemon.url),
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert listed.returncode == 0, listed.stderr
    assert [json.loads(line) for line in listed.stdout.splitlines()] == [
        {"key": [], "id": e["id"]} for e in full[:3]
    ]
    assert daemon.stop() == 0


def test_spans_read_several_ranges_in_index_order_each_entry_once(
    daemon_factory: Any, tmp_path: Path
) -> None:
    daemon = daemon_factory().start()
    documents = list(generate(Workload(4_000, 1_500, 0.1, 81)))
    fed = run_feed(daemon, write_jsonl(tmp_path / "docs.jsonl", documents))
    assert fed.returncode == 0, fed.stderr
    url = f"{daemon.url}/indexes/by_age"
    ages = model(documents, INDEXES["by_age"])

    def number(entry: dict[str, Any]) -> bool:
        value = entry["key"][0]
        return isinstance(value, int | float) and not isinstance(value, bool)

    # An IN list and overlapping ranges, out of order and repeated: merged, once each.
    spans = [{"low": 55, "high": 70}, {"eq": 30}, {"low": 50, "high": 60}, {"eq": 30}, {"eq": 12}]
    want = [e for e in ages if number(e) and (e["key"][0] in (12, 30) or 50 <= e["key"][0] <= 70)]
    assert len(want) > 100
    text = json.dumps(spans)
    assert ndjson(f"{url}/scan", spans=text) == want
    assert ndjson(f"{url}/scan", spans=text, order="desc") == want[::-1]
    counted = HTTP.get(f"{url}/count", params={"spans": text}).json()["count"]
    assert counted == len(want)
    assert pages(f"{url}/scan", spans=text, limit=37)[0] == want
    exclusive = json.dumps([{"low": 20, "high": 30, "inclusion": "neither"}, {"eq": 30}])
    assert ndjson(f"{url}/scan", spans=exclusive) == [
        e for e in ages if number(e) and 20 < e["key"][0] <= 30
    ]
    for params, message in (
        ({"spans": "[]"}, "spans: a list of 1 to"),
        ({"spans": '[{"eq": 1, "nope": 2}]'}, "spans: each one"),
        ({"spans": '[{"eq": 1}]', "low": "3"}, "give the range in spans"),
    ):
        answer = HTTP.get(f"{url}/scan", params=params)
        assert answer.status_code == 400 and message in answer.json()["error"], answer.text
    counted_cli = subprocess.run(
        indexer_command("count", "by_age", "--spans", text, "--url", daemon.url),
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert counted_cli.returncode == 0, counted_cli.stderr
    assert counted_cli.stdout.strip() == str(len(want))
    assert daemon.stop() == 0


def test_aggregates_per_group_equal_the_model(daemon_factory: Any, tmp_path: Path) -> None:
    daemon = daemon_factory().start()
    documents = list(generate(Workload(5_000, 2_000, 0.1, 82)))
    fed = run_feed(daemon, write_jsonl(tmp_path / "docs.jsonl", documents))
    assert fed.returncode == 0, fed.stderr
    url = f"{daemon.url}/indexes/by_city/aggregate"
    entries = model(documents, INDEXES["by_city"])
    asked = "count,count_distinct(age),min(age),max(age),sum(age),avg(age)"

    def numeric(value: Any) -> bool:
        return isinstance(value, int | float) and not isinstance(value, bool)

    def expected(rows: list[dict[str, Any]], width: int) -> list[dict[str, Any]]:
        groups: dict[str, list[dict[str, Any]]] = {}
        for e in rows:  # the model is in index order: groups come in it too
            groups.setdefault(json.dumps(e["key"][:width]), []).append(e)
        out = []
        for head, members in groups.items():
            ages = [m["key"][1] for m in members if 1 not in m.get("missing", [])]
            ages = [a for a in ages if a is not None]
            numbers = [a for a in ages if numeric(a)]
            out.append(
                {
                    "group": json.loads(head),
                    "count": len(members),
                    "count_distinct(age)": len({json.dumps(a) for a in ages}),
                    "sum(age)": round(sum(numbers), 6) if numbers else None,
                    "avg(age)": round(sum(numbers) / len(numbers), 6) if numbers else None,
                }
            )
        return out

    def rounded(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
        keep = ("group", "count", "count_distinct(age)", "sum(age)", "avg(age)")
        return [
            {k: round(g[k], 6) if isinstance(g[k], float) else g[k] for k in keep} for g in groups
        ]

    by_city = ndjson(url, group_by=1, aggregates=asked)
    assert rounded(by_city) == expected(entries, 1)
    assert all("min(age)" in g and "max(age)" in g for g in by_city)
    (everything,) = ndjson(url, aggregates="count")
    assert everything == {"group": [], "count": len(entries)}
    # Over spans, as a scan reads them.
    spans = json.dumps([{"eq": "Oslo"}, {"eq": "Lima"}])
    cities = {"Oslo", "Lima"}
    some = [e for e in entries if e["key"][0] in cities]
    assert rounded(ndjson(url, group_by=1, aggregates=asked, spans=spans)) == expected(some, 1)
    # Arrow: the group's keys as JSON text, counts as int64, sums as float64.
    import pyarrow as pa

    arrow = HTTP.get(
        url,
        params={"group_by": 1, "aggregates": "count,sum(age)"},
        headers={"accept": "application/vnd.apache.arrow.stream"},
        timeout=60,
    )
    table = pa.ipc.open_stream(arrow.content).read_all()
    assert table.column_names == ["address.city", "count", "sum(age)"]
    assert table.column("count").to_pylist() == [g["count"] for g in by_city]
    assert table.column("address.city").to_pylist() == [json.dumps(g["group"][0]) for g in by_city]
    for params, message in (
        ({"aggregates": "median(age)"}, "is not one of"),
        ({"group_by": 3}, "group_by"),
    ):
        bad = HTTP.get(url, params=params)
        assert bad.status_code == 400 and message in bad.json()["error"], bad.text
    listed = subprocess.run(
        indexer_command(
            "aggregate", "by_city", "--group-by", "1", "--aggregates", "count", "--url", daemon.url
        ),
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert listed.returncode == 0, listed.stderr
    assert [json.loads(line) for line in listed.stdout.splitlines()] == [
        {"group": g["group"], "count": g["count"]} for g in by_city
    ]
    assert daemon.stop() == 0
