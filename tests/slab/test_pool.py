"""Tests for slab.pool.SlabPool: accounting, size classes, slab reuse, waiting and invariants."""

from __future__ import annotations

import itertools

import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from slab import SlabPool, SlabStatistics

KiB = 1 << 10


def check_invariants(pool: SlabPool, live: dict[int, int]) -> None:
    """No two live chunks overlap, each fits its record, and statistics match ``live``."""
    st_ = pool.statistics()
    sb = st_.slab_bytes
    spans = sorted((off, pool.chunk_size(off)) for off in live)
    for (a, sa), (b, _) in itertools.pairwise(spans):
        assert a + sa <= b, f"chunks at {a} (+{sa}) and {b} overlap"
    for off, size in live.items():
        cs = pool.chunk_size(off)
        assert size <= cs
        assert off // sb == (off + cs - 1) // sb, "chunk crosses a slab boundary"
        assert (off % sb) % cs == 0, "chunk not aligned to its class within the slab"
    assert st_.chunks_in_use == len(live)
    assert st_.payload_bytes_in_use == sum(live.values())
    assert st_.chunk_bytes_in_use == sum(pool.chunk_size(o) for o in live)
    used_slabs = {o // st_.slab_bytes for o in live}
    # Every slab holding a live chunk is assigned; every other slab is empty (returned).
    assert st_.slabs_empty == st_.slabs_total - len(used_slabs)


def test_construction_and_size_classes() -> None:
    pool = SlabPool(10 * KiB + 5, slab_bytes=KiB, min_chunk=64)
    s = pool.statistics()
    assert isinstance(s, SlabStatistics)
    assert (s.total_bytes, s.slab_bytes, s.slabs_total, s.slabs_empty) == (10 * KiB, KiB, 10, 10)
    assert pool.chunk_sizes == [64, 128, 256, 512, 1024]
    assert pool.max_record == 1024
    pool3 = SlabPool(1 << 20, slab_bytes=1 << 16, min_chunk=100, growth=3)
    assert pool3.chunk_sizes == [100, 300, 900, 2700, 8100, 24300]
    assert pool3.max_record == 24300


def test_construction_errors() -> None:
    with pytest.raises(ValueError, match="smaller than one slab"):
        SlabPool(1000, slab_bytes=1024)
    with pytest.raises(ValueError, match="growth"):
        SlabPool(1 << 20, growth=1)
    with pytest.raises(ValueError, match="min_chunk"):
        SlabPool(1 << 20, slab_bytes=32, min_chunk=64)


def test_class_selection_by_size() -> None:
    pool = SlabPool(8 * KiB, slab_bytes=KiB, min_chunk=64)
    sizes = [0, 1, 64, 65, 128, 129, 512, 513, 1024]
    chunks = pool.try_alloc_many(sizes)
    assert chunks is not None
    assert [pool.chunk_size(c) for c in chunks] == [64, 64, 64, 128, 128, 256, 512, 1024, 1024]
    with pytest.raises(ValueError, match="exceeds the largest chunk"):
        pool.try_alloc_many([1025])
    with pytest.raises(ValueError, match=">= 0"):
        pool.try_alloc_many([-1])


def test_accounting_alloc_and_free() -> None:
    pool = SlabPool(4 * KiB, slab_bytes=KiB, min_chunk=64)
    sizes = [10, 60, 100, 200]
    chunks = pool.try_alloc_many(sizes)
    assert chunks is not None
    assert len(set(chunks)) == 4
    s = pool.statistics()
    assert s.chunks_in_use == 4
    assert s.chunk_bytes_in_use == 64 + 64 + 128 + 256
    assert s.payload_bytes_in_use == 370
    assert s.allocations == 4
    assert s.slabs_empty == 1  # three classes in use, one slab each
    pool.free_many(chunks[:2], sizes[:2])
    s = pool.statistics()
    assert (s.chunks_in_use, s.chunk_bytes_in_use, s.payload_bytes_in_use) == (2, 384, 300)
    assert s.slabs_empty == 2  # the 64-byte slab emptied and went back
    pool.free_many(chunks[2:], sizes[2:])
    s = pool.statistics()
    assert (s.chunks_in_use, s.chunk_bytes_in_use, s.payload_bytes_in_use) == (0, 0, 0)
    assert s.slabs_empty == 4
    assert pool.try_alloc_many([]) == []


def test_all_or_nothing() -> None:
    pool = SlabPool(2 * KiB, slab_bytes=KiB, min_chunk=64)
    first = pool.try_alloc_many([64] * 16)  # fills slab 0 with 64-byte chunks
    assert first is not None
    before = pool.statistics()
    # 8 x 128 fills slab 1; the extra 1024 record needs a third slab: nothing may stay allocated.
    assert pool.try_alloc_many([128] * 8 + [1024]) is None
    assert pool.statistics() == before
    assert pool.try_alloc_many([64] * 17) is None  # one more than the free slab holds
    assert pool.statistics() == before
    ok = pool.try_alloc_many([128] * 8)
    assert ok is not None
    assert pool.statistics().slabs_empty == 0
    assert pool.try_alloc_many([64]) is None


def test_slab_returned_when_empty_and_reused_by_other_class() -> None:
    pool = SlabPool(2 * KiB, slab_bytes=KiB, min_chunk=64)
    small = pool.try_alloc_many([50] * 32)  # two full slabs of 64-byte chunks
    assert small is not None
    assert pool.statistics().slabs_empty == 0
    assert pool.try_alloc_many([1000]) is None  # no slab for the 1024 class
    assert {c // KiB for c in small[:16]} == {0}  # the first slab is carved out first
    pool.free_many(small[:16], [50] * 16)  # empties slab 0, which goes back to the empty list
    assert pool.statistics().slabs_empty == 1
    big = pool.try_alloc_many([1000])
    assert big == [0]  # slab 0 now serves the 1024-byte class
    assert pool.try_alloc_many([50]) is None  # slab 1 is still full of small chunks
    pool.free_many(small[16:], [50] * 16)
    big2 = pool.try_alloc_many([1000])
    assert big2 == [KiB]
    big += big2
    assert [pool.chunk_size(c) for c in big] == [1024, 1024]


def test_full_slab_relisted_after_free() -> None:
    pool = SlabPool(2 * KiB, slab_bytes=KiB, min_chunk=64)
    a = pool.try_alloc_many([64] * 16)
    b = pool.try_alloc_many([64] * 16)
    assert a is not None and b is not None
    # Free one chunk in the first (no longer current) slab; it must be found again.
    pool.free_many([a[3]], [64])
    again = pool.try_alloc_many([64])
    assert again == [a[3]]
    assert pool.try_alloc_many([64]) is None


def test_double_free_and_bogus_free_raise_without_effect() -> None:
    pool = SlabPool(2 * KiB, slab_bytes=KiB, min_chunk=64)
    chunks = pool.try_alloc_many([100, 100, 100])
    assert chunks is not None
    pool.free_many([chunks[0]], [100])
    before = pool.statistics()
    with pytest.raises(ValueError, match="not an allocated chunk"):
        pool.free_many([chunks[1], chunks[0]], [100, 100])  # chunks[0] already free
    assert pool.statistics() == before  # chunks[1] was not freed either
    with pytest.raises(ValueError, match="not an allocated chunk"):
        pool.free_many([chunks[1], chunks[1]], [100, 100])  # same chunk twice in one batch
    with pytest.raises(ValueError, match="not an allocated chunk"):
        pool.free_many([chunks[1] + 64], [100])  # inside a chunk, not its start
    with pytest.raises(ValueError, match="not an allocated chunk"):
        pool.free_many([10 * KiB], [100])  # beyond the arena
    with pytest.raises(ValueError, match="not an allocated chunk"):
        pool.free_many([-64], [100])
    with pytest.raises(ValueError, match="sizes"):
        pool.free_many([chunks[1]], [])
    assert pool.statistics() == before
    pool.free_many(chunks[1:], [100, 100])
    assert pool.statistics().chunks_in_use == 0


def test_read_write_round_trip() -> None:
    pool = SlabPool(256 * KiB, slab_bytes=4 * KiB, min_chunk=64)
    datas = [bytes([i % 251]) * (i * 37 % 900) for i in range(100)]
    sizes = [len(d) for d in datas]
    chunks = pool.try_alloc_many(sizes)
    assert chunks is not None
    pool.write_many(chunks, datas)
    assert pool.read_many(chunks, sizes) == datas
    pool.write(chunks[5], memoryview(b"hello"))
    assert pool.read(chunks[5], 5) == b"hello"
    assert bytes(pool.view(chunks[5], 5)) == b"hello"
    with pytest.raises(ValueError, match="do not fit"):
        pool.write(chunks[0], b"x" * (pool.chunk_size(chunks[0]) + 1))
    with pytest.raises(ValueError, match="do not fit"):
        pool.write_many([chunks[0]], [b"x" * (pool.chunk_size(chunks[0]) + 1)])
    with pytest.raises(ValueError):
        pool.write_many(chunks, datas[:-1])


async def test_alloc_many_fast_path() -> None:
    pool = SlabPool(4 * KiB, slab_bytes=KiB)
    chunks = await pool.alloc_many([100, 200])
    assert len(chunks) == 2
    s = pool.statistics()
    assert (s.waits, s.waiting, s.allocations) == (0, 0, 2)


async def test_alloc_many_waits_until_freed(autojump_clock: trio.testing.MockClock) -> None:
    pool = SlabPool(2 * KiB, slab_bytes=KiB, min_chunk=64)
    held = await pool.alloc_many([1000, 1000])  # both slabs taken
    got: list[int] = []

    async def waiter() -> None:
        got.extend(await pool.alloc_many([60] * 4))

    with trio.fail_after(10):  # fail rather than hang if a wake-up is lost
        async with trio.open_nursery() as nursery:
            nursery.start_soon(waiter)
            await trio.testing.wait_all_tasks_blocked()
            assert got == []
            s = pool.statistics()
            assert (s.waiting, s.waits) == (1, 1)
            pool.free_many(held[:1], [1000])
            await trio.testing.wait_all_tasks_blocked()
            assert len(got) == 4
    s = pool.statistics()
    assert (s.waiting, s.waits, s.chunks_in_use) == (0, 1, 5)


async def test_waiters_served_in_order_large_not_starved(
    autojump_clock: trio.testing.MockClock,
) -> None:
    pool = SlabPool(4 * KiB, slab_bytes=KiB, min_chunk=64)
    held = await pool.alloc_many([1000] * 4)
    order: list[str] = []

    async def big() -> None:
        await pool.alloc_many([1000] * 3)
        order.append("big")

    async def small(name: str) -> None:
        await pool.alloc_many([60])
        order.append(name)

    with trio.fail_after(10):  # fail rather than hang if a wake-up is lost
        async with trio.open_nursery() as nursery:
            nursery.start_soon(big)
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(small, "s1")
            await trio.testing.wait_all_tasks_blocked()
            # One slab free would suit the small one, but it queues behind the big request.
            pool.free_many(held[:1], [1000])
            await trio.testing.wait_all_tasks_blocked()
            assert order == []
            assert pool.statistics().waiting == 2
            pool.free_many(held[1:3], [1000, 1000])
            await trio.testing.wait_all_tasks_blocked()
            assert order == ["big"]  # big got three slabs; small still waits for one
            pool.free_many(held[3:], [1000])
    assert order == ["big", "s1"]


async def test_cancelled_waiter_leaves_queue_and_unblocks_next(
    autojump_clock: trio.testing.MockClock,
) -> None:
    pool = SlabPool(2 * KiB, slab_bytes=KiB, min_chunk=64)
    held = await pool.alloc_many([1000])
    result: list[list[int]] = []

    with trio.fail_after(10):  # fail rather than hang if a wake-up is lost
        async with trio.open_nursery() as nursery:
            big_scope = trio.CancelScope()

            async def big() -> None:
                with big_scope:
                    await pool.alloc_many([1000, 1000])  # needs both slabs

            async def small() -> None:
                result.append(await pool.alloc_many([100]))

            nursery.start_soon(big)
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(small)
            await trio.testing.wait_all_tasks_blocked()
            assert pool.statistics().waiting == 2
            big_scope.cancel()  # the head waiter leaves; the small one now fits the free slab
            await trio.testing.wait_all_tasks_blocked()
            assert len(result) == 1
    assert pool.statistics().waiting == 0
    pool.free_many(held + result[0], [1000, 100])
    assert pool.statistics().chunks_in_use == 0


async def test_impossible_request_raises_at_once() -> None:
    pool = SlabPool(2 * KiB, slab_bytes=KiB, min_chunk=64)
    await pool.alloc_many([1000])  # even with memory in use the error is immediate
    with pytest.raises(ValueError, match="can never be satisfied"):
        await pool.alloc_many([1000] * 3)
    with pytest.raises(ValueError, match="can never be satisfied"):
        await pool.alloc_many([64] * 33)
    with pytest.raises(ValueError, match="exceeds the largest chunk"):
        await pool.alloc_many([KiB + 1])
    assert pool.statistics().waiting == 0


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.tuples(st.just("alloc"), st.lists(st.integers(0, 1024), min_size=0, max_size=12)),
            st.tuples(st.just("free"), st.lists(st.integers(0, 10_000), min_size=1, max_size=12)),
        ),
        max_size=60,
    )
)
def test_random_alloc_free_keeps_invariants(ops: list[tuple[str, list[int]]]) -> None:
    pool = SlabPool(8 * KiB, slab_bytes=KiB, min_chunk=64)
    live: dict[int, int] = {}
    data: dict[int, bytes] = {}
    for kind, args in ops:
        if kind == "alloc":
            before = pool.statistics()
            chunks = pool.try_alloc_many(args)
            if chunks is None:
                assert pool.statistics() == before
                continue
            assert len(chunks) == len(args)
            for off, size in zip(chunks, args, strict=True):
                assert off not in live
                live[off] = size
                payload = bytes([off % 256]) * size
                data[off] = payload
            pool.write_many(chunks, [data[o] for o in chunks])
        else:
            if not live:
                continue
            keys = sorted(live)
            picked = list(dict.fromkeys(keys[i % len(keys)] for i in args))
            pool.free_many(picked, [live[o] for o in picked])
            for off in picked:
                del live[off]
                del data[off]
        check_invariants(pool, live)
        offs = list(live)
        assert pool.read_many(offs, [live[o] for o in offs]) == [data[o] for o in offs]
    pool.free_many(list(live), list(live.values()))
    s = pool.statistics()
    assert (s.chunks_in_use, s.payload_bytes_in_use, s.slabs_empty) == (0, 0, s.slabs_total)


async def test_waiter_served_from_partially_freed_slab(
    autojump_clock: trio.testing.MockClock,
) -> None:
    pool = SlabPool(2 * KiB, slab_bytes=KiB, min_chunk=64)
    first = await pool.alloc_many([64] * 16)  # slab 0, full
    await pool.alloc_many([64] * 16)  # slab 1, full and current
    got: list[int] = []

    async def waiter() -> None:
        got.extend(await pool.alloc_many([64, 64]))

    with trio.fail_after(10):  # a waiter that is never served fails instead of hanging
        async with trio.open_nursery() as nursery:
            nursery.start_soon(waiter)
            await trio.testing.wait_all_tasks_blocked()
            pool.free_many(first[:1], [64])
            await trio.testing.wait_all_tasks_blocked()
            assert got == []  # one chunk free, two needed
            pool.free_many(first[1:2], [64])  # slab 0 (not current) now has two free chunks
    assert sorted(got) == sorted(first[:2])
