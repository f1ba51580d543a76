"""Memory: a router pushing as fast as it can into a daemon with a small slab pool and a memory
quota a little above its idle RSS. The throttle pauses and resumes reads, the RSS (sampled with
psutil) stays under the quota plus the overshoot documented in docs/testing.md, and everything
sent arrives."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from tests.e2e.conftest import INDEXES, WAIT_S, Daemon, RssSampler, model
from tests.e2e.feed_client import FeedClient, History
from tests.harness import http

pytestmark = pytest.mark.e2e

MiB = 1 << 20
PIPELINE = {
    "server": {"max_frame_bytes": 262144, "flow_control_bytes": 1 << 20},
    "slab": {"pool": "1MiB", "slab_bytes": 262144},
    "pipeline": {"workers": 4, "channel_batches": 4, "ring_slots": 32768},
}
# The quota: the idle daemon's RSS plus this budget.
BUDGET = 12 * MiB
# How far RSS may pass the quota while fed (docs/testing.md): what the pipeline takes in between
# the sample over the high mark and the pause, within the band a resume without RSS falling
# allows (high - low mark); and with the final scans, whose answers are built in memory.
OVERSHOOT = 8 * MiB
SCANS_OVERSHOOT = 24 * MiB


def idle_rss(daemon_factory: Any) -> int:
    """RSS of the idle daemon with the test's pipeline settings, after a scan and a stats call
    (their first calls import and allocate what every later one reuses)."""
    probe = daemon_factory(**PIPELINE).start()
    http().get(f"{probe.url}/indexes/by_age/scan", timeout=30)
    probe.stats()
    time.sleep(0.5)
    with RssSampler(probe.proc.pid) as sampler:  # type: ignore[union-attr]
        time.sleep(0.5)
    assert probe.stop() == 0
    return max(sampler.samples)


def scans_equal_model(daemon: Daemon, history: History) -> None:
    """Every index equals the model; a scan answered 503 (reads paused) is asked again."""
    documents = history.documents()
    for name, paths in INDEXES.items():
        deadline = time.monotonic() + WAIT_S
        while True:
            answer = http().get(f"{daemon.url}/indexes/{name}/scan", timeout=60)
            if answer.status_code != 503:
                break
            assert time.monotonic() < deadline, "scans kept answering 503"
            time.sleep(float(answer.headers.get("retry-after", "1")))
        assert answer.status_code == 200, answer.text
        rows = [json.loads(line) for line in answer.text.splitlines() if line]
        assert rows == model(documents, paths), name


def test_a_full_speed_router_stays_under_the_quota_with_reads_paused_and_resumed(
    daemon_factory: Any,
) -> None:
    base = idle_rss(daemon_factory)
    quota = base + BUDGET
    daemon = daemon_factory(
        **PIPELINE,
        memory={"quota": quota, "high_mark": 0.95, "low_mark": 0.9, "min_available": "1MiB"},
    ).start()
    vbuckets = list(range(64))
    history = History(vbuckets, seed=31, ids_per_vbucket=100)
    for vb in vbuckets:
        history.write(vb, 5_000)
    client = FeedClient(daemon, vbuckets)
    frames = [client.begin(vb) for vb in vbuckets]
    for vb in vbuckets:  # encoded before sending: the router then goes at socket speed
        frames += client.snapshot(history, vb, 1, history.high(vb))
    started = time.monotonic()
    with RssSampler(daemon.proc.pid) as sampler:  # type: ignore[union-attr]
        for frame in frames:
            client.send(frame)
        client.resume(history)  # nothing left to send: waits for every acknowledgement
        elapsed = time.monotonic() - started
        fed_peak = sampler.peak
        fed = daemon.stats()
        client.close()
        scans_equal_model(daemon, history)  # the scans' own memory counts too
    stats = daemon.stats()
    throttle = stats["throttle"]
    log = daemon.log()
    print(
        f"memory: idle {base / MiB:.1f} MiB, quota {quota / MiB:.1f} MiB, peak "
        f"{fed_peak / MiB:.1f} MiB while fed, {sampler.peak / MiB:.1f} MiB with the scans; "
        f"{fed['throttle']['pauses']} pauses while fed, {throttle['pauses']} pauses, "
        f"{throttle['resumes']} resumes ({throttle['settled_resumes']} settled); "
        f"{len(frames)} frames in {elapsed:.1f} s"
    )
    # Reads paused while the router pushed, and resumed: it all arrived.
    assert fed["throttle"]["pauses"] >= 1 and fed["throttle"]["resumes"] >= 1, fed["throttle"]
    assert fed["reader"]["throttle_waits"] >= 1, fed["reader"]
    assert throttle["resumes"] >= 1 and throttle["pauses"] - throttle["resumes"] in (0, 1)
    assert log.count("memory throttle: pausing reads") == throttle["pauses"]
    assert log.count("memory throttle: resuming reads") == throttle["resumes"]
    assert fed_peak <= quota + OVERSHOOT, (base, quota, fed_peak)
    assert sampler.peak <= quota + SCANS_OVERSHOOT, (base, quota, sampler.peak)
    assert daemon.stop() == 0
