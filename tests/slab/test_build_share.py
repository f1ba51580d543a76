"""The index builds' share of the slab pool (indexer/build.py BuildShare) on a real pool."""

from __future__ import annotations

import trio
import trio.testing

from indexer.build import BuildShare
from slab import SlabPool


def test_builds_take_free_chunks_within_their_share_and_never_queue_before_maintenance() -> None:
    pool = SlabPool(8 * 4096, slab_bytes=4096, min_chunk=64)
    share = BuildShare(pool, share=0.25)  # 8 KiB of the 32 KiB
    assert share.limit == 8192

    async def main() -> None:
        first = await share.alloc([1000] * 8)  # 8,000 bytes: within the share
        assert share.used == 8000
        # More would pass the share: the build waits, without queueing in the pool.
        with trio.move_on_after(1):
            await share.alloc([1000])
            raise AssertionError("a build took more than its share")
        assert share.waits == 1 and pool.statistics().waiting == 0
        # Maintenance allocates what is left of the pool meanwhile.
        rest = pool.try_alloc_many([4096] * 6)
        assert rest is not None
        share.free(first[:4], [1000] * 4)
        second = await share.alloc([1000])  # back within the share
        assert share.used == 5000
        share.free(first[4:] + second, [1000] * 5)
        pool.free_many(rest, [4096] * 6)
        assert share.used == 0 and pool.statistics().chunks_in_use == 0

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_a_record_larger_than_the_share_still_gets_through_alone() -> None:
    pool = SlabPool(8 * 4096, slab_bytes=4096, min_chunk=64)
    share = BuildShare(pool, share=0.01)  # less than one record: the share is one max record

    async def main() -> None:
        chunks = await share.alloc([4000])
        assert share.used == 4000
        share.free(chunks, [4000])

    trio.run(main)
    assert share.limit == pool.max_record
