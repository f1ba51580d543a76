"""The crash loop, short: a followed JSONL feed while the daemon is killed with SIGKILL at seeded
random moments and restarted; nothing acknowledged is lost and the indexes end equal to the model.
`make soak` runs the same loop for hundreds of kills (tests/e2e/crashloop.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.crashloop import run_crash_loop

pytestmark = pytest.mark.e2e


def test_the_daemon_killed_five_times_under_a_feed_ends_equal_to_the_model(
    tmp_path: Path,
) -> None:
    report = run_crash_loop(tmp_path, kills=5, seed=11, rate=2_000, keys=5_000)
    assert report.ok, report.summary()
    assert report.kills >= 5, report.summary()
    # The feed kept going across the kills: far more than the first second's worth arrived.
    assert report.documents > 10_000, report.summary()
    assert report.scan_mismatches == report.dump_mismatches == {"by_city": 0, "by_age": 0}
