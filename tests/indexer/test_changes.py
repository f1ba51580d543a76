"""The change history on a real LevelDB directory: records beside the entries, marks, reads
between marks, going back past a timestamp, retention."""

from __future__ import annotations

import marshal
from pathlib import Path

import pytest

from indexer.changes import (
    HISTORY_PREFIX,
    ChangeHistory,
    ChangeToken,
    ChangeTokenError,
    HistoryGoneError,
    decode_group,
)
from indexer.keys import encode_key
from indexer.storage import IndexStore, StoredIndex
from indexer.timestamps import StabilityTimestamp
from tests.workers.test_flush import DEFS, back, entries, record
from workers.flush import BackIndexCache, IndexWriter

VBUCKETS = 4


def ts(*seqnos: int) -> StabilityTimestamp:
    return StabilityTimestamp(tuple(seqnos), (0,) * len(seqnos))


@pytest.fixture
def store(tmp_path: Path):  # type: ignore[no-untyped-def]
    with IndexStore(tmp_path) as s:
        yield s


def writer(store: IndexStore) -> IndexWriter:
    indexes = store.ensure_indexes(DEFS)
    cache = BackIndexCache(1000, len(indexes))
    cache.load(store, indexes)
    return IndexWriter(store, indexes, cache, history=True)


def writing(store: IndexStore) -> tuple[IndexWriter, list[StoredIndex], ChangeHistory]:
    """A writer that keeps history, the indexes it writes, and the history to mark and read."""
    w = writer(store)
    return w, store.all_indexes(), ChangeHistory(store, VBUCKETS)


def rows_of(history: ChangeHistory, store: IndexStore, token: ChangeToken, until: int, **kw):  # type: ignore[no-untyped-def]
    source = store.snapshot()
    try:
        rows, after = history.read(store.index("by_city"), token, until, source, **kw)
        rows = list(rows)
        # Where a read ends is found alike without its rows.
        assert history.locate(store.index("by_city"), token, until, source, **kw) == after
        return rows, after
    finally:
        source.close()


def test_records_between_marks_are_the_changes_and_pages_read_the_same(store: IndexStore) -> None:
    w, indexes, history = writing(store)
    first = history.write_mark(ts(0, 0, 0, 0), indexes)
    w.apply([record(1, "a", "Oslo", 30), record(2, "b", "Rome", 40)], [1, 1])
    w.apply([record(1, "c", "Lima", 50)], [2])
    second = history.write_mark(ts(0, 2, 1, 0), indexes)
    w.apply([record(3, "a", "Kyiv", 30), record(4, "b", deleted=True)], [1, 1])
    w.apply([record(2, "c", "Lima", 51)], [2])  # by_city unchanged: no row of by_city
    third = history.write_mark(ts(0, 4, 2, 0), indexes)
    rows, after = rows_of(history, store, ChangeToken(history.history_id, first.number), 3)
    seen = [(r.op, r.key, r.docid, r.snapshot) for r in rows]
    assert seen == [
        ("insert", encode_key(["Oslo"]), b"a", second.number),
        ("insert", encode_key(["Rome"]), b"b", second.number),
        ("delete", encode_key(["Oslo"]), b"a", third.number),
        ("insert", encode_key(["Kyiv"]), b"a", third.number),
        ("delete", encode_key(["Rome"]), b"b", third.number),
        ("insert", encode_key(["Lima"]), b"c", second.number),
    ]
    assert after == ChangeToken(history.history_id, third.number)
    token = ChangeToken(history.history_id, first.number)
    paged = []
    pages = []
    while True:
        start = token
        page, token = rows_of(history, store, token, third.number, limit=2)
        assert len(page) <= 2
        paged += page
        pages.append((start, page, token))
        if token.until is None:
            break
    assert paged == rows and token == after
    # A page's bounds as tokens (a micro-batch's offsets) read that page again.
    for start, page, end in pages:
        if end.until is not None:
            again, at = rows_of(history, store, start, third.number, stop=end)
            assert (again, at) == (page, end)
    with pytest.raises(ChangeTokenError, match="after it"):
        rows_of(history, store, pages[1][2], third.number, stop=pages[0][2])
    # Whole records: a page of one row does not split a delete from its insert.
    page, partial = rows_of(
        history, store, ChangeToken(history.history_id, second.number), 3, limit=1
    )
    assert [r.op for r in page] == ["delete", "insert"]
    assert ChangeToken.decode(partial.encode()) == partial


def in_row_layout(store: IndexStore) -> int:
    """Rewrite every history record as the row layout wrote it: (ids, [(seqno, docid, olds,
    news), ...]), a tuple of every index's value per document. Returns how many."""
    records = list(store.db.iterator(prefix=HISTORY_PREFIX))
    for key, value in records:
        ids, seqnos, docids, olds, news = marshal.loads(value)
        rows = [
            (seqno, docid, tuple(o[i] for o in olds), tuple(n[i] for n in news))
            for i, (seqno, docid) in enumerate(zip(seqnos, docids, strict=True))
        ]
        store.db.put(key, marshal.dumps((ids, rows), 4))
        assert decode_group(store.db.get(key)) == decode_group(value)
    return len(records)


def test_records_of_the_row_layout_read_and_revert_as_the_columns_do(store: IndexStore) -> None:
    w, indexes, history = writing(store)
    by_city, by_age = indexes
    first = history.write_mark(ts(0, 0, 0, 0), indexes)
    w.apply([record(1, "a", "Oslo", 30), record(2, "b", "Rome", 40)], [1, 1])
    kept = history.write_mark(ts(0, 2, 0, 0), indexes)
    want = (entries(store, by_city), entries(store, by_age), back(store, by_city))
    w.apply([record(3, "a", "Kyiv", 31), record(4, "b", deleted=True)], [1, 1])
    w.apply([record(1, "c", "Lima", 50)], [2])
    last = history.write_mark(ts(0, 4, 1, 0), indexes)
    columns = rows_of(history, store, ChangeToken(history.history_id, first.number), last.number)
    assert len(columns[0]) == 6
    assert in_row_layout(store) == 3
    rows = rows_of(history, store, ChangeToken(history.history_id, first.number), last.number)
    assert rows == columns
    assert history.recover(ts(0, 2, 0, 0), indexes) == 3  # a, b and c
    assert (entries(store, by_city), entries(store, by_age), back(store, by_city)) == want
    assert [m.number for m in history.marks()] == [first.number, kept.number]


def test_going_back_past_an_unclean_timestamp_reverts_from_the_records(
    store: IndexStore,
) -> None:
    w = writer(store)
    by_city, by_age = indexes = store.all_indexes()
    history = ChangeHistory(store, VBUCKETS)
    w.apply([record(1, "a", "Oslo", 30), record(2, "b", "Rome", 40)], [1, 1])
    kept = history.write_mark(ts(0, 2, 0, 0), indexes)
    want = (entries(store, by_city), entries(store, by_age), back(store, by_city))
    # Written past the mark (a flush under memory pressure, or after the last persist).
    w.apply([record(3, "a", "Kyiv", 31), record(4, "b", deleted=True)], [1, 1])
    w.apply([record(5, "a", "Lima", 32), record(6, "d", "Oslo", 1)], [1, 1])
    history.write_mark(ts(0, 6, 0, 0), indexes)  # persisted to the store, not to the file
    reverted = history.recover(ts(0, 2, 0, 0), indexes)
    assert reverted == 3
    assert (entries(store, by_city), entries(store, by_age), back(store, by_city)) == want
    assert [m.number for m in history.marks()] == [kept.number]
    assert not list(store.db.iterator(start=b"h\x00\x01" + (3).to_bytes(8, "big"), stop=b"i"))
    # Numbers are never given twice: a token of the mark that went answers "gone".
    again = history.write_mark(ts(0, 2, 0, 0), indexes)
    assert again.number == kept.number + 2
    with pytest.raises(HistoryGoneError, match="no longer kept"):
        rows_of(history, store, ChangeToken(history.history_id, kept.number + 1), again.number)


def test_retention_drops_old_history_and_its_tokens(store: IndexStore) -> None:
    w, indexes, history = writing(store)
    old = history.write_mark(ts(0, 0, 0, 0), indexes)
    w.apply([record(1, "a", "Oslo", 30)], [3])
    middle = history.write_mark(ts(0, 0, 0, 1), indexes)
    w.apply([record(2, "a", "Rome", 30)], [3])
    latest = history.write_mark(ts(0, 0, 0, 2), indexes)
    assert history.prune(keep_s=3600, keep_marks=1) == 0  # young enough
    assert history.prune(keep_s=0, keep_marks=2) == 1  # the record of mark `middle` goes
    assert [m.number for m in history.marks()] == [middle.number, latest.number]
    with pytest.raises(HistoryGoneError, match="no longer kept"):
        rows_of(history, store, ChangeToken(history.history_id, old.number), latest.number)
    rows, _ = rows_of(history, store, ChangeToken(history.history_id, middle.number), 3)
    assert [(r.op, r.key) for r in rows] == [
        ("delete", encode_key(["Oslo"])),
        ("insert", encode_key(["Rome"])),
    ]
    stats = history.statistics()
    assert stats["marks"] == 2 and stats["oldest"].endswith(f".{middle.number}")


def test_an_index_without_history_there_and_tokens_of_another_history_are_gone(
    store: IndexStore,
) -> None:
    writer(store)
    indexes = store.all_indexes()
    history = ChangeHistory(store, VBUCKETS)
    mark = history.write_mark(ts(0, 0, 0, 0), indexes[:1])  # by_age is not active yet
    with pytest.raises(HistoryGoneError, match="no change history yet"):
        source = store.snapshot()
        history.read(store.index("by_age"), ChangeToken(history.history_id, 1), 1, source)
    with pytest.raises(HistoryGoneError, match="another change history"):
        rows_of(history, store, ChangeToken("0000", mark.number), mark.number)
    with pytest.raises(HistoryGoneError, match="never persisted"):
        rows_of(history, store, ChangeToken(history.history_id, mark.number + 5), 9)


@pytest.mark.parametrize(
    "text",
    ["", "abc", "a.b", "a.1.2", "a.3.1.0.0", "a.-1", "a.1.2.3.x", "a.1.s.", "a.1.s.!!", "a.x.s.AA"],
)
def test_tokens_that_the_feed_never_gave_are_refused(text: str) -> None:
    with pytest.raises(ChangeTokenError, match="not a token"):
        ChangeToken.decode(text)


def test_history_of_another_format_is_dropped_with_its_tokens(store: IndexStore) -> None:
    w, indexes, history = writing(store)
    old = history.write_mark(ts(0, 0, 0, 0), indexes)
    w.apply([record(1, "a", "Oslo", 30)], [1])
    history.write_mark(ts(0, 1, 0, 0), indexes)
    store.write([(b"\x00meta:changes", b'{"id": "0bad", "starts": {}}')], ())  # format 1
    again = ChangeHistory(store, VBUCKETS)
    assert again.stale and again.history_id != "0bad"
    again.recover(ts(0, 1, 0, 0), indexes)
    assert not list(store.db.iterator(prefix=b"h")) and not list(again.marks())
    mark = again.open(ts(0, 1, 0, 0), indexes)
    assert mark.number > old.number + 1
    with pytest.raises(HistoryGoneError, match="another change history"):
        rows_of(again, store, ChangeToken("0bad", old.number), mark.number)
    assert not ChangeHistory(store, VBUCKETS).stale


def test_a_lease_keeps_history_past_retention_until_it_ends_or_expires(
    store: IndexStore,
) -> None:
    w, indexes, history = writing(store)
    first = history.write_mark(ts(0, 0, 0, 0), indexes)
    for seqno in range(1, 4):
        w.apply([record(seqno, "a", f"City{seqno}", 30)], [2])
        history.write_mark(ts(0, 0, seqno, 0), indexes)
    token = ChangeToken(history.history_id, first.number)
    history.hold("spark-query", token, lease_s=60)
    assert history.prune(keep_s=0, keep_marks=1) == 0  # the lease holds it all
    history.hold("spark-query", ChangeToken(history.history_id, first.number + 2), lease_s=60)
    assert history.prune(keep_s=0, keep_marks=1) == 2  # moved forward: what is before goes
    assert next(m.number for m in history.marks()) == first.number + 2
    # Leases are kept in the store: a restart keeps holding.
    again = ChangeHistory(store, VBUCKETS)
    assert again.leases["spark-query"].mark == first.number + 2
    assert again.prune(keep_s=0, keep_marks=1) == 0
    later = again.leases["spark-query"].expires_at + 1
    assert again.prune(keep_s=0, keep_marks=1, now=later) == 1  # expired: it goes
    assert "spark-query" not in again.leases
    with pytest.raises(HistoryGoneError, match="no longer kept"):
        again.hold("late", token, lease_s=60)
    assert not again.release("late") and not again.release("spark-query")


def test_vbuckets_leaving_restart_every_history_and_drop_their_records(store: IndexStore) -> None:
    w, indexes, history = writing(store)
    first = history.write_mark(ts(0, 0, 0, 0), indexes)
    w.apply([record(1, "a", "Oslo", 30)], [1])
    w.apply([record(1, "c", "Lima", 50)], [2])
    history.write_mark(ts(0, 1, 1, 0), indexes)
    # Vbucket 1 leaves: its entries go without records, its seqnos start again from 0.
    assert history.restart({1}) == 1
    assert not list(store.db.iterator(start=b"h\x00\x01", stop=b"h\x00\x02"))
    with pytest.raises(HistoryGoneError, match="no change history yet"):
        rows_of(history, store, ChangeToken(history.history_id, first.number), 2)
    third = history.write_mark(ts(0, 0, 1, 0), indexes)
    w.apply([record(1, "d", "Kyiv", 20)], [1])  # vbucket 1 back, from seqno 1 again
    fourth = history.write_mark(ts(0, 1, 1, 0), indexes)
    rows, _ = rows_of(history, store, ChangeToken(history.history_id, third.number), 4)
    assert [(r.op, r.key, r.docid, r.snapshot) for r in rows] == [
        ("insert", encode_key(["Kyiv"]), b"d", fourth.number)
    ]
    with pytest.raises(HistoryGoneError, match="starts at snapshot"):
        rows_of(history, store, ChangeToken(history.history_id, first.number), 4)


def test_retention_by_size_drops_the_oldest_history_beyond_it_whatever_its_age(
    store: IndexStore,
) -> None:
    w, indexes, history = writing(store)
    marks = [history.write_mark(ts(0, 0, 0, 0), indexes)]
    seqno = 0
    for _ in range(4):  # four intervals of about the same size
        for _ in range(20):
            batch = [
                record(seqno + i + 1, f"doc{seqno + i}", f"City{seqno + i}" * 8, i)
                for i in range(100)
            ]
            w.apply(batch, [1] * len(batch))
            seqno += len(batch)
        marks.append(history.write_mark(ts(0, seqno, 0, 0), indexes))
    store.db.compact_range()  # sizes are those of LevelDB's tables
    total = int(store.db.approximate_sizes((b"h", b"i"))[0])
    assert total > 100_000
    # Young history within the size: nothing goes.
    assert history.prune(keep_s=3600, keep_marks=1, keep_bytes=total * 2) == 0
    history.hold("reader", ChangeToken(history.history_id, marks[0].number), lease_s=60)
    assert history.prune(keep_s=3600, keep_marks=1, keep_bytes=total // 3) == 0  # a lease holds
    history.release("reader")
    # About a third of it kept: the oldest intervals go, the latest stays.
    assert history.prune(keep_s=3600, keep_marks=1, keep_bytes=total // 3) > 0
    kept = [m.number for m in history.marks()]
    assert kept[-1] == marks[-1].number and kept[0] in (marks[2].number, marks[3].number)
    with pytest.raises(HistoryGoneError, match="no longer kept"):
        rows_of(history, store, ChangeToken(history.history_id, marks[1].number), kept[-1])
    rows, _ = rows_of(history, store, ChangeToken(history.history_id, kept[0]), kept[-1])
    assert rows and all(r.op == "insert" for r in rows)


@pytest.mark.parametrize("entry", [b"\x00", b"key\x00doc\x00\x03", bytes(range(256)) * 4])
def test_a_token_inside_a_snapshot_start_gives_back_its_entry(entry: bytes) -> None:
    token = ChangeToken("3f9a01c2", 41, entry=entry)
    text = token.encode()
    assert text.count(".") == 3 and text.startswith("3f9a01c2.41.s.")
    assert ChangeToken.decode(text) == token and not token.at_mark
    assert ChangeToken.decode("3f9a01c2.41").at_mark
