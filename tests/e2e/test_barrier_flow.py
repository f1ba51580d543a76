"""Barriers and flow control with a real daemon over TCP."""

from __future__ import annotations

import json
import subprocess
import time
from typing import Any

import pytest

from indexer import protocol as p
from indexer.router import Workload, generate
from tests.e2e.conftest import INDEXES, dump, indexer_command, model, run_feed, write_jsonl
from tests.e2e.stream_client import VBUCKETS, Router, Source, indexes_equal_model
from tests.harness import http

SLOW_SNAPSHOTS = {"snapshots": {"in_memory_interval_ms": 400, "persist_interval_ms": 5000}}


def count(daemon: Any, consistency: str = "any", **params: str) -> int:
    answer = http().get(
        daemon.url + "/indexes/by_age/count",
        params={"consistency": consistency, **params},
        timeout=30,
    )
    assert answer.status_code == 200, answer.text
    n: int = answer.json()["count"]
    return n


def test_a_barrier_is_answered_once_its_writes_are_readable(daemon_factory: Any) -> None:
    daemon = daemon_factory(**SLOW_SNAPSHOTS).start()
    source = Source(5)
    router = Router(daemon, source)
    expected = []
    for round_ in range(3):
        for vb in VBUCKETS:
            source.write(vb, 40)
        router.stream()
        router.restart = {vb: source.high(vb) for vb in VBUCKETS}  # sent: go on from there
        reply = router.barrier(round_ + 1)
        # The answer comes once the writes are readable: a read that does not wait sees them.
        wanted = len(model(source.surviving(), INDEXES["by_age"]))
        expected.append(wanted)
        assert count(daemon) == wanted
        assert {pos.vbucket: pos.seqno for pos in reply.positions} == {
            vb: source.high(vb) for vb in VBUCKETS
        }
        # The positions are the at_plus vector of this router's writes.
        vector = json.dumps({str(pos.vbucket): pos.seqno for pos in reply.positions})
        assert count(daemon, "at_plus", at_plus=vector, timeout="1") == wanted
    router.wait_persisted()
    persisted = router.barrier(99)
    assert persisted.persisted  # everything before it was acked as persisted already
    router.close()
    assert expected[0] < expected[-1]
    indexes_equal_model(daemon, source)


@pytest.mark.parametrize(
    "window, count",
    [pytest.param(1 << 18, 10_000), pytest.param(1 << 20, 40_000, marks=pytest.mark.soak)],
)
def test_flow_control_keeps_the_router_within_its_window(
    daemon_factory: Any, window: int, count: int
) -> None:
    # A frame may not be larger than the window: both at `window`.
    server = {"flow_control_bytes": window, "max_frame_bytes": window}
    daemon = daemon_factory(server=server).start()
    source = Source(6, docids_per_vbucket=3000)
    for vb in VBUCKETS:
        source.write(vb, count)  # about 5 windows of frames and more
    router = Router(daemon, source, flow_control=True)
    assert router.window == window
    router.stream()
    router.wait_persisted()
    assert router.sent > 4 * window
    assert router.most_in_flight <= window
    # Credit comes back in steps of at least a quarter window, for everything taken.
    assert router.credited >= router.sent - window // 4
    router.close()
    # The daemon releases the closed connection's vbuckets once it reads the close; until then
    # a new connection's claim on them is refused (STREAM_EXISTS).
    deadline = time.monotonic() + 30
    while daemon.stats()["vbuckets"]["streaming"]:
        assert time.monotonic() < deadline, "the closed connection's vbuckets stayed claimed"
        time.sleep(0.02)
    # A router that does not ask for flow control gets no window and no BUFFER_ACK.
    plain = Router(daemon, source)
    assert plain.window == 0 and plain.reply.flow_control_bytes == 0
    plain.close()
    indexes_equal_model(daemon, source)


def test_barrier_and_buffer_ack_frames_from_a_router_are_refused(daemon_factory: Any) -> None:
    daemon = daemon_factory().start()
    for frame in (p.BufferAck(5), p.BarrierReply(1, True, ())):
        router = Router(daemon, Source(7))
        router.send(p.encode(frame))
        error = router.next()
        assert isinstance(error, p.Error) and error.code is p.ErrorCode.PROTOCOL, error
        router.close()
    assert daemon.stop() == 0


def test_the_reference_router_gives_session_consistency_within_a_small_window(
    daemon_factory: Any, tmp_path: Any
) -> None:
    """`indexer feed --wait visible` prints an at_plus vector; a scan with it sees the feed.

    The daemon's window is one frame (1 MiB) and its snapshots are slow, so the feed runs on
    credit and the barrier answer waits for a snapshot.
    """
    window = {"flow_control_bytes": 1 << 20}
    daemon = daemon_factory(server=window, **SLOW_SNAPSHOTS).start()
    documents = list(generate(Workload(60_000, 8_000, 0.1, 8)))
    done = run_feed(daemon, write_jsonl(tmp_path / "a.jsonl", documents), "--wait", "visible")
    assert done.returncode == 0, done.stderr
    assert "visible over" in done.stderr
    line = done.stdout.strip()
    assert json.loads(line)["at_plus"]
    scanned = subprocess.run(
        indexer_command("scan", "by_age", "--url", daemon.url, "--at-plus", line, "--timeout", "5"),
        capture_output=True,
        text=True,
    )
    assert scanned.returncode == 0, scanned.stderr
    rows = [json.loads(r) for r in scanned.stdout.splitlines()]
    assert rows == model(documents, INDEXES["by_age"])
    assert "BUFFER_ACK" not in daemon.log()  # credit is normal traffic, not worth a log line
    assert daemon.stop() == 0
    assert dump(daemon, "by_city") == model(documents, INDEXES["by_city"])
