"""What the daemon's and the router's `/metrics` and `/stats` share: latency histograms kept by
the parts that measure, the package's version and the process's uptime.

A `Histogram` is plain data owned by whoever observes (the timekeeper, the HTTP API): there is
no registry here. Each HTTP app registers a collector on its own `CollectorRegistry` that reads
these at scrape time and turns them into Prometheus histograms (`histogram_family`).
"""

from __future__ import annotations

import bisect
import importlib.metadata
import math
import time
from collections.abc import Iterator, Sequence
from typing import Any

import psutil
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)

from indexer.collector import CollectorPauses

PACKAGE = "indexer"
# Upper bounds in seconds. A scan answers in milliseconds to minutes (a whole index, a
# request_plus wait); a flush of every worker takes milliseconds, seconds when the disk is slow;
# a snapshot waits up to the persist interval (1 s by default) to be persisted, longer when
# persists fail.
SCAN_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
FLUSH_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
PERSIST_LAG_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 300)


class Histogram:
    """Observations counted into buckets of fixed upper bounds, with their sum and largest.

    Observed and read on one thread (the event loop), so it needs no lock.
    """

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(float(b) for b in bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # the last one: above every bound (+Inf)
        self.count = 0
        self.sum = 0.0
        self.largest = 0.0

    def observe(self, value: float) -> None:
        """Count one observation (a value equal to a bound falls in that bound's bucket)."""
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.count += 1
        self.sum += value
        self.largest = max(self.largest, value)

    def cumulative(self) -> list[tuple[str, float]]:
        """(le, observations at or below it) for every bound and +Inf: Prometheus's buckets."""
        out = []
        running = 0
        for bound, n in zip((*self.bounds, math.inf), self.counts, strict=True):
            running += n
            out.append(("+Inf" if math.isinf(bound) else repr(bound), float(running)))
        return out

    def quantile(self, q: float) -> float | None:
        """An estimate of quantile `q` (0..1), interpolated within its bucket as Prometheus's
        histogram_quantile does (the largest observation past the last bound); None if empty."""
        if not self.count:
            return None
        rank = q * self.count
        below = 0
        lower = 0.0
        for j, n in enumerate(self.counts):
            upper = self.bounds[j] if j < len(self.bounds) else self.largest
            if n and below + n >= rank:
                return min(lower + (upper - lower) * (rank - below) / n, self.largest)
            below += n
            lower = upper
        return self.largest

    def summary(self) -> dict[str, Any]:
        """What `/stats` shows: the count, and mean, p50, p99 (estimates) and max in seconds."""

        def seconds(value: float | None) -> float | None:
            return None if value is None else round(value, 6)

        return {
            "count": self.count,
            "mean": seconds(self.sum / self.count) if self.count else None,
            "p50": seconds(self.quantile(0.5)),
            "p99": seconds(self.quantile(0.99)),
            "max": seconds(self.largest) if self.count else None,
        }


def histogram_family(
    name: str, doc: str, series: Sequence[tuple[Sequence[str], Histogram]], labels: Sequence[str]
) -> HistogramMetricFamily:
    """A Prometheus histogram of one or more labelled `Histogram`s."""
    family = HistogramMetricFamily(name, doc, labels=list(labels))
    for values, histogram in series:
        family.add_metric(list(values), histogram.cumulative(), sum_value=histogram.sum)
    return family


def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    """A gauge without labels: a value that goes up and down."""
    return GaugeMetricFamily(name, doc, value=value)


def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    """A counter without labels; `name` ends in `_total`, as it is exposed."""
    return CounterMetricFamily(name, doc, value=value)


def version() -> str:
    """The installed package's version (from its metadata), or "unknown" when not installed."""
    try:
        return importlib.metadata.version(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def build_info(prefix: str) -> InfoMetricFamily:
    """`PREFIX_build_info{version="..."} 1`: which version a process runs."""
    doc = "The version of the package this process runs"
    return InfoMetricFamily(f"{prefix}_build", doc, value={"version": version()})


def process_started_at() -> float:
    """When this process started (seconds since the epoch): uptimes count from here."""
    try:
        return float(psutil.Process().create_time())
    except psutil.Error:
        return time.time()


def collector_metrics(prefix: str, collector: CollectorPauses) -> Iterator[Metric]:
    """The cycle collector's collections (a counter) and longest pause (a gauge), per
    generation."""
    stats = collector.statistics()
    collections = CounterMetricFamily(
        f"{prefix}_gc_collections_total",
        "Collections of the cycle collector, per generation",
        labels=["generation"],
    )
    longest = GaugeMetricFamily(
        f"{prefix}_gc_pause_longest_seconds",
        "Longest pause of the cycle collector, per generation",
        labels=["generation"],
    )
    for generation, (n, pause) in enumerate(
        zip(stats.collections, stats.pause_s_longest, strict=True)
    ):
        collections.add_metric([str(generation)], n)
        longest.add_metric([str(generation)], pause)
    yield collections
    yield longest
