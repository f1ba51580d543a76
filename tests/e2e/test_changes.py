"""The change feed with a real daemon: replayed over its starting snapshot it gives the index.

The source is the stream client's model (a list of mutations per vbucket); the feed is read
over HTTP in pages and applied to a set of entries, which must equal the model's index computed
from the source's documents, never deleting what is not there nor inserting what is.
"""

from __future__ import annotations

import json
import subprocess
import time
from typing import Any

from indexer.client import NEXT_HEADER
from tests.e2e.conftest import INDEXES, WAIT_S, Daemon, indexer_command, model
from tests.e2e.stream_client import FAST_PERSIST, VBUCKETS, Source, feed
from tests.harness import http

NAME = "by_city"

# One client for the module's requests: a new one per call (httpx.get) builds its TLS
# context each time, which costs more than the request on a busy machine.
HTTP = http()  # the harness's client: no kept-alive connections


def _entry(row: dict[str, Any]) -> str:
    """An entry as the model lists it, as one comparable string."""
    entry = {"key": row["key"], "id": row["id"]}
    if "missing" in row:
        entry["missing"] = row["missing"]
    return json.dumps(entry, sort_keys=True)


def read_changes(
    daemon: Daemon, since: str, limit: int | None = None, until: str | None = None
) -> tuple[list[dict[str, Any]], str]:
    """Every row from `since` to the latest persisted snapshot (or `until`), page by page,
    and the token to read on from."""
    rows: list[dict[str, Any]] = []
    while True:
        params: dict[str, Any] = {"since": since}
        if limit is not None:
            params["limit"] = limit
        if until is not None:
            params["until"] = until
        answer = HTTP.get(f"{daemon.url}/indexes/{NAME}/changes", params=params, timeout=60)
        assert answer.status_code == 200, answer.text
        page = [json.loads(line) for line in answer.text.splitlines() if line]
        if limit is not None:
            assert len(page) <= limit + 1  # whole records: a delete and its insert together
        rows += page
        after = answer.headers[NEXT_HEADER]
        if limit is not None:  # the same end, found without the rows
            alone = HTTP.get(
                f"{daemon.url}/indexes/{NAME}/changes", params={**params, "only": "token"}
            )
            assert alone.status_code == 200, alone.text
            assert (alone.headers[NEXT_HEADER], alone.text) == (after, "")
        if after.count(".") == 1:  # a snapshot's token: read to the end
            return rows, after
        since = after


def replay(entries: set[str], rows: list[dict[str, Any]]) -> None:
    """Apply the feed's rows in order; a delete of an absent entry or an insert of a present
    one means the feed disagrees with the index it describes."""
    for row in rows:
        entry = _entry(row)
        if row["op"] == "delete":
            assert entry in entries, f"deletes what is not there: {row}"
            entries.remove(entry)
        else:
            assert row["op"] == "insert", row
            assert entry not in entries, f"inserts what is there: {row}"
            entries.add(entry)


def modelled(source: Source) -> set[str]:
    return {_entry(e) for e in model(source.surviving(), INDEXES[NAME])}


def test_changes_replayed_over_the_snapshot_give_the_index(daemon_factory: Any) -> None:
    daemon = daemon_factory(**FAST_PERSIST).start()
    source = Source(7)
    for vb in VBUCKETS:
        source.write(vb, 80)
    feed(daemon, source)
    start, token = read_changes(daemon, "snapshot")
    assert {r["op"] for r in start} == {"insert"}
    assert all(r["snapshot"] == token for r in start)
    entries: set[str] = set()
    replay(entries, start)
    assert entries == modelled(source)
    tokens = [token]
    held = {token: set(entries)}  # the index at each token, as the model gives it
    for round_ in range(4):
        for vb in VBUCKETS:
            source.write(vb, 60)  # updates of the same 60 documents per vbucket, and deletes
        feed(daemon, source)
        rows, after = read_changes(daemon, token, limit=7 if round_ % 2 else None)
        assert rows, "a round of updates changed nothing in the feed"
        assert {r["op"] for r in rows} <= {"insert", "delete"}
        marks = [int(r["snapshot"].split(".")[1]) for r in rows]
        low, high = int(token.split(".")[1]), int(after.split(".")[1])
        assert all(low < m <= high for m in marks), (low, high, set(marks))
        replay(entries, rows)
        assert entries == modelled(source)
        token = after
        tokens.append(token)
        held[token] = set(entries)
    # The whole index at an older snapshot: the latest's entries with the changes taken back.
    for older in tokens[:-1]:
        at, end = read_changes(daemon, "snapshot", until=older)
        assert end == older and {r["op"] for r in at} == {"insert"}
        assert {_entry(r) for r in at} == held[older] and len(at) == len(held[older])
    # The same tokens give the same rows, and across a restart too.
    before = read_changes(daemon, tokens[1], until=tokens[3])
    paged = read_changes(daemon, tokens[1], limit=3, until=tokens[3])
    assert paged[0] == before[0] and paged[1] == before[1] == tokens[3]
    daemon.kill()
    daemon.start()
    assert read_changes(daemon, tokens[1], until=tokens[3]) == before
    rows, _ = read_changes(daemon, tokens[0])
    replayed: set[str] = set()
    replay(replayed, start)
    replay(replayed, rows)
    assert replayed == modelled(source)


def test_a_token_past_a_rollback_is_gone_and_one_before_it_reads_the_new_history(
    daemon_factory: Any,
) -> None:
    daemon = daemon_factory(**FAST_PERSIST).start()
    source = Source(8)
    for vb in VBUCKETS:
        source.write(vb, 100)
    feed(daemon, source)
    start, first = read_changes(daemon, "snapshot")
    source.write(11, 100)
    feed(daemon, source)
    _, doomed = read_changes(daemon, first)
    # vbucket 11's replica had only its first 150 seqnos; it takes over and goes on.
    source.failover(11, 150)
    source.write(11, 30)
    source.write(222, 20)
    router = feed(daemon, source)
    assert set(router.reply.rollback) == {11}
    gone = HTTP.get(f"{daemon.url}/indexes/{NAME}/changes", params={"since": doomed}, timeout=60)
    assert gone.status_code == 410, gone.text
    assert "start again from a snapshot" in gone.json()["error"]
    rows, _ = read_changes(daemon, first)
    entries: set[str] = set()
    replay(entries, start)
    replay(entries, rows)
    assert entries == modelled(source)


def test_history_past_retention_is_dropped_and_its_tokens_get_410(daemon_factory: Any) -> None:
    daemon = daemon_factory(
        changes={"retention": "0s", "retention_snapshots": 1}, **FAST_PERSIST
    ).start()
    source = Source(9)
    for vb in VBUCKETS:
        source.write(vb, 50)
    feed(daemon, source)
    _, old = read_changes(daemon, "latest")
    lease = HTTP.put(
        f"{daemon.url}/changes/leases/reader-1", json={"token": old, "lease_s": 3600}, timeout=60
    )
    assert lease.status_code == 200, lease.text
    for _ in range(3):
        for vb in VBUCKETS:
            source.write(vb, 20)
        feed(daemon, source)
    held, _ = read_changes(daemon, old)  # the lease kept it past the retention
    assert held
    assert daemon.stats(HTTP)["changes"]["leases"]["reader-1"]["token"] == old
    gone = HTTP.delete(f"{daemon.url}/changes/leases/reader-1", timeout=60)
    assert gone.status_code == 204
    assert HTTP.delete(f"{daemon.url}/changes/leases/reader-1", timeout=60).status_code == 404
    for vb in VBUCKETS:
        source.write(vb, 20)
    feed(daemon, source)
    # The history is dropped at a persisted snapshot after the lease went: it may come just
    # after the feed's last ACK.
    deadline = time.monotonic() + WAIT_S
    while True:
        answer = HTTP.get(f"{daemon.url}/indexes/{NAME}/changes", params={"since": old}, timeout=60)
        if answer.status_code != 200 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert answer.status_code == 410, answer.text
    assert "no longer kept" in answer.json()["error"]
    stats = daemon.stats(HTTP)["changes"]
    assert stats["marks"] == 1 and stats["oldest"] == stats["latest"] != old
    bad = HTTP.get(f"{daemon.url}/indexes/{NAME}/changes", params={"since": "x"}, timeout=60)
    assert bad.status_code == 400 and "not a token" in bad.json()["error"]


def test_the_changes_command_prints_the_feed(daemon_factory: Any) -> None:
    daemon = daemon_factory(**FAST_PERSIST).start()
    source = Source(10)
    for vb in VBUCKETS:
        source.write(vb, 40)
    feed(daemon, source)
    out = subprocess.run(
        indexer_command("changes", NAME, "--url", daemon.url, "--limit", "5"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    entries: set[str] = set()
    replay(entries, rows)
    assert entries == modelled(source)
    token = out.stderr.strip().splitlines()[-1].removeprefix("next: ")
    for vb in VBUCKETS:
        source.write(vb, 30)
    feed(daemon, source)
    more = subprocess.run(
        indexer_command("changes", NAME, "--url", daemon.url, "--since", token),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert more.returncode == 0, more.stderr
    replay(entries, [json.loads(line) for line in more.stdout.splitlines()])
    assert entries == modelled(source)
    stale = subprocess.run(
        indexer_command("changes", NAME, "--url", daemon.url, "--since", "nothing.1"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert stale.returncode == 1 and "HTTP 410" in stale.stderr
    assert len(stale.stderr.strip().splitlines()) == 1


def test_a_snapshot_start_in_pages_survives_a_kill_and_goes_on_to_the_changes(
    daemon_factory: Any,
) -> None:
    daemon = daemon_factory(**FAST_PERSIST).start()
    source = Source(10, docids_per_vbucket=200)
    for vb in VBUCKETS:
        source.write(vb, 600)
    feed(daemon, source)
    at_start = modelled(source)  # the index at the snapshot the pages start from
    limit = len(at_start) // 12 + 1  # more than 10 pages
    url = f"{daemon.url}/indexes/{NAME}/changes"
    since, pages, start = "snapshot", 0, []
    mark: str | None = None
    while True:
        params = {"since": since, "limit": limit}
        answer = HTTP.get(url, params=params, timeout=60)
        assert answer.status_code == 200, answer.text
        page = [json.loads(line) for line in answer.text.splitlines() if line]
        after = answer.headers[NEXT_HEADER]
        alone = HTTP.get(url, params={**params, "only": "token"}, timeout=60)
        assert (alone.status_code, alone.headers[NEXT_HEADER]) == (200, after), alone.text
        assert 0 < len(page) <= limit and {r["op"] for r in page} == {"insert"}
        mark = mark or page[0]["snapshot"]
        assert {r["snapshot"] for r in page} == {mark}
        start += page
        pages += 1
        if after.count(".") == 1:  # the start's end: its mark's token, to read changes from
            assert after == mark
            break
        assert after.startswith(mark + ".s."), after
        since = after
        # Under a feed: the persisted snapshot moves on while the pages read their own.
        for vb in VBUCKETS:
            source.write(vb, 20)
        feed(daemon, source)
        if pages == 5:  # the pin is gone with the process: the pages go on from the history
            daemon.kill()
            daemon.start()
    assert pages > 10, pages
    entries: set[str] = set()
    replay(entries, start)  # an entry given twice fails here
    assert entries == at_start and len(start) == len(at_start)
    rows, _ = read_changes(daemon, mark)
    replay(entries, rows)
    assert entries == modelled(source)
    # The feed held the history of the start for its pages, and says so.
    leases = daemon.stats(HTTP)["changes"]["leases"]
    assert leases[f"~snapshot-pages.{mark.split('.')[1]}"]["token"] == mark
    # A token inside a start and one past its end, read together, are the rest of the start.
    half = HTTP.get(url, params={"since": "snapshot", "until": mark, "limit": limit}, timeout=60)
    inside = half.headers[NEXT_HEADER]
    rest = HTTP.get(url, params={"since": inside, "until": mark}, timeout=60)
    assert rest.status_code == 200, rest.text
    got = [json.loads(line) for line in half.text.splitlines() + rest.text.splitlines() if line]
    assert {_entry(r) for r in got} == at_start and len(got) == len(at_start)
    for bad, message in (
        ({"since": inside, "until": "x"}, "not a token"),
        ({"since": mark, "until": inside}, "inside a snapshot start"),
        ({"since": inside[:-2] + "!!"}, "not a token"),
    ):
        answer = HTTP.get(url, params=bad, timeout=60)
        assert answer.status_code == 400 and message in answer.json()["error"], answer.text


def test_a_retention_of_seconds_drops_unheld_tokens_and_keeps_leased_ones(
    daemon_factory: Any,
) -> None:
    daemon = daemon_factory(
        changes={"retention": "2s", "retention_snapshots": 1}, **FAST_PERSIST
    ).start()
    source = Source(11)
    for vb in VBUCKETS:
        source.write(vb, 40)
    feed(daemon, source)
    _, unheld = read_changes(daemon, "latest")
    for vb in VBUCKETS:
        source.write(vb, 20)
    feed(daemon, source)
    _, leased = read_changes(daemon, "latest")
    leased_at = time.monotonic()
    assert leased != unheld
    lease = HTTP.put(
        f"{daemon.url}/changes/leases/reader-2", json={"token": leased, "lease_s": 600}, timeout=60
    )
    assert lease.status_code == 200, lease.text
    url = f"{daemon.url}/indexes/{NAME}/changes"
    deadline = time.monotonic() + WAIT_S
    while True:  # new snapshots, so that prunes run once both tokens are past 2 s
        for vb in VBUCKETS:
            source.write(vb, 5)
        feed(daemon, source)
        answer = HTTP.get(url, params={"since": unheld}, timeout=60)
        if answer.status_code != 200:
            break
        assert time.monotonic() < deadline, "the history of 2 s was never dropped"
        time.sleep(0.2)
    assert answer.status_code == 410 and "no longer kept" in answer.json()["error"], answer.text
    time.sleep(max(0.0, leased_at + 2.5 - time.monotonic()))  # the leased mark past 2 s too
    rows, _ = read_changes(daemon, leased)  # held by the lease, past the retention
    assert rows
    retention = daemon.stats(HTTP)["changes"]["retention"]
    assert retention["age"]["bound_s"] == 2.0 and retention["snapshots"]["bound"] == 1
    assert retention["oldest_kept_by"] == ["lease reader-2"], retention
    assert retention["leases"]["marks"] >= 2 and retention["size"]["bound_bytes"] is None
