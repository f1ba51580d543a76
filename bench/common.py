"""Pieces the benchmarks share: output lines, ratios, a work dir, a thread sampling the daemon's
`GET /stats` into a time series, and the tests' process harness (tests/harness.py), re-exported."""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import psutil

# The benchmarks run as `python bench/NAME.py`: the project's root makes `tests` importable.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.harness import (
    HOST,
    Daemon,
    Postgres,
    Router,
    RssSampler,
    cpu_by_thread_kind,
    cpu_split,
    find_postgres,
    free_port,
    jsonl_lines,
    latest,
    stop_process,
    tree_cpu,
    wait_for_line,
    write_cluster_map,
)

__all__ = [
    "HOST",
    "Daemon",
    "Postgres",
    "Router",
    "RssSampler",
    "cpu_by_thread_kind",
    "cpu_split",
    "find_postgres",
    "free_port",
    "jsonl_lines",
    "latest",
    "stop_process",
    "tree_cpu",
    "wait_for_line",
    "write_cluster_map",
]


def say(line: str) -> None:
    """One human-readable line, flushed at once."""
    print(line, flush=True)


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b rounded, or None when either is missing."""
    return None if a is None or not b else round(a / b, 3)


def in_workdir(prefix: str, keep: bool, run: Callable[[Path], dict[str, Any]]) -> int:
    """Run a benchmark in a fresh temp directory, print its summary as the last line."""
    workdir = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        summary = run(workdir)
    finally:
        if keep:
            say(f"kept: {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    print(json.dumps(summary), flush=True)
    return 0


# Columns of `stats_row`: what a time series of the daemon's `GET /stats` keeps per sample.
STATS_COLUMNS = (
    "received_seqno_sum",  # seqnos handed to the pipeline (what the daemon took in)
    "stable_seqno_sum",  # seqnos readable (the latest in-memory snapshot)
    "persisted_seqno_sum",
    "queued",  # records waiting in the worker rings
    "slab_bytes",  # slab chunk bytes in use
    "throttle_paused",  # 1 while reads are paused for memory
    "throttle_pauses",
    "throttle_resumes",
    "throttle_rss_bytes",  # the throttle's own last RSS sample
    "throttle_settled_resumes",  # resumes with RSS above the low mark (daemons that have them)
)


def stats_row(stats: dict[str, Any]) -> list[int]:
    """The STATS_COLUMNS of one `GET /stats` answer (0 for a field this daemon does not have)."""
    vbuckets = stats.get("vbuckets", {})
    throttle = stats.get("throttle", {})
    return [
        int(vbuckets.get("received_seqno_sum", 0)),
        int(stats.get("stable", {}).get("seqno_sum", 0)),
        int(stats.get("persisted", {}).get("seqno_sum", 0)),
        sum(int(q.get("queued", 0)) for q in stats.get("queues", [])),
        int(stats.get("slab", {}).get("chunk_bytes_in_use", 0)),
        int(bool(throttle.get("paused", False))),
        int(throttle.get("pauses", 0)),
        int(throttle.get("resumes", 0)),
        int(throttle.get("rss", 0)),
        int(throttle.get("settled_resumes", 0)),
    ]


class StatsSampler(threading.Thread):
    """`GET /stats` of a daemon every `interval` s from a thread, on a fixed cadence.

    Each sample is (wall time, stats_row + extra()), `extra` giving values measured beside it
    (an RSS read with psutil, say). Failed requests are counted, not retried.
    """

    def __init__(
        self, url: str, interval: float, extra: Callable[[], list[int]] | None = None
    ) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.interval = interval
        self.extra = extra
        self.samples: list[tuple[float, list[int]]] = []
        self.last: dict[str, Any] = {}
        self.failures = 0
        self.stopped = threading.Event()

    def run(self) -> None:
        due = time.monotonic()
        with httpx.Client(timeout=5) as client:
            while not self.stopped.is_set():
                at = time.time()
                try:
                    stats = client.get(f"{self.url}/stats").json()
                    row = stats_row(stats) + (self.extra() if self.extra else [])
                except (httpx.HTTPError, ValueError, psutil.Error):
                    self.failures += 1
                else:
                    self.last = stats
                    self.samples.append((at, row))
                due = max(due + self.interval, time.monotonic())
                self.stopped.wait(due - time.monotonic())

    def stop(self) -> None:
        self.stopped.set()
        self.join()

    def series(
        self, start: float, end: float | None = None, extra_columns: tuple[str, ...] = ()
    ) -> dict[str, list[float]]:
        """The samples from one interval before `start` to `end`, by column; `t_s` from start."""
        names = ("t_s", *STATS_COLUMNS, *extra_columns)
        out: dict[str, list[float]] = {name: [] for name in names}
        for at, row in self.samples:
            if at < start - self.interval or (end is not None and at > end + self.interval):
                continue
            out["t_s"].append(round(at - start, 3))
            for name, value in zip(names[1:], row, strict=True):
                out[name].append(value)
        return out
