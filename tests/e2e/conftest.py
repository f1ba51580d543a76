"""Real processes on 127.0.0.1: the daemon and the router feed as subprocesses."""

from __future__ import annotations

import functools
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from indexer.keys import MISSING, collate, field_value
from indexer.router.documents import Document
from indexer.where import Expr, matches, parse_where

pytestmark = pytest.mark.e2e

INDEXES = {"by_city": ["address.city", "age"], "by_age": ["age"]}


def _ephemeral_ports() -> range:
    """The range the kernel picks outgoing connections' ports from (Linux; elsewhere a guess)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return range(int(low), int(high) + 1)
    except (OSError, ValueError):
        return range(32768, 61000)


# Ports this test process has handed out: a daemon binds its port some time after it is chosen.
_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A port free on 127.0.0.1 now, below the ephemeral range and not handed out before.

    A port the kernel picked for a bind to port 0 could be picked again for an outgoing
    connection (the feeds, HTTP clients) before the daemon that was given it binds it.
    """
    ephemeral = _ephemeral_ports()
    candidates = [p for p in range(20_000, 32_768) if p not in ephemeral and p not in _HANDED_OUT]
    for port in random.sample(candidates, min(200, len(candidates))):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    raise AssertionError("no free port on 127.0.0.1 below the ephemeral range")


def indexer_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "indexer", *args]


def write_config(path: Path, data_dir: Path, port: int, **sections: dict[str, Any]) -> Path:
    """A TOML config: the two test indexes plus any overridden sections."""
    server = sections.pop("server", {})
    server.setdefault("http_port", free_port())
    lines = [
        "[server]",
        f'data_dir = "{data_dir}"',
        f"feed_port = {port}",
        'log_level = "info"',
    ]
    for key, value in server.items():
        lines.append(f"{key} = {json.dumps(value)}")
    for name, table in sections.items():
        lines.append(f"[{name}]")
        lines.extend(f"{k} = {json.dumps(v)}" for k, v in table.items())
    for name, keys in INDEXES.items():
        lines += [f"[indexes.{name}]", f"keys = {json.dumps(keys)}"]
    path.write_text("\n".join(lines) + "\n")
    return path


class Daemon:
    """`indexer serve` in a subprocess, its log in a file."""

    def __init__(self, config: Path, log: Path, port: int) -> None:
        self.config = config
        self.log_path = log
        self.port = port
        text = config.read_text()
        self.http_port = int(text.split("http_port = ", 1)[1].split("\n", 1)[0])
        self.proc: subprocess.Popen[bytes] | None = None
        self.args: list[str] = []  # more `indexer serve` arguments

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def start(self, timeout: float = 30) -> Daemon:
        mark = self.log().count("listening for router feeds")
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                indexer_command("serve", "--config", str(self.config), *self.args), stderr=log
            )
        deadline = time.monotonic() + timeout
        while self.log().count("listening for router feeds") <= mark:
            if self.proc.poll() is not None:
                raise AssertionError(f"daemon exited at start:\n{self.log()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"daemon did not listen in time:\n{self.log()}")
            time.sleep(0.05)
        return self

    def log(self) -> str:
        try:
            return self.log_path.read_text()
        except FileNotFoundError:
            return ""

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
        assert self.proc is not None
        self.proc.send_signal(sig)
        code = self.proc.wait(timeout=timeout)
        self.proc = None
        return code

    def kill(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self.proc = None

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


@pytest.fixture
def daemon_factory(tmp_path: Path) -> Iterator[Any]:
    started: list[Daemon] = []

    def make(**sections: dict[str, Any]) -> Daemon:
        port = free_port()
        data = tmp_path / f"data{len(started)}"
        config = write_config(tmp_path / f"indexer{len(started)}.toml", data, port, **sections)
        daemon = Daemon(config, tmp_path / f"daemon{len(started)}.log", port)
        started.append(daemon)
        return daemon

    yield make
    for daemon in started:
        if daemon.running:
            daemon.kill()


def run_feed(
    daemon: Daemon, jsonl: Path, *extra: str, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        indexer_command("feed", "--to", daemon.address, "--jsonl", str(jsonl), *extra),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def dump(daemon: Daemon, name: str) -> list[dict[str, Any]]:
    out = subprocess.run(
        indexer_command("dump", name, "--config", str(daemon.config)),
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return [json.loads(line) for line in out.splitlines()]


def write_jsonl(path: Path, documents: list[Document], append: bool = False) -> Path:
    """Documents as the feed's JSONL input; with `append`, added to the end of the file."""
    with open(path, "a" if append else "w") as f:
        for d in documents:
            item = (
                {"id": d.docid, "deleted": True}
                if d.body is None
                else {"id": d.docid, "doc": d.body}
            )
            f.write(json.dumps(item) + "\n")
    return path


def model(
    documents: list[Document], paths: list[str], where: str | Expr | None = None
) -> list[dict[str, Any]]:
    """The index an uninterrupted run must give, computed without the key encoding; with
    `where`, that of a partial index (only documents the condition is TRUE for)."""
    condition = parse_where(where) if isinstance(where, str) else where
    latest: dict[str, dict[str, Any] | None] = {}
    for d in documents:
        latest[d.docid] = d.body
    rows = []
    for docid, body in latest.items():
        if body is None or not matches(condition, body):
            continue
        values = [field_value(body, path) for path in paths]
        if values[0] is MISSING:
            continue
        rows.append((values, docid))

    def order(a: tuple[list[Any], str], b: tuple[list[Any], str]) -> int:
        for x, y in zip(a[0], b[0], strict=True):
            c = collate(x, y)
            if c:
                return c
        ka, kb = a[1].encode(), b[1].encode()
        return (ka > kb) - (ka < kb)

    rows.sort(key=functools.cmp_to_key(order))
    out = []
    for values, docid in rows:
        entry: dict[str, Any] = {"key": [None if v is MISSING else v for v in values], "id": docid}
        missing = [i for i, v in enumerate(values) if v is MISSING]
        if missing:
            entry["missing"] = missing
        out.append(entry)
    return out


# ------------------------------------------------------------------------------------------------
# The long-running router

WAIT_S = 60.0


class Router:
    """`indexer router` in a subprocess, its log in a file."""

    def __init__(self, log_path: Path, *args: str) -> None:
        self.log_path = log_path
        with open(log_path, "ab") as log:
            self.proc = subprocess.Popen(indexer_command("router", *args), stderr=log)

    def log(self) -> str:
        return self.log_path.read_text()

    def wait_log(self, pattern: str, count: int = 1, timeout: float = WAIT_S) -> list[str]:
        """The log's matches of `pattern` once there are `count` of them."""
        deadline = time.monotonic() + timeout
        while True:
            found = re.findall(pattern, self.log())
            if len(found) >= count:
                return found
            assert self.proc.poll() is None, f"the router exited:\n{self.log()}"
            assert time.monotonic() < deadline, f"no {pattern!r} x{count} in:\n{self.log()}"
            time.sleep(0.05)

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=30)


@pytest.fixture
def routers(tmp_path: Path) -> Iterator[Any]:
    started: list[Router] = []

    def make(*args: str) -> Router:
        router = Router(tmp_path / f"router{len(started)}.log", *args)
        started.append(router)
        return router

    yield make
    for router in started:
        if router.proc.poll() is None:
            router.proc.kill()
            router.proc.wait()


def scan(daemon: Daemon, name: str, consistency: str = "request_plus") -> list[dict[str, Any]]:
    answer = httpx.get(
        f"{daemon.url}/indexes/{name}/scan", params={"consistency": consistency}, timeout=60
    )
    assert answer.status_code == 200, answer.text
    return [json.loads(line) for line in answer.text.splitlines() if line]


def wait_equal(daemon: Daemon, documents: list[Document], timeout: float = WAIT_S) -> None:
    """Until every index of the daemon equals the model of `documents` (request_plus scans)."""
    want = {name: model(documents, paths) for name, paths in INDEXES.items()}
    deadline = time.monotonic() + timeout
    while True:
        got = {name: scan(daemon, name) for name in INDEXES}
        if got == want:
            return
        assert time.monotonic() < deadline, {
            name: (len(got[name]), len(want[name])) for name in INDEXES
        }
        time.sleep(0.2)


# ------------------------------------------------------------------------------------------------
# Fault and memory tests: the daemon's statistics and its RSS over time


def thread_nices(pid: int) -> dict[int, int]:
    """The nice value of every thread of a process (Linux), by thread id."""
    nices = {}
    # A listing stops early at a thread that is exiting, so take the union of a few.
    tids = set().union(*(os.listdir(f"/proc/{pid}/task") for _ in range(3)))
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                nices[int(tid)] = int(f.read().rsplit(")", 1)[1].split()[16])
        except OSError:
            continue  # the thread ended meanwhile
    return nices


def daemon_stats(daemon: Daemon) -> dict[str, Any]:
    """The daemon's `GET /stats`."""
    answer = httpx.get(f"{daemon.url}/stats", timeout=30)
    assert answer.status_code == 200, answer.text
    stats: dict[str, Any] = answer.json()
    return stats


class RssSampler:
    """Samples a process's RSS every `interval` seconds in a thread, while inside `with`."""

    def __init__(self, pid: int, interval: float = 0.05) -> None:
        import psutil

        self.process = psutil.Process(pid)
        self.interval = interval
        self.samples: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        import psutil

        while not self._stop.is_set():
            try:
                self.samples.append(int(self.process.memory_info().rss))
            except psutil.NoSuchProcess:
                return
            self._stop.wait(self.interval)

    @property
    def peak(self) -> int:
        return max(self.samples, default=0)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
