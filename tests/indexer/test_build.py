"""How an index build cuts what its stream delivered into flushes, names its stream and is
resumed at start-up (indexer/build.py); the store's deferred state."""

from __future__ import annotations

from pathlib import Path

from indexer import protocol as p
from indexer.build import (
    QueuedBatch,
    _piece_end,
    forget_progress,
    progress_key,
    read_progress,
    resumed_builds,
    stream_name,
)
from indexer.storage import IndexStore


def batch(records: int) -> QueuedBatch:
    return QueuedBatch(0, list(range(records)), [10] * records, records)


def pieces(items: list[QueuedBatch | p.SnapshotMarker], records: int) -> list[list[int]]:
    """The pieces as the record counts of their batches (-1 for a marker)."""
    out = []
    start = 0
    while start < len(items):
        stop = _piece_end(items, start, records)
        assert stop > start
        out.append([len(i.chunks) if isinstance(i, QueuedBatch) else -1 for i in items[start:stop]])
        start = stop
    return out


def test_flush_pieces_hold_whole_batches_up_to_the_record_cap_in_order() -> None:
    marker = p.SnapshotMarker(0, 1, 9)
    items: list[QueuedBatch | p.SnapshotMarker] = [
        marker,
        batch(3),
        batch(4),
        marker,
        batch(2),
        batch(9),
        batch(1),
        marker,
    ]
    assert pieces(items, 7) == [[-1, 3, 4, -1], [2], [9], [1, -1]]
    assert pieces(items, 100) == [[-1, 3, 4, -1, 2, 9, 1, -1]]
    assert pieces(items, 1) == [[-1, 3], [4, -1], [2], [9], [1, -1]]  # a batch over the cap alone
    assert pieces([marker], 5) == [[-1]]


def test_a_build_of_several_indexes_has_one_stream_named_by_all_of_them() -> None:
    assert stream_name(["by_zip"]) == "by_zip"  # a single index's build: as before
    assert stream_name(["a", "b", "c"]) == "a,b,c"
    assert stream_name(["a", "b", "c"]).split(",") == ["a", "b", "c"]


def test_indexes_with_equal_progress_resume_as_one_build() -> None:
    """A build writes the same progress under each of its indexes in every flush."""
    groups = resumed_builds(
        {
            "a": [5, 0, 7],
            "b": [5, 0, 7],
            "alone": [6, 0, 7],
            "c": [5, 0, 7],
            "new1": [0, 0, 0],
            "new2": [0, 0, 0],
        }
    )
    assert groups == [["a", "b", "c"], ["alone"], ["new1", "new2"]]
    assert resumed_builds({}) == []


def test_deferred_indexes_are_stored_and_change_state_together(tmp_path: Path) -> None:
    definitions = [p.IndexDefinition(n, ("x",)) for n in ("a", "b", "c")]
    with IndexStore(tmp_path) as store:
        stored = store.ensure_indexes(definitions, deferred={"a", "c"})
        assert [(i.definition.name, i.state) for i in stored] == [
            ("a", "deferred"),
            ("b", "active"),
            ("c", "deferred"),
        ]
        built = store.set_states(["c", "a"], "building")
        assert [i.definition.name for i in built] == ["c", "a"]
        assert {i.state for i in built} == {"building"}
        index = store.index("a")
        store.write([(progress_key(index), bytes(8 * 4))], ())
        assert read_progress(store, index, 4) == [0, 0, 0, 0]
        forget_progress(store, [index])
        assert store.get(progress_key(index)) is None
    with IndexStore(tmp_path) as store:  # the states survive a restart
        states = {i.definition.name: i.state for i in store.ensure_indexes(definitions, {"b"})}
        assert states == {"a": "building", "b": "active", "c": "building"}
