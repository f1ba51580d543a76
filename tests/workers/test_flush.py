"""The flush on a real LevelDB directory: main and back index as the slice writer keeps them."""

from __future__ import annotations

from pathlib import Path

import pytest

from indexer import protocol as p
from indexer.keys import encode_key, split_entry
from indexer.storage import IndexStore, StoredIndex
from workers.flush import BackIndexCache, IndexWriter

DEFS = [p.IndexDefinition("by_city", ("city",)), p.IndexDefinition("by_age", ("age",))]


def record(
    seqno: int, docid: str, city: object = None, age: object = None, deleted: bool = False
) -> bytes:
    keys = (
        (b"", b"")
        if deleted
        else (
            encode_key([city]) if city is not None else b"",
            encode_key([age]) if age is not None else b"",
        )
    )
    # A queued record is the wire record without its leading length field.
    return p.encode_record(p.Mutation(seqno, docid.encode(), keys, deleted))[4:]


def entries(store: IndexStore, index: StoredIndex) -> list[tuple[list[object], str]]:
    out = []
    for entry in store.main_entries(index):
        values, docid = split_entry(entry, 1)
        out.append((values, docid.decode()))
    return out


def back(store: IndexStore, index: StoredIndex) -> dict[str, bytes]:
    return {d.decode(): k for d, k in store.back_entries(index)}


@pytest.fixture
def store(tmp_path: Path):  # type: ignore[no-untyped-def]
    with IndexStore(tmp_path) as s:
        yield s


def writer(store: IndexStore, capacity: int = 1000) -> IndexWriter:
    indexes = store.ensure_indexes(DEFS)
    cache = BackIndexCache(capacity, len(indexes))
    cache.load(store, indexes)
    return IndexWriter(store, indexes, cache)


def test_insert_update_unchanged_and_delete(store: IndexStore) -> None:
    w = writer(store)
    by_city, by_age = store.ensure_indexes(DEFS)
    r = w.apply([record(1, "a", "Oslo", 30), record(1, "b", "Rome", None)])
    assert (r.puts, r.deletes, r.entry_deltas) == (6, 0, (2, 1))
    assert entries(store, by_city) == [(["Oslo"], "a"), (["Rome"], "b")]
    assert entries(store, by_age) == [([30], "a")]
    # Same city, new age: only by_age changes; the old main entry goes.
    r = w.apply([record(2, "a", "Oslo", 31)])
    assert (r.puts, r.deletes) == (2, 1)
    assert entries(store, by_age) == [([31], "a")]
    # Unchanged keys write nothing.
    assert w.apply([record(3, "a", "Oslo", 31)]).puts == 0
    # A delete removes the main and back entries of every index.
    r = w.apply([record(4, "a", deleted=True)])
    assert r.entry_deltas == (-1, -1)
    assert entries(store, by_city) == [(["Rome"], "b")]
    assert entries(store, by_age) == []
    assert back(store, by_city) == {"b": encode_key(["Rome"])}
    assert back(store, by_age) == {}


def test_superseded_mutations_in_one_flush_are_written_once(store: IndexStore) -> None:
    w = writer(store)
    by_city, _ = store.ensure_indexes(DEFS)
    r = w.apply([record(1, "a", "Oslo", 1), record(2, "a", "Rome", 2), record(3, "a", "Lima", 3)])
    assert (r.mutations, r.documents, r.puts, r.deletes) == (3, 1, 4, 0)
    assert entries(store, by_city) == [(["Lima"], "a")]


def test_a_reopened_store_and_a_partial_cache_give_the_same_result(tmp_path: Path) -> None:
    with IndexStore(tmp_path) as s:
        writer(s).apply([record(1, f"d{i}", f"c{i % 7}", i) for i in range(50)])
    with IndexStore(tmp_path) as s:
        w = writer(s, capacity=10)  # too small: misses are read from the store
        assert not w.cache.complete
        w.apply([record(2, f"d{i}", f"c{(i + 1) % 7}", i) for i in range(0, 50, 2)])
        w.apply([record(3, f"d{i}", deleted=True) for i in range(1, 50, 2)])
        by_city, by_age = s.ensure_indexes(DEFS)
        want = sorted((f"c{(i + 1) % 7}", f"d{i}") for i in range(0, 50, 2))
        assert [(v[0], d) for v, d in entries(s, by_city)] == want
        assert len(entries(s, by_age)) == 25
        assert len(back(s, by_city)) == 25


def test_changed_index_keys_are_refused(tmp_path: Path) -> None:
    with IndexStore(tmp_path) as s:
        s.ensure_indexes(DEFS)
    with IndexStore(tmp_path) as s, pytest.raises(Exception, match="stored with keys"):
        s.ensure_indexes([p.IndexDefinition("by_city", ("town",))])


def test_counts_survive_a_restart_with_a_cache_too_small(tmp_path: Path) -> None:
    with IndexStore(tmp_path) as s:
        writer(s).apply([record(1, f"d{i}", f"c{i % 7}", i if i % 3 else None) for i in range(30)])
        by_city, by_age = s.ensure_indexes(DEFS)
        assert (s.count_main(by_city), s.count_main(by_age)) == (30, 20)


def test_keys_of_an_index_being_built_ride_along_and_are_not_written(store: IndexStore) -> None:
    by_city, by_age = store.ensure_indexes(DEFS)
    cache = BackIndexCache(1000, 1)
    cache.load(store, [by_age])
    # Records carry by_city's key first, as for an index created before by_age was merged.
    w = IndexWriter(store, [by_age], cache, record_indexes=["by_city", "by_age"])
    r = w.apply([record(1, "a", "Oslo", 30), record(2, "b", "Rome", None)])
    assert (r.puts, r.entry_deltas) == (2, (1,))
    assert entries(store, by_age) == [([30], "a")]
    assert entries(store, by_city) == [] and back(store, by_city) == {}
    # A change of the skipped key alone writes nothing; one of the written key does.
    assert w.apply([record(3, "a", "Bergen", 30)]).puts == 0
    r = w.apply([record(4, "a", "Bergen", 31), record(5, "b", deleted=True)])
    assert entries(store, by_age) == [([31], "a")]
    assert back(store, by_age) == {"a": encode_key([31])}
    assert entries(store, by_city) == []
