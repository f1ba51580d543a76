"""The router's Mutation Manager: recent mutations in memory, read by many consumers (sans-IO).

Per vbucket, a list of snapshots in seqno order; the last one is *open* and takes the writes.
A snapshot covers a seqno range `start..end` and holds, for each document id written in that
range, only its latest item (seqno, docid, payload; None for a delete): a newer write of a docid
in the open snapshot flags the older item as skipped. The range still covers the skipped seqnos.

Each consumer (an indexer connection) has at most one cursor per vbucket, at a seqno: it has
everything up to there and reads whole snapshots after it (the first one cut to start after the
cursor). A cursor that reads the open snapshot closes it, and a new open snapshot starts, so a
snapshot never changes once read. Closed snapshots every cursor has passed are freed; runs of
consecutive closed snapshots no cursor is in are collapsed into one, de-duplicating across them.

A consumer whose connection may break also says what it holds for good (`keep`: what the
indexer acknowledged): memory keeps what follows that seqno until the consumer moves it on, as
if a cursor stood there, so that after a reconnect it resumes from memory rather than from the
source log (what was in flight when a connection closed is not lost to memory).

Memory is capped: over the cap the manager first expels what no cursor needs, then drops the
cursors (and kept seqnos) furthest behind. A dropped cursor, or one registered below what memory
holds, must read the source log (the caller's job) and then `rejoin` memory at the seqno it
reached.

Guarantee to every cursor: each snapshot it reads starts right after its seqno (no gap, nothing
twice), and after it the consumer holds, for every docid, its latest item as of the snapshot's
end. Nothing is omitted. A backfill from the log sends superseded versions too, in seqno order.

Nothing here does IO: the feed owns the sockets, the source log and the backfill queues.
"""

from __future__ import annotations

from array import array
from bisect import bisect_right
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from itertools import islice
from typing import NamedTuple, cast

DEFAULT_ITEM_OVERHEAD = 240
"""Bytes charged per item on top of its docid and payload: what an item takes in memory beyond
them (the item, the docid's and payload's objects, its seqno, a slot, a dict entry), measured
with tracemalloc on CPython 3.11 (tests/indexer/test_mutations.py holds the cap to it)."""

_COMPACT_AT = 16
"""A snapshot drops its skipped slots once they are at least this many and outnumber its items."""


class MutationError(Exception):
    """A call the manager refuses: seqnos out of order, an unknown or duplicate cursor."""


class Item(NamedTuple):
    """One mutation of a vbucket: its seqno, document id, and payload (None for a delete)."""

    seqno: int
    docid: bytes
    payload: bytes | None


@dataclass(frozen=True, slots=True)
class Snapshot:
    """What a consumer sends as SNAPSHOT_MARKER(start, end) and then the items, in seqno order.

    `end` is the seqno of the last item; the items are every docid's latest as of `end`.
    """

    vbucket: int
    start: int
    end: int
    items: tuple[Item, ...]


@dataclass(frozen=True, slots=True)
class Backfill:
    """A cursor memory cannot serve: its consumer has everything up to `after` and must read the
    source log after it up to at least `until` (memory held all after `until` when this was said),
    then call `MutationManager.rejoin` with the seqno it reached."""

    consumer: str
    vbucket: int
    after: int
    until: int


class BackfillRequired(MutationError):
    """`read` on a cursor that must backfill first (dropped, or registered below memory)."""

    def __init__(self, backfill: Backfill) -> None:
        super().__init__(
            f"{backfill.consumer!r} on vbucket {backfill.vbucket} must backfill "
            f"from seqno {backfill.after + 1} to {backfill.until}"
        )
        self.backfill = backfill


@dataclass(frozen=True, slots=True)
class MutationStats:
    """Counters for /stats: current sizes, and totals since the manager was made."""

    memory: int
    capacity: int
    items: int
    snapshots: int
    cursors: int
    backfilling: int
    cursors_dropped: int
    kept: int  # consumers' kept seqnos, over all vbuckets
    snapshots_collapsed: int
    items_expelled: int


class _Snapshot:
    """One snapshot: items in seqno order, a skipped item's slot set to None (its skip flag).

    An item's cost is len(docid) + len(payload) + `overhead`, worked out when needed rather
    than held beside it (a tuple and an int per item would be a third of what an item takes).
    """

    __slots__ = ("bytes", "closed", "end", "entries", "latest", "overhead", "seqnos", "start")

    def __init__(self, start: int, overhead: int) -> None:
        self.start = start
        self.end = start - 1  # empty: the range is start..start-1
        self.overhead = overhead
        self.entries: list[Item | None] = []  # None when skipped
        self.seqnos = array("Q")  # the seqno of every slot, skipped ones too: bisect by seqno
        self.latest: dict[bytes, int] = {}  # docid -> slot of its live item
        self.bytes = 0
        self.closed = False

    def cost(self, item: Item) -> int:
        payload = item.payload
        return len(item.docid) + (0 if payload is None else len(payload)) + self.overhead

    def add(self, item: Item) -> int:
        """Append a write, skipping the docid's older item here; returns the change in bytes."""
        freed = 0
        slot = self.latest.get(item.docid)
        if slot is not None:
            freed = self._skip(slot)
        self.latest[item.docid] = len(self.entries)
        self.entries.append(item)
        self.seqnos.append(item.seqno)
        self.end = item.seqno
        cost = self.cost(item)
        self.bytes += cost
        self._maybe_compact()
        return cost - freed

    def _skip(self, slot: int) -> int:
        item = self.entries[slot]
        assert item is not None
        self.entries[slot] = None
        cost = self.cost(item)
        self.bytes -= cost
        return cost

    def absorb(self, later: _Snapshot) -> int:
        """Collapse the next snapshot into this one, de-duplicating; returns the bytes freed."""
        freed = 0
        for docid in later.latest:
            slot = self.latest.get(docid)
            if slot is not None:
                freed += self._skip(slot)
        offset = len(self.entries)
        self.entries.extend(later.entries)
        self.seqnos.extend(later.seqnos)
        for docid, slot in later.latest.items():
            self.latest[docid] = slot + offset
        self.end = later.end
        self.bytes += later.bytes
        self._maybe_compact()
        return freed

    def trim(self, upto: int) -> tuple[int, int]:
        """Expel the items at or below `upto` (nobody needs them); returns (bytes, items)."""
        cut = bisect_right(self.seqnos, upto)
        gone = [item for item in self.entries[:cut] if item is not None]
        self._rebuild(islice(self.entries, cut, None))
        self.start = max(self.start, upto + 1)
        freed = sum(self.cost(item) for item in gone)
        self.bytes -= freed
        return freed, len(gone)

    def view(self, vbucket: int, after: int) -> Snapshot:
        """The snapshot as read by a cursor at `after`: cut to the items above it."""
        first = bisect_right(self.seqnos, after)
        items = tuple(item for item in islice(self.entries, first, None) if item is not None)
        return Snapshot(vbucket, max(self.start, after + 1), self.end, items)

    def _maybe_compact(self) -> None:
        skipped = len(self.entries) - len(self.latest)
        if skipped >= _COMPACT_AT and skipped > len(self.latest):
            self._rebuild(self.entries)

    def _rebuild(self, entries: Iterable[Item | None]) -> None:
        live = [item for item in entries if item is not None]
        self.entries = cast(list[Item | None], live)
        self.seqnos = array("Q", [item.seqno for item in live])
        self.latest = {item.docid: slot for slot, item in enumerate(live)}


class _Cursor:
    """A consumer's place in a vbucket: reading memory after `position`, or backfilling.

    Backfilling (`backfill_after` set): the consumer has everything up to `backfill_after`;
    `position` is where it is parked in memory (pinning what follows), or None once dropped.
    """

    __slots__ = ("backfill_after", "consumer", "position")

    def __init__(self, consumer: str, position: int | None, backfill_after: int | None) -> None:
        self.consumer = consumer
        self.position = position
        self.backfill_after = backfill_after


class _Vbucket:
    """A vbucket's snapshots (the last one open), cursors and high seqno."""

    __slots__ = ("bytes", "cursors", "high", "kept", "number", "snapshots")

    def __init__(self, number: int, high: int, overhead: int) -> None:
        self.number = number
        self.high = high
        self.snapshots = [_Snapshot(high + 1, overhead)]
        self.cursors: dict[str, _Cursor] = {}
        self.kept: dict[str, int] = {}  # consumer -> the seqno it may resume from (`keep`)
        self.bytes = 0

    def floor(self) -> int:
        """Memory holds every mutation after this seqno (de-duplicated)."""
        return self.snapshots[0].start - 1

    def positions(self) -> list[int]:
        """Where cursors stand and consumers keep: memory after the lowest must stay."""
        out = [c.position for c in self.cursors.values() if c.position is not None]
        if self.kept:
            out.extend(self.kept.values())
        return out


class MutationManager:
    """Recent mutations of every vbucket for the consumers' cursors, within `capacity` bytes.

    `high_seqnos`: per vbucket, the seqno the source already holds when the manager starts
    (memory starts empty above it); a vbucket not listed starts at 0.

    The cap: `memory <= capacity` whenever no call is running. `memory` sums, over the items
    held and not skipped, len(docid) + len(payload) + `item_overhead`. Only `write` adds to it,
    and before returning it expels what no cursor needs (recent writes kept for consumers yet to
    come) and then drops cursors, furthest behind first. Nothing pins memory: every cursor can
    be dropped, since the source log has each mutation before the manager does. Not counted:
    skipped slots (at most max(16, live items) per snapshot), bookkeeping per snapshot and
    cursor, and what `read` returned (the caller's; its payloads are shared, not copied).
    """

    def __init__(
        self,
        capacity: int,
        item_overhead: int = DEFAULT_ITEM_OVERHEAD,
        high_seqnos: Mapping[int, int] | None = None,
    ) -> None:
        if capacity < 0 or item_overhead < 0:
            raise ValueError("capacity and item_overhead must be >= 0")
        self.capacity = capacity
        self.item_overhead = item_overhead
        self.memory = 0
        self._highs = dict(high_seqnos or {})
        self._vbuckets: dict[int, _Vbucket] = {}
        self._unpinned: set[int] = set()  # vbuckets that may hold items no cursor needs
        self._dropped = 0
        self._collapsed = 0
        self._expelled = 0

    # ----------------------------------------------------------------------------------------
    # Queries

    def high_seqno(self, vbucket: int) -> int:
        """The seqno of the vbucket's latest write (or its starting high seqno)."""
        return self._vbucket(vbucket).high

    def floor(self, vbucket: int) -> int:
        """Memory holds every mutation of the vbucket after this seqno; below it is disk only."""
        return self._vbucket(vbucket).floor()

    def state(self, consumer: str, vbucket: int) -> int | Backfill:
        """The seqno a cursor has read up to, or the backfill it needs before reading memory."""
        vb, cursor = self._cursor(consumer, vbucket)
        if cursor.backfill_after is not None:
            return self._backfill(vb, cursor)
        assert cursor.position is not None
        return cursor.position

    def pending(self, consumer: str, vbucket: int) -> bool:
        """Whether the cursor has work: memory above it, or a backfill to do."""
        vb, cursor = self._cursor(consumer, vbucket)
        if cursor.position is None or cursor.backfill_after is not None:
            return True
        return cursor.position < vb.high

    def cursors(self, vbucket: int) -> list[str]:
        """The consumers with a cursor on the vbucket, sorted."""
        return sorted(self._vbucket(vbucket).cursors)

    def stats(self) -> MutationStats:
        """Sizes and counters (O(vbuckets + snapshots))."""
        vbs = self._vbuckets.values()
        return MutationStats(
            memory=self.memory,
            capacity=self.capacity,
            items=sum(len(s.latest) for vb in vbs for s in vb.snapshots),
            snapshots=sum(len(vb.snapshots) for vb in vbs),
            cursors=sum(len(vb.cursors) for vb in vbs),
            backfilling=sum(
                c.backfill_after is not None for vb in vbs for c in vb.cursors.values()
            ),
            cursors_dropped=self._dropped,
            kept=sum(len(vb.kept) for vb in vbs),
            snapshots_collapsed=self._collapsed,
            items_expelled=self._expelled,
        )

    # ----------------------------------------------------------------------------------------
    # Writing

    def write(
        self, vbucket: int, seqno: int, docid: bytes, payload: bytes | None
    ) -> list[Backfill]:
        """Queue a mutation (seqnos strictly increase per vbucket) into the open snapshot.

        Returns the cursors dropped to get back under the cap, if any (their consumers must
        backfill); `read` on them raises `BackfillRequired` from now on.
        """
        vb = self._vbucket(vbucket)
        if seqno <= vb.high:
            raise MutationError(
                f"vbucket {vbucket}: seqno {seqno} is not above the last one ({vb.high})"
            )
        vb.high = seqno
        for cursor in vb.cursors.values():  # a loop, not all(...): this runs per mutation
            if cursor.position is not None:
                break
        else:
            self._unpinned.add(vbucket)
        self._grow(vb, vb.snapshots[-1].add(Item(seqno, docid, payload)))
        return self._enforce() if self.memory > self.capacity else []

    def write_all(
        self,
        positions: Sequence[tuple[int, int]],
        docids: Sequence[bytes],
        payloads: Sequence[bytes | None],
    ) -> list[Backfill]:
        """`write` of each (vbucket, seqno), docid and payload in turn (an append's batch);
        every cursor dropped on the way."""
        dropped: list[Backfill] = []
        write = self.write
        for (vbucket, seqno), docid, payload in zip(positions, docids, payloads, strict=True):
            backfills = write(vbucket, seqno, docid, payload)
            if backfills:
                dropped.extend(backfills)
        return dropped

    # ----------------------------------------------------------------------------------------
    # Cursors

    def register(self, consumer: str, vbucket: int, after: int) -> Backfill | None:
        """Add the consumer's cursor on the vbucket; it has everything up to `after`.

        None: it reads memory from there. A Backfill: memory no longer holds all after `after`;
        the cursor is parked at the oldest snapshot (which stays unless the cap drops it).
        """
        vb = self._vbucket(vbucket)
        if consumer in vb.cursors:
            raise MutationError(f"{consumer!r} already has a cursor on vbucket {vbucket}")
        if not 0 <= after <= vb.high:
            raise MutationError(
                f"vbucket {vbucket}: {consumer!r} asks from seqno {after}, "
                f"outside 0..{vb.high} (the source's high seqno)"
            )
        floor = vb.floor()
        if after >= floor:
            vb.cursors[consumer] = _Cursor(consumer, after, None)
            self._unpinned.add(vbucket)
            return None
        cursor = vb.cursors[consumer] = _Cursor(consumer, floor, after)
        return self._backfill(vb, cursor)

    def read(self, consumer: str, vbucket: int, limit: int | None = None) -> list[Snapshot]:
        """The next snapshots for the cursor (at most `limit`), moving it past them.

        Reading the open snapshot closes it. Empty when the cursor is at the high seqno.
        Raises BackfillRequired when the cursor must backfill first.
        """
        vb, cursor = self._cursor(consumer, vbucket)
        if cursor.backfill_after is not None or cursor.position is None:
            raise BackfillRequired(self._backfill(vb, cursor))
        after = cursor.position
        snapshots = vb.snapshots
        index = next((i for i, s in enumerate(snapshots) if s.end > after), len(snapshots))
        out: list[Snapshot] = []
        while index < len(snapshots) and (limit is None or len(out) < limit):
            snapshot = snapshots[index]
            if snapshot.end <= after:  # the open snapshot, empty
                break
            if not snapshot.closed:
                snapshot.closed = True
                snapshots.append(_Snapshot(vb.high + 1, self.item_overhead))
            out.append(snapshot.view(vbucket, after))
            after = snapshot.end
            index += 1
        if out:
            cursor.position = after
            self._tidy(vb)
            self._unpinned.add(vbucket)
        return out

    def rejoin(self, consumer: str, vbucket: int, reached: int) -> Backfill | None:
        """A backfilling cursor's consumer now has everything up to `reached`.

        None: the cursor reads memory from there. A Backfill: memory starts above `reached`;
        backfill on to its `until` (the cursor is parked there meanwhile).
        """
        vb, cursor = self._cursor(consumer, vbucket)
        if cursor.backfill_after is None:
            raise MutationError(f"{consumer!r} on vbucket {vbucket} is not backfilling")
        if not cursor.backfill_after <= reached <= vb.high:
            raise MutationError(
                f"vbucket {vbucket}: {consumer!r} cannot rejoin at {reached}, outside "
                f"{cursor.backfill_after}..{vb.high} (its backfill start..the high seqno)"
            )
        cursor.backfill_after = reached
        if reached >= vb.floor():
            cursor.position = reached
            cursor.backfill_after = None
            self._tidy(vb)
            self._unpinned.add(vbucket)
            return None
        if cursor.position is None:
            cursor.position = vb.floor()
        return self._backfill(vb, cursor)

    def unregister(self, consumer: str, vbucket: int) -> None:
        """Remove the consumer's cursor on the vbucket (its stream ended)."""
        vb, _ = self._cursor(consumer, vbucket)
        del vb.cursors[consumer]
        self._tidy(vb)
        self._unpinned.add(vbucket)

    def reset_vbucket(self, vbucket: int, high: int) -> None:
        """After a failover of the vbucket's source: its history above `high` is gone.

        Memory of the vbucket and its cursors are forgotten; the consumers must connect again
        (a new handshake compares histories) and register anew.
        """
        if high < 0:
            raise MutationError(f"vbucket {vbucket}: seqno {high} is negative")
        vb = self._vbuckets.pop(vbucket, None)
        if vb is not None:
            self.memory -= vb.bytes
        self._highs[vbucket] = high
        self._unpinned.discard(vbucket)

    def unregister_consumer(self, consumer: str) -> None:
        """Remove every cursor of the consumer (its connection closed); what it keeps stays."""
        for vb in self._vbuckets.values():
            if vb.cursors.pop(consumer, None) is not None:
                self._tidy(vb)
                self._unpinned.add(vb.number)

    def keep(self, consumer: str, vbucket: int, seqno: int) -> None:
        """The consumer holds everything up to `seqno` for good: should it connect again, it
        resumes from there, so memory keeps what follows (while the cap allows) until a later
        `keep` moves it on. Memory below its floor is gone: then it keeps from the floor."""
        vb = self._vbucket(vbucket)
        vb.kept[consumer] = min(max(seqno, vb.floor()), vb.high)
        self._tidy(vb)
        self._unpinned.add(vbucket)

    def forget_consumer(self, consumer: str) -> None:
        """The consumer is gone for good: its cursors and what it keeps go."""
        self.unregister_consumer(consumer)
        for vb in self._vbuckets.values():
            if vb.kept.pop(consumer, None) is not None:
                self._tidy(vb)
                self._unpinned.add(vb.number)

    # ----------------------------------------------------------------------------------------
    # Internals

    def _vbucket(self, vbucket: int) -> _Vbucket:
        vb = self._vbuckets.get(vbucket)
        if vb is None:
            if vbucket < 0:
                raise MutationError(f"vbucket {vbucket} is negative")
            vb = self._vbuckets[vbucket] = _Vbucket(
                vbucket, self._highs.get(vbucket, 0), self.item_overhead
            )
        return vb

    def _cursor(self, consumer: str, vbucket: int) -> tuple[_Vbucket, _Cursor]:
        vb = self._vbucket(vbucket)
        cursor = vb.cursors.get(consumer)
        if cursor is None:
            raise MutationError(f"{consumer!r} has no cursor on vbucket {vbucket}")
        return vb, cursor

    def _backfill(self, vb: _Vbucket, cursor: _Cursor) -> Backfill:
        after = cursor.backfill_after
        assert after is not None
        return Backfill(cursor.consumer, vb.number, after, vb.floor())

    def _grow(self, vb: _Vbucket, delta: int) -> None:
        vb.bytes += delta
        self.memory += delta

    def _tidy(self, vb: _Vbucket) -> None:
        """Free the closed snapshots every cursor has passed; collapse runs no cursor is in."""
        positions = vb.positions()
        low = min(positions, default=None)
        snapshots = vb.snapshots
        passed = 0
        while passed < len(snapshots) - 1 and (low is None or snapshots[passed].end <= low):
            passed += 1
        if passed:
            self._grow(vb, -sum(s.bytes for s in snapshots[:passed]))
            del snapshots[:passed]
        if len(snapshots) < 3:  # collapsing needs two closed snapshots
            return
        ends = [s.end for s in snapshots]
        occupied = {bisect_right(ends, p) for p in positions}  # the snapshot each cursor is in
        kept: list[_Snapshot] = []
        previous_free = False
        for index, snapshot in enumerate(snapshots):
            free = snapshot.closed and index not in occupied
            if free and previous_free:
                self._grow(vb, -kept[-1].absorb(snapshot))
                self._collapsed += 1
            else:
                kept.append(snapshot)
            previous_free = free
        vb.snapshots = kept

    def _expel(self, vb: _Vbucket) -> None:
        """Free every item no cursor needs: those at or below the lowest cursor (all if none)."""
        low = min(vb.positions(), default=vb.high)
        if low <= vb.floor():  # the lowest cursor needs all memory holds (passed ones are freed)
            return  # and until a cursor moves or goes, or a write comes with none in memory
        self._tidy(vb)
        first = vb.snapshots[0]
        if first.start <= low:
            freed, count = first.trim(low)
            self._grow(vb, -freed)
            self._expelled += count

    def _enforce(self) -> list[Backfill]:
        """Get under the cap: expel what no cursor needs, then drop the cursors furthest behind.

        Furthest behind: all cursors at the lowest seqno of the vbucket holding the most bytes
        (after expelling, all of a vbucket's bytes lie ahead of its lowest cursors).
        """
        for number in self._unpinned:
            self._expel(self._vbuckets[number])
        self._unpinned.clear()
        dropped: list[tuple[_Vbucket, _Cursor]] = []
        while self.memory > self.capacity:
            vb = max(
                (vb for vb in self._vbuckets.values() if vb.bytes),
                key=lambda vb: (vb.bytes, -vb.number),
            )
            low = min(vb.positions())
            for cursor in vb.cursors.values():
                if cursor.position == low:
                    if cursor.backfill_after is None:
                        cursor.backfill_after = low
                    cursor.position = None
                    dropped.append((vb, cursor))
                    self._dropped += 1
            for consumer in [c for c, seqno in vb.kept.items() if seqno == low]:
                del vb.kept[consumer]  # a reconnect of it will read the source log
            self._expel(vb)
        return [self._backfill(vb, cursor) for vb, cursor in dropped]


def backfill_snapshots(
    vbucket: int, items: Iterable[Item], after: int, until: int, max_items: int
) -> Iterator[Snapshot]:
    """Source-log items in after..until (exclusive..inclusive) as snapshots of up to `max_items`.

    The log keeps every version, so any cut is consistent; items at or below `after` are skipped.
    """
    if max_items < 1:
        raise ValueError("max_items must be >= 1")
    start = after + 1
    chunk: list[Item] = []
    for item in items:
        if item.seqno <= after:
            continue
        if item.seqno > until:
            break
        chunk.append(item)
        if len(chunk) == max_items:
            yield Snapshot(vbucket, start, item.seqno, tuple(chunk))
            start = item.seqno + 1
            chunk = []
    if chunk:
        yield Snapshot(vbucket, start, chunk[-1].seqno, tuple(chunk))
