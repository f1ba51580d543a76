"""The latency histogram behind /metrics' histograms and /stats' latency summaries."""

from __future__ import annotations

import pytest

from indexer.metrics import Histogram


def test_buckets_are_cumulative_and_a_bound_holds_its_own_value() -> None:
    h = Histogram((0.1, 1, 10))
    for value in (0.05, 0.1, 0.5, 1, 20):
        h.observe(value)
    assert h.cumulative() == [("0.1", 2.0), ("1.0", 4.0), ("10.0", 4.0), ("+Inf", 5.0)]
    assert (h.count, h.sum, h.largest) == (5, pytest.approx(21.65), 20)


def test_quantiles_interpolate_within_a_bucket_as_prometheus_does() -> None:
    h = Histogram((1, 2, 4))
    assert h.quantile(0.5) is None
    assert h.summary() == {"count": 0, "mean": None, "p50": None, "p99": None, "max": None}
    for value in (0.5, 1.5, 1.5, 3):
        h.observe(value)
    assert h.quantile(0.5) == pytest.approx(1.5)  # rank 2: halfway through (1, 2]
    assert h.quantile(0.25) == pytest.approx(1.0)
    assert h.quantile(1.0) == pytest.approx(3)  # never past the largest observation
    h.observe(100)  # past the last bound: estimated up to the largest
    assert h.quantile(0.99) == pytest.approx(100 - 0.05 * 96, rel=0.01)
    summary = h.summary()
    assert summary["count"] == 5 and summary["max"] == 100
    assert summary["mean"] == pytest.approx(106.5 / 5)
