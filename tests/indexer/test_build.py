"""How an index build cuts what its stream delivered into flushes (indexer/build.py)."""

from __future__ import annotations

from indexer import protocol as p
from indexer.build import QueuedBatch, _piece_end


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
        marker, batch(3), batch(4), marker, batch(2), batch(9), batch(1), marker
    ]
    assert pieces(items, 7) == [[-1, 3, 4, -1], [2], [9], [1, -1]]
    assert pieces(items, 100) == [[-1, 3, 4, -1, 2, 9, 1, -1]]
    assert pieces(items, 1) == [[-1, 3], [4, -1], [2], [9], [1, -1]]  # a batch over the cap alone
    assert pieces([marker], 5) == [[-1]]
