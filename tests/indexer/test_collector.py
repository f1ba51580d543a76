"""The cycle collector's policy: thresholds set and restored, pauses counted and timed."""

from __future__ import annotations

import gc

from indexer.collector import THRESHOLDS, rare_collections


class _Node:
    def __init__(self) -> None:
        self.other: _Node | None = None


def _cycles(n: int) -> None:
    for _ in range(n):
        a, b = _Node(), _Node()
        a.other, b.other = b, a


def test_thresholds_apply_inside_and_are_restored_after() -> None:
    before = gc.get_threshold()
    callbacks = list(gc.callbacks)
    with rare_collections() as pauses:
        assert gc.get_threshold() == THRESHOLDS
        assert gc.get_freeze_count() > 0  # what existed on entry is out of reach
        assert pauses.statistics().thresholds == THRESHOLDS
    assert gc.get_threshold() == before
    assert gc.get_freeze_count() == 0
    assert gc.callbacks == callbacks


def test_every_collection_is_counted_and_timed_by_generation() -> None:
    with rare_collections() as pauses:
        start = pauses.statistics()
        assert start.collections == (0, 0, 0)
        _cycles(1_000)
        found = gc.collect(0)
        gc.collect(2)
        stats = pauses.statistics()
    assert found >= 2_000  # the cycles made inside were collected by the young collection
    assert stats.collections[0] >= 1 and stats.collections[2] >= 1
    assert stats.pause_s_longest[0] > 0 and stats.pause_s_longest[2] > 0
    pairs = zip(stats.pause_s_total, stats.pause_s_longest, strict=True)
    assert all(total >= longest for total, longest in pairs)
    # Outside, nothing more is counted.
    gc.collect(0)
    assert pauses.statistics().collections == stats.collections
