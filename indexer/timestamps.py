"""Timestamps of the pipeline: a vector of seqnos (and vbuuids) per vbucket (a leaf module).

`StabilityTimestamp` is a point everything at or below is applied at (what a snapshot covers);
`HighWaterTimestamp` is what the workers have queued so far, which the timekeeper reads to cut
the next stability timestamp. The workers write one, the timekeeper reads it: both import it
from here, and neither imports the other.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from indexer.protocol import VbucketPosition


@dataclass(frozen=True)
class StabilityTimestamp:
    """A seqno and vbuuid per vbucket; everything at or below the seqnos is applied."""

    seqnos: tuple[int, ...]
    vbuuids: tuple[int, ...]

    @classmethod
    def zero(cls, num_vbuckets: int) -> StabilityTimestamp:
        return cls((0,) * num_vbuckets, (0,) * num_vbuckets)

    def covers(self, seqnos: Iterable[tuple[int, int]]) -> bool:
        """True when every (vbucket, seqno) given is at or below this timestamp."""
        mine = self.seqnos
        return all(mine[vb] >= seqno for vb, seqno in seqnos)

    def positions(self, vbuckets: Iterable[int]) -> tuple[VbucketPosition, ...]:
        return tuple(VbucketPosition(vb, self.seqnos[vb], self.vbuuids[vb]) for vb in vbuckets)

    @property
    def total(self) -> int:
        """Sum of seqnos: a rough count of what the timestamp covers, for logs."""
        return sum(self.seqnos)


class HighWaterTimestamp:
    """Per vbucket: highest queued seqno, vbuuid, current snapshot marker, last complete snapshot.

    Only the worker owning a vbucket writes its entries; the timekeeper reads them.
    """

    def __init__(self, start: StabilityTimestamp) -> None:
        n = len(start.seqnos)
        self.seqnos = list(start.seqnos)
        self.vbuuids = list(start.vbuuids)
        self.snapshot_start = list(start.seqnos)
        self.snapshot_end = list(start.seqnos)
        self.stable = list(start.seqnos)
        self.num_vbuckets = n

    def reset(self, start: StabilityTimestamp) -> None:
        """After a rollback: everything restarts from `start`."""
        self.seqnos[:] = start.seqnos
        self.vbuuids[:] = start.vbuuids
        self.snapshot_start[:] = start.seqnos
        self.snapshot_end[:] = start.seqnos
        self.stable[:] = start.seqnos

    def reset_vbuckets(self, vbuckets: set[int]) -> None:
        """Vbuckets handed to another node: they start from seqno 0 if they come back."""
        for vb in vbuckets:
            self.seqnos[vb] = self.snapshot_start[vb] = self.snapshot_end[vb] = 0
            self.stable[vb] = 0

    def record_begin(self, vbucket: int, vbuuid: int) -> None:
        self.vbuuids[vbucket] = vbuuid

    def record_marker(self, vbucket: int, start: int, end: int) -> None:
        # A new marker closes the previous snapshot even if its last seqnos were deduplicated.
        if self.snapshot_end[vbucket] > self.stable[vbucket]:
            self.stable[vbucket] = max(self.seqnos[vbucket], self.stable[vbucket])
        self.snapshot_start[vbucket] = start
        self.snapshot_end[vbucket] = end

    def record_mutations(self, vbucket: int, last_seqno: int) -> None:
        self.seqnos[vbucket] = last_seqno
        if last_seqno >= self.snapshot_end[vbucket]:
            self.stable[vbucket] = last_seqno

    def stability_timestamp(self) -> StabilityTimestamp:
        """Aligned to snapshot markers: no vbucket shows half a snapshot."""
        return StabilityTimestamp(tuple(self.stable), tuple(self.vbuuids))

    def high_water(self) -> StabilityTimestamp:
        """Everything queued, aligned or not."""
        return StabilityTimestamp(tuple(self.seqnos), tuple(self.vbuuids))
