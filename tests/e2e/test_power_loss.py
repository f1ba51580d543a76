"""Power cuts under the daemon: its data directory lives under the power-loss layer
(tests/powercut), a router feeds it from a growing JSONL file, and the test cuts the power at
seeded moments (SIGKILL, then every write not fsynced undone), restarts it on what survived, and
lets the router resume from the daemon's restart positions.

Half the cuts are aimed where acknowledged writes were at risk: right after a persisted
snapshot that followed a switch of LevelDB's log (a new `*.log` in the store), when the closed
log may hold unsynced bytes. The layer makes the disk slow for table files (each sync of an
`.ldb` takes SLOW_TABLE_SYNC_MS more), so the closed log waits that long for its memtable's table
to be synced: the aimed cut lands inside that window, and a few cuts find what many found on a
fast disk. After every restart the persisted snapshot must be at least the
last one acknowledged before the cut; at the end the indexes must equal the model of the whole
file: a mutation lost below an acknowledged snapshot is never sent again, so it would show.
"""

from __future__ import annotations

import contextlib
import json
import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from indexer.router.documents import Document
from indexer.snapshots import SNAPSHOT_FILE
from indexer.storage import STORE_DIR
from tests.e2e.conftest import (
    INDEXES,
    Daemon,
    Router,
    dump,
    free_port,
    http,
    model,
    scan,
    write_config,
)
from tests.e2e.crashloop import DAEMON_CONFIG, Writer, differing_rows, persisted_sum, scans_equal
from tests.e2e.stream_client import FAST_PERSIST, VBUCKETS, Source, feed, indexes_equal_model
from tests.e2e.stream_client import Router as StreamRouter
from tests.e2e.test_index_build import ZIP, index_states, wait_active
from tests.powercut import PowerLoss

pytestmark = pytest.mark.e2e

SOAK = pytest.mark.soak  # the larger counts of these cases: `pytest -m soak`
AIM_S = 10.0  # at most, waiting for a log switch and the persist after it
# A slow disk for table files: the window in which a closed log is the only copy of its writes
# (LevelDB writes its memtable to a table and syncs that before it deletes the log) lasts this
# much longer than on a fast disk, longer than the persist interval of DAEMON_CONFIG.
SLOW_TABLE_SYNC_MS = 600
ROLLBACK_S = 30.0  # at most, waiting for a handshake's rollback to start or to end
COMPACTED = "compacted the store"


@pytest.fixture
def cleanup() -> Iterator[list[Daemon | Router]]:
    started: list[Daemon | Router] = []
    yield started
    for process in started:
        if isinstance(process, Daemon):
            if process.running:
                process.kill()
        else:
            process.kill()


def aim(daemon: Daemon, store: Path, seen: int) -> tuple[int, bool]:
    """Wait for a new log in the store and then a persist: the persisted sum, and whether the
    switch was seen. The store's directory is watched closely, the daemon asked only after."""
    logs = set(store.glob("*.log"))
    deadline = time.monotonic() + AIM_S
    while not set(store.glob("*.log")) - logs:
        if time.monotonic() > deadline:
            return max(seen, persisted_sum(daemon) or 0), False
        time.sleep(0.005)
    while time.monotonic() < deadline:
        now = persisted_sum(daemon) or 0
        if now > seen:
            return now, True
        time.sleep(0.01)
    return seen, True


# Half of them aimed: 8 fail every run on the store without `ClosedLogs`.
@pytest.mark.parametrize("cuts", [pytest.param(8), pytest.param(20, marks=SOAK)])
def test_power_cuts_lose_nothing_acknowledged(
    library: Path, tmp_path: Path, cleanup: list[Daemon | Router], cuts: int
) -> None:
    rng = random.Random(20261127)
    layer = PowerLoss(library, tmp_path / "disk", tmp_path / "powercut")
    port = free_port()
    data = layer.root / "data"
    config = write_config(tmp_path / "indexer.toml", data, port, **DAEMON_CONFIG)
    daemon = Daemon(config, tmp_path / "daemon.log", port)
    daemon.env = layer.env(slow_sync=(".ldb", SLOW_TABLE_SYNC_MS))
    cleanup.append(daemon)
    jsonl = tmp_path / "docs.jsonl"
    writer = Writer(jsonl, rng.getrandbits(32), rate=6_000, keys=20_000)
    writer.append(6_000)
    router = Router(
        tmp_path / "router.log",
        "--state", str(tmp_path / "router"), "--jsonl", str(jsonl), "--follow",
        "--to", daemon.address,
    )  # fmt: skip
    cleanup.append(router)
    writer.start()
    lost: list[str] = []
    aimed = 0
    truncated = 0
    try:
        daemon.start()
        for cut in range(cuts):
            seen = persisted_sum(daemon) or 0
            if cut % 2 == 0:
                seen, hit = aim(daemon, data / STORE_DIR, seen)
                aimed += hit
            else:
                until = time.monotonic() + rng.uniform(0.1, 2.0)
                while time.monotonic() < until:
                    seen = max(seen, persisted_sum(daemon) or 0)
                    time.sleep(0.02)
            daemon.kill()
            report = layer.cut()
            truncated += bool(report.bytes_lost)
            daemon.start()
            restarted = persisted_sum(daemon)
            if restarted is None or restarted < seen:
                lost.append(f"cut {cut}: persisted seqno sum {seen} before, {restarted} after")
        writer.stop()
        want = {name: model(writer.documents, paths) for name, paths in INDEXES.items()}
        differing = scans_equal(daemon, want, 180)
        assert lost == [] and differing == dict.fromkeys(INDEXES, 0), (lost, differing)
        router.stop()
        assert daemon.stop() == 0
        dumped = {name: differing_rows(dump(daemon, name), want[name]) for name in INDEXES}
        assert dumped == dict.fromkeys(INDEXES, 0)
    finally:
        writer.stop()
    # The layer did take something in most cuts, and the aim found log switches.
    assert truncated >= cuts // 2 and aimed >= cuts // 4, (truncated, aimed)


# Its appends are all synchronous writes: a guard, not a hunt.
@pytest.mark.parametrize("cuts", [pytest.param(3), pytest.param(6, marks=SOAK)])
def test_power_cuts_under_the_router_lose_no_acknowledged_bulk_line(
    library: Path, tmp_path: Path, cleanup: list[Daemon | Router], cuts: int
) -> None:
    """The router's source log under the layer: a client posts bulks of new documents, each
    200 acknowledging its lines as synced; the power is cut (some cuts right after a switch of
    the log's LevelDB log), the router restarted. Every acknowledged line must reach the index,
    and nothing that was never sent. (Every append to the source log is a synchronous write,
    so its closed logs hold nothing unsynced: this run passes without `ClosedLogs` too.)"""
    rng = random.Random(11)
    layer = PowerLoss(library, tmp_path / "disk", tmp_path / "powercut")
    daemon = start_plain_daemon(tmp_path)
    cleanup.append(daemon)
    state = layer.root / "router"
    args = ["--state", str(state), "--to", daemon.address, "--http", "127.0.0.1:0"]
    acknowledged: dict[str, int] = {}
    sent: set[str] = set()
    batch = 0
    for cut in range(cuts):
        router = Router(tmp_path / f"router{cut}.log", *args, env=layer.env())
        cleanup.append(router)
        url = router.wait_url()
        logs = set((state / "source").glob("*.log"))
        until = time.monotonic() + rng.uniform(0.5, 3.0)
        with httpx.Client(base_url=url, timeout=30) as client:
            while time.monotonic() < until or (
                cut % 3 == 0 and not set((state / "source").glob("*.log")) - logs
            ):
                batch += 1
                lines = [(f"b{batch}-{k}", rng.randrange(90)) for k in range(2_000)]
                sent.update(docid for docid, _ in lines)
                body = "".join(
                    json.dumps({"id": d, "doc": {"age": age, "pad": "x" * 200}}) + "\n"
                    for d, age in lines
                )
                answer = client.post("/docs/_bulk", content=body)
                assert answer.status_code == 200, answer.text
                assert answer.json()["appended"] == len(lines)
                acknowledged.update(lines)
        router.kill()
        assert layer.cut().bytes_lost >= 0
    router = Router(tmp_path / "router-last.log", *args)
    cleanup.append(router)
    router.wait_url()
    want = model([Document(d, {"age": a}) for d, a in acknowledged.items()], INDEXES["by_age"])
    deadline = time.monotonic() + 180
    while True:
        answer = http().get(f"{daemon.url}/indexes/by_age/scan", timeout=120)
        got = [json.loads(line) for line in answer.text.splitlines() if line]
        if got == want or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    ids = {entry["id"] for entry in got}
    assert ids <= sent  # no phantom
    assert differing_rows(got, want) == 0, (len(got), len(want))
    assert router.stop() == 0 and daemon.stop() == 0


def start_plain_daemon(tmp_path: Path) -> Daemon:
    port = free_port()
    config = write_config(tmp_path / "plain.toml", tmp_path / "plain-data", port)
    return Daemon(config, tmp_path / "plain-daemon.log", port).start()


ROLLED_BACK = "rolled back to"  # a handshake's rollback ended, its undo synced
PHASES = ("before", "during", "after")


def snapshot_sum(data: Path) -> int | None:
    """The seqno sum of the snapshot file's current point (None before the first persist)."""
    try:
        return sum(json.loads((data / SNAPSHOT_FILE).read_text())["seqnos"])
    except FileNotFoundError:
        return None


def wait_rollback(daemon: Daemon, data: Path, persisted: int, rolled: int, ended: bool) -> None:
    """Until the handshake's rollback has begun its undo (the snapshot file names a point
    below `persisted`) or, with `ended`, logged its end (more than the `rolled` lines seen
    before). Polled without pause: the undo lasts a fraction of a second."""
    deadline = time.monotonic() + ROLLBACK_S
    while daemon.log().count(ROLLED_BACK) <= rolled:
        if not ended and (snapshot_sum(data) or persisted) < persisted:
            return
        daemon.check_alive()
        assert time.monotonic() < deadline, f"no rollback:\n{daemon.log()[-3000:]}"
        time.sleep(0.001)


@pytest.mark.parametrize("rounds", [pytest.param(1), pytest.param(4, marks=SOAK)])
def test_power_cuts_during_rollbacks_lose_nothing_acknowledged(
    library: Path, tmp_path: Path, cleanup: list[Daemon | Router], rounds: int
) -> None:
    """A failover makes the daemon roll a vbucket back (the undo of thousands of mutations,
    written at start of the stream); the power is cut before it starts, while it undoes
    (the snapshot file already naming the earlier point, the store not yet synced) and right
    after it ended, and the restarted daemon must still end equal to the source's surviving
    history: the rollback's writes are synced before anything after them is acknowledged."""
    layer = PowerLoss(library, tmp_path / "disk", tmp_path / "powercut")
    port = free_port()
    data = layer.root / "data"
    config = write_config(tmp_path / "indexer.toml", data, port, **FAST_PERSIST)
    daemon = Daemon(config, tmp_path / "daemon.log", port)
    daemon.env = layer.env()
    cleanup.append(daemon)
    daemon.start()
    source = Source(4, docids_per_vbucket=4000)
    for _ in range(2):
        for vb in VBUCKETS:
            source.write(vb, 6000)
        feed(daemon, source)
        time.sleep(0.3)
    truncated = 0
    hits = dict.fromkeys(PHASES, 0)
    attempt = 0
    for phase in PHASES * rounds:
        # A cut that missed its moment (the undo began before the kill meant to come before
        # it, or ended before the poll saw it begin) is made again, after a new failover.
        for _ in range(3):
            attempt += 1
            source.failover(333, source.high(333) - 1500 - attempt)
            for vb in VBUCKETS:
                source.write(vb, 2000)
            rolled = daemon.log().count(ROLLED_BACK)
            persisted = snapshot_sum(data) or 0
            stream = StreamRouter(daemon, source, wait_reply=False)  # the handshake rolls back
            if phase != "before":  # during: the undo's target written, the undo under way
                wait_rollback(daemon, data, persisted, rolled, ended=phase == "after")
            daemon.kill()
            stream.close()
            hit = {  # before: the undo's target not written yet (the handshake perhaps read)
                "before": (snapshot_sum(data) or 0) >= persisted,
                "during": daemon.log().count(ROLLED_BACK) == rolled,
                "after": True,
            }[phase]
            truncated += bool(layer.cut().bytes_lost)
            daemon.start()
            feed(daemon, source)
            if hit:
                hits[phase] += 1
                break
    indexes_equal_model(daemon, source)
    # Every moment was cut at; the log spans every restart: rollbacks happened.
    assert hits == dict.fromkeys(PHASES, rounds), hits
    assert daemon.log().count(ROLLED_BACK) >= 2, daemon.log()[-3000:]
    assert truncated >= 2, truncated


@pytest.mark.parametrize("compactions", [pytest.param(1), pytest.param(3, marks=SOAK)])
def test_power_cuts_during_index_builds_and_compactions_lose_nothing(
    library: Path, tmp_path: Path, cleanup: list[Daemon | Router], compactions: int
) -> None:
    """An index built over existing data and full compactions of the store, each cut short by
    the power while a feed goes on: the build resumes, the store opens, and every index equals
    the model of the whole feed."""
    rng = random.Random(7)
    layer = PowerLoss(library, tmp_path / "disk", tmp_path / "powercut")
    port = free_port()
    config = write_config(
        tmp_path / "indexer.toml", layer.root / "data", port, **DAEMON_CONFIG,
        compaction={"interval_minutes": 0},
    )  # fmt: skip
    daemon = Daemon(config, tmp_path / "daemon.log", port)
    daemon.env = layer.env()
    cleanup.append(daemon)
    jsonl = tmp_path / "docs.jsonl"
    writer = Writer(jsonl, 5, rate=2_000, keys=20_000)
    writer.append(30_000)
    router = Router(
        tmp_path / "router.log",
        "--state", str(tmp_path / "router"), "--jsonl", str(jsonl), "--follow",
        "--to", daemon.address,
    )  # fmt: skip
    cleanup.append(router)
    truncated = 0
    try:
        daemon.start()
        writer.start()
        wait_persisted_at_least(daemon, 30_000)
        created = http().post(f"{daemon.url}/indexes", json={"name": "by_zip", "keys": ZIP})
        assert created.status_code == 201, created.text
        builds_cut = 0
        for _ in range(2):  # cut during the build, and again during its resumption
            if not built_some(daemon, "by_zip"):
                break
            time.sleep(rng.uniform(0.0, 0.3))
            daemon.kill()
            builds_cut += 1
            truncated += bool(layer.cut().bytes_lost)
            daemon.start()
        assert builds_cut == 2, "the build ended before its cuts"
        wait_active(daemon, "by_zip", timeout=240)  # it catches up with the feed
        compactions_cut = 0
        # A compaction that ended before its cut (a small store compacts fast) is made again.
        for _ in range(3 * compactions):
            compaction = threading.Thread(target=compact_quietly, args=(daemon,))
            done = daemon.log().count(COMPACTED)
            compaction.start()
            wait_compacting(daemon, compaction)
            time.sleep(rng.uniform(0.0, 0.2))
            daemon.kill()
            compaction.join()
            compactions_cut += daemon.log().count(COMPACTED) == done
            truncated += bool(layer.cut().bytes_lost)
            daemon.start()
            if compactions_cut == compactions:
                break
        assert compactions_cut == compactions, "every compaction ended before its cut"
        writer.stop()
        want = {name: model(writer.documents, paths) for name, paths in INDEXES.items()}
        assert scans_equal(daemon, want, 180) == dict.fromkeys(INDEXES, 0)
        assert scan(daemon, "by_zip") == model(writer.documents, ZIP)
        router.stop()
        assert daemon.stop() == 0
        want["by_zip"] = model(writer.documents, ZIP)
        dumped = {name: dump(daemon, name) for name in want}
        assert {name: differing_rows(dumped[name], want[name]) for name in want} == dict.fromkeys(
            want, 0
        )
    finally:
        writer.stop()
    assert truncated >= 2, truncated


def built_some(daemon: Daemon, name: str) -> bool:
    """Until this start's build of `name` has written something: True; False if the index
    became active first."""
    deadline = time.monotonic() + 120
    while True:
        entry = index_states(daemon)[name]
        if entry["state"] == "active":
            return False
        if entry["build"]["items"] > 0:
            return True
        assert time.monotonic() < deadline, entry
        time.sleep(0.01)


def wait_compacting(daemon: Daemon, compaction: threading.Thread) -> None:
    """Until `/stats` shows a compaction running, or the request has ended."""
    deadline = time.monotonic() + 60
    while compaction.is_alive():
        if daemon.stats()["compaction"]["running"]:
            return
        assert time.monotonic() < deadline, daemon.stats()["compaction"]
        time.sleep(0.005)


def wait_persisted_at_least(daemon: Daemon, total: int, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while (persisted_sum(daemon) or 0) < total:
        assert time.monotonic() < deadline, persisted_sum(daemon)
        time.sleep(0.1)


def compact_quietly(daemon: Daemon) -> None:
    """POST /compact; the daemon may lose power before it answers."""
    with contextlib.suppress(httpx.HTTPError):
        http().post(f"{daemon.url}/compact", timeout=120)
