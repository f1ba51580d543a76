"""Array and expression indexes through the router's record encoder, the flush and a rollback,
on a real LevelDB directory, against a model that computes each index's entries on its own."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from indexer import protocol as p
from indexer.keys import MISSING, split_entry
from indexer.recovery import RecoveryPoints, restore
from indexer.router.documents import Document
from indexer.router.streams.records import RecordEncoder
from indexer.scans import KeyRange, iterate, lookup
from indexer.storage import IndexStore, StoredIndex
from workers.flush import BackIndexCache, IndexWriter, entry_counts

DEFS = [
    p.IndexDefinition("tags", ("DISTINCT ARRAY t FOR t IN tags END",)),
    p.IndexDefinition("city_tags", ("city", "DISTINCT ARRAY LOWER(t) FOR t IN tags END")),
    p.IndexDefinition("kids", ("ALL ARRAY c.name FOR c IN kids END", "age DESC")),
    p.IndexDefinition("lower_name", ("LOWER(name)", "age * 2 + 1")),
    p.IndexDefinition("age_desc", ("age DESC",)),
    p.IndexDefinition("#primary", ("META().id",)),
]


def _number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def model_entries(name: str, docid: str, doc: dict[str, Any]) -> list[tuple[Any, ...]]:
    """The keys a document has in index `name`, written out by hand (not by the encoder)."""
    get = doc.get
    if name == "tags":
        tags = get("tags", MISSING)
        if not isinstance(tags, list):
            return []
        return [(t,) for t in tags]
    if name == "city_tags":
        city = get("city", MISSING)
        tags = get("tags", MISSING)
        if city is MISSING or not isinstance(tags, list):
            return []
        return [(city, t.lower() if isinstance(t, str) else None) for t in tags]
    if name == "kids":
        kids = get("kids", MISSING)
        if not isinstance(kids, list):
            return []
        names = [k.get("name", MISSING) if isinstance(k, dict) else MISSING for k in kids]
        return [(n, get("age", MISSING)) for n in names if n is not MISSING]
    if name == "lower_name":
        n = get("name", MISSING)
        if n is MISSING:
            return []
        age = get("age", MISSING)
        twice = MISSING if age is MISSING else age * 2 + 1 if _number(age) else None
        return [(n.lower() if isinstance(n, str) else None, twice)]
    if name == "age_desc":
        age = get("age", MISSING)
        return [] if age is MISSING else [(age,)]
    assert name == "#primary"
    return [(docid,)]


def norm(key: Sequence[Any]) -> str:
    """A key as N1QL compares it: 2 and 2.0 are one value, false and 0 are two."""
    return repr(tuple(("number", float(x)) if _number(x) else (type(x).__name__, x) for x in key))


def stored(store: IndexStore, index: StoredIndex) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for entry in store.main_entries(index):
        values, docid = split_entry(entry, len(index.definition.keys), index.definition.desc)
        out.setdefault(docid.decode(), set()).add(norm(values))
    return out


def expected(docs: dict[str, dict[str, Any] | None], name: str) -> dict[str, set[str]]:
    out = {}
    for docid, doc in docs.items():
        if doc is not None:
            keys = {norm(k) for k in model_entries(name, docid, doc)}
            if keys:
                out[docid] = keys
    return out


SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-5, 5), st.sampled_from(["A", "a", "b"]))
DOCS = st.fixed_dictionaries(
    {},
    optional={
        "tags": st.one_of(st.lists(SCALARS, max_size=5), SCALARS),
        "city": st.sampled_from(["Oslo", "Rome"]),
        "kids": st.lists(
            st.one_of(st.fixed_dictionaries({}, optional={"name": SCALARS}), SCALARS), max_size=4
        ),
        "name": st.sampled_from(["Ann", "BOB", "bob"]) | SCALARS,
        "age": st.integers(0, 3) | st.floats(0, 3, allow_nan=False) | SCALARS,
    },
)
EVENTS = st.lists(
    st.tuples(st.sampled_from(["d1", "d2", "d3", "d4"]), st.one_of(st.none(), DOCS)),
    min_size=1,
    max_size=30,
)


@settings(max_examples=150, deadline=None)
@given(st.lists(EVENTS, min_size=1, max_size=4), st.sampled_from([1, 1000]), st.integers(0, 3))
def test_array_and_expression_indexes_equal_the_model(
    tmp_path_factory: Any, flushes: list[list[tuple[str, Any]]], capacity: int, back_to: int
) -> None:
    """Documents whose arrays change between versions, deletes, then a rollback to an earlier
    recovery point: every index holds exactly the model's entries, and counts agree."""
    tmp_path: Path = tmp_path_factory.mktemp("store")
    encoder = RecordEncoder(DEFS)
    with IndexStore(tmp_path) as store:
        indexes = store.ensure_indexes(DEFS)
        points = RecoveryPoints(0)
        cache = BackIndexCache(capacity, len(indexes))  # 1: misses read from the store
        writer = IndexWriter(store, indexes, cache, points.log())
        docs: dict[str, dict[str, Any] | None] = {}
        states = [dict(docs)]
        counts = [0] * len(indexes)
        seqno = 0
        for tag, events in enumerate(flushes, start=1):
            records = []
            for docid, body in events:
                seqno += 1
                records.append(encoder.record(seqno, Document(docid, body))[4:])
                docs[docid] = body
            result = writer.apply(records)
            counts = [c + d for c, d in zip(counts, result.entry_deltas, strict=True)]
            points.advance(tag)
            states.append(dict(docs))
        for index, count in zip(indexes, counts, strict=True):
            name = index.definition.name
            assert stored(store, index) == expected(docs, name), name
            assert count == sum(len(v) for v in stored(store, index).values()), name
        assert entry_counts(store, indexes, cache) == counts
        # Every index reads in index order, DESC keys from high to low.
        for index in indexes:
            rows = list(iterate(store, index, None, KeyRange()))
            assert len(rows) == sum(len(v) for v in stored(store, index).values())
        # The back index gives each document's entries.
        kids = next(i for i in indexes if i.definition.name == "kids")
        in_kids = stored(store, kids)
        for docid in docs:
            got = {norm(r.key) for r in lookup(store, kids, None, docid)}
            assert got == in_kids.get(docid, set())
        tag = min(back_to, len(flushes))
        restore(store, indexes, tag)
        for index in indexes:
            name = index.definition.name
            assert stored(store, index) == expected(states[tag], name), (name, tag)


def test_desc_key_reads_from_high_to_low(tmp_path: Path) -> None:
    encoder = RecordEncoder([DEFS[4]])
    with IndexStore(tmp_path) as store:
        indexes = store.ensure_indexes([DEFS[4]])
        cache = BackIndexCache(100, 1)
        writer = IndexWriter(store, indexes, cache)
        ages = [3, -1, 2.5, "x", None, 10]
        writer.apply(
            [encoder.record(i + 1, Document(f"d{i}", {"age": a}))[4:] for i, a in enumerate(ages)]
        )
        rows = [r.key[0] for r in iterate(store, indexes[0], None, KeyRange())]
        assert rows == ["x", 10, 3, 2.5, -1, None]
