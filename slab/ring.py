"""The circular buffer of one worker queue: mutation slots (parallel lists) in arrival order.

A drain takes entries covered by a stability timestamp; head moves over freed slots at the front.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from operator import itemgetter

import trio

__all__ = ["MutationRing", "RingStatistics"]


@dataclass(frozen=True, slots=True)
class RingStatistics:
    """A snapshot of a :class:`MutationRing`; holes are unused slots between head and tail."""

    capacity: int
    queued: int
    head: int
    tail: int
    holes: int


class MutationRing:
    """Fixed-capacity ring of (vbucket, seqno, chunk, length) entries with per-vbucket drains."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self._cap = capacity
        self._vb = [0] * capacity
        self._seq = [0] * capacity
        self._chunk = [0] * capacity
        self._len = [0] * capacity
        self._used = bytearray(capacity)
        self._ones = memoryview(b"\x01" * capacity)
        self._zeros = memoryview(bytes(capacity))
        self._blank = [0] * capacity
        self._head = 0
        self._size = 0  # slots from head to tail, holes included
        self._queued = 0  # USED slots
        self._space: trio.Event | None = None

    @property
    def capacity(self) -> int:
        """Number of slots."""
        return self._cap

    @property
    def queued(self) -> int:
        """Number of entries waiting (USED slots)."""
        return self._queued

    def __len__(self) -> int:
        """Slots between head and tail, unused holes included."""
        return self._size

    def free_slots(self) -> int:
        """Slots available to :meth:`push_many`."""
        return self._cap - self._size

    def push_many(
        self,
        vbucket: int,
        seqnos: Sequence[int],
        chunks: Sequence[int],
        lengths: Sequence[int],
    ) -> None:
        """Append entries of one vbucket at the tail; OverflowError if they do not all fit."""
        n = len(seqnos)
        if len(chunks) != n or len(lengths) != n:
            raise ValueError(f"{n} seqnos, {len(chunks)} chunks, {len(lengths)} lengths")
        if n > self._cap - self._size:
            raise OverflowError(f"{n} entries but only {self._cap - self._size} free slots")
        if not n:
            return
        cap = self._cap
        t = self._head + self._size
        if t >= cap:
            t -= cap
        k = min(n, cap - t)
        e = t + k
        self._vb[t:e] = [vbucket] * k
        self._seq[t:e] = seqnos[:k]
        self._chunk[t:e] = chunks[:k]
        self._len[t:e] = lengths[:k]
        self._used[t:e] = self._ones[:k]
        if k < n:
            r = n - k
            self._vb[:r] = [vbucket] * r
            self._seq[:r] = seqnos[k:]
            self._chunk[:r] = chunks[k:]
            self._len[:r] = lengths[k:]
            self._used[:r] = self._ones[:r]
        self._size += n
        self._queued += n

    def drain(self, upto: Sequence[int]) -> tuple[list[int], list[int], list[int], list[int]]:
        """Take every entry with ``seqno <= upto[vbucket]``, in ring order, as parallel lists.

        Returns (vbuckets, seqnos, chunks, lengths); uncovered entries stay where they are.
        """
        ov: list[int] = []
        os: list[int] = []
        oc: list[int] = []
        ol: list[int] = []
        if not self._queued:
            return ov, os, oc, ol
        cap = self._cap
        head = self._head
        tail = head + self._size
        segments = [(head, tail)] if tail <= cap else [(head, cap), (0, tail - cap)]
        vbs = self._vb
        seqs = self._seq
        chunks = self._chunk
        lens = self._len
        used = self._used
        # Select first (upto may raise), then take: a failed drain leaves the ring untouched.
        picks = [
            (
                a,
                b,
                [
                    i
                    for i, u, v, s in zip(range(a, b), used[a:b], vbs[a:b], seqs[a:b], strict=True)
                    if u and s <= upto[v]
                ],
            )
            for a, b in segments
        ]
        taken = 0
        for a, b, idx in picks:
            n = len(idx)
            if not n:
                continue
            taken += n
            if n == b - a:  # the whole segment: slices are fastest
                ov += vbs[a:b]
                os += seqs[a:b]
                oc += chunks[a:b]
                ol += lens[a:b]
                used[a:b] = self._zeros[: b - a]
                # A taken slot must not keep its entry's int objects alive: over a ring's
                # first lap that would be ~60 bytes per slot of memory no quota sees.
                blank = self._blank[: b - a]
                seqs[a:b] = chunks[a:b] = lens[a:b] = blank
            elif n == 1:
                i = idx[0]
                ov.append(vbs[i])
                os.append(seqs[i])
                oc.append(chunks[i])
                ol.append(lens[i])
                used[i] = 0
                seqs[i] = chunks[i] = lens[i] = 0
            else:
                get = itemgetter(*idx)
                ov += get(vbs)
                os += get(seqs)
                oc += get(chunks)
                ol += get(lens)
                for i in idx:
                    used[i] = 0
                    seqs[i] = chunks[i] = lens[i] = 0
        if not taken:
            return ov, os, oc, ol
        self._queued -= taken
        self._advance_head()
        return ov, os, oc, ol

    def _advance_head(self) -> None:
        """Move head over the contiguous run of unused slots and wake space waiters."""
        cap = self._cap
        head = self._head
        size = self._size
        tail = head + size
        if not self._queued:
            self._head = tail if tail < cap else tail - cap
            self._size = 0
        else:
            used = self._used
            i = used.find(1, head, min(tail, cap))
            if i < 0:
                # Not in [head, cap): the first USED slot is in the wrapped part [0, tail - cap).
                i = used.find(1, 0, tail - cap)
                self._size = size - (cap - head + i)
            else:
                self._size = size - (i - head)
            self._head = i
        if self._size != size:
            ev = self._space
            if ev is not None:
                self._space = None
                ev.set()

    async def wait_for_space(self, n: int) -> None:
        """Wait until at least ``n`` slots are free (ValueError if ``n`` exceeds the capacity)."""
        if n > self._cap:
            raise ValueError(f"cannot wait for {n} slots in a ring of {self._cap}")
        if self._cap - self._size >= n:
            await trio.lowlevel.checkpoint()
            return
        while self._cap - self._size < n:
            if self._space is None:
                self._space = trio.Event()
            await self._space.wait()

    def statistics(self) -> RingStatistics:
        """Capacity, occupancy, head/tail positions and holes."""
        tail = self._head + self._size
        if tail >= self._cap:
            tail -= self._cap
        return RingStatistics(
            capacity=self._cap,
            queued=self._queued,
            head=self._head,
            tail=tail,
            holes=self._size - self._queued,
        )
