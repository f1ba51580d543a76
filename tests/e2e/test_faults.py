"""Faults with real processes: a router gone mid-frame, a router that stops reading, slow
storage and a full disk. Each checks that the daemon stays up, stays bounded, tells why, and
ends with every index equal to the model of what was sent."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from indexer.router import Workload, generate
from tests.e2e.conftest import (
    INDEXES,
    WAIT_S,
    Daemon,
    RssSampler,
    dump,
    free_port,
    http,
    model,
    scan,
    wait_equal,
    write_config,
    write_jsonl,
)
from tests.e2e.feed_client import FeedClient, History
from workers.flush import FAULT_ENOSPC_FILE, FAULT_SLOW_WRITE_MS

pytestmark = pytest.mark.e2e

# One client for the module's requests: a new one per call (httpx.get) builds its TLS
# context each time, which costs more than the request on a busy machine.
HTTP = http()  # the harness's client: no kept-alive connections

MiB = 1 << 20
FAST_PERSIST: dict[str, dict[str, Any]] = {
    "snapshots": {"persist_interval_ms": 100, "in_memory_interval_ms": 20}
}


def small_frames() -> dict[str, Any]:
    """Server settings with 64 KiB frames and flow-control window (a new dict each time)."""
    return {"max_frame_bytes": 65536, "flow_control_bytes": 65536}


def wait_for(what: str, check: Any, timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def rss(daemon: Daemon) -> int:
    import psutil

    assert daemon.proc is not None
    return int(psutil.Process(daemon.proc.pid).memory_info().rss)


# ------------------------------------------------------------------------------------------------
# (a) a router gone in the middle of a frame


def test_a_router_gone_mid_frame_applies_nothing_partial_and_the_next_one_resumes(
    daemon_factory: Any,
) -> None:
    daemon = daemon_factory(**FAST_PERSIST).start()
    vb = 11
    history = History([vb], seed=1)
    history.write(vb, 300)
    received = 0
    for n, cut in enumerate(("in the length", "in the header", "in the payload", "last byte")):
        client = FeedClient(daemon, [vb], flow_control=False)
        # A whole snapshot, then the next snapshot's marker and part of its first frame.
        whole = client.snapshot(history, vb, received + 1, received + 50)
        marker, frame, *_ = client.snapshot(history, vb, received + 51, received + 100)
        at = {"in the length": 2, "in the header": 5, "in the payload": len(frame) // 2}.get(
            cut, len(frame) - 1
        )
        client.sock.sendall(b"".join([client.begin(vb), *whole, marker, frame[:at]]))
        client.close()
        received += 50
        wait_for(
            "the truncated frame to be refused",
            lambda n=n: daemon.log().count("connection closed inside a frame") > n,
        )
        assert daemon.running
        assert HTTP.get(f"{daemon.url}/health").status_code == 200
        stats = daemon.stats(HTTP)
        assert stats["vbuckets"]["received_seqno_sum"] == received, (cut, stats["vbuckets"])
        assert stats["reader"]["protocol_errors"] == n + 1
        applied = history.docs[vb][:received]
        for name, paths in INDEXES.items():
            assert scan(daemon, name) == model(applied, paths), (cut, name)
    # The next connection resumes from the restart position and completes the history.
    client = FeedClient(daemon, [vb])
    restart = client.restart[vb]
    assert restart <= received
    client.resume(history)
    client.close()
    wait_equal(daemon, history.documents())
    # What it resent below the received position was skipped, not applied twice.
    assert daemon.stats(HTTP)["reader"]["duplicates_skipped"] == received - restart
    assert daemon.stop() == 0
    for name, paths in INDEXES.items():
        assert dump(daemon, name) == model(history.documents(), paths), name


# ------------------------------------------------------------------------------------------------
# (b) a router that keeps sending and never reads its acknowledgements


class Flooder:
    """A thread sending snapshots of many vbuckets as fast as the socket takes them, ignoring
    the flow-control window, never reading (its receive buffer is tiny)."""

    def __init__(self, client: FeedClient, history: History) -> None:
        self.client = client
        self.history = history
        self.bytes = 0
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        client, history = self.client, self.history
        try:
            client.sock.sendall(b"".join(client.begin(vb) for vb in client.vbuckets))
            while True:
                for vb in client.vbuckets:
                    start = history.high(vb) + 1
                    history.write(vb, 4)
                    data = b"".join(client.snapshot(history, vb, start, history.high(vb)))
                    client.sock.sendall(data)
                    self.bytes += len(data)
        except OSError as exc:  # the test closed the socket
            self.error = exc

    def stop(self) -> None:
        with contextlib.suppress(OSError):
            self.client.sock.shutdown(socket.SHUT_RDWR)
        self.client.close()
        self.thread.join(timeout=30)
        assert not self.thread.is_alive()


def test_a_router_that_stops_reading_acks_blocks_only_itself(daemon_factory: Any) -> None:
    daemon = daemon_factory(server=small_frames(), **FAST_PERSIST).start()
    # Many vbuckets: every ACK lists them all, so unread ACKs fill the socket buffers quickly.
    stuck_vbs, good_vbs = list(range(0, 600)), list(range(600, 608))
    stuck_history, good_history = History(stuck_vbs, seed=2), History(good_vbs, seed=3)
    base = rss(daemon)
    flooder = Flooder(FeedClient(daemon, stuck_vbs, receive_buffer=4096), stuck_history)
    try:
        # TCP pushes back: the daemon's ACKs to it wait, so it stops reading that socket.
        # Stalled: nothing sent for 2 s, and then for 1 s more nothing taken by a daemon that
        # answers meanwhile (on a loaded machine a slow daemon alone stills it for 2 s).
        last, still_since = -1, time.monotonic()
        deadline = time.monotonic() + WAIT_S
        while True:
            assert flooder.error is None, flooder.error
            assert time.monotonic() < deadline, f"the flooder never stalled ({flooder.bytes} B)"
            if flooder.bytes != last:
                last, still_since = flooder.bytes, time.monotonic()
            elif time.monotonic() - still_since >= 2.0:
                taken = daemon.stats(HTTP)["reader"]["mutations"]
                time.sleep(1.0)
                if daemon.stats(HTTP)["reader"]["mutations"] == taken and flooder.bytes == last:
                    break
            time.sleep(0.1)
        assert flooder.bytes > 1 * MiB
        with RssSampler(daemon.proc.pid) as sampler:  # type: ignore[union-attr]
            # Other connections and scans go on meanwhile.
            for vb in good_vbs:
                good_history.write(vb, 200)
            good = FeedClient(daemon, good_vbs)
            started = time.monotonic()
            good.resume(good_history)
            good.close()
            fed_s = time.monotonic() - started
            answer = HTTP.get(f"{daemon.url}/indexes/by_age/scan", timeout=10)
            assert answer.status_code == 200
            time.sleep(2)
        assert fed_s < 10, fed_s
        # The daemon took nothing more from the stuck router, which cannot send either.
        assert daemon.stats(HTTP)["reader"]["mutations"] == taken + 8 * 200
        assert flooder.bytes == last, "the stalled router moved on"
        # Bounded: a little over the idle daemon, and flat while the router keeps trying.
        assert sampler.peak - base < 48 * MiB, (base, sampler.peak)
        last_second = sampler.samples[-20:]
        assert max(last_second) - min(last_second) < 2 * MiB, last_second
    finally:
        flooder.stop()
    wait_for("the disconnect", lambda: daemon.stats(HTTP)["reader"]["connections"] == 0)
    # It comes back and resumes from the restart position: nothing it sent is lost or doubled.
    again = FeedClient(daemon, stuck_vbs)
    again.resume(stuck_history)
    again.close()
    wait_equal(daemon, stuck_history.documents() + good_history.documents())
    assert daemon.stop() == 0


# ------------------------------------------------------------------------------------------------
# (c) a router at full speed into slowed-down storage


def test_slow_storage_stalls_reads_instead_of_growing(
    daemon_factory: Any, routers: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    daemon = daemon_factory(
        server=small_frames(),
        slab={"pool": "512KiB", "slab_bytes": 65536},
        pipeline={"workers": 2, "channel_batches": 2},
    )
    monkeypatch.setenv(FAULT_SLOW_WRITE_MS, "1000")
    daemon.start()
    monkeypatch.delenv(FAULT_SLOW_WRITE_MS)
    assert "fault injection on" in daemon.log()
    base = rss(daemon)
    started = time.monotonic()
    backlog = 0  # mutations the daemon has taken in and not yet written, at most
    with RssSampler(daemon.proc.pid) as sampler:  # type: ignore[union-attr]
        router = routers(
            "--state", str(tmp_path / "state"), "--to", daemon.address,
            "--generate", "60000", "--keys", "60000", "--seed", "9",
        )  # fmt: skip
        deadline = time.monotonic() + WAIT_S
        while True:
            stats = daemon.stats(HTTP)
            written = sum(q["flushed"] for q in stats["queues"])
            backlog = max(backlog, stats["reader"]["mutations"] - written)
            if stats["persisted"]["seqno_sum"] >= 60_000:
                break
            assert time.monotonic() < deadline, stats["persisted"]
            time.sleep(0.1)
        wait_equal(daemon, list(generate(Workload(60_000, 60_000, 0.1, 9))))
    elapsed = time.monotonic() - started
    stats = daemon.stats(HTTP)
    # The pipeline waited for room instead of taking more: stalls on the full pool, each a pause
    # of reading the network, and the slow writes were what it waited for.
    assert sum(q["stalls"] for q in stats["queues"]) > 0, stats["queues"]
    assert stats["slab"]["waits"] > 0, stats["slab"]
    assert "slab pool full" in daemon.log()
    # Taken in but not written: at most the pool (8,192 chunks of 64 bytes) and the channels (six
    # receives of at most a 64 KiB window), far less than all the router sent.
    assert backlog <= 20_000 < stats["reader"]["mutations"], (backlog, stats["reader"])
    flushes = sum(q["flushes"] for q in stats["queues"])
    assert elapsed > flushes / 2 * 1.0 * 0.9, (elapsed, flushes)
    assert sampler.peak - base < 64 * MiB, (base, sampler.peak)
    assert router.stop() == 0
    assert daemon.stop() == 0


# ------------------------------------------------------------------------------------------------
# (d) a full disk: injected ENOSPC, and a real small tmpfs where it can be mounted


def _can_mount_tmpfs() -> bool:
    """Whether this process may mount a tmpfs (root, outside most CI containers)."""
    if os.geteuid() != 0:
        return False
    with tempfile.TemporaryDirectory() as where:
        try:
            mounted = subprocess.run(
                ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", where], capture_output=True
            )
        except OSError:  # no mount command
            return False
        if mounted.returncode != 0:
            return False
        subprocess.run(["umount", where], check=True)
        return True


DISK_FULL = ["injected", *(["tmpfs"] if _can_mount_tmpfs() else [])]


class DiskFull:
    """Makes the daemon's disk full and gives the space back: by the fault-injection file, or
    by filling a real tmpfs holding the data directory."""

    def __init__(self, how: str, root: Path) -> None:
        self.how = how
        self.flag = root / "disk-full"
        self.mount = root / "disk"
        self.filler = self.mount / "filler"
        self.mount.mkdir()
        if how == "tmpfs":
            subprocess.run(
                ["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(self.mount)], check=True
            )

    def fill(self) -> None:
        if self.how == "injected":
            self.flag.touch()
            return
        free = os.statvfs(self.mount)
        room = free.f_bavail * free.f_frsize
        with open(self.filler, "wb") as f:  # all but a few pages, then the rest
            f.write(b"\0" * max(room - 16384, 0))
            with contextlib.suppress(OSError):
                f.write(b"\0" * 16384)

    def free(self) -> None:
        self.flag.unlink(missing_ok=True)
        self.filler.unlink(missing_ok=True)

    def close(self) -> None:
        if self.how == "tmpfs":
            subprocess.run(["umount", "-l", str(self.mount)], check=False)


@pytest.fixture(params=DISK_FULL)
def disk(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[DiskFull]:
    disk = DiskFull(request.param, tmp_path)
    yield disk
    disk.close()


def test_a_full_disk_stops_intake_says_why_and_recovers_losing_nothing(
    disk: DiskFull, routers: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    port = free_port()
    config = write_config(
        tmp_path / "indexer.toml",
        disk.mount / "data",
        port,
        server=small_frames(),
        slab={"pool": "512KiB", "slab_bytes": 65536},
        pipeline={"workers": 2, "channel_batches": 2},
        snapshots={"persist_interval_ms": 200},
    )
    daemon = Daemon(config, tmp_path / "daemon.log", port)
    monkeypatch.setenv(FAULT_ENOSPC_FILE, str(disk.flag))
    try:
        _disk_full_scenario(daemon, disk, routers, tmp_path)
    finally:
        if daemon.running:
            daemon.kill()


def _disk_full_scenario(daemon: Daemon, disk: DiskFull, routers: Any, tmp_path: Path) -> None:
    daemon.start()
    before = list(generate(Workload(2_000, 1_000, 0.1, 21)))
    jsonl = write_jsonl(tmp_path / "docs.jsonl", before)
    router = routers(
        "--state", str(tmp_path / "state"), "--jsonl", str(jsonl), "--follow",
        "--to", daemon.address, "--http", "127.0.0.1:0",
    )  # fmt: skip
    (router_url,) = router.wait_log(r"router API on (http://\S+)")
    wait_equal(daemon, before)
    wait_for("the first documents to persist", lambda: persisted(daemon) >= len(before))

    disk.fill()
    during = list(generate(Workload(24_000, 24_000, 0.1, 22)))
    write_jsonl(jsonl, during, append=True)
    wait_for("the write error in the log", lambda: "No space left on device" in daemon.log())
    # It stops: nothing more acknowledged, intake stalls once the pool is full, and /stats
    # says why; scans of what is readable still answer.
    time.sleep(1.0)
    stuck = daemon.stats(HTTP)
    time.sleep(1.5)
    later = daemon.stats(HTTP)
    assert daemon.running
    assert later["persisted"]["seqno_sum"] == stuck["persisted"]["seqno_sum"]
    assert later["persisted"]["seqno_sum"] < len(before) + len(during)
    assert later["vbuckets"]["received_seqno_sum"] == stuck["vbuckets"]["received_seqno_sum"]
    assert later["vbuckets"]["received_seqno_sum"] < len(before) + len(during)
    write_errors = sum(q["write_errors"] for q in later["queues"])
    failing = (
        any(q["write_failing"] for q in later["queues"]) or (later["timekeeper"]["persist_failing"])
    )
    assert failing and write_errors + later["timekeeper"]["persist_errors"] > 0, later
    if disk.how == "injected":
        assert any("No space left on device" in (q["write_error"] or "") for q in later["queues"])
    answer = HTTP.get(f"{daemon.url}/indexes/by_age/scan", timeout=10)
    assert answer.status_code == 200
    node = HTTP.get(f"{router_url}/stats", timeout=10).json()["nodes"][daemon.address]
    assert node["connected"], node  # the router holds its data, connected, waiting

    disk.free()
    documents = before + during
    wait_equal(daemon, documents)
    assert "store write succeeded after" in daemon.log() or (
        "snapshots persist again after" in daemon.log()
    )
    total = len(documents)
    wait_for("everything to persist", lambda: persisted(daemon) >= total)
    stats = daemon.stats(HTTP)
    assert not any(q["write_failing"] for q in stats["queues"])
    assert not stats["timekeeper"]["persist_failing"]
    # Losing nothing acknowledged: killed now, it restarts from all of it.
    daemon.kill()
    daemon.start()
    assert persisted(daemon) >= total
    for name, paths in INDEXES.items():
        assert scan(daemon, name, "any") == model(documents, paths), name
    assert router.stop() == 0
    assert daemon.stop() == 0
    for name, paths in INDEXES.items():
        assert dump(daemon, name) == model(documents, paths), name


def persisted(daemon: Daemon) -> int:
    total: int = daemon.stats(HTTP)["persisted"]["seqno_sum"]
    return total
