"""Pieces the benchmarks share: the daemon as a subprocess, output lines, ratios, a work dir, and
a thread sampling the daemon's `GET /stats` into a time series."""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import httpx
import psutil

HOST = "127.0.0.1"
HTTP_LINE = re.compile(r"HTTP API on http://[^\s:]+:(\d+)")
FEED_LINE = re.compile(r"listening for router feeds on [^\s]+:(\d+);")


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


class Daemon:
    """`python -m indexer serve` on a temp config (and `args`); both ports read from its log."""

    def __init__(self, workdir: Path, extra_config: str = "", args: Sequence[str] = ()) -> None:
        self.workdir = workdir
        self.args = list(args)  # more `indexer serve` arguments (a cluster map's --node, say)
        self.data_dir = workdir / "data"
        self.config_path = workdir / "indexer.toml"
        self.log_path = workdir / "daemon.log"
        self.feed_port = 0
        self.http_port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        workdir.mkdir(parents=True, exist_ok=True)
        self.config_path.write_text(
            "[server]\n"
            f'data_dir = "{self.data_dir}"\n'
            f'host = "{HOST}"\n'
            "feed_port = 0\n"
            "http_port = 0\n"
            'log_level = "info"\n' + extra_config
        )

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.http_port}"

    @property
    def feed_address(self) -> str:
        return f"{HOST}:{self.feed_port}"

    def start(self, timeout: float = 60) -> None:
        """Start it (again) and wait for this start's "listening" line."""
        seen = self.log().count("listening for router feeds")
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "indexer",
                    "serve",
                    "--config",
                    str(self.config_path),
                    *self.args,
                ],
                stderr=log,
                stdin=subprocess.DEVNULL,
            )
        deadline = time.monotonic() + timeout
        while True:
            text = self.log()
            if text.count("listening for router feeds") > seen:
                self.http_port = int(HTTP_LINE.findall(text)[-1])
                self.feed_port = int(FEED_LINE.findall(text)[-1])
                return
            if self.proc.poll() is not None:
                raise RuntimeError(f"the daemon exited at start-up:\n{text[-4000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the daemon did not listen within {timeout} s:\n{text[-4000:]}")
            time.sleep(0.05)

    def log(self) -> str:
        try:
            return self.log_path.read_text()
        except FileNotFoundError:
            return ""

    def stop(self, timeout: float = 120) -> int:
        """SIGINT; it must drain, persist, say "stopped cleanly" and exit 0; its exit code."""
        assert self.proc is not None
        seen = self.log().count("stopped cleanly")
        self.proc.send_signal(signal.SIGINT)
        try:
            code = self.proc.wait(timeout=timeout)
        finally:
            self.kill()
        if code != 0 or self.log().count("stopped cleanly") <= seen:
            raise RuntimeError(f"the daemon exited with {code}:\n{self.log()[-4000:]}")
        return code

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def cpu(self) -> tuple[float, float]:
        """CPU seconds so far: the main (trio) thread, and every other thread together."""
        assert self.proc is not None
        process = psutil.Process(self.proc.pid)
        total = process.cpu_times()
        main = sum(t.user_time + t.system_time for t in process.threads() if t.id == process.pid)
        return main, total.user + total.system - main


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
