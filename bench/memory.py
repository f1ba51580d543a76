"""Memory benchmark: the daemon's RSS under a feed faster than it writes, with a small quota.

    python bench/memory.py [--mutations N] [--keys K] [--seed S] [--quota-mb Q]
                           [--headroom-mb H] [--pool SIZE] [--ring-slots R] [--stuck-s S]
                           [--timeout S] [--keep]

Everything runs as subprocesses on 127.0.0.1: `python -m indexer serve` on a temp configuration
and `python -m indexer feed` (the real router).

1. The daemon's configuration: a small slab pool (`[slab] pool`, default 4 MiB), rings of
   `--ring-slots` (default 16,384 per worker, twice the chunks the pool holds: the default
   262,144 slots keep the boxed ints of every slot's last mutation, so RSS would climb about
   60 B per mutation until 2.1M mutations have passed, whatever the quota), and a memory quota
   (`[memory] quota`) with the default marks (pause at 90%, resume below 80%) and sampling
   (100 ms). Unless `--quota-mb` is given, a first start without a feed measures the idle RSS
   and the quota is set so that its high mark is that RSS plus `--headroom-mb` (default 16).
2. `python -m indexer feed --to DAEMON --generate N --keys K` (default 1,000,000 mutations
   over 20,000 docids, 10% deletes) pushes as fast as it can and exits once everything is
   persisted. A bounded key space keeps the back-index cache small: what grows is the queue.
3. Every 100 ms a thread of the bench reads the daemon's RSS (psutil) and `GET /stats`
   (throttle state, pause and resume counters, received and readable seqno sums, queued
   records, slab bytes in use). The pauses and resumes are also timed from the daemon's log.
4. The run ends when the feed exits, or when reads have stayed paused `--stuck-s` seconds
   (default 20) in a row: the RSS did not fall to the low mark while nothing was read. The
   feed is then stopped and the run reported as stuck. The daemon is stopped with SIGINT (exit
   0 and "stopped cleanly" checked).

Reported: peak RSS against the quota and the marks, pauses and resumes with their times (and
how many resumes came with RSS still above the low mark, when the daemon resumes so), the time
spent paused, what was readable at the end, and the time series. Prints one line per
measurement and ends with one JSON object of every figure. Everything lives in a temporary
directory, removed at the end unless --keep is given.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import psutil
from common import Daemon, StatsSampler, in_workdir, ratio, say  # bench/common.py

MIB = 1 << 20
SAMPLE_S = 0.1
HIGH_MARK = 0.9  # the default configuration's marks, written out so the quota can be derived
LOW_MARK = 0.8
THROTTLE_LINE = re.compile(
    r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) .*memory throttle: (pausing|resuming) reads: "
    r"rss ([\d.]+) MiB(.*)$",
    re.MULTILINE,
)
STALLS = re.compile(r"(\d+) stalls on full queues, (\d+) memory throttle pauses")


def config_text(pool: str, ring_slots: int, quota_bytes: int | None) -> str:
    """The daemon's configuration beyond common.Daemon's: pool, rings and the memory quota."""
    text = f'[pipeline]\nring_slots = {ring_slots}\n[slab]\npool = "{pool}"\n'
    if quota_bytes is not None:
        text += (
            f"[memory]\nquota = {quota_bytes}\nhigh_mark = {HIGH_MARK}\nlow_mark = {LOW_MARK}\n"
            f"sample_interval_ms = {round(SAMPLE_S * 1000)}\n"
        )
    return text


def idle_rss(workdir: Path, pool: str, ring_slots: int) -> int:
    """RSS of a started daemon with this pool and these rings, before any feed."""
    daemon = Daemon.in_workdir(workdir, config_text(pool, ring_slots, None))
    try:
        daemon.start()
        assert daemon.proc is not None
        time.sleep(1.0)  # let start-up settle (HTTP server, first snapshot)
        rss = int(psutil.Process(daemon.proc.pid).memory_info().rss)
        daemon.stop_cleanly()
    finally:
        daemon.kill()
    return rss


def throttle_events(log: str, start: float) -> list[dict[str, Any]]:
    """The daemon's pause and resume lines: seconds since `start`, kind, RSS it logged and
    whether a resume came with RSS above the low mark (daemons that resume so)."""
    events = []
    for found in THROTTLE_LINE.finditer(log):
        at = datetime.strptime(found.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
        events.append(
            {
                "t_s": round(at - start, 3),
                "kind": "pause" if found.group(2) == "pausing" else "resume",
                "rss_bytes": round(float(found.group(3)) * MIB),
                # A resume with RSS still above the low mark: pausing could not lower it.
                "settled": "stayed above the low mark" in found.group(4),
            }
        )
    return events


def paused_seconds(events: Sequence[dict[str, Any]], end: float) -> float:
    """Time spent paused from the pause/resume events, up to `end` (seconds since start)."""
    total = 0.0
    since: float | None = None
    for event in events:
        if event["kind"] == "pause" and since is None:
            since = event["t_s"]
        elif event["kind"] == "resume" and since is not None:
            total += event["t_s"] - since
            since = None
    if since is not None:
        total += max(end - since, 0.0)
    return total


def stop_feed(feed: subprocess.Popen[bytes]) -> int | None:
    """SIGTERM the feed, then SIGKILL; its exit code (None if it was still running)."""
    code = feed.poll()
    if code is not None:
        return code
    feed.send_signal(signal.SIGTERM)
    try:
        feed.wait(timeout=10)
    except subprocess.TimeoutExpired:
        feed.kill()
        feed.wait()
    return None


def watch(
    feed: subprocess.Popen[bytes],
    sampler: StatsSampler,
    start: float,
    stuck_s: float,
    timeout: float,
) -> tuple[bool, bool]:
    """Wait for the feed to exit; (stuck, timed out) when reads stayed paused or time ran out."""
    paused_since: float | None = None
    while feed.poll() is None:
        time.sleep(SAMPLE_S)
        now = time.time()
        if sampler.last.get("throttle", {}).get("paused", False):
            paused_since = now if paused_since is None else paused_since
            if now - paused_since >= stuck_s:
                return True, False
        else:
            paused_since = None
        if now - start >= timeout:
            return False, True
    return False, False


def run(opts: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """Probe, then the throttled run; the JSON summary."""
    idle = idle_rss(workdir / "probe", opts.pool, opts.ring_slots)
    if opts.quota_mb is not None:
        quota = round(opts.quota_mb * MIB)
    else:
        quota = round((idle + opts.headroom_mb * MIB) / HIGH_MARK)
    high, low = int(HIGH_MARK * quota), int(LOW_MARK * quota)
    say(
        f"workload: {opts.mutations:,} mutations over {opts.keys:,} docids, seed {opts.seed}; "
        f"slab pool {opts.pool}, rings of {opts.ring_slots:,} slots; idle RSS "
        f"{idle / MIB:.1f} MiB; quota {quota / MIB:.1f} MiB (pause at {high / MIB:.1f}, resume "
        f"below {low / MIB:.1f}); {os.cpu_count()} cores, Python {sys.version.split()[0]}"
    )
    daemon = Daemon.in_workdir(workdir / "run", config_text(opts.pool, opts.ring_slots, quota))
    feed: subprocess.Popen[bytes] | None = None
    try:
        daemon.start()
        assert daemon.proc is not None
        process = psutil.Process(daemon.proc.pid)
        sampler = StatsSampler(daemon.url, SAMPLE_S, lambda: [int(process.memory_info().rss)])
        sampler.start()
        with open(workdir / "feed.log", "wb") as feed_log:
            start = time.time()
            feed = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "indexer",
                    "feed",
                    "--to",
                    daemon.address,
                    "--generate",
                    str(opts.mutations),
                    "--keys",
                    str(opts.keys),
                    "--seed",
                    str(opts.seed),
                ],
                stdout=subprocess.DEVNULL,
                stderr=feed_log,
                stdin=subprocess.DEVNULL,
            )
            stuck, timed_out = watch(feed, sampler, start, opts.stuck_s, opts.timeout)
            end = time.time()
            feed_exit = stop_feed(feed)
        sampler.stop()
        final = sampler.last
        code = daemon.stop_cleanly()
        log = daemon.log()
    finally:
        if feed is not None and feed.poll() is None:
            feed.kill()
            feed.wait()
        daemon.kill()
    seconds = end - start
    series = sampler.series(start, end, ("rss_bytes",))
    if not series["t_s"]:
        raise RuntimeError(f"no GET /stats sample ({sampler.failures} failures)")
    if feed_exit not in (None, 0):
        raise RuntimeError(
            f"the feed exited with {feed_exit}:\n{(workdir / 'feed.log').read_text()[-3000:]}"
        )
    events = throttle_events(log, start)
    peak = int(max(series["rss_bytes"]))
    paused_rss = [
        r for r, p in zip(series["rss_bytes"], series["throttle_paused"], strict=True) if p
    ]
    throttle = final.get("throttle", {})
    readable = int(final.get("stable", {}).get("seqno_sum", 0))
    found = STALLS.search(log)
    pauses = int(throttle.get("pauses", 0))
    resumes = int(throttle.get("resumes", 0))
    settled = int(throttle.get("settled_resumes", 0))
    paused_s = paused_seconds(events, seconds)
    first_pause = next((e["t_s"] for e in events if e["kind"] == "pause"), None)
    if feed_exit == 0:
        outcome = "feed finished"
    elif stuck:
        outcome = f"stuck: paused {opts.stuck_s:g} s in a row"
    else:
        outcome = f"timed out after {opts.timeout:g} s"
    say(
        f"run: {seconds:.2f} s, {outcome}; readable seqno sum at the end {readable:,} of "
        f"{opts.mutations:,} ({readable / opts.mutations:.0%}); daemon exit code {code}"
    )
    say(
        f"  RSS: peak {peak / MIB:.1f} MiB = {peak / quota:.0%} of the quota "
        f"({(peak - high) / MIB:+.1f} MiB over the high mark); {len(series['t_s'])} samples "
        f"every {SAMPLE_S * 1000:.0f} ms ({sampler.failures} failed)"
    )
    say(
        f"  throttle: {pauses} pauses, {resumes} resumes ({settled} with RSS above the low mark)"
        + ("" if first_pause is None else f", first pause at {first_pause:.2f} s")
        + f", paused {paused_s:.1f} s in all"
        + (
            ""
            if not paused_rss
            else f"; RSS while paused {min(paused_rss) / MIB:.1f}-{max(paused_rss) / MIB:.1f} "
            f"MiB against a low mark of {low / MIB:.1f} MiB"
        )
    )
    if stuck:
        say(
            f"  NOTE: reads stayed paused {opts.stuck_s:g} s: the daemon's RSS did not fall "
            "back to the low mark while nothing was read and the throttle did not resume; the "
            "feed was stopped"
        )
    return {
        "mutations": opts.mutations,
        "keys": opts.keys,
        "seed": opts.seed,
        "pool": opts.pool,
        "ring_slots": opts.ring_slots,
        "idle_rss_bytes": idle,
        "quota_bytes": quota,
        "high_mark_bytes": high,
        "low_mark_bytes": low,
        "peak_rss_bytes": peak,
        "peak_rss_vs_quota": ratio(peak, quota),
        "peak_over_high_mark_bytes": peak - high,
        "min_rss_paused_bytes": int(min(paused_rss)) if paused_rss else None,
        "pauses": pauses,
        "resumes": resumes,
        "settled_resumes": settled,
        "first_pause_s": first_pause,
        "paused_s": round(paused_s, 3),
        "seconds": round(seconds, 3),
        "outcome": outcome,
        "feed_finished": feed_exit == 0,
        "stuck": stuck,
        "timed_out": timed_out,
        "stuck_s": opts.stuck_s,
        "readable_seqno_sum": readable,
        "readable_share": round(readable / opts.mutations, 3),
        "stalls_on_full_queues": int(found.group(1)) if found else None,
        "daemon_exit_code": code,
        "sample_interval_s": SAMPLE_S,
        "sample_failures": sampler.failures,
        "events": events,
        "timeline": series,
        "cores": os.cpu_count(),
    }


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--mutations", type=int, default=1_000_000, help="default 1,000,000")
    parser.add_argument("--keys", type=int, default=20_000, help="docids (default 20,000)")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument(
        "--quota-mb", type=float, default=None, help="the daemon's memory quota (default: derived)"
    )
    parser.add_argument(
        "--headroom-mb",
        type=float,
        default=16,
        help="without --quota-mb: the high mark is the idle RSS plus this (default 16)",
    )
    parser.add_argument("--pool", default="4MiB", help="slab pool size (default 4MiB)")
    parser.add_argument(
        "--ring-slots", type=int, default=16_384, help="slots per worker ring (default 16,384)"
    )
    parser.add_argument(
        "--stuck-s",
        type=float,
        default=20,
        help="end the run once reads stayed paused this long (default 20)",
    )
    parser.add_argument("--timeout", type=float, default=600, help="of the run, seconds")
    parser.add_argument("--keep", action="store_true", help="keep the temp directory")
    opts = parser.parse_args(argv)
    if min(opts.mutations, opts.keys, opts.ring_slots) < 1 or opts.stuck_s <= 0:
        parser.error("--mutations, --keys, --ring-slots and --stuck-s must be positive")
    return opts


def main(argv: Sequence[str] | None = None) -> int:
    """The whole benchmark in a temp directory."""
    opts = parse_args(argv)
    return in_workdir("memory-bench-", opts.keep, lambda workdir: run(opts, workdir))


if __name__ == "__main__":
    raise SystemExit(main())
