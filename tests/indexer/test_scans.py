"""Scan bounds and splits on a real LevelDB store."""

from __future__ import annotations

from pathlib import Path

import pytest

from indexer import protocol as p
from indexer.keys import encode_key
from indexer.scans import KeyRange, ScanRequestError, iterate, key_range, splits
from indexer.storage import IndexStore
from workers.flush import BackIndexCache, IndexWriter


def fill(store: IndexStore, n: int) -> None:
    indexes = store.ensure_indexes([p.IndexDefinition("by_n", ("n", "m"))])
    cache = BackIndexCache(10 * n, 1)
    writer = IndexWriter(store, indexes, cache)
    records = [
        p.encode_record(p.Mutation(i + 1, b"d%05d" % i, (encode_key([i % 50, i]),)))[4:]
        for i in range(n)
    ]
    writer.apply(records)


def test_splits_cover_the_index_once_in_about_equal_parts(tmp_path: Path) -> None:
    with IndexStore(tmp_path) as store:
        fill(store, 1000)
        index = store.index("by_n")
        everything = [r.docid for r in iterate(store, index, None, KeyRange())]
        for parts in (1, 2, 3, 7):
            ranges = splits(store, index, None, parts)
            assert len(ranges) == parts
            pieces = [[r.docid for r in iterate(store, index, None, rng)] for rng in ranges]
            assert [d for piece in pieces for d in piece] == everything
            assert max(map(len, pieces)) - min(map(len, pieces)) <= 2


def test_key_range_on_prefixes(tmp_path: Path) -> None:
    with IndexStore(tmp_path) as store:
        fill(store, 200)
        index = store.index("by_n")

        def ns(**kw: object) -> list[object]:
            bounds = key_range(2, **kw)  # type: ignore[arg-type]
            return sorted({r.key[0] for r in iterate(store, index, None, bounds)})

        assert ns(eq=7, has_eq=True) == [7]
        assert ns(low=3, high=5, has_low=True, has_high=True) == [3, 4, 5]
        assert ns(low=3, high=5, inclusion="neither", has_low=True, has_high=True) == [4]
        assert ns(low=48, has_low=True) == [48, 49]
        assert ns(eq=[7, 57], has_eq=True) == [7]
        with pytest.raises(ScanRequestError):
            key_range(2, eq=[1, 2, 3], has_eq=True)
        with pytest.raises(ScanRequestError):
            key_range(2, low=1, inclusion="sometimes", has_low=True)
