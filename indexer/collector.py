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
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

THRESHOLDS = (10_000, 1_000, 1_000)


@contextlib.contextmanager
def rare_collections() -> Iterator[None]:
    """Collect cycles as THRESHOLDS say while inside, and freeze what exists on entry."""
    old = gc.get_threshold()
    gc.collect()
    gc.freeze()
    gc.set_threshold(*THRESHOLDS)
    try:
        yield
    finally:
        gc.set_threshold(*old)
        gc.unfreeze()


def freeze_long_lived() -> None:
    """Move everything alive now out of the collector's reach for good: call it once the
    structures that live as long as the process (caches, slab pool, rings) exist."""
    gc.freeze()
