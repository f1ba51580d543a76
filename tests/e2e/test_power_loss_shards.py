"""Power cuts under a router of two shards (parent and shards die at once, every unsynced write
under its state undone) lose nothing a shard acknowledged and leave each shard's log holding
exactly its lines up to its stored input position; the daemon ends equal to the model.
"""

from __future__ import annotations

import os
import random
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest

from tests.e2e.conftest import INDEXES, Daemon, Router, dump, free_port, model, write_config
from tests.e2e.crashloop import Writer, differing_rows, scans_equal
from tests.e2e.soak_shards import (
    SHARDS,
    acknowledged,
    check_holdings,
    holdings,
    power_off,
    raised,
    router_args,
    shard_processes,
    shard_stats,
    wait_appended,
)
from tests.powercut import CutReport, PowerLoss

pytestmark = pytest.mark.e2e

# Cuts at least: half right after a LevelDB log switch, half right after an append; the
# larger count runs in the soak (`pytest -m soak`).
CUTS = [pytest.param(4), pytest.param(6, marks=pytest.mark.soak)]
# More cuts, up to this many, until two of them took log data: on a busy machine a cut can
# find every log already synced, and such cuts test little.
MAX_CUTS = 12
SHARD_KILL_AT = 3  # before this cut, one shard is killed alone (a crash, not a cut)
AIM_S = 20.0  # at most, waiting for what a cut aims at
START_S = 120.0


@pytest.fixture
def cleanup() -> Iterator[list[Daemon | Router]]:
    started: list[Daemon | Router] = []
    yield started
    for process in started:
        if isinstance(process, Daemon):
            if process.running:
                process.kill()
        else:
            power_off(process)


def wal_sizes(state: Path) -> dict[Path, int]:
    """Every shard's LevelDB write-ahead logs (`*.log`, not the text `LOG`), with their sizes."""
    sizes = {}
    for path in state.glob("shard-*/source/*.log"):
        try:
            sizes[path] = path.stat().st_size
        except FileNotFoundError:  # deleted by LevelDB meanwhile
            continue
    return sizes


def cut_when(router: Router, state: Path, ready: Callable[[dict[Path, int]], bool]) -> bool:
    """Watch the shards' write-ahead logs until `ready(sizes)`, then power the router off at
    once (the shards known ahead stopped first): a sync takes a few milliseconds, so the
    watch polls without pause once the shards run. Whether it was seen in time."""
    deadline = time.monotonic() + AIM_S
    shards: list[psutil.Process] = []
    polls = 0
    seen = False
    while time.monotonic() < deadline:
        if len(shards) < SHARDS or polls % 100 == 0:
            shards = shard_processes(router)
            router.check_alive()
        if ready(wal_sizes(state)):
            seen = True
            break
        polls += 1
        time.sleep(0 if len(shards) == SHARDS else 0.005)
    power_off(router, shards)
    return seen


def new_log_written(before: set[Path]) -> Callable[[dict[Path, int]], bool]:
    """A log that was not there before the router started holds a first write: the shards
    opened new logs (a switch), then appended what the input holds."""
    return lambda sizes: any(size > 0 for path, size in sizes.items() if path not in before)


def log_grown(before: dict[Path, int]) -> Callable[[dict[Path, int]], bool]:
    """A log grew: the write of lines with the input position they bring the shard to, its
    sync under way or just done."""
    return lambda sizes: any(size > before.get(path, 0) for path, size in sizes.items())


def took_log_data(report: CutReport) -> bool:
    """Whether a cut undid something of the logs themselves, beyond LevelDB's text `LOG`."""
    names = report.files_truncated + report.creates_undone + report.unlinks_undone
    return bool(report.renames_undone) or any(
        Path(name).name not in ("LOG", "LOG.old") for name in names
    )


@pytest.mark.parametrize("cuts", CUTS)
def test_power_cuts_under_a_sharded_router_lose_and_double_nothing(
    library: Path, tmp_path: Path, cleanup: list[Daemon | Router], cuts: int
) -> None:
    rng = random.Random(20261128)
    layer = PowerLoss(library, tmp_path / "disk", tmp_path / "powercut")
    port = free_port()
    config = write_config(tmp_path / "indexer.toml", tmp_path / "data", port)
    daemon = Daemon(config, tmp_path / "daemon.log", port)
    cleanup.append(daemon)
    daemon.start()
    jsonl = tmp_path / "docs.jsonl"
    writer = Writer(jsonl, rng.getrandbits(32), rate=3_000, keys=20_000)
    writer.append(10_000)
    state = layer.root / "router"
    routers: list[Router] = []

    def start_router() -> Router:
        router = Router(
            tmp_path / f"router{len(routers)}.log",
            *router_args(state, jsonl, daemon),
            env=layer.env(),
        )
        routers.append(router)
        cleanup.append(router)
        return router

    seen = [0] * SHARDS  # per shard: versions acknowledged before the cut
    lost: list[str] = []
    aimed = 0
    took = 0
    before = set(wal_sizes(state))
    router = start_router()
    writer.start()
    try:
        for cut in range(MAX_CUTS):
            if cut % 2 == 0:  # a start opens new logs: cut at their first write
                aimed += cut_when(router, state, new_log_written(before))
            else:  # cut as a shard writes lines and the input position they bring it to
                router.wait_url(START_S)
                until = time.monotonic() + rng.uniform(0.5, 1.5)
                while time.monotonic() < until:  # the daemon gets some of it between cuts
                    seen = raised(seen, acknowledged(router))
                    time.sleep(0.05)
                if cut == SHARD_KILL_AT:
                    shards = shard_stats(router)
                    assert shards is not None, router.log()[-4000:]
                    pid = int(shards[1]["pid"])
                    os.kill(pid, signal.SIGKILL)
                    router.wait_log(rf"shard 1 \(vbuckets 512-1023, pid {pid}\) was killed")
                    router.wait_log(r"shard 1 is back", timeout=START_S)
                    now = acknowledged(router)
                    assert now is not None and now[1] >= seen[1], (now, seen)
                seen = raised(seen, acknowledged(router))
                aimed += cut_when(router, state, log_grown(wal_sizes(state)))
            report = layer.cut()
            took += took_log_data(report)
            lost += check_holdings(state, jsonl, tmp_path / "copy", seen, f"cut {cut}")
            before = set(wal_sizes(state))
            last = cut == MAX_CUTS - 1 or (cut >= cuts - 1 and took >= 2)
            if last:
                writer.stop()  # the last start reads the rest of the file
            router = start_router()
            if last:
                break
        router.wait_url(START_S)
        want = {name: model(writer.documents, paths) for name, paths in INDEXES.items()}
        differing = scans_equal(daemon, want, 120)
        assert lost == [] and differing == dict.fromkeys(INDEXES, 0), (lost, differing)
        wait_appended(router, len(writer.documents), 120)
        assert router.stop() == 0
        held = holdings(state, jsonl, tmp_path / "copy")
        assert sum(h.versions for h in held) == len(writer.documents), held  # once each
        assert all(h.versions == h.lines for h in held), held
        assert daemon.stop() == 0
        dumped = {name: differing_rows(dump(daemon, name), want[name]) for name in INDEXES}
        assert dumped == dict.fromkeys(INDEXES, 0)
    finally:
        writer.stop()
    # Not vacuous: the aims found what they waited for, and cuts took from the logs.
    assert aimed >= cuts - 1 and took >= 2, (aimed, took)
