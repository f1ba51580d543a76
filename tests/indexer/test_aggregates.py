"""Aggregates in the index (indexer/aggregates.py) against a plain model of the same entries."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from indexer import protocol as p
from indexer.aggregates import AggregateError, aggregate, decoded_values, parse_aggregates
from indexer.keys import MISSING, collate, encode_key
from indexer.scans import KeyRange, entry_batches, key_names
from indexer.storage import IndexStore
from workers.flush import BackIndexCache, IndexWriter

PATHS = ["city", "age"]
VALUES = st.one_of(
    st.just(MISSING),
    st.none(),
    st.integers(-5, 5),
    st.floats(-5, 5, allow_nan=False),
    st.sampled_from(["a", "b", "c"]),
    st.booleans(),
)


def model(rows: list[tuple[list[Any], str]], group_by: int) -> list[dict[str, Any]]:
    """The groups by plain Python: sort, group, aggregate."""
    rows = sorted(rows, key=functools.cmp_to_key(lambda a, b: _cmp(a[0], b[0])))
    groups: list[tuple[list[Any], list[list[Any]]]] = []
    for key, _ in rows:
        head = key[:group_by]
        if groups and all(
            (x is MISSING) == (y is MISSING) and (x is MISSING or collate(x, y) == 0)
            for x, y in zip(groups[-1][0], head, strict=True)
        ):
            groups[-1][1].append(key)
        else:
            groups.append((head, [key]))
    out = []
    for head, keys in groups:
        ages = [k[1] for k in keys if k[1] is not MISSING and k[1] is not None]
        numbers = [a for a in ages if isinstance(a, int | float) and not isinstance(a, bool)]
        entry: dict[str, Any] = {"group": [None if v is MISSING else v for v in head]}
        missing = [i for i, v in enumerate(head) if v is MISSING]
        if missing:
            entry["missing"] = missing
        entry["count"] = len(keys)
        entry["count(age)"] = len(ages)
        # Numbers are one type in the index: -4 and -4.0 are one value.
        entry["count_distinct(age)"] = len(
            {("n", a) if _numeric(a) else (type(a), a) for a in ages}
        )
        entry["min(age)"] = min(ages, key=functools.cmp_to_key(collate)) if ages else None
        entry["max(age)"] = max(ages, key=functools.cmp_to_key(collate)) if ages else None
        entry["sum(age)"] = sum(numbers) if numbers else None
        entry["avg(age)"] = sum(numbers) / len(numbers) if numbers else None
        out.append(entry)
    return out


def _numeric(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _cmp(a: list[Any], b: list[Any]) -> int:
    for x, y in zip(a, b, strict=True):
        c = collate(x, y)
        if c:
            return c
    return 0


def test_a_bad_request_says_what_is_wrong() -> None:
    for text, message in (
        ("cnt", "is not one of"),
        ("min", "needs a key path"),
        ("avg(zip)", "is not a key of the index"),
        ("count,count", "each once"),
    ):
        with pytest.raises(AggregateError, match=message):
            parse_aggregates(text, PATHS)


def test_a_key_is_named_by_its_path_its_text_or_its_column_name() -> None:
    keys = ["DISTINCT ARRAY t FOR t IN tags END", "age DESC", "LOWER(name)"]
    for text, position in (
        ("min(age)", 1),
        ("min(age DESC)", 1),
        ("count_distinct(tags)", 0),
        ("count_distinct(DISTINCT ARRAY t FOR t IN tags END)", 0),
        ("max(LOWER(name))", 2),
        ("max(LOWER_name)", 2),
    ):
        (parsed,) = parse_aggregates(text, keys)
        assert parsed.position == position, text
        assert parsed.name == text  # the answer's column is named as asked
    assert key_names(["address.city DESC"]) == {
        "address.city DESC": 0,
        "address.city": 0,
        "address_city": 0,
    }


@settings(max_examples=40, deadline=None)
@given(
    rows=st.lists(st.tuples(st.sampled_from(["x", "y", "z"]), VALUES), max_size=60),
    group_by=st.integers(0, 2),
)
def test_groups_equal_the_model(
    tmp_path_factory: pytest.TempPathFactory, rows: list[tuple[str, Any]], group_by: int
) -> None:
    tmp: Path = tmp_path_factory.mktemp("agg")
    entries = [([city, age], f"d{i}") for i, (city, age) in enumerate(rows)]
    with IndexStore(tmp) as store:
        (index,) = store.ensure_indexes([p.IndexDefinition("by", tuple(PATHS))])
        writer = IndexWriter(store, [index], BackIndexCache(1000, 1))
        records = [
            p.encode_record(p.Mutation(i + 1, docid.encode(), (encode_key(key),)))[4:]
            for i, (key, docid) in enumerate(entries)
            if key[0] is not MISSING
        ]
        writer.apply(records)
        wanted = parse_aggregates(
            "count,count(age),count_distinct(age),min(age),max(age),sum(age),avg(age)", PATHS
        )
        batches = entry_batches(store, index, None, KeyRange(), chunk=7)
        got = list(aggregate(batches, group_by, wanted))
        # Counts decode only the groups' values, most keys not at all.
        counting = parse_aggregates("count", PATHS)
        needed = decoded_values(group_by, counting)
        batches = entry_batches(
            store, index, None, KeyRange(), chunk=7, docids=False, decode=needed
        )
        counted = list(aggregate(batches, group_by, counting))
    want = model(entries, group_by)
    if not entries and group_by == 0:  # no entries: one empty group, as SQL's COUNT(*) gives
        empty = {"count": 0, "count(age)": 0, "count_distinct(age)": 0}
        none = dict.fromkeys(["min(age)", "max(age)", "sum(age)", "avg(age)"])
        want = [{"group": [], **empty, **none}]
    assert _approx(got) == _approx(want)
    kept = ("group", "missing", "count")
    assert counted == [{k: v for k, v in g.items() if k in kept} for g in want]


def _approx(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: round(v, 9) if isinstance(v, float) else v for k, v in g.items()} for g in groups]
