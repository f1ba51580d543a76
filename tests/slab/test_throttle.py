"""Tests for slab.throttle: hysteresis policy, MemoryThrottle with a fake sampler, parse_size."""

from __future__ import annotations

import logging

import pytest
import trio
import trio.testing

from slab import MemoryThrottle, ThrottlePolicy, ThrottleStatistics, parse_size

MiB = 1 << 20
GiB = 1 << 30

POLICY = ThrottlePolicy(quota_bytes=1000 * MiB, high=0.9, low=0.8, min_available_bytes=100 * MiB)
PLENTY = 10 * GiB


@pytest.mark.parametrize(
    ("paused", "rss", "available", "expected"),
    [
        # Running: pause at or above the high mark, or when the host runs short.
        (False, 0, PLENTY, False),
        (False, 899 * MiB, PLENTY, False),
        (False, 900 * MiB, PLENTY, True),
        (False, 2000 * MiB, PLENTY, True),
        (False, 0, 100 * MiB, False),
        (False, 0, 100 * MiB - 1, True),
        # Between the marks the state is kept either way (hysteresis).
        (False, 850 * MiB, PLENTY, False),
        (True, 850 * MiB, PLENTY, True),
        # Paused: resume only when rss <= low mark and available >= 1.25 x the minimum.
        (True, 800 * MiB, PLENTY, False),
        (True, 800 * MiB + 1, PLENTY, True),
        (True, 0, 125 * MiB, False),
        (True, 0, 125 * MiB - 1, True),
        (True, 0, 110 * MiB, True),  # above the minimum but not clear of it: stay paused
        (True, 950 * MiB, PLENTY, True),
    ],
)
def test_policy_hysteresis(paused: bool, rss: int, available: int, expected: bool) -> None:
    assert POLICY.decide(paused, rss, available) is expected


def test_policy_marks_and_validation() -> None:
    assert POLICY.high_bytes == 900 * MiB
    assert POLICY.low_bytes == 800 * MiB
    assert POLICY.resume_available_bytes == 125 * MiB
    with pytest.raises(ValueError):
        ThrottlePolicy(quota_bytes=0)
    with pytest.raises(ValueError):
        ThrottlePolicy(quota_bytes=MiB, high=0.5, low=0.6)
    with pytest.raises(ValueError):
        ThrottlePolicy(quota_bytes=MiB, min_available_bytes=-1)


class FakeMemory:
    """A settable sampler that counts how often it is read."""

    def __init__(self) -> None:
        self.rss = 100 * MiB
        self.available = PLENTY
        self.samples = 0

    def __call__(self) -> tuple[int, int]:
        self.samples += 1
        return self.rss, self.available


async def test_throttle_pauses_and_resumes(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    mem = FakeMemory()
    throttle = MemoryThrottle(POLICY, interval_s=0.1, sample=mem)
    caplog.set_level(logging.DEBUG, logger="indexer.throttle")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(throttle.run)
        await trio.sleep(1)
        assert not throttle.paused
        assert mem.samples >= 9
        mem.rss = 950 * MiB
        await trio.sleep(0.15)
        assert throttle.paused
        await trio.sleep(1)  # many samples while paused: still one transition
        mem.rss = 850 * MiB  # below high but above low: stays paused
        await trio.sleep(1)
        assert throttle.paused
        mem.rss = 700 * MiB
        await trio.sleep(0.15)
        assert not throttle.paused
        mem.available = 50 * MiB  # host short of memory
        await trio.sleep(0.15)
        assert throttle.paused
        mem.available = PLENTY
        await trio.sleep(0.15)
        assert not throttle.paused
        nursery.cancel_scope.cancel()
    s = throttle.statistics()
    assert isinstance(s, ThrottleStatistics)
    assert (s.paused, s.pauses, s.resumes) == (False, 2, 2)
    assert (s.rss, s.available) == (700 * MiB, PLENTY)
    assert (s.quota_bytes, s.high_bytes, s.low_bytes) == (1000 * MiB, 900 * MiB, 800 * MiB)
    msgs = [r.getMessage() for r in caplog.records if r.name == "indexer.throttle"]
    assert len(msgs) == 4  # one line per transition, never per sample
    assert "pausing" in msgs[0] and "950.0 MiB" in msgs[0]
    assert "resuming" in msgs[1] and "700.0 MiB" in msgs[1]


async def test_wait_open_blocks_while_paused(autojump_clock: trio.testing.MockClock) -> None:
    mem = FakeMemory()
    throttle = MemoryThrottle(POLICY, interval_s=0.1, sample=mem)
    await throttle.wait_open()  # open: returns at once
    mem.rss = 990 * MiB
    assert throttle.update() is True
    opened_at: list[float] = []

    async def reader() -> None:
        await throttle.wait_open()
        opened_at.append(trio.current_time())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(throttle.run)
        nursery.start_soon(reader)
        nursery.start_soon(reader)
        await trio.sleep(5)
        assert opened_at == []
        start = trio.current_time()
        mem.rss = 10 * MiB
        await trio.sleep(0.5)
        assert len(opened_at) == 2
        assert all(start <= t <= start + 0.11 for t in opened_at)
        await throttle.wait_open()
        nursery.cancel_scope.cancel()
    assert throttle.statistics().pauses == 1
    assert throttle.statistics().resumes == 1


def test_default_sampler_uses_psutil() -> None:
    throttle = MemoryThrottle(ThrottlePolicy(quota_bytes=1 << 50, min_available_bytes=0))
    assert throttle.update() is False
    s = throttle.statistics()
    assert s.rss > 0
    assert s.available > 0


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        (1000, 1000),
        (0, 0),
        ("1000000", 1_000_000),
        ("512KiB", 512 << 10),
        ("64MiB", 64 << 20),
        ("64 mib", 64 << 20),
        ("2GiB", 2 << 30),
        ("1TiB", 1 << 40),
        ("1.5GiB", 3 << 29),
        ("10MB", 10_000_000),
        ("100B", 100),
        (0.5, 4 * GiB),
        (1.0, 8 * GiB),
        ("25%", 2 * GiB),
    ],
)
def test_parse_size(spec: int | float | str, expected: int) -> None:
    assert parse_size(spec, 8 * GiB) == expected


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (-1, ">= 0"),
        (0.0, "fraction"),
        (1.5, "fraction"),
        (-0.5, "fraction"),
        (True, "expected"),
        ("", "expected e.g."),
        ("lots", "expected e.g."),
        ("64 MiB extra", "expected e.g."),
        ("12Q", "unknown unit"),
        ("64M", "unknown unit"),
        ("0%", "percentage"),
        ("150%", "percentage"),
    ],
)
def test_parse_size_errors(spec: int | float | str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_size(spec, 8 * GiB)
