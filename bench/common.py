"""Pieces both benchmarks use: the daemon as a subprocess, output lines, ratios, a work dir."""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

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
    """`python -m indexer serve` on a temp config; both ports read from its log."""

    def __init__(self, workdir: Path, extra_config: str = "") -> None:
        self.workdir = workdir
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
                [sys.executable, "-m", "indexer", "serve", "--config", str(self.config_path)],
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
