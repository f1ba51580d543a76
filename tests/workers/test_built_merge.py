"""Merging a built index's back-index cache into maintenance's while both go on writing.

`BuiltIndexMerge` widens the maintenance cache a slice at a time; writes of either cache between
slices are redone at `finish`. Whatever the interleaving and the caches' sizes, the merged cache
must agree with the store's back index for every document it holds, and hold every indexed
document while it says it is complete.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from indexer import protocol as p
from indexer.keys import encode_key
from indexer.storage import IndexStore, StoredIndex
from workers.flush import BackIndexCache, BuiltIndexMerge, IndexWriter

ACTIVE = [p.IndexDefinition("by_city", ("city",)), p.IndexDefinition("by_age", ("age",))]
BUILT = p.IndexDefinition("by_zip", ("zip",))
# Deferred indexes built together: one build, one cache with a column per index.
BUILT_TOGETHER = [BUILT, p.IndexDefinition("by_name", ("name",)), p.IndexDefinition("x", ("x",))]


def record(seqno: int, docid: bytes, keys: tuple[bytes, ...]) -> bytes:
    deleted = not any(keys)
    return p.encode_record(p.Mutation(seqno, docid, keys, deleted))[4:]


def key(rng: random.Random, present: float = 0.8) -> bytes:
    """An index key, or b"" (not in that index) one time in five."""
    return encode_key([rng.randrange(50)]) if rng.random() < present else b""


class Writes:
    """Random writes of the same documents through maintenance's and the build's writers."""

    def __init__(
        self, rng: random.Random, docs: int, main: IndexWriter, build: IndexWriter, built: int = 1
    ):
        self.rng = rng
        self.built = built  # the indexes the build writes
        self.docids = [f"doc{i}".encode() for i in range(docs)]
        self.main = main
        self.build = build
        self.seqno = 0

    def batch(self, n: int) -> None:
        rng = self.rng
        main_records = []
        build_records = []
        for _ in range(n):
            self.seqno += 1
            docid = rng.choice(self.docids)
            if rng.random() < 0.1:  # a delete leaves every index
                main_records.append(record(self.seqno, docid, (b"", b"")))
                build_records.append(record(self.seqno, docid, (b"",) * self.built))
            else:
                main_records.append(record(self.seqno, docid, (key(rng), key(rng))))
                built = tuple(key(rng, 0.5) for _ in range(self.built))
                build_records.append(record(self.seqno, docid, built))
        # The two streams are applied independently, as maintenance and the build are.
        if rng.random() < 0.5:
            self.main.apply(main_records)
        if rng.random() < 0.7:
            self.build.apply(build_records)


def stored_keys(store: IndexStore, indexes: list[StoredIndex]) -> dict[bytes, tuple[bytes, ...]]:
    out: dict[bytes, list[bytes]] = {}
    for j, index in enumerate(indexes):
        for docid, k in store.back_entries(index):
            out.setdefault(docid, [b""] * len(indexes))[j] = k
    return {docid: tuple(keys) for docid, keys in out.items()}


def check(cache: BackIndexCache, store: IndexStore, indexes: list[StoredIndex]) -> None:
    truth = stored_keys(store, indexes)
    empty = (b"",) * len(indexes)
    assert cache.nindexes == len(indexes)
    for docid, keys in cache.entries.items():
        assert keys == truth.get(docid, empty), docid
    if cache.complete:
        assert set(truth) <= set(cache.entries)


@pytest.mark.parametrize(
    ("main_capacity", "build_capacity"),
    [(50_000, 50_000), (300, 50_000), (50_000, 300), (300, 300)],
)
@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("prepared", [True, False])
@pytest.mark.parametrize(
    "docs", [pytest.param(3_000), pytest.param(12_000, marks=pytest.mark.soak)]
)
def test_merged_cache_agrees_with_the_store(
    tmp_path: Path, main_capacity: int, build_capacity: int, seed: int, prepared: bool, docs: int
) -> None:
    """`docs` documents, written 2.5 times each on average: 300 entries are a cache too small
    for them, 50,000 one that holds them all; 100 documents a slice give many slices."""
    rng = random.Random(seed)
    with IndexStore(tmp_path) as store:
        active = store.ensure_indexes(ACTIVE)
        built = store.create_index(BUILT, "building")
        main_cache = BackIndexCache(main_capacity, len(active))
        build_cache = BackIndexCache(build_capacity, 1)
        main = IndexWriter(store, active, main_cache)
        build = IndexWriter(store, [built], build_cache)
        writes = Writes(rng, docs, main, build)
        for _ in range(docs // 200):
            writes.batch(500)
        merge = None
        if prepared:
            merge = BuiltIndexMerge(main_cache, build_cache)
            merge.slice_docs = 100
            steps = 0
            while merge.step(0):  # one slice of documents, then more writes
                writes.batch(200)
                steps += 1
            assert steps >= 1  # the writes really came between slices
            writes.batch(200)
        main_cache.add_built_index(build_cache, merge)
        indexes = [*active, built]
        assert main_cache.recording is None and build_cache.recording is None
        check(main_cache, store, indexes)
        if main_capacity > 300 and build_capacity > 300:
            assert main_cache.complete
        # Maintenance goes on with the merged cache and every index: still in agreement.
        after = IndexWriter(store, indexes, main_cache)
        for i in range(5):
            after.apply(
                [
                    record(10**6 + i * 100 + n, rng.choice(writes.docids), (key(rng),) * 3)
                    for n in range(100)
                ]
            )
        check(main_cache, store, indexes)


@pytest.mark.parametrize(
    ("main_capacity", "build_capacity"), [(50_000, 50_000), (300, 50_000), (50_000, 300)]
)
@pytest.mark.parametrize("seed", [4, 5])
@pytest.mark.parametrize("docs", [pytest.param(2_000), pytest.param(6_000, marks=pytest.mark.soak)])
def test_a_build_of_several_indexes_merges_a_column_for_each(
    tmp_path: Path, main_capacity: int, build_capacity: int, seed: int, docs: int
) -> None:
    rng = random.Random(seed)
    with IndexStore(tmp_path) as store:
        active = store.ensure_indexes(ACTIVE)
        built = [store.create_index(d, "building") for d in BUILT_TOGETHER]
        main_cache = BackIndexCache(main_capacity, len(active))
        build_cache = BackIndexCache(build_capacity, len(built))
        writes = Writes(
            rng,
            docs,
            IndexWriter(store, active, main_cache),
            IndexWriter(store, built, build_cache),
            len(built),
        )
        for _ in range(docs // 300):
            writes.batch(500)
        merge = BuiltIndexMerge(main_cache, build_cache)
        merge.slice_docs = 100
        steps = 0
        while merge.step(0):
            writes.batch(100)
            steps += 1
        assert steps >= 1  # the writes really came between slices
        main_cache.add_built_index(build_cache, merge)
        indexes = [*active, *built]
        check(main_cache, store, indexes)
        after = IndexWriter(store, indexes, main_cache)
        after.apply(
            [record(10**6 + n, rng.choice(writes.docids), (key(rng),) * 5) for n in range(300)]
        )
        check(main_cache, store, indexes)


def test_a_cache_reloaded_meanwhile_is_merged_whole(tmp_path: Path) -> None:
    """A rollback reloads the maintenance cache during the preparation: the merge starts over."""
    rng = random.Random(7)
    with IndexStore(tmp_path) as store:
        active = store.ensure_indexes(ACTIVE)
        built = store.create_index(BUILT, "building")
        main_cache = BackIndexCache(10_000, len(active))
        build_cache = BackIndexCache(10_000, 1)
        writes = Writes(
            rng,
            3_000,
            IndexWriter(store, active, main_cache),
            IndexWriter(store, [built], build_cache),
        )
        writes.batch(3_000)
        merge = BuiltIndexMerge(main_cache, build_cache)
        merge.step(0)
        main_cache.load(store, active)  # a new dict: the prepared slices describe the old one
        writes.batch(500)
        assert not merge.valid(main_cache, build_cache)
        main_cache.add_built_index(build_cache, merge)
        check(main_cache, store, [*active, built])


def test_an_abandoned_merge_stops_recording(tmp_path: Path) -> None:
    with IndexStore(tmp_path) as store:
        active = store.ensure_indexes(ACTIVE)
        main_cache = BackIndexCache(100, len(active))
        build_cache = BackIndexCache(100, 1)
        merge = BuiltIndexMerge(main_cache, build_cache)
        assert main_cache.recording is not None and build_cache.recording is not None
        merge.abandon()
        assert main_cache.recording is None and build_cache.recording is None
