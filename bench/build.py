"""Index build benchmark: initial builds of a new index, and scans fanned out over two nodes.

    python bench/build.py [--documents N] [--keys K] [--feed-rate R] [--feed-max-s S]
                          [--seed S] [--builds B] [--no-fan-out] [--timeout S] [--keep]

Everything runs as subprocesses on 127.0.0.1: `indexer serve` (default configuration: the
indexes `by_city(address.city, age)` and `by_age(age)`) and `indexer router`.

1. Builds. N generated documents (default 300,000 over K = N/3 docids, 10% deletes) are written
   as a JSONL file; `indexer router --jsonl FILE --follow --to DAEMON --http 127.0.0.1:0` loads
   them into one daemon. Once everything is readable (the daemon's `stable.seqno_sum` equals the
   router's `source.high_seqno_sum` = N):
   (a) quiet: `POST /indexes {"name": "by_zip", "keys": ["address.zip", "name"]}`, then
       `GET /indexes` every 50 ms until its state is `active`; reported: the build's items/s
       (the mutations its build stream carried, from the daemon's "index ... built" line), the
       entries/s, and the time in each state (building, catchup). Then `DELETE /indexes/by_zip`.
   (b) with a feed: a thread appends more documents of the same docids (another seed) to the
       followed file at a steady R per second (default 10,000), every 50 ms what is due. After
       1 s of warm-up and 5 s of baseline (`--baseline-s`: as long as the build, its p99 and
       max compare over as many probes), `by_zip2` (same keys) is created and timed the same
       way, also in seqnos/s (the build stream can carry fewer items than seqnos: the router
       sends a docid written twice in a snapshot once). The feed goes on 2 s after the index is
       active, then stops; if the index is not active `--feed-max-s` after its create (default
       60), the feed stops then and the wait goes on.
       A second thread samples every 100 ms the maintenance lag: the router's
       `source.high_seqno_sum` (what it appended) minus the daemon's `stable.seqno_sum` (what is
       readable), both from `GET /stats`; beside it how far the router is behind the file, and
       the end-to-end lag (documents written minus readable). Reported: p50/p99/max during the
       baseline, during the build and after it, in seqnos and in ms at the feed rate. After the
       feed: request_plus counts of `by_zip2` and `by_city` equal the live documents (latest
       version per docid, deleted ones excluded) having `address.zip`, resp. `address.city`,
       computed from the documents written. With `--builds B` the baseline and the build repeat
       B times under the same feed (`by_zip3`, ...; the previous one dropped first), and the lag
       figures pool all of them: one build's figures vary from run to run as much as a change.
2. Scan fan-out. A cluster map gives vbuckets 0-511 to daemon `a` and 512-1023 to daemon `b`
   (`indexer serve --cluster-map F --node NAME`); `indexer router --cluster-map F` loads the N
   documents into both, then `indexer router --to` loads them into a third daemon alone. Timed,
   best of 3, interleaved: `indexer.cluster.scan.scan_cluster(map, "by_city",
   {"consistency": "any"})` reading every merged row over the 2 nodes; an NDJSON scan of the
   single node (httpx stream, newlines counted); and `scan_cluster` over a one-node map of the
   single node (the same client code: JSON parsing, without a second node to merge with); and,
   for what the
   two nodes can serve, both nodes' NDJSON scans at once in two threads, newlines counted, no
   merge. Reported: rows/s and the ratios.

The JSON's `builds.timeline` holds every lag sample (s, phase, readable seqno sum, the build's
received seqno sum, level-0 files, documents the router is behind the file) and
`builds.probes` every probe (s written, s until readable), to see when in a build the lag
moved. `--no-fan-out` runs part 1 only.

The first line gives the conditions, with the median time of a 4 KiB write + fsync in the
temp directory: the router appends every read of its input as one synced batch, so a busy disk
slows it. Prints one line per measurement and ends with one JSON object of every figure.
Everything lives in a temporary directory, removed at the end unless --keep is given.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import date
from itertools import islice
from pathlib import Path
from typing import Any

import httpx
import psutil
from build_fanout import fan_out  # bench/build_fanout.py
from build_processes import check, load, start_router  # bench/build_processes.py
from common import (  # bench/common.py: run as `python bench/...`
    Daemon,
    Router,
    in_workdir,
    jsonl_lines,
    latest,
    ratio,
    say,
)

from indexer.keys import MISSING, field_value
from indexer.router import Document, Workload, generate

DELETE_RATIO = 0.1
ZIP_KEYS = ["address.zip", "name"]
STATE_POLL_S = 0.05
SAMPLE_S = 0.1
FEED_TICK_S = 0.05
PROBE_ID = "probe"
PROBE_CITY = "~probe"  # sorts after every generated city
WARMUP_S = 1.0
BASELINE_S = 5.0
AFTER_S = 2.0
PHASES = ("baseline", "build", "drain", "after")
FEED_SEED_OFFSET = 1000
MIB = 1 << 20


# --------------------------------------------------------------------------------------------
# Input and model


class Model:
    """The latest version of each docid: None when deleted, else (has address.zip, has
    address.city), the leading keys of `by_zip*` and `by_city`."""

    def __init__(self) -> None:
        self.latest: dict[str, tuple[bool, bool] | None] = {}

    def add(self, documents: Iterable[Document]) -> None:
        for docid, body in latest(documents).items():
            self.latest[docid] = (
                None
                if body is None
                else (
                    field_value(body, "address.zip") is not MISSING,
                    field_value(body, "address.city") is not MISSING,
                )
            )

    def with_zip(self) -> int:
        return sum(1 for v in self.latest.values() if v is not None and v[0])

    def with_city(self) -> int:
        return sum(1 for v in self.latest.values() if v is not None and v[1])


# --------------------------------------------------------------------------------------------
# 1. Builds


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100); 0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * q // 100))
    return float(ordered[int(rank) - 1])


class Feed(threading.Thread):
    """Appends documents to the followed file at a steady rate, what is due every 50 ms."""

    def __init__(self, path: Path, documents: Iterator[Document], rate: float, model: Model):
        super().__init__(daemon=True)
        self.path = path
        self.documents = documents
        self.rate = rate
        self.model = model
        self.written = 0
        self.max_behind = 0  # documents due but not written yet, at the start of a tick
        self.seconds = 0.0
        self.stopped = threading.Event()
        self.error: BaseException | None = None
        self.ticks = 0
        self.probe_written: dict[int, float] = {}  # tick -> when its probe line was written

    def run(self) -> None:
        started = time.monotonic()
        try:
            with open(self.path, "a") as f:
                while not self.stopped.is_set():
                    due = int((time.monotonic() - started) * self.rate) - self.written
                    self.max_behind = max(self.max_behind, due)
                    if due > 0:
                        batch = list(islice(self.documents, min(due, int(self.rate) + 1)))
                        # The probe: one document rewritten every tick with the tick's number
                        # in its by_city key, to time how soon a write becomes readable.
                        self.ticks += 1
                        batch.append(
                            Document(PROBE_ID, {"address": {"city": PROBE_CITY}, "age": self.ticks})
                        )
                        f.write("".join(jsonl_lines(batch)))  # whole lines in one write
                        f.flush()
                        self.probe_written[self.ticks] = time.monotonic()
                        self.model.add(batch)
                        self.written += len(batch)
                    self.stopped.wait(FEED_TICK_S)
        except BaseException as exc:  # reported by stop()
            self.error = exc
        self.seconds = time.monotonic() - started

    def stop(self) -> None:
        self.stopped.set()
        self.join()
        if self.error is not None:
            raise RuntimeError(f"the feed failed: {self.error!r}")


@dataclass
class Sample:
    phase: str
    lag: int  # seqnos appended by the router, not yet readable on the daemon
    in_flight: int  # of those, not yet received by the daemon (the router's send, TCP)
    unpublished: int  # received by the daemon, not yet readable (its queues, flushes, cuts)
    router_behind: int  # documents written to the file, not yet appended by the router
    end_to_end: int  # documents written to the file, not yet readable on the daemon
    at: float  # seconds since the sampler started
    readable: int  # the daemon's stable seqno sum
    build: int | None  # the seqno sum the build in progress has received, if one runs
    level0: int  # files in the daemon store's LevelDB level 0 (compaction behind from 4 on)


class LagSampler(threading.Thread):
    """Every 100 ms: the daemon's readable seqno sum against what the router appended."""

    def __init__(self, daemon: Daemon, router: Router, feed: Feed, base: int) -> None:
        super().__init__(daemon=True)
        self.daemon_url = daemon.url
        self.router_url = router.url
        self.feed = feed
        self.base = base
        self.phase = "warmup"
        self.samples: list[Sample] = []
        self.failures = 0
        self.stopped = threading.Event()
        self.visible: list[tuple[str, float]] = []  # (phase, s from the probe's write to read)
        self.probes: list[tuple[float, float]] = []  # (s since the start it was written, the same)
        self.began = time.monotonic()
        self._seen = 0

    def probe(self, client: httpx.Client, phase: str) -> None:
        """Read the probe's latest visible tick; time every tick that became visible since."""
        answer = client.get(
            f"{self.daemon_url}/indexes/by_city/scan",
            params={"eq": json.dumps([PROBE_CITY]), "consistency": "any"},
        )
        rows = [json.loads(line) for line in answer.text.splitlines() if line]
        if not rows:
            return
        tick = int(rows[-1]["key"][1])
        now = time.monotonic()
        written = self.feed.probe_written
        for seen in range(self._seen + 1, tick + 1):
            if seen in written:
                self.visible.append((phase, now - written[seen]))
                self.probes.append(
                    (round(written[seen] - self.began, 2), round(now - written[seen], 3))
                )
        self._seen = max(self._seen, tick)

    def run(self) -> None:
        began = self.began
        with httpx.Client(timeout=10) as client:
            while not self.stopped.is_set():
                written = self.base + self.feed.written
                phase = self.phase
                try:
                    # The daemon first: the lag is over-stated by what the router appends
                    # between the two requests (a few ms), never under-stated.
                    daemon = client.get(f"{self.daemon_url}/stats").json()
                    stable = daemon["stable"]["seqno_sum"]
                    received = daemon["vbuckets"]["received_seqno_sum"]
                    builds = [b["received_seqno_sum"] for b in daemon["builds"].values()]
                    appended = client.get(f"{self.router_url}/stats").json()["source"][
                        "high_seqno_sum"
                    ]
                    self.probe(client, phase)
                except (httpx.HTTPError, ValueError, KeyError, IndexError):
                    self.failures += 1
                else:
                    self.samples.append(
                        Sample(
                            phase,
                            max(appended - stable, 0),
                            max(appended - received, 0),
                            max(received - stable, 0),
                            max(written - appended, 0),
                            max(written - stable, 0),
                            round(time.monotonic() - began, 2),
                            stable,
                            builds[0] if builds else None,
                            daemon["storage"]["level0_files"],
                        )
                    )
                self.stopped.wait(SAMPLE_S)

    def stop(self) -> None:
        self.stopped.set()
        self.join()

    def summary(self, phase: str, rate: float) -> dict[str, Any]:
        samples = [s for s in self.samples if s.phase == phase]
        out: dict[str, Any] = {"samples": len(samples)}
        if not samples:
            return out
        visible = [1000 * seconds for p, seconds in self.visible if p == phase]
        out["probes"] = len(visible)
        for name, q in (("p50", 50), ("p99", 99), ("max", 100)):
            out[f"visible_{name}_ms"] = round(percentile(visible, q), 1)
        # The baseline's first and second half apart: with no build in either, how much the
        # usual lag varies by itself, the yardstick for a build's ratio.
        half = len(visible) // 2
        if phase == "baseline" and half:
            out["visible_p99_halves_ms"] = [
                round(percentile(visible[:half], 99), 1),
                round(percentile(visible[half:], 99), 1),
            ]
        for what in ("lag", "in_flight", "unpublished", "end_to_end", "router_behind"):
            values = [getattr(s, what) for s in samples]
            for name, q in (("p50", 50), ("p99", 99), ("max", 100)):
                value = percentile(values, q)
                out[f"{what}_{name}"] = int(value)
                if what != "router_behind":
                    out[f"{what}_{name}_ms"] = round(value / rate * 1000, 1)
        return out


def own_cpu() -> float:
    """CPU seconds of this process (the feed's generation and the sampling)."""
    times = psutil.Process().cpu_times()
    return float(times.user + times.system)


def fsync_ms(directory: Path, count: int = 20) -> float:
    """Median time of a 4 KiB write + fsync in `directory`: how busy the disk is."""
    seconds = []
    with open(directory / "fsync-probe", "wb") as f:
        for _ in range(count):
            f.write(b"\0" * 4096)
            t0 = time.perf_counter()
            f.flush()
            os.fsync(f.fileno())
            seconds.append(time.perf_counter() - t0)
    (directory / "fsync-probe").unlink()
    return round(percentile(seconds, 50) * 1000, 2)


def index_entry(client: httpx.Client, daemon: Daemon, name: str) -> dict[str, Any]:
    answer = client.get(f"{daemon.url}/indexes")
    answer.raise_for_status()
    for entry in answer.json()["indexes"]:
        if entry["name"] == name:
            found: dict[str, Any] = entry
            return found
    raise RuntimeError(f"index {name} is not in GET /indexes")


def time_build(
    client: httpx.Client,
    daemon: Daemon,
    router: Router,
    name: str,
    timeout: float,
    feed: Feed | None = None,
    sampler: LagSampler | None = None,
    feed_max_s: float = 0.0,
) -> dict[str, Any]:
    """Create the index, poll its state every 50 ms until active; the figures of the build.

    With a feed: if the index is not active `feed_max_s` after the create, the feed stops (the
    build did not catch up under it) and the wait goes on."""
    cpu_before = daemon.cpu()
    router_cpu_before = router.cpu()
    bench_cpu_before = own_cpu()
    started = time.monotonic()
    feed_stopped: float | None = None
    at_feed_stop: dict[str, Any] = {}
    created = client.post(f"{daemon.url}/indexes", json={"name": name, "keys": ZIP_KEYS})
    if created.status_code != 201:
        raise RuntimeError(f"create {name}: HTTP {created.status_code}: {created.text}")
    posted = time.monotonic()
    first_seen: dict[str, float] = {created.json()["state"]: posted}
    states = [created.json()["state"]]
    last_build: dict[str, Any] = created.json().get("build") or {}
    deadline = started + timeout
    while True:
        entry = index_entry(client, daemon, name)
        now = time.monotonic()
        state = entry["state"]
        if state not in first_seen:
            first_seen[state] = now
            states.append(state)
        if "build" in entry:
            last_build = entry["build"]
        if state == "active":
            break
        daemon.check_alive()
        router.check_alive()
        if feed is not None and feed_stopped is None and now - started > feed_max_s:
            feed.stopped.set()
            feed_stopped = now - started
            at_feed_stop = dict(last_build)
            if sampler is not None:
                sampler.phase = "drain"
        if now > deadline:
            raise RuntimeError(f"{name}: not active within {timeout} s (states {states})")
        time.sleep(STATE_POLL_S)
    active = first_seen["active"]
    main_cpu, other_cpu = daemon.cpu()
    router_cpu = router.cpu() - router_cpu_before
    bench_cpu = own_cpu() - bench_cpu_before
    built = re.compile(
        rf"index {name} built: (\d+) mutations from its build stream; active from seqno sum (\d+)"
    )
    found = None
    log_deadline = time.monotonic() + 10
    while found is None and time.monotonic() < log_deadline:
        found = built.search(daemon.log())
        if found is None:
            time.sleep(0.05)
    items = int(found.group(1)) if found else int(last_build.get("items", 0))
    active_from = int(found.group(2)) if found else None
    seconds = active - started
    catchup = first_seen.get("catchup")
    return {
        "index": name,
        "seconds": round(seconds, 3),
        "create_request_s": round(posted - started, 3),
        "states_seen": states,
        "building_s": round((catchup or active) - started, 3),
        "catchup_s": None if catchup is None else round(active - catchup, 3),
        "items": items,
        "items_from_log_line": found is not None,
        "items_per_s": round(items / seconds),
        "active_from_seqno_sum": active_from,
        "seqnos_per_s": None if active_from is None else round(active_from / seconds),
        "last_seen_build": last_build,
        "entries": int(entry["entries"]),
        "entries_per_s": round(int(entry["entries"]) / seconds),
        "daemon_main_cpu_s": round(main_cpu - cpu_before[0], 2),
        "daemon_thread_cpu_s": round(other_cpu - cpu_before[1], 2),
        "router_cpu_s": round(router_cpu, 2),
        "bench_cpu_s": round(bench_cpu, 2),
        "feed_stopped_after_s": None if feed_stopped is None else round(feed_stopped, 3),
        "build_at_feed_stop": at_feed_stop or None,
        "seqnos_per_s_under_feed": (
            round(at_feed_stop.get("received_seqno_sum", 0) / feed_stopped)
            if feed_stopped
            else None
        ),
    }


def report_build(label: str, b: dict[str, Any]) -> None:
    catchup = "not seen" if b["catchup_s"] is None else f"{b['catchup_s']:.2f} s"
    seqnos = "" if b["seqnos_per_s"] is None else f", {b['seqnos_per_s']:,} seqnos/s"
    say(
        f"build {label} ({b['index']}): active after {b['seconds']:.2f} s, {b['items_per_s']:,} "
        f"items/s ({b['items']:,} mutations from its build stream{seqnos}, active from seqno "
        f"sum {b['active_from_seqno_sum']:,}), {b['entries_per_s']:,} "
        f"entries/s ({b['entries']:,} entries); building {b['building_s']:.2f} s, catchup "
        f"{catchup} (polled every {STATE_POLL_S * 1000:.0f} ms; the POST took "
        f"{b['create_request_s']:.2f} s); daemon CPU {b['daemon_main_cpu_s']:.2f} s main thread "
        f"+ {b['daemon_thread_cpu_s']:.2f} s other threads, router CPU {b['router_cpu_s']:.2f} "
        f"s, this process (feed, sampling) {b['bench_cpu_s']:.2f} s"
    )


def report_lag(phase: str, s: dict[str, Any], feed_rate: float) -> None:
    if not s["samples"]:
        return

    def three(what: str, ms: bool = True) -> str:
        text = " / ".join(f"{s[f'{what}_{q}']:,}" for q in ("p50", "p99", "max"))
        if ms:
            text += " (" + " / ".join(f"{s[f'{what}_{q}_ms']:,.0f}" for q in ("p50", "p99", "max"))
            text += f" ms at {feed_rate:,.0f}/s)"
        return text

    say(
        f"  lag {phase} ({s['samples']} samples), p50 / p99 / max: maintenance (router appended "
        f"- daemon readable) {three('lag')}, of which not yet received by the daemon "
        f"{three('in_flight')} and received, not yet readable {three('unpublished')}; the "
        f"router behind the file "
        f"{three('router_behind', False)}; end to end (file - readable) {three('end_to_end')}"
    )
    if s.get("probes"):
        say(
            f"    a write readable after, p50 / p99 / max ({s['probes']} probes, polled every "
            f"{SAMPLE_S * 1000:.0f} ms): "
            + " / ".join(f"{s[f'visible_{q}_ms']:,.0f}" for q in ("p50", "p99", "max"))
            + " ms"
        )
    if s.get("visible_p99_halves_ms"):
        first, second = s["visible_p99_halves_ms"]
        say(
            f"    the baseline's first and second half apart, p99: {first:,.0f} / {second:,.0f} ms"
            f" ({second / first:.2f}x: how much the usual lag varies with no build)"
        )


def builds(
    opts: argparse.Namespace, workdir: Path, initial: Path, model: Model, total: int
) -> dict[str, Any]:
    run_dir = workdir / "builds"
    daemon = Daemon.in_workdir(run_dir / "daemon")
    jsonl = run_dir / "follow.jsonl"
    shutil.copyfile(initial, jsonl)
    router: Router | None = None
    feed: Feed | None = None
    sampler: LagSampler | None = None
    checks: dict[str, bool] = {}
    try:
        daemon.start()
        with httpx.Client(timeout=opts.timeout) as client:
            started = time.monotonic()
            router = start_router(
                run_dir / "router",
                ["--to", daemon.address, "--jsonl", str(jsonl), "--follow"],
            )
            appended_s, readable_s = load(
                "load", router, [daemon], total, started, client, opts.timeout
            )
            say(
                f"load: {total:,} documents appended by the router after {appended_s:.2f} s, "
                f"readable on the daemon after {readable_s:.2f} s ({total / readable_s:,.0f}/s "
                f"from the router's start)"
            )

            quiet = time_build(client, daemon, router, "by_zip", opts.timeout)
            report_build("without a feed", quiet)
            checks["quiet_count"] = check(
                "request_plus count of by_zip = live documents with address.zip",
                daemon.count("by_zip", client),
                model.with_zip(),
            )
            dropped_at = time.monotonic()
            answer = client.delete(f"{daemon.url}/indexes/by_zip")
            if answer.status_code != 204:
                raise RuntimeError(f"drop by_zip: HTTP {answer.status_code}: {answer.text}")
            drop_s = time.monotonic() - dropped_at
            say(f"drop by_zip: {drop_s:.2f} s")

            more = generate(
                Workload(1 << 40, opts.keys, DELETE_RATIO, opts.seed + FEED_SEED_OFFSET)
            )
            feed = Feed(jsonl, more, opts.feed_rate, model)
            sampler = LagSampler(daemon, router, feed, total)
            sampler.start()
            feed.start()
            time.sleep(WARMUP_S)
            runs: list[dict[str, Any]] = []
            name = "by_zip2"
            for cycle in range(opts.builds):
                if cycle:  # the previous build's index goes; the feed goes on
                    sampler.phase = "drop"
                    answer = client.delete(f"{daemon.url}/indexes/{name}")
                    if answer.status_code != 204:
                        raise RuntimeError(f"drop {name}: HTTP {answer.status_code}")
                    name = f"by_zip{cycle + 2}"
                sampler.phase = "baseline"
                time.sleep(opts.baseline_s)
                sampler.phase = "build"
                runs.append(
                    time_build(
                        client, daemon, router, name, opts.timeout, feed, sampler, opts.feed_max_s
                    )
                )
                if feed.stopped.is_set():  # --feed-max-s: no feed left for another build
                    break
                sampler.phase = "after"
                time.sleep(AFTER_S)
            with_feed = runs[-1]
            feed.stop()
            sampler.stop()
            fed = feed.written
            final = total + fed
            caught_up_s, readable_after_s = load(
                "after the feed", router, [daemon], final, time.monotonic(), client, opts.timeout
            )
            for cycle, figures in enumerate(runs):
                label = f" ({cycle + 1} of {len(runs)})" if len(runs) > 1 else ""
                report_build(f"with a feed of {opts.feed_rate:,.0f}/s{label}", figures)
            lag = {phase: sampler.summary(phase, opts.feed_rate) for phase in PHASES}
            say(
                f"  feed: {fed:,} documents in {feed.seconds:.2f} s ({fed / feed.seconds:,.0f}/s; "
                f"at most {feed.max_behind:,} due at once); everything readable "
                f"{readable_after_s:.2f} s after it stopped; {sampler.failures} failed samples"
            )
            if with_feed["feed_stopped_after_s"] is not None:
                stop = with_feed["build_at_feed_stop"] or {}
                say(
                    f"  NOTE: {name} was not active {opts.feed_max_s:g} s after its create "
                    f"under the feed (--feed-max-s): the feed was stopped then, the build at "
                    f"{stop.get('received_seqno_sum', 0):,} of {stop.get('target_seqno_sum', 0):,}"
                    f" seqnos ({with_feed['seqnos_per_s_under_feed']:,}/s under the feed)"
                )
            for phase in PHASES:
                report_lag(phase, lag[phase], opts.feed_rate)
            checks["feed_count"] = check(
                f"request_plus count of {name} = live documents with address.zip",
                daemon.count(name, client),
                model.with_zip(),
            )
            checks["feed_by_city"] = check(
                "request_plus count of by_city = live documents with address.city",
                daemon.count("by_city", client),
                model.with_city(),
            )
        router.stop_cleanly()
        daemon.stop_cleanly()
    finally:
        if feed is not None and feed.is_alive():
            feed.stopped.set()
            feed.join()
        if sampler is not None and sampler.is_alive():
            sampler.stop()
        if router is not None:
            router.kill()
        daemon.kill()
    return {
        "load_appended_s": round(appended_s, 3),
        "load_readable_s": round(readable_s, 3),
        "load_per_s": round(total / readable_s),
        "quiet": quiet,
        "drop_s": round(drop_s, 3),
        "with_feed": with_feed,
        "with_feed_runs": runs,
        "feed_documents": fed,
        "feed_seconds": round(feed.seconds, 3),
        "feed_per_s": round(fed / feed.seconds),
        "feed_max_due": feed.max_behind,
        "readable_after_feed_s": round(readable_after_s, 3),
        "appended_after_feed_s": round(caught_up_s, 3),
        "lag": lag,
        "lag_samples_failed": sampler.failures,
        # Every sample: (s, phase, seqnos readable, seqnos the build received or None, the
        # daemon store's level-0 files).
        "timeline": [
            (s.at, s.phase, s.readable, s.build, s.level0, s.router_behind) for s in sampler.samples
        ],
        # Every probe: (s when it was written, s until it was readable).
        "probes": sampler.probes,
        "build_slowdown": ratio(quiet["items_per_s"], with_feed["items_per_s"]),
        "checks": checks,
    }


# --------------------------------------------------------------------------------------------
# Main


def run(opts: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    began = time.monotonic()
    load_before = os.getloadavg()[0]
    fsync = fsync_ms(workdir)
    total = opts.documents
    documents = list(generate(Workload(total, opts.keys, DELETE_RATIO, opts.seed)))
    model = Model()
    model.add(documents)
    initial = workdir / "initial.jsonl"
    initial.write_text("".join(jsonl_lines(documents)))
    del documents
    say(
        f"workload: {total:,} documents over {opts.keys:,} docids, {DELETE_RATIO:.0%} deletes, "
        f"seed {opts.seed} ({initial.stat().st_size / MIB:.1f} MiB of JSONL; "
        f"{model.with_zip():,} live documents); {os.cpu_count()} cores, Python "
        f"{sys.version.split()[0]}, load average {load_before:.2f}, fsync of 4 KiB {fsync} ms"
    )
    with_city = model.with_city()  # the feed of the builds adds to the model
    build = builds(opts, workdir, initial, model, total)
    scans = fan_out(opts, workdir, initial, with_city, total) if opts.fan_out else None
    seconds = time.monotonic() - began
    checks = {f"build_{k}": v for k, v in build["checks"].items()}
    if scans is not None:
        checks.update({f"scan_{k}": v for k, v in scans["checks"].items()})
    say(f"run: {seconds:.0f} s; checks {'passed' if all(checks.values()) else 'FAILED'}")
    return {
        "date": date.today().isoformat(),
        "documents": total,
        "keys": opts.keys,
        "seed": opts.seed,
        "feed_rate": opts.feed_rate,
        "cores": os.cpu_count(),
        "load_average_before": round(load_before, 2),
        "load_average_after": round(os.getloadavg()[0], 2),
        "fsync_ms": fsync,
        "run_s": round(seconds, 1),
        "quiet_build_items_per_s": build["quiet"]["items_per_s"],
        # The log's mutations the build covered per second: its stream carries fewer items,
        # each document once per chunk at its latest version.
        "quiet_build_seqnos_per_s": build["quiet"]["seqnos_per_s"],
        "feed_build_items_per_s": build["with_feed"]["items_per_s"],
        "lag_p99_baseline": build["lag"]["baseline"]["lag_p99"],
        "lag_p99_build": build["lag"]["build"]["lag_p99"],
        "scan_two_nodes_rows_per_s": scans and scans["rows_per_s"]["two_nodes"],
        "scan_one_node_ndjson_rows_per_s": scans and scans["rows_per_s"]["one_node_ndjson"],
        "scan_ratio_two_vs_one_ndjson": scans and scans["ratio_two_vs_one_ndjson"],
        "checks_passed": all(checks.values()),
        "checks": checks,
        "builds": build,
        "scans": scans,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--documents", type=int, default=300_000, help="default 300,000")
    parser.add_argument("--keys", type=int, default=None, help="docids (default documents/3)")
    parser.add_argument(
        "--feed-rate", type=float, default=10_000, help="documents/s of the feed (default 10,000)"
    )
    parser.add_argument(
        "--feed-max-s",
        type=float,
        default=60,
        help="stop the feed if the build is not active this long after its create (default 60)",
    )
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument(
        "--builds",
        type=int,
        default=1,
        help="builds under the feed, each after its own baseline (default 1); the lag "
        "figures pool every baseline and every build",
    )
    parser.add_argument(
        "--no-fan-out",
        dest="fan_out",
        action="store_false",
        help="only the builds (part 1); the scan fan-out's figures are null",
    )
    parser.add_argument(
        "--baseline-s",
        type=float,
        default=BASELINE_S,
        help=f"the feed's baseline before each build (default {BASELINE_S:g}); about as long "
        "as the build, its p99 and max compare with the build's over as many probes",
    )
    parser.add_argument("--timeout", type=float, default=300, help="of every wait, seconds")
    parser.add_argument("--keep", action="store_true", help="keep the temp directory")
    opts = parser.parse_args()
    if opts.keys is None:
        opts.keys = max(1, opts.documents // 3)
    if min(opts.documents, opts.keys, opts.builds) < 1 or min(opts.feed_rate, opts.baseline_s) <= 0:
        parser.error("--documents, --keys, --builds, --feed-rate and --baseline-s must be > 0")
    return in_workdir("build-bench-", opts.keep, lambda workdir: run(opts, workdir))


if __name__ == "__main__":
    raise SystemExit(main())
