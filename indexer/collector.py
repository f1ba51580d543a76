"""The cycle collector's policy for the long-running pipelines (daemon, router, feed).

Every mutation allocates short-lived tuples, and both the daemon (its back-index cache) and the
router (the Mutation Manager's items, the parsed recent documents) keep hundreds of thousands of
objects alive. At CPython's default thresholds (700, 10, 10) the collector runs every few hundred
mutations and, in its older generations, walks all of them: in the daemon 40% of the pipeline's
Python time; in the router a full collection every 1.3 s under a 10,000/s feed, 30-45 ms each,
and 100-170 ms while a build's cursor keeps the Mutation Manager full. A write arriving during
such a pause waits for it. Nothing on the hot path makes reference cycles, so:

- the youngest generation is collected every 10,000 net allocations: a pause of a few ms (at
  100,000 the daemon paused 50-230 ms each time, untracking the back-index cache's new tuples);
- the older generations almost never (after 1,000 collections of the one below): what survives
  the young collections lives long and is freed by reference counting.

`GET /stats` of the daemon and of the router show the collections and their longest pause.
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

THRESHOLDS = (10_000, 1_000, 1_000)


@dataclass(frozen=True)
class CollectorStatistics:
    """What `/stats` shows of the cycle collector: per generation, collections and pauses."""

    thresholds: tuple[int, int, int]
    collections: tuple[int, int, int]
    pause_s_total: tuple[float, float, float]
    pause_s_longest: tuple[float, float, float]


class CollectorPauses:
    """Counts the collections and times their pauses (a `gc.callbacks` entry while inside
    `rare_collections`)."""

    def __init__(self) -> None:
        self._started = 0.0
        self._collections = [0, 0, 0]
        self._total = [0.0, 0.0, 0.0]
        self._longest = [0.0, 0.0, 0.0]

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        pause = time.perf_counter() - self._started
        generation = info["generation"]
        self._collections[generation] += 1
        self._total[generation] += pause
        self._longest[generation] = max(self._longest[generation], pause)

    def statistics(self) -> CollectorStatistics:
        def three(values: list[float]) -> tuple[float, float, float]:
            return (round(values[0], 6), round(values[1], 6), round(values[2], 6))

        a, b, c = gc.get_threshold()
        return CollectorStatistics(
            (a, b, c),
            (self._collections[0], self._collections[1], self._collections[2]),
            three(self._total),
            three(self._longest),
        )


@contextlib.contextmanager
def rare_collections() -> Iterator[CollectorPauses]:
    """Collect cycles as THRESHOLDS say while inside, freeze what exists on entry, and time
    every collection."""
    old = gc.get_threshold()
    gc.collect()
    gc.freeze()
    gc.set_threshold(*THRESHOLDS)
    pauses = CollectorPauses()
    gc.callbacks.append(pauses)
    try:
        yield pauses
    finally:
        gc.callbacks.remove(pauses)
        gc.set_threshold(*old)
        gc.unfreeze()


def freeze_long_lived() -> None:
    """Move everything alive now out of the collector's reach for good: call it once the
    structures that live as long as the process (caches, slab pool, rings) exist."""
    gc.freeze()
