"""Partial indexes end to end: a `where` in the configuration and over HTTP, a real feed whose
updates move documents in and out of the condition, the index compared with a model."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from indexer.router import Workload, generate
from indexer.router.documents import Document
from tests.e2e.conftest import Daemon, dump, indexer_command, model, run_feed, write_jsonl
from tests.harness import http

pytestmark = pytest.mark.e2e

PATHS = ["address.city", "age"]
# As written in the configuration: lower-case keywords, == and <>, single quotes.
WHERE = "active == true and age >= 40 and (address.city <> 'Oslo' or age is null)"
CANONICAL = 'active = TRUE AND age >= 40 AND (address.city != "Oslo" OR age IS NULL)'


def _in_where(body: dict[str, Any]) -> bool:
    """The same condition in plain Python, to check the model independently of indexer.where."""
    age = body.get("age")
    address = body.get("address")
    city = address.get("city") if isinstance(address, dict) else None
    number = isinstance(age, int | float) and not isinstance(age, bool)
    return body.get("active") is True and number and age >= 40 and city not in (None, "Oslo")


def _doc(city: str | None, age: Any, active: bool, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"age": age, "active": active, "address": {}, **extra}
    if city is not None:
        body["address"]["city"] = city
    return body


# Hand-made flips (phase 1, then phase 2): in -> out by each clause, out -> in, in -> in with a
# new key, in -> deleted, deleted -> in, and never in.
PHASE_1 = [
    Document("flip:active", _doc("Rome", 50, True)),
    Document("flip:age", _doc("Rome", 50, True)),
    Document("flip:city", _doc("Rome", 50, True)),
    Document("flip:in", _doc("Rome", 30, True)),
    Document("flip:key", _doc("Rome", 45, True)),
    Document("flip:delete", _doc("Lima", 60, True)),
    Document("flip:undelete", _doc("Lima", 60, True)),
    Document("flip:missing", _doc("Lima", 60, True)),
    Document("never", _doc("Oslo", 70, True)),
]
PHASE_2 = [
    Document("flip:active", _doc("Rome", 50, False)),
    Document("flip:age", _doc("Rome", 39.5, True)),
    Document("flip:city", _doc("Oslo", 50, True)),
    Document("flip:in", _doc("Rome", 40, True)),
    Document("flip:key", _doc("Kyoto", 46, True)),
    Document("flip:delete", None),
    Document("flip:undelete", None),
    Document("flip:undelete", _doc("Lima", 61, True)),
    Document("flip:missing", {"active": True, "address": {"city": "Lima"}}),
    Document("never", _doc("Oslo", None, True)),
]


def _scan(daemon: Daemon, name: str) -> list[dict[str, Any]]:
    response = http().get(
        f"{daemon.url}/indexes/{name}/scan", params={"consistency": "request_plus"}, timeout=60
    )
    assert response.status_code == 200, response.text
    return [json.loads(line) for line in response.text.splitlines() if line]


def _feed(daemon: Daemon, path: Path, documents: list[Document]) -> None:
    fed = run_feed(daemon, write_jsonl(path, documents))
    assert fed.returncode == 0, fed.stderr


def test_partial_index_follows_documents_in_and_out(daemon_factory: Any, tmp_path: Path) -> None:
    daemon = daemon_factory(**{"indexes.seniors": {"keys": PATHS, "where": WHERE}}).start()
    listed = {i["name"]: i for i in http().get(daemon.url + "/indexes").json()["indexes"]}
    assert listed["seniors"]["where"] == CANONICAL
    assert "where" not in listed["by_city"]

    # Phase 1, then everything again with phase 2 (the feed skips what the daemon has).
    generated = list(generate(Workload(8_000, 2_000, 0.1, 31)))
    first = PHASE_1 + generated[:4_000]
    _feed(daemon, tmp_path / "one.jsonl", first)
    want = model(first, PATHS, WHERE)
    assert _scan(daemon, "seniors") == want
    assert {e["id"] for e in want} & {d.docid for d in PHASE_1} == {
        d.docid for d in PHASE_1 if d.docid not in ("never", "flip:in")
    }
    everything = first + PHASE_2 + generated[4_000:]
    _feed(daemon, tmp_path / "two.jsonl", everything)
    want = model(everything, PATHS, WHERE)
    assert _scan(daemon, "seniors") == want
    ids = {e["id"] for e in want}
    assert {d.docid for d in PHASE_1} & ids == {"flip:in", "flip:key", "flip:undelete"}
    assert [e["key"] for e in want if e["id"] == "flip:key"] == [["Kyoto", 46]]
    # The model agrees with the condition written in plain Python, and the other indexes hold
    # every document as before.
    latest = {d.docid: d.body for d in everything}
    assert ids == {i for i, body in latest.items() if body is not None and _in_where(body)}
    assert 0 < len(want) < len(model(everything, PATHS))
    assert _scan(daemon, "by_city") == model(everything, PATHS)

    # A partial index created at run time over data: it waits for a build stream (which only a
    # router keeping a source log serves: tests/e2e/test_index_build.py builds a partial one).
    bad = [
        ({"name": "x", "keys": ["age"], "where": "age >= "}, "where: expected a field or a value"),
        ({"name": "x", "keys": ["age"], "where": "age = 1)"}, "at position 8"),
        ({"name": "x", "keys": ["age"], "where": "age ~ 1"}, "unexpected character '~'"),
        ({"name": "x", "keys": ["age"], "where": 18}, "where: a condition as a string"),
    ]
    for body, message in bad:
        refused = http().post(daemon.url + "/indexes", json=body, timeout=30)
        assert refused.status_code == 400, refused.text
        assert message in refused.json()["error"]
    created = subprocess.run(
        indexer_command(
            "create-index",
            "rich",
            "--keys",
            "score",
            "--where",
            "score>50 AND tags is not missing",
            "--url",
            daemon.url,
        ),
        capture_output=True,
        text=True,
    )
    assert created.returncode == 0, created.stderr
    assert "WHERE score > 50 AND tags IS NOT MISSING" in created.stdout
    shown = subprocess.run(
        indexer_command("list-indexes", "--url", daemon.url), capture_output=True, text=True
    )
    assert "rich\tscore\tbuilding 0%\t0\tWHERE score > 50 AND tags IS NOT MISSING" in shown.stdout
    listed = {i["name"]: i for i in http().get(daemon.url + "/indexes").json()["indexes"]}
    assert listed["rich"]["where"] == "score > 50 AND tags IS NOT MISSING"
    assert listed["rich"]["state"] == "building"
    later = list(generate(Workload(2_000, 2_000, 0.1, 32)))
    _feed(daemon, tmp_path / "three.jsonl", everything + later)
    everything += later
    assert _scan(daemon, "seniors") == model(everything, PATHS, WHERE)

    # Stopped, the store holds the same; a restart keeps both definitions.
    assert daemon.stop() == 0
    assert dump(daemon, "seniors") == model(everything, PATHS, WHERE)
    daemon.start()
    listed = {i["name"]: i for i in http().get(daemon.url + "/indexes").json()["indexes"]}
    assert listed["seniors"]["where"] == CANONICAL
    assert listed["rich"]["where"] == "score > 50 AND tags IS NOT MISSING"
    assert daemon.stop() == 0


def test_where_in_the_configuration_is_checked(daemon_factory: Any) -> None:
    daemon = daemon_factory(**{"indexes.seniors": {"keys": PATHS, "where": WHERE}}).start()
    assert daemon.stop() == 0
    text = daemon.config.read_text()
    # Written differently but the same condition: the stored definition still matches.
    same = "active = True AND (age>=40) AND (address.city!='Oslo' OR age IS NULL)"
    daemon.config.write_text(text.replace(json.dumps(WHERE), json.dumps(same)))
    daemon.start()
    assert daemon.stop() == 0
    # A different condition for the stored index, and a malformed one: one line each.
    for where, message, code in (
        ("age >= 41", "index 'seniors' is stored with where", 1),
        ("age >= 41 and", "indexes.seniors.where: expected a field, a value, NOT or '('", 2),
    ):
        daemon.config.write_text(text.replace(json.dumps(WHERE), json.dumps(where)))
        with pytest.raises(AssertionError, match="daemon exited at start"):
            daemon.start()
        assert daemon.proc is not None and daemon.proc.returncode == code
        assert f"indexer: error: {message}" in daemon.log()
