"""Tests for slab.ring.MutationRing: ordering, partial drains, wrap-around, overflow, waiting."""

from __future__ import annotations

import sys

import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from slab import MutationRing, RingStatistics

NVB = 4
ALL = [1 << 62] * NVB
NONE = [-1] * NVB


def push(ring: MutationRing, vb: int, seqnos: list[int]) -> None:
    """Push entries whose chunk is 1000*vb+seqno and length seqno (easy to recognise)."""
    ring.push_many(vb, seqnos, [1000 * vb + s for s in seqnos], list(seqnos))


def test_empty_ring() -> None:
    ring = MutationRing(8)
    assert len(ring) == 0
    assert ring.queued == 0
    assert ring.free_slots() == 8
    assert ring.drain(ALL) == ([], [], [], [])
    assert ring.statistics() == RingStatistics(capacity=8, queued=0, head=0, tail=0, holes=0)
    with pytest.raises(ValueError):
        MutationRing(0)


def test_push_and_drain_in_order() -> None:
    ring = MutationRing(16)
    push(ring, 1, [10, 11, 12])
    push(ring, 0, [5, 6])
    push(ring, 1, [13])
    assert (len(ring), ring.queued, ring.free_slots()) == (6, 6, 10)
    vbs, seqs, chunks, lens = ring.drain(ALL)
    assert vbs == [1, 1, 1, 0, 0, 1]
    assert seqs == [10, 11, 12, 5, 6, 13]
    assert chunks == [1010, 1011, 1012, 5, 6, 1013]
    assert lens == seqs
    assert (len(ring), ring.queued, ring.free_slots()) == (0, 0, 16)
    st_ = ring.statistics()
    assert (st_.head, st_.tail, st_.holes) == (6, 6, 0)


def test_partial_drain_leaves_uncovered_entries_and_head_moves_over_freed_only() -> None:
    ring = MutationRing(16)
    push(ring, 0, [1, 2, 3])  # slots 0-2
    push(ring, 1, [1, 2, 3])  # slots 3-5
    push(ring, 0, [4, 5])  # slots 6-7
    # Stability timestamp: vb0 up to 2, vb1 up to 3.
    vbs, seqs, _, _ = ring.drain([2, 3, 0, 0])
    assert list(zip(vbs, seqs, strict=True)) == [(0, 1), (0, 2), (1, 1), (1, 2), (1, 3)]
    st_ = ring.statistics()
    # Head moved over slots 0-1 only; slot 2 (vb0 seq3) blocks it; slots 3-5 are holes.
    assert (st_.head, st_.tail, st_.queued, st_.holes) == (2, 8, 3, 3)
    assert len(ring) == 6
    assert ring.free_slots() == 10
    # Nothing newly covered: nothing drains, nothing moves.
    assert ring.drain([2, 3, 0, 0]) == ([], [], [], [])
    assert ring.statistics() == st_
    vbs, seqs, chunks, _ = ring.drain([4, 3, 0, 0])
    assert (vbs, seqs, chunks) == ([0, 0], [3, 4], [3, 4])
    st_ = ring.statistics()
    # Slot 2 freed: head skips the holes 3-5 and slot 6, stops at slot 7 (seq 5).
    assert (st_.head, st_.tail, st_.queued, st_.holes) == (7, 8, 1, 0)
    vbs, seqs, _, _ = ring.drain(ALL)
    assert (vbs, seqs) == ([0], [5])
    assert ring.statistics() == RingStatistics(capacity=16, queued=0, head=8, tail=8, holes=0)


def test_wrap_around_many_times() -> None:
    cap = 7
    ring = MutationRing(cap)
    expected_next = 0
    seq = 0
    for rnd in range(200):
        n = 1 + rnd % cap
        room = ring.free_slots()
        n = min(n, room)
        push(ring, rnd % NVB, list(range(seq, seq + n)))
        seq += n
        # Keep the newest entry (if any) so head and tail keep crawling around the ring.
        limit = seq - 2 if rnd % 3 else seq
        _, seqs, _, _ = ring.drain([limit] * NVB)
        assert seqs == list(range(expected_next, expected_next + len(seqs)))
        expected_next += len(seqs)
        st_ = ring.statistics()
        assert st_.queued == seq - expected_next
        assert st_.holes == 0
        assert st_.tail == (st_.head + len(ring)) % cap
    assert seq > 20 * cap


def test_wrapped_segment_partial_drain() -> None:
    ring = MutationRing(6)
    push(ring, 0, [1, 2, 3, 4])
    ring.drain([2, 0, 0, 0])  # head -> 2
    push(ring, 1, [1, 2, 3, 4])  # slots 4,5,0,1 (wraps)
    assert ring.free_slots() == 0
    vbs, seqs, _, _ = ring.drain([0, 3, 0, 0])
    assert list(zip(vbs, seqs, strict=True)) == [(1, 1), (1, 2), (1, 3)]
    st_ = ring.statistics()
    assert (st_.head, st_.tail, st_.queued, st_.holes) == (2, 2, 3, 3)
    vbs, seqs, _, _ = ring.drain([4, 0, 0, 0])  # frees slots 2,3; head skips holes 4,5,0
    assert (vbs, seqs) == ([0, 0], [3, 4])
    st_ = ring.statistics()
    assert (st_.head, st_.tail, st_.queued, st_.holes) == (1, 2, 1, 0)
    assert ring.free_slots() == 5
    assert ring.drain(ALL)[1] == [4]
    assert ring.free_slots() == 6


def test_overflow_raises_without_effect() -> None:
    ring = MutationRing(4)
    push(ring, 0, [1, 2, 3])
    before = ring.statistics()
    with pytest.raises(OverflowError):
        push(ring, 0, [4, 5])
    assert ring.statistics() == before
    with pytest.raises(ValueError):
        ring.push_many(0, [1, 2], [1], [1, 2])
    push(ring, 0, [4])
    assert ring.free_slots() == 0


def test_drain_with_bad_timestamp_leaves_ring_untouched() -> None:
    ring = MutationRing(4)
    push(ring, 0, [1])
    push(ring, 3, [1])
    before = ring.statistics()
    with pytest.raises(IndexError):
        ring.drain([5])  # no entry for vbucket 3
    assert ring.statistics() == before
    assert ring.drain(ALL)[0] == [0, 3]


async def test_wait_for_space_wakes_after_drain(autojump_clock: trio.testing.MockClock) -> None:
    ring = MutationRing(4)
    push(ring, 0, [1, 2, 3, 4])
    woke: list[int] = []

    async def producer() -> None:
        await ring.wait_for_space(2)
        woke.append(ring.free_slots())
        push(ring, 0, [5, 6])

    with trio.fail_after(10):  # fail rather than hang if a wake-up is lost
        async with trio.open_nursery() as nursery:
            nursery.start_soon(producer)
            await trio.testing.wait_all_tasks_blocked()
            assert woke == []
            ring.drain([1, 0, 0, 0])  # one slot free: not enough yet
            await trio.testing.wait_all_tasks_blocked()
            assert woke == []
            ring.drain([2, 0, 0, 0])
    assert woke == [2]
    assert ring.drain(ALL)[1] == [3, 4, 5, 6]


async def test_wait_for_space_immediate_and_errors() -> None:
    ring = MutationRing(4)
    await ring.wait_for_space(4)
    await ring.wait_for_space(0)
    with pytest.raises(ValueError):
        await ring.wait_for_space(5)


async def test_drain_of_non_head_entries_does_not_wake_space_waiter(
    autojump_clock: trio.testing.MockClock,
) -> None:
    ring = MutationRing(2)
    push(ring, 0, [1])
    push(ring, 1, [1])
    woke: list[bool] = []

    async def producer() -> None:
        await ring.wait_for_space(1)
        woke.append(True)

    with trio.fail_after(10):  # fail rather than hang if a wake-up is lost
        async with trio.open_nursery() as nursery:
            nursery.start_soon(producer)
            await trio.testing.wait_all_tasks_blocked()
            ring.drain([0, 1, 0, 0])  # drains slot 1, head blocked by slot 0: no space
            await trio.testing.wait_all_tasks_blocked()
            assert woke == []
            assert ring.free_slots() == 0
            ring.drain([1, 1, 0, 0])
    assert woke == [True]


@settings(max_examples=300, deadline=None)
@given(
    st.integers(1, 9),
    st.lists(
        st.one_of(
            st.tuples(st.just("push"), st.integers(0, NVB - 1), st.integers(0, 6)),
            st.tuples(
                st.just("drain"),
                st.lists(st.integers(-1, 40), min_size=NVB, max_size=NVB),
                st.just(0),
            ),
        ),
        max_size=50,
    ),
)
def test_model_against_plain_list(cap: int, ops: list[tuple[str, object, int]]) -> None:
    ring = MutationRing(cap)
    # Model: list of slots from head to tail; None is a hole.
    slots: list[tuple[int, int, int, int] | None] = []
    next_seq = [0] * NVB
    for kind, arg, n in ops:
        if kind == "push":
            assert isinstance(arg, int)
            vb = arg
            seqs = list(range(next_seq[vb], next_seq[vb] + n))
            chunks = [x * 7 + vb for x in seqs]
            lens = [x % 5 for x in seqs]
            if n > cap - len(slots):
                with pytest.raises(OverflowError):
                    ring.push_many(vb, seqs, chunks, lens)
            else:
                ring.push_many(vb, seqs, chunks, lens)
                next_seq[vb] += n
                slots += [(vb, s, c, ln) for s, c, ln in zip(seqs, chunks, lens, strict=True)]
        else:
            assert isinstance(arg, list)
            upto: list[int] = arg
            taken = [e for e in slots if e is not None and e[1] <= upto[e[0]]]
            slots = [None if e is None or e[1] <= upto[e[0]] else e for e in slots]
            while slots and slots[0] is None:
                slots.pop(0)
            got = ring.drain(upto)
            want = tuple(list(col) for col in zip(*taken, strict=True)) if taken else ([],) * 4
            assert got == want
        assert len(ring) == len(slots)
        assert ring.queued == sum(e is not None for e in slots)
        assert ring.free_slots() == cap - len(slots)
        st_ = ring.statistics()
        assert st_.holes == sum(e is None for e in slots)
        assert st_.tail == (st_.head + len(slots)) % cap


def test_drained_slots_keep_no_entry_alive() -> None:
    """A slot taken by a drain lets go of its entry's numbers: otherwise every slot of a large
    ring would hold ~60 bytes of int objects once used, memory the quota never sees."""
    ring = MutationRing(8)
    seqno, chunk, length = 10**12 + 1, 10**12 + 2, 10**12 + 3  # not small-int singletons
    before = [sys.getrefcount(x) for x in (seqno, chunk, length)]
    for split in (False, True):  # a whole segment, then entries taken one by one
        ring.push_many(1, [seqno], [chunk], [length])
        ring.push_many(2, [5], [6], [7])
        taken = ring.drain([0, 10**13, 4] if split else [10**13] * 3)
        assert taken[1][0] == seqno
        del taken
        ring.drain([10**13] * 3)
        assert [sys.getrefcount(x) for x in (seqno, chunk, length)] == before
