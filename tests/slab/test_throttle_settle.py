"""The memory throttle when pausing cannot lower RSS: reads resume once neither RSS nor the
queues move, and pause again only when RSS grows a band past that level."""

from __future__ import annotations

import logging

import pytest
import trio
import trio.testing

from slab import MemoryThrottle, ThrottlePolicy
from slab.throttle import SETTLE_S

MiB = 1 << 20
PLENTY = 10 << 30
POLICY = ThrottlePolicy(quota_bytes=1000 * MiB, high=0.9, low=0.8, min_available_bytes=100 * MiB)


class Memory:
    def __init__(self) -> None:
        self.rss = 100 * MiB
        self.queued = 0

    def sample(self) -> tuple[int, int]:
        return self.rss, PLENTY


async def test_reads_resume_when_rss_and_queues_stay_still(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    mem = Memory()
    throttle = MemoryThrottle(POLICY, interval_s=0.1, sample=mem.sample)
    throttle.queued = lambda: mem.queued
    caplog.set_level(logging.INFO, logger="indexer.throttle")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(throttle.run)
        mem.rss, mem.queued = 950 * MiB, 5000
        await trio.sleep(0.15)
        assert throttle.paused
        # The queues drain: pausing is working, so reads stay paused however long it takes.
        for left in range(5000, -1, -500):
            mem.queued = left
            await trio.sleep(SETTLE_S / 2)
            assert throttle.paused
        # Nothing queued, RSS still above the low mark: pausing cannot lower it.
        await trio.sleep(SETTLE_S + 0.2)
        assert not throttle.paused
        stats = throttle.statistics()
        assert (stats.pauses, stats.resumes, stats.settled_resumes) == (1, 1, 1)
        assert stats.retained_bytes == 950 * MiB
        # Reused memory does not pause again; growth of a band (100 MiB) past it does.
        mem.rss = 1040 * MiB
        await trio.sleep(0.3)
        assert not throttle.paused
        mem.rss = 1050 * MiB
        await trio.sleep(0.15)
        assert throttle.paused
        # Once RSS falls below the low mark, the marks apply as before.
        mem.rss = 700 * MiB
        await trio.sleep(0.15)
        assert not throttle.paused
        assert throttle.statistics().retained_bytes == 0
        mem.rss = 900 * MiB
        await trio.sleep(0.15)
        assert throttle.paused
        nursery.cancel_scope.cancel()
    messages = [r.getMessage() for r in caplog.records if r.name == "indexer.throttle"]
    assert "stayed above the low mark" in messages[1] and "past 1050.0 MiB" in messages[1]


async def test_without_the_queue_count_reads_wait_for_the_low_mark(
    autojump_clock: trio.testing.MockClock,
) -> None:
    mem = Memory()
    throttle = MemoryThrottle(POLICY, interval_s=0.1, sample=mem.sample)
    mem.rss = 950 * MiB
    async with trio.open_nursery() as nursery:
        nursery.start_soon(throttle.run)
        await trio.sleep(10 * SETTLE_S)
        assert throttle.paused
        nursery.cancel_scope.cancel()
    assert throttle.statistics().settled_resumes == 0
