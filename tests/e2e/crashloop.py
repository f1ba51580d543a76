"""The crash loop: the daemon killed (SIGKILL) at random moments under a running feed, and,
with `power_cuts`, some of those kills made power cuts (tests/powercut: every write the daemon
had not fsynced undone before it restarts).

A writer keeps appending documents to a JSONL file that `indexer router --follow` streams to the
daemon; the daemon is killed at seeded random moments (some while it is still recovering, before
it listens), restarted on the same data directory, and the router reconnects by itself (now and
then the router is killed and restarted too). After each restart the persisted snapshot must be
at least the last one `/stats` showed before the kill (nothing acknowledged lost); at the end,
request_plus scans and a dump of the stopped store must equal the model of the whole file.

Used by tests/e2e/test_crash_loop.py (a few kills) and by `make soak`:

    python -m tests.e2e.crashloop --kills 200 --seconds 1800 --seed 1 [--power-cuts 0.5]
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from indexer.router import Workload, generate
from indexer.router.documents import Document
from tests.e2e.conftest import (
    INDEXES,
    Daemon,
    Router,
    dump,
    free_port,
    http,
    indexer_command,
    model,
    write_config,
    write_jsonl,
)
from tests.powercut import PowerLoss, build_library

CONNECTED = r"connected; resuming"
# Snapshots cut and persisted often: kills land before, during and after many of them.
DAEMON_CONFIG: dict[str, dict[str, Any]] = {
    "snapshots": {"in_memory_interval_ms": 50, "persist_interval_ms": 250},
    "pipeline": {"workers": 4},
}


@dataclass
class CrashLoopReport:
    """What a crash loop did and found; `ok` when nothing was lost or wrong."""

    seed: int
    scenario: str = "daemon"  # what was killed: see tests/e2e/soak.py
    kills: int = 0  # SIGKILLs of the daemon followed by a successful restart
    kills_in_recovery: int = 0  # of which before the daemon listened
    power_cuts: int = 0  # kills (of any process) whose unsynced writes were undone too
    router_kills: int = 0  # of a router, whole or one shard
    documents: int = 0
    seconds: float = 0.0
    # Restarts whose persisted seqno sum was below one /stats showed before the kill.
    lost_acknowledged: list[str] = field(default_factory=list)
    # Per index: rows of the request_plus scan, then of the dump, that differ from the model.
    scan_mismatches: dict[str, int] = field(default_factory=dict)
    dump_mismatches: dict[str, int] = field(default_factory=dict)
    # Over every index's final dump (else its scan): model rows absent, and rows the model
    # does not have (a phantom: a version never sent, or one already replaced or deleted).
    missing: int = 0
    phantoms: int = 0
    failure: str | None = None  # why the loop stopped early (a daemon that did not restart...)

    @property
    def faults(self) -> int:
        """Every SIGKILL survived, of any process."""
        return self.kills + self.router_kills

    @property
    def mismatches(self) -> int:
        return sum(self.scan_mismatches.values()) + sum(self.dump_mismatches.values())

    @property
    def ok(self) -> bool:
        return (
            self.failure is None
            and not self.lost_acknowledged
            and self.mismatches == self.missing == self.phantoms == 0
        )

    def compare(
        self, got: dict[str, list[dict[str, Any]]], want: dict[str, list[dict[str, Any]]]
    ) -> None:
        """Count the final rows missing and phantom, per index (`got` and `want` by name)."""
        for name, rows in want.items():
            missing, phantoms = missing_and_phantoms(got[name], rows)
            self.missing += missing
            self.phantoms += phantoms

    def summary(self) -> str:
        lines = [
            f"{self.scenario} crash loop (seed {self.seed}): {self.kills} kills survived "
            f"({self.kills_in_recovery} during recovery, {self.power_cuts} power cuts), "
            f"{self.router_kills} router kills, "
            f"{self.documents} documents in {self.seconds:.0f} s",
            f"mismatches: {self.mismatches} (scans {self.scan_mismatches}, "
            f"dumps {self.dump_mismatches}); rows missing {self.missing}, "
            f"phantom {self.phantoms}",
            f"acknowledged data lost at restart: {len(self.lost_acknowledged)}",
        ]
        lines += [f"  {line}" for line in self.lost_acknowledged]
        if self.failure is not None:
            lines.append(f"failed: {self.failure}")
        lines.append("OK" if self.ok else "FAILED")
        return "\n".join(lines)


def differing_rows(got: list[dict[str, Any]], want: list[dict[str, Any]]) -> int:
    """Rows in one list and not the other (order included: a misplaced row counts twice)."""
    if got == want:
        return 0
    a = [json.dumps(r, sort_keys=True) for r in got]
    b = [json.dumps(r, sort_keys=True) for r in want]
    common = sum(1 for x, y in zip(a, b, strict=False) if x == y)
    return len(a) + len(b) - 2 * common


def missing_and_phantoms(got: list[dict[str, Any]], want: list[dict[str, Any]]) -> tuple[int, int]:
    """Rows of `want` absent from `got`, and rows of `got` absent from `want` (as multisets)."""
    a = Counter(json.dumps(r, sort_keys=True) for r in got)
    b = Counter(json.dumps(r, sort_keys=True) for r in want)
    return sum((b - a).values()), sum((a - b).values())


class Writer:
    """Appends seeded batches of documents to the JSONL file the router follows (a thread)."""

    def __init__(self, path: Path, seed: int, rate: int, keys: int) -> None:
        self.path = path
        self.rng = random.Random(seed)
        self.rate = rate
        self.keys = keys
        self.documents: list[Document] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="jsonl-writer", daemon=True)
        self._batch = 0

    def append(self, count: int) -> None:
        self._batch += 1
        seed = self.rng.getrandbits(32)
        batch = list(generate(Workload(count, self.keys, 0.15, seed)))
        write_jsonl(self.path, batch, append=True)
        self.documents += batch

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            self.append(max(1, int(self.rate * self.rng.uniform(0.05, 0.15))))

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()


def persisted_sum(daemon: Daemon) -> int | None:
    """The persisted seqno sum `/stats` shows, or None if the daemon does not answer."""
    try:
        answer = http().get(f"{daemon.url}/stats", timeout=2)
    except httpx.HTTPError:
        return None
    if answer.status_code != 200:
        return None
    total: int = answer.json()["persisted"]["seqno_sum"]
    return total


def start_unwaited(daemon: Daemon) -> None:
    """Start the daemon without waiting for it to listen (to kill it while it recovers), in
    its environment: under the power-loss layer, its recovery's writes must be recorded too."""
    with open(daemon.log_path, "ab") as log:
        daemon.proc = subprocess.Popen(
            indexer_command("serve", "--config", str(daemon.config), *daemon.args),
            stderr=log,
            env=daemon.env,
        )


def scans_equal(
    daemon: Daemon, want: dict[str, list[dict[str, Any]]], timeout: float
) -> dict[str, int]:
    """Poll request_plus scans until they equal `want`; the rows still differing per index.

    Gives up `timeout` seconds after the daemon's persisted snapshot last moved: a catch-up
    that goes on (a last router streams every version again) is waited for, a stalled one is
    not."""
    deadline = time.monotonic() + timeout
    persisted: int | None = -1
    while True:
        moved = persisted_sum(daemon)
        if moved is not None and moved != persisted:
            persisted = moved
            deadline = time.monotonic() + timeout
        got: dict[str, list[dict[str, Any]]] = {}
        for name in INDEXES:
            answer = http().get(
                f"{daemon.url}/indexes/{name}/scan",
                params={"consistency": "request_plus"},
                timeout=120,
            )
            if answer.status_code != 200:
                raise AssertionError(f"scan of {name}: {answer.status_code} {answer.text}")
            got[name] = [json.loads(line) for line in answer.text.splitlines() if line]
        differing = {name: differing_rows(got[name], want[name]) for name in INDEXES}
        if not any(differing.values()) or time.monotonic() > deadline:
            return differing
        time.sleep(0.5)


def run_crash_loop(
    workdir: Path,
    kills: int,
    seconds: float | None = None,
    seed: int = 1,
    rate: int = 2_000,
    keys: int = 5_000,
    router_kill_chance: float = 0.1,
    catch_up_s: float = 120.0,
    say: Callable[[str], None] = lambda line: None,
    power_cuts: float = 0.0,
    faults: int = 0,
) -> CrashLoopReport:
    """Kill and restart the daemon `kills` times (and on until `faults` kills of the daemon
    and the router together, or until `seconds` pass, if given, whichever comes last) under a
    feed of about `rate` documents a second over `keys` document ids; a `power_cuts` share of
    the kills are power cuts."""
    rng = random.Random(seed)
    report = CrashLoopReport(seed)
    started = time.monotonic()
    port = free_port()
    layer = router_layer = None
    data = workdir / "data"
    router_state = workdir / "router"
    if power_cuts:
        # Two machines: the daemon's and the router's, each losing its own unsynced writes.
        library = build_library(workdir / "powercut-lib")
        layer = PowerLoss(library, workdir / "disk", workdir / "powercut")
        data = layer.root / "data"
        router_layer = PowerLoss(library, workdir / "router-disk", workdir / "router-powercut")
        router_state = router_layer.root / "router"
    config = write_config(workdir / "indexer.toml", data, port, **DAEMON_CONFIG)
    daemon = Daemon(config, workdir / "daemon.log", port)
    if layer is not None:
        daemon.env = layer.env()

    def kill_daemon() -> None:
        daemon.kill()
        report.kills += 1
        if layer is not None and rng.random() < power_cuts:
            layer.cut()
            report.power_cuts += 1

    jsonl = workdir / "docs.jsonl"
    writer = Writer(jsonl, rng.getrandbits(32), rate, keys)
    writer.append(rate)  # a second's worth before anything runs
    router_args = [
        "--state", str(router_state), "--jsonl", str(jsonl), "--follow",
        "--to", daemon.address,
    ]  # fmt: skip
    routers: list[Router] = []

    def new_router() -> Router:
        env = None if router_layer is None else router_layer.env()
        router = Router(workdir / f"router{len(routers)}.log", *router_args, env=env)
        routers.append(router)
        return router

    router = new_router()
    writer.start()
    try:
        daemon.start()
        while (
            report.kills < kills
            or report.faults < faults
            or (seconds is not None and time.monotonic() - started < seconds)
        ):
            seen = persisted_sum(daemon) or 0
            until = time.monotonic() + rng.choice([rng.uniform(0.0, 0.5), rng.uniform(0.5, 3.0)])
            while time.monotonic() < until:
                seen = max(seen, persisted_sum(daemon) or 0)
                time.sleep(0.05)
            kill_daemon()
            if rng.random() < 0.25:
                # Again while it recovers, before it listens (back index load, undo of the store).
                listened = daemon.log().count("listening for router feeds")
                start_unwaited(daemon)
                time.sleep(rng.uniform(0.05, 0.6))
                kill_daemon()
                if daemon.log().count("listening for router feeds") == listened:
                    report.kills_in_recovery += 1
            connections = router.log().count(CONNECTED)
            if rng.random() < router_kill_chance:
                router.proc.kill()
                router.proc.wait()
                report.router_kills += 1
                if router_layer is not None and rng.random() < power_cuts:
                    router_layer.cut()
                    report.power_cuts += 1
                router = new_router()
                connections = 0
            time.sleep(rng.uniform(0.0, 1.0))
            daemon.start()
            if rng.random() < 0.8:  # most kills under traffic: once the router is back
                router.wait_log(CONNECTED, connections + 1, timeout=120)
            restarted = persisted_sum(daemon)
            if restarted is None or restarted < seen:
                report.lost_acknowledged.append(
                    f"kill {report.kills}: persisted seqno sum {seen} before, {restarted} after"
                )
            say(f"kill {report.kills}: restarted at persisted seqno sum {restarted}")
        writer.stop()
        report.documents = len(writer.documents)
        # A router started again reads the whole file again: after many restarts that takes
        # minutes. A last router, not following, says when it has read to the end; only then
        # must the indexes equal the model (a comparison before would count rows not yet sent).
        if router.proc.poll() is None:
            router.stop()
        env = None if router_layer is None else router_layer.env()
        last_args = [arg for arg in router_args if arg != "--follow"]
        router = Router(workdir / "router-last.log", *last_args, env=env)
        routers.append(router)
        read_s = max(120.0, report.documents / 5_000)
        router.wait_log(r"read (\d+) documents from", timeout=read_s)
        want = {name: model(writer.documents, paths) for name, paths in INDEXES.items()}
        report.scan_mismatches = scans_equal(daemon, want, catch_up_s)
        if router.proc.poll() is None:
            router.stop()
        code = daemon.stop()
        if code != 0:
            report.failure = f"the daemon exited {code} on SIGTERM"
        dumped = {name: dump(daemon, name) for name in INDEXES}
        report.dump_mismatches = {
            name: differing_rows(dumped[name], want[name]) for name in INDEXES
        }
        report.compare(dumped, want)
    except AssertionError as exc:  # a daemon that did not restart, a scan that failed
        report.failure = str(exc)[-4000:]
    finally:
        writer.stop()
        for r in routers:
            if r.proc.poll() is None:
                r.proc.send_signal(signal.SIGKILL)
                r.proc.wait()
        if daemon.running:
            daemon.kill()
        report.seconds = time.monotonic() - started
    return report


def main(argv: list[str] | None = None) -> int:
    """`make soak`: a long crash loop; prints the report, exits 1 unless it is clean."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--kills", type=int, default=100, help="kills at least (default 100)")
    parser.add_argument("--seconds", type=float, default=None, help="run at least this long")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--rate", type=int, default=2_000, help="documents a second")
    parser.add_argument("--keys", type=int, default=20_000, help="document ids")
    parser.add_argument("--workdir", type=Path, default=None, help="kept; default: a temp dir")
    parser.add_argument(
        "--power-cuts", type=float, default=0.0, help="share of the kills that cut the power"
    )
    args = parser.parse_args(argv)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="indexer-soak-"))
    workdir.mkdir(parents=True, exist_ok=True)
    print(f"crash loop in {workdir}: {args.kills} kills, seed {args.seed}", flush=True)
    report = run_crash_loop(
        workdir,
        args.kills,
        args.seconds,
        args.seed,
        args.rate,
        args.keys,
        say=lambda line: print(line, flush=True),
        power_cuts=args.power_cuts,
    )
    print(report.summary(), flush=True)
    if report.ok and args.workdir is None:
        shutil.rmtree(workdir, ignore_errors=True)
    elif not report.ok:
        print(f"logs and data kept in {workdir}", flush=True)
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
