"""Primary, array and expression indexes on a real daemon fed by a real feed: every scan equals
a model that computes the entries by hand; prefix and id-range scans, DESC keys, lookups of
documents with several entries, and bad definitions."""

from __future__ import annotations

import json
import random
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from indexer.keys import MISSING, collate
from indexer.router.documents import Document
from tests.e2e.conftest import indexer_command, run_feed, wait_equal, write_jsonl
from tests.e2e.test_index_build import wait_active
from tests.harness import http, latest, ordered_entries

pytestmark = pytest.mark.e2e

CONFIGURED = {
    "tags": ["DISTINCT ARRAY LOWER(t) FOR t IN tags END"],
    "kid_age": ["ALL ARRAY k.name FOR k IN kids END", "age DESC"],
}
INDEXES: dict[str, dict[str, Any]] = {
    'indexes."#primary"': {"primary": True},
    **{f"indexes.{name}": {"keys": keys} for name, keys in CONFIGURED.items()},
}
CREATED = {
    "name_age": ["lower(name)", "age * 10 + 1"],
    "age_desc": ["age desc"],
}


def _number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def model_keys(name: str, docid: str, doc: dict[str, Any]) -> list[list[Any]]:
    """The keys of a document in index `name`, computed without the index's own code."""
    get = doc.get
    if name == "#primary":
        return [[docid]]
    if name == "tags":
        tags = get("tags", MISSING)
        if not isinstance(tags, list):
            return []
        return [[t.lower() if isinstance(t, str) else None] for t in tags]
    if name == "kid_age":
        kids = get("kids", MISSING)
        if not isinstance(kids, list):
            return []
        names = [k.get("name", MISSING) if isinstance(k, dict) else MISSING for k in kids]
        return [[n, get("age", MISSING)] for n in names if n is not MISSING]
    if name == "name_age":
        n = get("name", MISSING)
        if n is MISSING:
            return []
        age = get("age", MISSING)
        value = MISSING if age is MISSING else age * 10 + 1 if _number(age) else None
        return [[n.lower() if isinstance(n, str) else None, value]]
    assert name == "age_desc"
    age = get("age", MISSING)
    return [] if age is MISSING else [[age]]


DESC = {"kid_age": (False, True), "age_desc": (True,)}


def model(documents: list[Document], name: str) -> list[dict[str, Any]]:
    """The index's rows in index order, as a scan answers them (one per distinct key)."""
    desc = DESC.get(name, ())
    rows = []
    for docid, body in latest(documents).items():
        if body is None:
            continue
        seen: list[list[Any]] = []
        for key in model_keys(name, docid, body):
            if not any(all(collate(a, b) == 0 for a, b in zip(key, s, strict=True)) for s in seen):
                seen.append(key)
                rows.append((key, docid))
    return ordered_entries(rows, desc)


def documents(seed: int, count: int) -> list[Document]:
    """Documents whose arrays change between versions, with deletes."""
    rng = random.Random(seed)
    words = ["Red", "red", "BLUE", "green", 7, None, True]
    out = []
    for _ in range(count):
        docid = f"user::{rng.randint(0, 400)}"
        if rng.random() < 0.1:
            out.append(Document(docid, None))
            continue
        body: dict[str, Any] = {}
        if rng.random() < 0.9:
            body["tags"] = rng.sample(words, rng.randint(0, 4)) * rng.randint(1, 2)
        if rng.random() < 0.8:
            body["kids"] = [
                {"name": rng.choice(["Ann", "Bo", "Cy"])} if rng.random() < 0.8 else {"age": 3}
                for _ in range(rng.randint(0, 3))
            ]
        if rng.random() < 0.9:
            body["name"] = rng.choice(["Ann", "ANN", "bo", 12])
        if rng.random() < 0.9:
            body["age"] = rng.choice([rng.randint(0, 90), rng.random() * 90, "old", None])
        out.append(Document(docid, body))
    return out


def ndjson(url: str, **params: Any) -> list[dict[str, Any]]:
    answer = http().get(url, params=params, timeout=60)
    assert answer.status_code == 200, answer.text
    return [json.loads(line) for line in answer.text.splitlines() if line]


def test_primary_array_and_expression_indexes_equal_the_model(
    daemon_factory: Any, tmp_path: Path
) -> None:
    daemon = daemon_factory(**INDEXES).start()
    base = f"{daemon.url}/indexes"
    for name, keys in CREATED.items():
        created = http().post(base, json={"name": name, "keys": keys}, timeout=30)
        assert created.status_code == 201, created.text
    listed = {i["name"]: i for i in http().get(base, timeout=30).json()["indexes"]}
    assert listed["name_age"]["keys"] == ["LOWER(name)", "(age * 10) + 1"]
    assert listed["#primary"]["keys"] == ["META().id"]

    # Two passes over the same documents: most arrays change between versions, and only
    # the last version's entries stay.
    docs = documents(3, 3_000) + documents(4, 3_000)
    fed = run_feed(daemon, write_jsonl(tmp_path / "docs.jsonl", docs))
    assert fed.returncode == 0, fed.stderr
    for name in ("#primary", "tags", "kid_age", "name_age", "age_desc"):
        url = f"{base}/{name.replace('#', '%23')}"
        want = model(docs, name)
        assert len(want) > 100, name
        assert ndjson(f"{url}/scan") == want, name
        assert ndjson(f"{url}/scan", order="desc") == want[::-1], name
        count = http().get(f"{url}/count", timeout=30).json()["count"]
        assert count == len(want), name

    primary = model(docs, "#primary")
    pbase = f"{base}/%23primary"
    # Ids by prefix and by range.
    assert ndjson(f"{pbase}/scan", prefix="user::1") == [
        e for e in primary if e["id"].startswith("user::1")
    ]
    assert ndjson(f"{pbase}/scan", low='"user::2"', high='"user::3"', inclusion="low") == [
        e for e in primary if "user::2" <= e["id"] < "user::3"
    ]
    spans = json.dumps([{"prefix": "user::39"}, {"eq": "user::7"}])
    assert ndjson(f"{pbase}/scan", spans=spans) == [
        e for e in primary if e["id"].startswith("user::39") or e["id"] == "user::7"
    ]
    # A DESC key: low and high bound its values, read from high to low.
    ages = model(docs, "age_desc")
    ranged = [e for e in ages if _number(e["key"][0]) and 20 <= e["key"][0] <= 40]
    assert ranged and ndjson(f"{base}/age_desc/scan", low=20, high=40) == ranged
    assert ndjson(f"{base}/age_desc/scan", low=20, high=40, inclusion="neither") == [
        e for e in ranged if e["key"][0] not in (20, 40)
    ]
    # An equality on an array index: the documents holding that element.
    red = [e for e in model(docs, "tags") if e["key"] == ["red"]]
    assert red and ndjson(f"{base}/tags/scan", eq='"red"') == red

    # A document's entries in an array index, from the back index.
    final = latest(docs)
    holder = next(d for d, b in final.items() if b and len(model_keys("tags", d, b)) >= 2)
    got = http().get(f"{base}/tags/docs/{holder.replace(':', '%3A')}", timeout=30).json()
    assert got["entries"] == [e for e in model(docs, "tags") if e["id"] == holder]
    assert len(got["entries"]) >= 2

    # Projection by key text or column name.
    rows = ndjson(f"{base}/name_age/scan", fields="LOWER_name,id", limit=3)
    assert rows == [{"key": [e["key"][0]], "id": e["id"]} for e in model(docs, "name_age")[:3]]

    # The CLI quotes the primary index's name.
    scanned = subprocess.run(
        indexer_command("scan", "#primary", "--limit", "4", "--url", daemon.url),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert scanned.returncode == 0, scanned.stderr
    assert [json.loads(line) for line in scanned.stdout.splitlines()] == primary[:4]
    assert daemon.stop() == 0


BAD = [
    ({"name": "x", "keys": ["LOWER(name"]}, "keys: key 1 ('LOWER(name'): expected ')'"),
    (
        {"name": "x", "keys": ["DISTINCT ARRAY t FOR t IN a END", "ALL ARRAY u FOR u IN b END"]},
        "keys 1 and 2 are both array keys",
    ),
    ({"name": "x", "keys": ["a +"]}, "found the end at position 4"),
    ({"name": "#primary", "keys": ["a"]}, "#primary names a primary index"),
    ({"name": "p", "primary": True, "keys": ["a"]}, "a primary index has none"),
    ({"name": "p", "primary": "yes"}, "primary: true or false"),
]


def test_cli_definitions_and_bad_ones_name_the_problem(daemon_factory: Any) -> None:
    daemon = daemon_factory().start()
    for body, message in BAD:
        answer = http().post(f"{daemon.url}/indexes", json=body, timeout=30)
        assert answer.status_code == 400, answer.text
        assert message in answer.json()["error"], (body, answer.text)

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        command = indexer_command("create-index", *args, "--url", daemon.url)
        return subprocess.run(command, capture_output=True, text=True, timeout=60)

    made = cli("#primary", "--primary")
    assert made.returncode == 0, made.stderr
    assert made.stdout.startswith("created #primary(META().id): active")
    made = cli("by_tag", "--keys", "distinct array t for t in tags end,age desc")
    assert made.returncode == 0, made.stderr
    assert "by_tag(DISTINCT ARRAY t FOR t IN tags END, age DESC)" in made.stdout
    bad = cli("bad", "--keys", "LOWER(name")
    assert bad.returncode != 0 and "expected ')'" in bad.stderr
    assert cli("neither").returncode == 2
    listed = {i["name"] for i in http().get(f"{daemon.url}/indexes", timeout=30).json()["indexes"]}
    assert {"#primary", "by_tag"} <= listed and "bad" not in listed
    assert daemon.stop() == 0


def test_array_and_primary_indexes_built_over_data_under_a_feed(
    daemon_factory: Any, routers: Any, tmp_path: Path
) -> None:
    """An array index built on its own stream, and a primary and an expression index deferred
    then built together, while the router keeps streaming documents whose arrays change: once
    active, each equals the model."""
    daemon = daemon_factory().start()
    docs = documents(11, 4_000)
    jsonl = write_jsonl(tmp_path / "in.jsonl", docs)
    router = routers(
        "--state", str(tmp_path / "state"), "--jsonl", str(jsonl), "--follow",
        "--to", daemon.address,
    )  # fmt: skip
    wait_equal(daemon, docs)
    base = f"{daemon.url}/indexes"
    made = http().post(base, json={"name": "tags", "keys": CONFIGURED["tags"]}, timeout=30)
    assert made.status_code == 201 and made.json()["state"] == "building", made.text
    for name, body in (
        ("#primary", {"primary": True}),
        ("name_age", {"keys": CREATED["name_age"]}),
    ):
        made = http().post(base, json={"name": name, **body, "defer_build": True}, timeout=30)
        assert made.status_code == 201 and made.json()["state"] == "deferred", made.text
    for seed in range(12, 16):  # more versions while the builds run
        more = documents(seed, 1_000)
        write_jsonl(jsonl, more, append=True)
        docs += more
        if seed == 13:
            built = http().post(f"{base}/_build", json={"indexes": ["#primary", "name_age"]})
            assert built.status_code in (200, 202), built.text
        time.sleep(0.2)
    for name in ("tags", "#primary", "name_age"):
        wait_active(daemon, name)
    wait_equal(daemon, docs)
    for name in ("tags", "#primary", "name_age"):
        url = f"{base}/{name.replace('#', '%23')}/scan"
        assert ndjson(url, consistency="request_plus") == model(docs, name), name
    assert router.stop() == 0
