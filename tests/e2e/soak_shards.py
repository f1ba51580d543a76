"""The `shards` soak: faults under a router of two shard processes (`indexer router --shards 2
--follow`) and the daemon it feeds, each on its own machine under its own power-loss layer
(tests/powercut).

A writer keeps appending documents to a JSONL file the router follows. At seeded moments, mostly
0.2-2 s apart, one fault among: the whole router (parent and shards at once) killed, a power cut
with probability `power_cuts` (every write not fsynced under its state directory undone), and
now and then killed again while it starts; one shard killed alone (a crash: the parent starts it
again, nothing is cut); the daemon killed, a power cut with probability `power_cuts`.

Checks: after each whole-router kill, read from a copy of the state directory (the restart
finds it as the cut left it), every shard's log holds at least the document versions its
`/stats` acknowledged, and exactly its lines of the input before the position stored with them
(nothing doubled, nothing missing); after each daemon restart, the persisted seqno sum is at
least the last one seen; at the end, request_plus scans and the dumps of the stopped store
equal the model of the whole file, and the shards' logs hold every line once.

    python -m tests.e2e.soak --only shards --faults 400   # 100 of them here
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil

from indexer.router import SourceLog
from indexer.router.documents import vbucket_of
from indexer.router.shards.layout import ShardLayout
from indexer.router.shards.messages import InputPosition
from indexer.router.source.log import SourceError
from tests.e2e.conftest import INDEXES, Daemon, Router, dump, free_port, model, write_config
from tests.e2e.crashloop import (
    DAEMON_CONFIG,
    CrashLoopReport,
    Writer,
    differing_rows,
    persisted_sum,
    scans_equal,
)
from tests.powercut import PowerLoss, build_library

SHARDS = 2
PLAIN_ID = re.compile(rb'^\{"id": "([^"\\]*)"', re.MULTILINE)  # the writer's lines begin so
LAYOUT = ShardLayout("", 1024, SHARDS)  # the routing of `--shards 2` (the identity aside)
RATE = 2_000  # documents a second
KEYS = 10_000
START_S = 120.0  # a start on a busy machine: a router recovers its logs, the daemon its store
CATCH_UP_S = 180.0
# Fault weights: the whole router, one shard alone, the daemon.
FAULTS = {"router": 0.35, "shard": 0.2, "daemon": 0.45}


def router_args(state: Path, jsonl: Path, daemon: Daemon) -> list[str]:
    """`indexer router` of two shards following `jsonl`, its API on a port of its choosing."""
    return [
        "--state", str(state), "--shards", str(SHARDS), "--jsonl", str(jsonl), "--follow",
        "--to", daemon.address, "--http", "127.0.0.1:0",
    ]  # fmt: skip


def power_off(router: Router, first: Sequence[psutil.Process] = (), timeout: float = 30) -> None:
    """SIGKILL the router's parent and every shard at once, as a power cut stops a machine.

    The shards run in sessions of their own (the parent alone takes SIGINT), so no process
    group holds them all: the processes `first` (known ahead, when the moment matters) and
    the parent are stopped first (it can then neither start a shard again nor close a pipe),
    then its other children, then every one is killed. None sees another die."""
    stopped = list(first)
    for process in first:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.suspend()
    if router.proc.poll() is None:
        with contextlib.suppress(psutil.NoSuchProcess):
            router.process.suspend()
            stopped += [router.process, *router.process.children(recursive=True)]
    for process in stopped:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.suspend()
            process.kill()
    router.proc.wait()
    deadline = time.monotonic() + timeout
    while not all(dead(process) for process in stopped):
        if time.monotonic() > deadline:
            raise AssertionError("a router process outlived SIGKILL")
        time.sleep(0.01)


def shard_processes(router: Router) -> list[psutil.Process]:
    """The router's shard processes now (none once it exited)."""
    try:
        return list(router.process.children())
    except psutil.NoSuchProcess:
        return []


def dead(process: psutil.Process) -> bool:
    """Gone, or a zombie (its files closed) waiting for whoever reaps orphans."""
    try:
        status = process.status()
    except psutil.NoSuchProcess:
        return True
    return bool(status == psutil.STATUS_ZOMBIE)


def shard_stats(router: Router) -> list[dict[str, Any]] | None:
    """Each shard's `/stats`, through the parent; None unless all of them answered."""
    try:
        answer = httpx.get(f"{router.url}/stats", timeout=10)
    except httpx.HTTPError:
        return None
    if answer.status_code != 200:
        return None
    shards: list[dict[str, Any]] = answer.json()["shards"]
    if len(shards) != SHARDS or any(shard["stats"] is None for shard in shards):
        return None
    return shards


def acknowledged(router: Router) -> list[int] | None:
    """Per shard, the document versions its source log holds as `/stats` shows them: each
    append is synced before it counts there, so this much must survive a power cut."""
    shards = shard_stats(router)
    if shards is None:
        return None
    return [int(shard["stats"]["source"]["high_seqno_sum"]) for shard in shards]


def raised(seen: list[int], now: list[int] | None) -> list[int]:
    """Each shard's highest of `seen` and `now` (if the shards answered)."""
    return seen if now is None else [max(a, b) for a, b in zip(seen, now, strict=True)]


@dataclass(frozen=True)
class Holding:
    """What one shard's source log holds after a kill."""

    versions: int  # document versions appended
    offset: int  # how far into the input its stored position says it holds the lines
    lines: int  # its lines of the input before that offset: `versions` must equal it


def holdings(state: Path, jsonl: Path, scratch: Path) -> list[Holding]:
    """Each shard's holding, read from a copy of its directory (opening a LevelDB database
    writes to it: the router's next start must find the state as the kill left it)."""
    shutil.rmtree(scratch, ignore_errors=True)
    found: list[tuple[int, InputPosition | None]] = []
    for i in range(SHARDS):
        copy = scratch / f"shard-{i}"
        if not (state / f"shard-{i}").is_dir():
            found.append((0, None))
            continue
        shutil.copytree(state / f"shard-{i}", copy)
        try:
            with SourceLog(copy) as log:
                versions = sum(log.high_seqno(vb) for vb in log.vbuckets_with_history())
                found.append((versions, InputPosition.decode(log.input_position)))
        except SourceError as exc:
            raise AssertionError(f"shard {i}'s source log does not open: {exc}") from None
    shutil.rmtree(scratch, ignore_errors=True)
    base = str(jsonl.resolve())
    offsets = []
    for _, position in found:
        if position is not None and not position.key.startswith(base + "|"):
            raise AssertionError(f"a shard holds a position in another input: {position}")
        offsets.append(0 if position is None else position.offset)
    counts = lines_before(jsonl, offsets)
    return [
        Holding(versions, offset, count)
        for (versions, _), offset, count in zip(found, offsets, counts, strict=True)
    ]


def lines_before(jsonl: Path, offsets: Sequence[int]) -> list[int]:
    """Per shard, its lines of the input before its offset (a line's end)."""
    with open(jsonl, "rb") as f:
        head = f.read(max(offsets, default=0))
    owners = LAYOUT.owners()
    counts = []
    for shard, offset in enumerate(offsets):
        part = head[:offset]
        ids = PLAIN_ID.findall(part)
        if len(ids) != part.count(b"\n"):  # not every line as the writer writes them
            ids = [json.loads(line)["id"].encode() for line in part.splitlines() if line.strip()]
        counts.append(sum(1 for docid in ids if owners[vbucket_of(docid, 1024)] == shard))
    return counts


def check_holdings(
    state: Path, jsonl: Path, scratch: Path, seen: list[int], what: str
) -> list[str]:
    """After a kill: the acknowledged versions lost, per shard (lines), as messages.
    AssertionError if a log holds other than its lines before its position exactly."""
    held = holdings(state, jsonl, scratch)
    for i, holding in enumerate(held):
        if holding.versions != holding.lines:
            raise AssertionError(
                f"{what}: shard {i} holds {holding.versions} versions, and its input position "
                f"(byte {holding.offset}) says {holding.lines} lines: doubled or missing"
            )
    return [
        f"{what}: shard {i} acknowledged {want} versions, its log holds {holding.versions}"
        for i, (want, holding) in enumerate(zip(seen, held, strict=True))
        if holding.versions < want
    ]


def wait_appended(router: Router, lines: int, timeout: float) -> list[int]:
    """Until the shards acknowledged `lines` versions together; what each acknowledged."""
    deadline = time.monotonic() + timeout
    while True:
        now = acknowledged(router)
        if now is not None and sum(now) >= lines:
            return now
        if time.monotonic() > deadline:
            raise AssertionError(f"the shards acknowledged {now} of {lines} lines")
        time.sleep(0.1)


def shard_connections(router: Router) -> list[int]:
    """Per shard, the connections to the daemon its lines in the router's log tell."""
    text = router.log()
    return [
        len(re.findall(rf"\[shard {i}/{SHARDS}\] [^\n]*connected; resuming", text))
        for i in range(SHARDS)
    ]


def run_shards_loop(
    workdir: Path,
    kills: int,
    seed: int = 1,
    power_cuts: float = 0.5,
    say: Callable[[str], None] = lambda line: None,
) -> CrashLoopReport:
    """`kills` faults (see the module's docstring); a `power_cuts` share of the router's and
    the daemon's kills are power cuts. `router_kills` counts the faults of the router (whole
    or one shard), `kills_in_recovery` the router killed again before its API was up."""
    rng = random.Random(seed)
    report = CrashLoopReport(seed, scenario="shards")
    started = time.monotonic()
    library = build_library(workdir / "powercut-lib")
    router_layer = PowerLoss(library, workdir / "router-disk", workdir / "router-powercut")
    daemon_layer = PowerLoss(library, workdir / "daemon-disk", workdir / "daemon-powercut")
    port = free_port()
    config = write_config(
        workdir / "indexer.toml", daemon_layer.root / "data", port, **DAEMON_CONFIG
    )
    daemon = Daemon(config, workdir / "daemon.log", port)
    daemon.env = daemon_layer.env()
    jsonl = workdir / "docs.jsonl"
    writer = Writer(jsonl, rng.getrandbits(32), RATE, KEYS)
    writer.append(RATE)  # a second's worth before anything runs
    state = router_layer.root / "router"
    scratch = workdir / "copy"
    routers: list[Router] = []

    def start_router() -> Router:
        router = Router(
            workdir / f"router{len(routers)}.log",
            *router_args(state, jsonl, daemon),
            env=router_layer.env(),
        )
        routers.append(router)
        return router

    def kill_router(router: Router, seen: list[int]) -> str:
        """Kill the whole router, maybe cut its power, check its logs; what was done."""
        power_off(router)
        report.router_kills += 1
        what = "SIGKILL"
        if rng.random() < power_cuts:
            router_layer.cut()
            report.power_cuts += 1
            what = "power cut"
        where = f"fault {report.faults} ({what} of the router)"
        report.lost_acknowledged += check_holdings(state, jsonl, scratch, seen, where)
        return what

    try:
        daemon.start(START_S)
        router = start_router()
        router.wait_url(START_S)
        writer.start()
        seen = [0] * SHARDS  # per shard: versions acknowledged
        while report.kills + report.router_kills < kills:
            persisted = persisted_sum(daemon) or 0
            pause = rng.uniform(0.2, 2.0) if rng.random() < 0.85 else rng.uniform(0.0, 0.2)
            until = time.monotonic() + pause
            while True:
                persisted = max(persisted, persisted_sum(daemon) or 0)
                seen = raised(seen, acknowledged(router))
                if time.monotonic() >= until:
                    break
                time.sleep(0.05)
            fault = rng.choices(list(FAULTS), weights=list(FAULTS.values()))[0]
            if fault == "router":
                what = kill_router(router, seen) + " of the router"
                router = start_router()
                if rng.random() < 0.2:  # again while it starts: logs recovered, shards started
                    time.sleep(rng.uniform(0.05, 1.5))
                    if "router API on" not in router.log():
                        report.kills_in_recovery += 1
                    what += ", and a " + kill_router(router, seen) + " while it started again"
                    router = start_router()
                router.wait_url(START_S)
                say(f"fault {report.faults}: {what}; its shards had acknowledged {seen} versions")
            elif fault == "shard":
                shards = shard_stats(router)
                if shards is None:
                    raise AssertionError(f"the router's shards do not answer:\n{router.log()}")
                i = rng.randrange(SHARDS)
                pid = int(shards[i]["pid"])
                back = router.log().count(f"shard {i} is back")
                os.kill(pid, signal.SIGKILL)
                report.router_kills += 1
                router.wait_log(rf"shard {i} \(vbuckets [\d-]+, pid {pid}\) was killed by SIGKILL")
                router.wait_log(rf"shard {i} is back", back + 1, START_S)
                now = acknowledged(router)
                if now is not None and now[i] < seen[i]:  # a crash: the page cache keeps all
                    report.lost_acknowledged.append(
                        f"fault {report.faults} (shard {i} killed): {seen[i]} versions "
                        f"acknowledged, {now[i]} after"
                    )
                say(f"fault {report.faults}: SIGKILL of shard {i}; back with {now} versions")
            else:
                connections = shard_connections(router)
                daemon.kill()
                report.kills += 1
                what = "SIGKILL"
                if rng.random() < power_cuts:
                    daemon_layer.cut()
                    report.power_cuts += 1
                    what = "power cut"
                time.sleep(rng.uniform(0.0, 0.5))
                daemon.start(START_S)
                restarted = persisted_sum(daemon)
                if restarted is None or restarted < persisted:
                    report.lost_acknowledged.append(
                        f"fault {report.faults} (the daemon): persisted seqno sum {persisted} "
                        f"before, {restarted} after"
                    )
                if rng.random() < 0.8:  # most faults under traffic: once the shards are back
                    deadline = time.monotonic() + START_S
                    while any(
                        a <= b for a, b in zip(shard_connections(router), connections, strict=True)
                    ):
                        router.check_alive()
                        if time.monotonic() > deadline:
                            raise AssertionError(f"the shards did not reconnect:\n{router.log()}")
                        time.sleep(0.05)
                say(f"fault {report.faults}: {what} of the daemon; persisted sum {restarted}")
        writer.stop()
        report.documents = len(writer.documents)
        want = {name: model(writer.documents, paths) for name, paths in INDEXES.items()}
        report.scan_mismatches = scans_equal(daemon, want, CATCH_UP_S)
        wait_appended(router, report.documents, CATCH_UP_S)
        code = router.stop()
        if code != 0:
            raise AssertionError(f"the router exited {code} on SIGTERM:\n{router.log()[-4000:]}")
        held = holdings(state, jsonl, scratch)
        if sum(h.versions for h in held) != report.documents or any(
            h.versions != h.lines for h in held
        ):
            raise AssertionError(
                f"the shards' logs hold {held} for {report.documents} lines of input"
            )
        code = daemon.stop()
        if code != 0:
            raise AssertionError(f"the daemon exited {code} on SIGTERM")
        dumped = {name: dump(daemon, name) for name in INDEXES}
        report.dump_mismatches = {
            name: differing_rows(dumped[name], want[name]) for name in INDEXES
        }
        report.compare(dumped, want)
    except AssertionError as exc:  # a process that did not start, a scan that failed...
        report.failure = str(exc)[-4000:]
    finally:
        writer.stop()
        for r in routers:
            power_off(r)
        if daemon.running:
            daemon.kill()
        report.seconds = time.monotonic() - started
    return report
