"""The crash loop, short: a followed JSONL feed while the daemon is killed with SIGKILL at seeded
random moments and restarted; nothing acknowledged is lost and the indexes end equal to the model.
`make soak` runs the same loop for hundreds of kills (tests/e2e/crashloop.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.crashloop import run_crash_loop

pytestmark = pytest.mark.e2e

RATE = 2_000  # documents a second


# Seed 209 draws, in two rounds, a kill after about 0.9 s of traffic each time, each followed by
# a kill during the restart (0.42 s and 0.32 s after it), and a router kill in the first: four
# kills. Seed 11's five kills take four rounds, with one kill during a restart.
@pytest.mark.parametrize(
    "kills, seed", [pytest.param(4, 209), pytest.param(5, 11, marks=pytest.mark.soak)]
)
def test_the_daemon_killed_under_a_feed_ends_equal_to_the_model(
    tmp_path: Path, kills: int, seed: int
) -> None:
    report = run_crash_loop(tmp_path, kills=kills, seed=seed, rate=RATE, keys=5_000)
    print(report.summary())
    assert report.ok, report.summary()
    assert report.kills >= kills, report.summary()
    # The feed kept going across the kills: far more than the first second's worth arrived.
    assert report.documents > 3 * RATE, report.summary()
    assert report.scan_mismatches == report.dump_mismatches == {"by_city": 0, "by_age": 0}
