"""Scan bounds and splits on a real LevelDB store."""

from __future__ import annotations

import random
import zlib
from pathlib import Path

import pytest

from indexer import protocol as p
from indexer.keys import MISSING, KeyEncodingError, encode_key, entry_tail, split_entry
from indexer.scans import (
    KeyRange,
    ScanRequestError,
    VbucketFilter,
    entry_batches,
    entry_vbuckets,
    iterate,
    key_range,
    merge_spans,
    splits,
)
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
            # The snapshot's entry count in place of the counting walk: the same cuts.
            assert splits(store, index, None, parts, len(everything)) == ranges
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


def mixed_store(store: IndexStore, docids: list[bytes]) -> None:
    """Keys of every kind (MISSING, arrays, objects, long strings) over the given docids."""
    indexes = store.ensure_indexes([p.IndexDefinition("mixed", ("a", "b"))])
    writer = IndexWriter(store, indexes, BackIndexCache(10_000, 1))
    values: list[object] = [None, True, 1.5, -3, "x" * 40, "é", [1, ["z"]], {"k": "v"}]
    records = []
    for i, docid in enumerate(docids):
        leading = values[i % len(values)]
        second = MISSING if i % 3 == 0 else values[(i // 2) % len(values)]
        key = encode_key([leading, second])
        records.append(p.encode_record(p.Mutation(i + 1, docid, (key,)))[4:])
    writer.apply(records)


@pytest.mark.parametrize("chunk", [1, 7, 8192])
def test_entry_batches_equal_iterate(tmp_path: Path, chunk: int) -> None:
    """The array split of a batch gives the rows the per-entry decoding gives, in order."""
    docids = [b"d%d" % i for i in range(300)] + [b"", b"x" * 250, "ü".encode(), b"\xff\xfe"]
    with IndexStore(tmp_path) as store:
        mixed_store(store, docids)
        index = store.index("mixed")
        expected = [(r.key, r.docid) for r in iterate(store, index, None, KeyRange())]
        got = []
        for batch in entry_batches(store, index, None, KeyRange(), chunk=chunk):
            assert len(batch) <= chunk
            for code, docid in zip(batch.codes.to_pylist(), batch.docids.to_pylist(), strict=True):
                got.append((batch.keys[code], docid))
        assert got == expected
        assert len(got) == len(docids)
        assert "\ufffd\ufffd" in {d for _, d in got}  # invalid UTF-8 shown as replacement


def test_entry_batches_honour_range_and_limit(tmp_path: Path) -> None:
    with IndexStore(tmp_path) as store:
        fill(store, 500)
        index = store.index("by_n")
        bounds = key_range(2, low=10, high=12, has_low=True, has_high=True)
        rows = [r.docid for r in iterate(store, index, None, bounds, limit=25)]
        batches = list(entry_batches(store, index, None, bounds, limit=25, chunk=10))
        assert [len(b) for b in batches] == [10, 10, 5]
        assert [d for b in batches for d in b.docids.to_pylist()] == rows


def test_entry_batches_reject_a_corrupt_tail(tmp_path: Path) -> None:
    with IndexStore(tmp_path) as store:
        fill(store, 3)
        index = store.index("by_n")
        store.db.put(index.main_prefix + encode_key([1, 1]) + b"\x00\xff", b"")
        with pytest.raises(KeyEncodingError):
            list(entry_batches(store, index, None, KeyRange()))


def test_an_older_store_gets_docid_lengths_on_open(tmp_path: Path) -> None:
    """Main entries written without the docid length are rebuilt from the back index."""
    with IndexStore(tmp_path) as store:
        fill(store, 100)
        index = store.index("by_n")
        expected = [(r.key, r.docid) for r in iterate(store, index, None, KeyRange())]
        old = [
            (e, index.main_prefix + e[: -2 - len(split_entry(e, 2)[1])] + split_entry(e, 2)[1])
            for e in store.main_entries(index)
        ]
        store.write([(o, b"") for _, o in old], [index.main_prefix + e for e, _ in old])
        store.db.delete(b"\x00meta:format")
    with IndexStore(tmp_path) as store:
        index = store.index("by_n")
        assert [(r.key, r.docid) for r in iterate(store, index, None, KeyRange())] == expected
        assert store.count_main(index) == 100


def test_spans_merge_into_disjoint_ranges_in_order() -> None:
    def r(a: int | None, b: int | None) -> KeyRange:
        return KeyRange(None if a is None else bytes([a]), None if b is None else bytes([b]))

    assert merge_spans([r(5, 9), r(1, 3), r(2, 4), r(9, 12), r(20, 20)]) == (r(1, 4), r(5, 12))
    assert merge_spans([r(5, None), r(7, 9), r(None, 2)]) == (r(None, 2), r(5, None))
    assert merge_spans([r(None, None), r(3, 4)]) == (r(None, None),)


def test_a_vbucket_filter_keeps_the_entries_of_its_vbuckets_as_zlib_hashes_them() -> None:
    rng = random.Random(11)
    docids = [b"", b"a", "dé\U0001f600".encode(), bytes(range(256)), b"x" * 700]
    docids += [rng.randbytes(rng.randrange(0, 40)) for _ in range(3000)]
    entries = [b"\x07" + encode_key([f"k{i % 13}"]) + entry_tail(d) for i, d in enumerate(docids)]
    for num in (1, 7, 1024):
        want = [zlib.crc32(d) % num for d in docids]
        assert entry_vbuckets(entries, num).tolist() == want
        keep = frozenset(rng.sample(range(num), max(1, num // 3)))
        kept = list(VbucketFilter(keep, num).entries(iter(entries)))
        assert kept == [e for e, vb in zip(entries, want, strict=True) if vb in keep]
    assert entry_vbuckets([], 1024).tolist() == []
    with pytest.raises(KeyEncodingError, match="shorter than its docid length"):
        entry_vbuckets([b"\x07abc" + b"\x00\x09"], 1024)
