"""Failover-log comparison and undo-based rollback on a real LevelDB store."""

from __future__ import annotations

import random
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from indexer import protocol as p
from indexer.keys import encode_key
from indexer.recovery import RecoveryPoints, prune, restore, rollback_seqno, undo_tags
from indexer.storage import IndexStore
from tests.budget import examples
from workers.flush import BackIndexCache, IndexWriter

DEFS = [p.IndexDefinition("by_city", ("city",)), p.IndexDefinition("by_age", ("age",))]


def test_rollback_seqno_cases() -> None:
    log = ((7, 0),)
    assert rollback_seqno(log, 100, log) is None
    assert rollback_seqno((), 100, log) is None  # nothing known locally: nothing to compare
    assert rollback_seqno(log, 0, ((9, 0),)) is None  # nothing applied: nothing to undo
    # The router failed over at 60: what the indexer has past 60 did not survive.
    assert rollback_seqno(log, 100, ((8, 60), (7, 0))) == 60
    assert rollback_seqno(log, 50, ((8, 60), (7, 0))) is None
    # The indexer saw a branch (8 from 60) the router no longer has; the router's branch 9
    # forked from 7 at 40.
    assert rollback_seqno(((8, 60), (7, 0)), 100, ((9, 40), (7, 0))) == 40
    assert rollback_seqno(((8, 60), (7, 0)), 100, ((9, 80), (7, 0))) == 60
    assert rollback_seqno(log, 100, ((9, 0),)) == 0  # no common entry


@st.composite
def histories(draw: st.DrawFn) -> list[tuple[str, int]]:
    """Events on one vbucket: ("m", n) writes n mutations, ("f", s) fails over to seqno <= s."""
    events = draw(
        st.lists(
            st.one_of(
                st.tuples(st.just("m"), st.integers(1, 20)),
                st.tuples(st.just("f"), st.integers(0, 200)),
                st.tuples(st.just("look"), st.just(0)),
            ),
            max_size=25,
        )
    )
    return [*events, ("look", 0)]


@settings(max_examples=examples(100), deadline=None)
@given(histories(), st.data())
def test_rollback_seqno_finds_the_longest_common_history(
    events: list[tuple[str, int]], data: st.DataObject
) -> None:
    """An indexer that looked at the source at some point rolls back exactly to what survived."""
    history: list[int] = []  # one unique id per seqno
    log: list[tuple[int, int]] = [(1, 0)]
    fresh = iter(range(10**6))
    looks: list[tuple[list[int], tuple[tuple[int, int], ...]]] = []
    for kind, n in events:
        if kind == "m":
            history += [next(fresh) for _ in range(n)]
        elif kind == "f":
            at = min(n, len(history))
            del history[at:]
            log = [(u, s) for u, s in log if s <= at]
            log.insert(0, (10**7 + next(fresh), at))
        else:
            looks.append((list(history), tuple(log)))
    seen, seen_log = data.draw(st.sampled_from(looks))
    common = 0
    while common < min(len(seen), len(history)) and seen[common] == history[common]:
        common += 1
    answer = rollback_seqno(seen_log, len(seen), tuple(log))
    restart = len(seen) if answer is None else answer
    assert restart == common


def dump(store: IndexStore) -> list[list[tuple[bytes, bytes]]]:
    """Every main and back entry of every index."""
    return [
        [
            *store.db.iterator(prefix=index.main_prefix),
            *store.db.iterator(prefix=index.back_prefix),
        ]
        for index in store.all_indexes()
    ]


def test_restore_brings_back_every_recovery_point(tmp_path: Path) -> None:
    rng = random.Random(5)
    with IndexStore(tmp_path) as store:
        indexes = store.ensure_indexes(DEFS)
        points = RecoveryPoints(0)
        cache = BackIndexCache(10, len(indexes))  # small: misses are read from the store
        writer = IndexWriter(store, indexes, cache, points.log())
        states = {0: dump(store)}
        for tag in range(1, 8):
            for _ in range(rng.randint(1, 4)):
                records = []
                for seqno in range(rng.randint(1, 60)):
                    docid = b"d%d" % rng.randint(0, 80)
                    deleted = rng.random() < 0.2
                    keys = (
                        (b"", b"")
                        if deleted
                        else (
                            encode_key([rng.choice("ABC")]) if rng.random() < 0.8 else b"",
                            encode_key([rng.randint(1, 5)]),
                        )
                    )
                    mutation = p.Mutation(seqno + 1, docid, keys, deleted)
                    records.append(p.encode_record(mutation)[4:])
                writer.apply(records)
            points.advance(tag)
            states[tag] = dump(store)
        assert undo_tags(store) == list(range(7))
        assert prune(store, 2) > 0
        assert undo_tags(store) == list(range(2, 7))
        for tag in (6, 4, 2):
            restore(store, indexes, tag)
            assert dump(store) == states[tag]
            assert restore(store, indexes, tag) == 0  # again: nothing left to do
        assert undo_tags(store) == []
