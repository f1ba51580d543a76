"""Memory throttle: pause reading mutations when the process or the host runs short of memory.

ThrottlePolicy is the pure hysteresis decision; MemoryThrottle samples it (psutil) on an interval.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import dataclass

import trio

__all__ = [
    "MemoryThrottle",
    "ThrottlePolicy",
    "ThrottleStatistics",
    "parse_size",
]

log = logging.getLogger("indexer.throttle")

MiB = 1 << 20

# Paused this long with neither RSS falling (by SETTLE_DROP_BYTES) nor the queues moving, pausing
# no longer helps: the memory is held outside the queues (caches, freed memory the allocator
# keeps for reuse). Reads (and scans) resume then, and pause again once RSS grows a band
# (high - low) past it.
SETTLE_S = 2.0
SETTLE_DROP_BYTES = 1 * MiB

_UNITS = {
    "": 1,
    "b": 1,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*|%)\s*$", re.IGNORECASE)


def parse_size(spec: int | float | str, total: int) -> int:
    """Parse a memory size to bytes: an int, "64MiB"/"2GiB"/"512KiB"/"1000000", or a fraction.

    A float 0 < f <= 1 (or a string such as "25%") means that fraction of ``total`` bytes.
    KiB/MiB/GiB/TiB are binary, KB/MB/GB/TB decimal; anything else raises ValueError.
    """
    if isinstance(spec, bool):
        raise ValueError(f"invalid memory size {spec!r}: expected bytes, a size string or 0<f<=1")
    if isinstance(spec, int):
        if spec < 0:
            raise ValueError(f"invalid memory size {spec}: must be >= 0 bytes")
        return spec
    if isinstance(spec, float):
        if not (0.0 < spec <= 1.0):
            raise ValueError(
                f"invalid memory size {spec!r}: a float is a fraction of {total} bytes and must"
                " be in (0, 1]; give bytes as an int or a string such as '512MiB'"
            )
        return int(spec * total)
    if isinstance(spec, str):
        m = _SIZE_RE.match(spec)
        if m is None:
            raise ValueError(
                f"invalid memory size {spec!r}: expected e.g. '1000000', '512KiB', '64MiB',"
                " '2GiB' or '25%'"
            )
        number, unit = m.group(1), m.group(2).lower()
        if unit == "%":
            pct = float(number)
            if not 0.0 < pct <= 100.0:
                raise ValueError(f"invalid memory size {spec!r}: a percentage must be in (0, 100]")
            return int(pct * total / 100)
        if unit not in _UNITS:
            raise ValueError(
                f"invalid memory size {spec!r}: unknown unit {m.group(2)!r}"
                " (use B, KiB, MiB, GiB, TiB, or KB, MB, GB, TB)"
            )
        if "." in number:
            return int(float(number) * _UNITS[unit])
        return int(number) * _UNITS[unit]
    raise ValueError(f"invalid memory size {spec!r}: expected int, float or str")


@dataclass(frozen=True, slots=True)
class ThrottlePolicy:
    """Hysteresis thresholds for pausing reads.

    Pause when rss >= high*quota or available < min_available_bytes; resume only once
    rss <= low*quota and available >= 1.25*min_available_bytes, so the state does not flap.
    """

    quota_bytes: int
    high: float = 0.90
    low: float = 0.80
    min_available_bytes: int = 256 * MiB

    def __post_init__(self) -> None:
        if self.quota_bytes <= 0:
            raise ValueError(f"quota_bytes must be > 0, got {self.quota_bytes}")
        if not 0.0 < self.low < self.high:
            raise ValueError(f"need 0 < low < high, got low={self.low} high={self.high}")
        if self.min_available_bytes < 0:
            raise ValueError(f"min_available_bytes must be >= 0, got {self.min_available_bytes}")

    @property
    def high_bytes(self) -> int:
        """RSS at or above which reading pauses."""
        return int(self.high * self.quota_bytes)

    @property
    def low_bytes(self) -> int:
        """RSS at or below which a paused reader may resume."""
        return int(self.low * self.quota_bytes)

    @property
    def resume_available_bytes(self) -> int:
        """Available memory needed (with the low mark) before resuming: 1.25 x the minimum."""
        return self.min_available_bytes * 5 // 4

    def decide(self, paused: bool, rss: int, available: int) -> bool:
        """Whether reading should be paused, given the current state and a sample."""
        if paused:
            return not (rss <= self.low_bytes and available >= self.resume_available_bytes)
        return rss >= self.high_bytes or available < self.min_available_bytes


@dataclass(frozen=True, slots=True)
class ThrottleStatistics:
    """A snapshot of a :class:`MemoryThrottle`: state, transition counts, last sample, marks."""

    paused: bool
    pauses: int
    resumes: int
    rss: int
    available: int
    quota_bytes: int
    high_bytes: int
    low_bytes: int
    settled_resumes: int = 0  # resumes with RSS above the low mark: pausing could not lower it
    retained_bytes: int = 0  # RSS at the last of them (0 once below the low mark)


def _psutil_sampler() -> Callable[[], tuple[int, int]]:
    """A sampler returning (process RSS, system available memory) from one reused Process."""
    import psutil

    proc = psutil.Process()

    def sample() -> tuple[int, int]:
        return int(proc.memory_info().rss), int(psutil.virtual_memory().available)

    return sample


class MemoryThrottle:
    """Samples memory every ``interval_s`` and pauses/resumes reading per a ThrottlePolicy."""

    def __init__(
        self,
        policy: ThrottlePolicy,
        interval_s: float = 0.1,
        sample: Callable[[], tuple[int, int]] | None = None,
    ) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.policy = policy
        self.interval_s = interval_s
        self._sample = sample if sample is not None else _psutil_sampler()
        self._paused = False
        self._open: trio.Event | None = None
        self._pauses = 0
        self._resumes = 0
        self._rss = 0
        self._available = 0
        # Mutations queued in the pipeline (the daemon sets it). Without it reads stay paused
        # until RSS falls below the low mark, however long that takes.
        self.queued: Callable[[], int] | None = None
        self._retained = 0
        self._settled = 0
        self._settle_since: float | None = None
        self._settle_rss = 0
        self._settle_queued = 0

    @property
    def paused(self) -> bool:
        """True while reading should stop."""
        return self._paused

    def update(self) -> bool:
        """Take one sample, apply the policy, log a transition; returns the paused state."""
        rss, available = self._sample()
        self._rss = rss
        self._available = available
        p = self.policy
        paused = p.decide(self._paused, rss, available)
        if rss <= p.low_bytes:
            self._retained = 0
        if self._paused and paused and self._settled_now(rss, available):
            self._resume_settled(rss)
            return False
        if (
            paused
            and not self._paused
            and available >= p.min_available_bytes
            and rss < self._retained + p.high_bytes - p.low_bytes
        ):
            paused = False  # not grown a band past what pausing could not lower
        if paused != self._paused:
            self._paused = paused
            self._settle_since = None
            if paused:
                self._pauses += 1
                self._open = trio.Event()
                log.warning(
                    "memory throttle: pausing reads: rss %.1f MiB (high mark %.1f MiB of quota"
                    " %.1f MiB), available %.1f MiB (minimum %.1f MiB)",
                    rss / MiB,
                    p.high_bytes / MiB,
                    p.quota_bytes / MiB,
                    available / MiB,
                    p.min_available_bytes / MiB,
                )
            else:
                self._resumes += 1
                ev, self._open = self._open, None
                if ev is not None:
                    ev.set()
                log.info(
                    "memory throttle: resuming reads: rss %.1f MiB (low mark %.1f MiB),"
                    " available %.1f MiB (resume at %.1f MiB)",
                    rss / MiB,
                    p.low_bytes / MiB,
                    available / MiB,
                    p.resume_available_bytes / MiB,
                )
        return paused

    def _resume_settled(self, rss: int) -> None:
        """Resume with RSS above the low mark: pausing could not lower it (see SETTLE_S)."""
        p = self.policy
        self._paused = False
        self._resumes += 1
        self._settled += 1
        self._retained = rss
        self._settle_since = None
        ev, self._open = self._open, None
        if ev is not None:
            ev.set()
        log.warning(
            "memory throttle: resuming reads: rss %.1f MiB stayed above the low mark (%.1f MiB)"
            " for %.0f s with the queues still, so pausing cannot lower it (caches, memory the"
            " allocator keeps); reads pause again past %.1f MiB. Raise memory.quota if this"
            " repeats",
            rss / MiB,
            p.low_bytes / MiB,
            SETTLE_S,
            (rss + p.high_bytes - p.low_bytes) / MiB,
        )

    def _settled_now(self, rss: int, available: int) -> bool:
        """Whether pausing stopped helping: for SETTLE_S neither RSS fell nor the queues moved
        (they may hold only incomplete snapshots, which wait for more input)."""
        queued = self.queued
        if queued is None or available < self.policy.resume_available_bytes:
            self._settle_since = None
            return False
        now, items = trio.current_time(), queued()
        if (
            self._settle_since is None
            or rss < self._settle_rss - SETTLE_DROP_BYTES
            or items != self._settle_queued
        ):
            self._settle_since, self._settle_rss, self._settle_queued = now, rss, items
            return False
        return now - self._settle_since >= SETTLE_S

    async def run(self) -> None:
        """Sample forever, every ``interval_s`` seconds (start it in the daemon's nursery)."""
        while True:
            self.update()
            await trio.sleep(self.interval_s)

    async def wait_open(self) -> None:
        """Return at once when reading is allowed, else wait until the throttle resumes."""
        ev = self._open
        if ev is None:
            await trio.lowlevel.checkpoint()
            return
        await ev.wait()

    def statistics(self) -> ThrottleStatistics:
        """Current state, transition counts, last sample and the policy's marks."""
        p = self.policy
        return ThrottleStatistics(
            paused=self._paused,
            pauses=self._pauses,
            resumes=self._resumes,
            rss=self._rss,
            available=self._available,
            quota_bytes=p.quota_bytes,
            high_bytes=p.high_bytes,
            low_bytes=p.low_bytes,
            settled_resumes=self._settled,
            retained_bytes=self._retained,
        )
