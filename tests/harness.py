"""Real processes on 127.0.0.1, for the end-to-end tests and the benchmarks alike.

The daemon and the router run as subprocesses with their logs in files; ports are chosen below
the kernel's ephemeral range; the model computes what an index must hold without the key
encoding. A failure raises AssertionError with the tail of the process's log, so pytest shows
it as a test failure and a benchmark stops with it.
"""

from __future__ import annotations

import functools
import glob
import json
import os
import pwd
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
from collections.abc import Iterable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import psutil

from indexer.keys import MISSING, collate, field_value
from indexer.router.documents import Document
from indexer.where import Expr, matches, parse_where

HOST = "127.0.0.1"
WAIT_S = 60.0
POLL_S = 0.02
INDEXES = {"by_city": ["address.city", "age"], "by_age": ["age"]}  # write_config's indexes
HTTP_LINE = re.compile(r"HTTP API on https?://[^\s:]+:(\d+)")
FEED_LINE = re.compile(r"listening for router feeds on [^\s]+:(\d+);")
LOG_TIME = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) .*$", re.MULTILINE)
TAIL = 4000  # characters of a log quoted in a failure


# ------------------------------------------------------------------------------------------------
# HTTP


@functools.cache
def http() -> httpx.Client:
    """One HTTP client for the whole test process. A client builds an SSL context and loads the
    CA bundle when it is made (0.1-0.3 s of CPU), which every `httpx.get` pays again; a test
    polling /stats that way spent most of its CPU there. No kept-alive connections: a daemon
    killed and started again on its port must not meet a connection of its last life."""
    return httpx.Client(limits=httpx.Limits(max_keepalive_connections=0))


# ------------------------------------------------------------------------------------------------
# Ports and commands


def _ephemeral_ports() -> range:
    """The range the kernel picks outgoing connections' ports from (Linux; elsewhere a guess)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return range(int(low), int(high) + 1)
    except (OSError, ValueError):
        return range(32768, 61000)


# Ports this process has handed out: a daemon binds its port some time after it is chosen.
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
                s.bind((HOST, port))
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


def write_cluster_map(path: Path, nodes: Iterable[tuple[str, int, int, str]]) -> Path:
    """A cluster map of nodes on 127.0.0.1: (name, feed port, HTTP port, vbuckets), the
    vbuckets a range such as "0-511" or "all"."""
    lines = ["num_vbuckets = 1024"]
    for name, feed_port, http_port, vbuckets in nodes:
        lines += [
            f"[nodes.{name}]",
            f'feed = "{HOST}:{feed_port}"',
            f'http = "{HOST}:{http_port}"',
            f"vbuckets = {json.dumps(vbuckets if vbuckets == 'all' else [vbuckets])}",
        ]
    path.write_text("\n".join(lines) + "\n")
    return path


def read_log(path: Path) -> str:
    try:
        return path.read_text()
    except FileNotFoundError:
        return ""


def wait_for_line(
    path: Path,
    pattern: str,
    proc: subprocess.Popen[bytes],
    timeout: float = WAIT_S,
    count: int = 1,
) -> str:
    """Group 1 (or the whole match) of the `count`-th match of `pattern` in a process's log."""
    deadline = time.monotonic() + timeout
    while True:
        text = read_log(path)
        found = re.findall(pattern, text)
        if len(found) >= count:
            return str(found[count - 1])
        if proc.poll() is not None:
            raise AssertionError(
                f"{path.name}: the process exited ({proc.returncode}):\n{text[-TAIL:]}"
            )
        if time.monotonic() > deadline:
            raise AssertionError(f"{path.name}: no {pattern!r} x{count} in:\n{text[-TAIL:]}")
        time.sleep(POLL_S)


def stop_process(
    proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM, timeout: float = 30
) -> int:
    """Signal it and wait; kill it if it does not exit within `timeout`. Its exit code."""
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
    return proc.wait()


def cpu_split(process: psutil.Process) -> tuple[float, float]:
    """CPU seconds so far: the main (trio) thread, and every other thread together."""
    total = process.cpu_times()
    main = sum(t.user_time + t.system_time for t in process.threads() if t.id == process.pid)
    return main, total.user + total.system - main


def cpu_by_thread_kind(process: psutil.Process) -> dict[str, float]:
    """CPU seconds so far by kind of thread: "main" (the trio thread), "trio" (trio's worker
    threads: storage writes and syncs) and "native" (threads Python did not start, LevelDB's
    compaction thread above all, which a Python profiler does not see). Linux only ({} else)."""
    kinds = {"main": 0.0, "trio": 0.0, "native": 0.0}
    try:
        threads = process.threads()
    except psutil.Error:
        return {}
    for thread in threads:
        try:
            name = Path(f"/proc/{process.pid}/task/{thread.id}/comm").read_text().strip()
        except OSError:
            return {}
        kind = (
            "main" if thread.id == process.pid else "trio" if name.startswith("Trio") else "native"
        )
        kinds[kind] += thread.user_time + thread.system_time
    return kinds


def tree_cpu(process: psutil.Process) -> tuple[float, float]:
    """CPU seconds (user + system) of the process itself, and of its children: those it has
    reaped and its live descendants."""
    own = process.cpu_times()
    children = own.children_user + own.children_system
    for child in process.children(recursive=True):
        try:
            times = child.cpu_times()
        except psutil.Error:
            continue
        children += times.user + times.system
    return own.user + own.system, children


# ------------------------------------------------------------------------------------------------
# The daemon


class Daemon:
    """`indexer serve --config CONFIG` in a subprocess, its log in a file.

    The ports are read from the config, and from the log once started, so a config may give
    port 0 and let the daemon choose.
    """

    def __init__(
        self, config: Path, log: Path, port: int | None = None, args: Sequence[str] = ()
    ) -> None:
        self.config = config
        self.log_path = log
        server = tomllib.loads(config.read_text()).get("server", {})
        self.data_dir = Path(server.get("data_dir", "data"))
        self.port = int(server.get("feed_port", 0)) if port is None else port
        self.http_port = int(server.get("http_port", 0))
        self.proc: subprocess.Popen[bytes] | None = None
        self.args = list(args)  # more `indexer serve` arguments (a cluster map's --node, say)
        self.env: dict[str, str] | None = None  # its environment (a power-loss layer's, say)

    @classmethod
    def in_workdir(cls, workdir: Path, extra_config: str = "", args: Sequence[str] = ()) -> Daemon:
        """A daemon on ports of its choosing, its data, config and log in `workdir`."""
        workdir.mkdir(parents=True, exist_ok=True)
        config = workdir / "indexer.toml"
        config.write_text(
            "[server]\n"
            f'data_dir = "{workdir / "data"}"\n'
            f'host = "{HOST}"\n'
            "feed_port = 0\n"
            "http_port = 0\n"
            'log_level = "info"\n' + extra_config
        )
        return cls(config, workdir / "daemon.log", args=args)

    @property
    def address(self) -> str:
        return f"{HOST}:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.http_port}"

    def start(self, timeout: float = WAIT_S) -> Daemon:
        """Start it (again) and wait for this start's "listening" line."""
        seen = self.log().count("listening for router feeds")
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                indexer_command("serve", "--config", str(self.config), *self.args),
                stdout=subprocess.DEVNULL,  # it logs to stderr; a caller's pipe is not held open
                stderr=log,
                stdin=subprocess.DEVNULL,
                env=self.env,
            )
        deadline = time.monotonic() + timeout
        while (text := self.log()).count("listening for router feeds") <= seen:
            if self.proc.poll() is not None:
                raise AssertionError(f"daemon exited at start:\n{text[-TAIL:]}")
            if time.monotonic() > deadline:
                raise AssertionError(f"daemon did not listen within {timeout} s:\n{text[-TAIL:]}")
            time.sleep(0.05)
        # The ports it bound (a config's port 0 lets it choose); else those configured.
        if found := HTTP_LINE.findall(text):
            self.http_port = int(found[-1])
        if found := FEED_LINE.findall(text):
            self.port = int(found[-1])
        return self

    def log(self) -> str:
        return read_log(self.log_path)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = WAIT_S) -> int:
        """Signal it and wait for it to exit; its exit code."""
        assert self.proc is not None
        self.proc.send_signal(sig)
        code = self.proc.wait(timeout=timeout)
        self.proc = None
        return code

    def stop_cleanly(self, timeout: float = 120) -> int:
        """SIGINT; it must drain, persist, say "stopped cleanly" and exit 0."""
        assert self.proc is not None
        seen = self.log().count("stopped cleanly")
        try:
            code = self.stop(signal.SIGINT, timeout)
        finally:
            self.kill()
        if code != 0 or self.log().count("stopped cleanly") <= seen:
            raise AssertionError(f"the daemon exited with {code}:\n{self.log()[-TAIL:]}")
        return code

    def kill(self) -> None:
        """SIGKILL, if it runs."""
        if self.proc is not None:
            if self.proc.poll() is None:
                os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            self.proc = None

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def check_alive(self) -> None:
        if not self.running:
            raise AssertionError(f"the daemon exited:\n{self.log()[-TAIL:]}")

    def cpu(self) -> tuple[float, float]:
        """CPU seconds so far: the main (trio) thread, and every other thread together."""
        assert self.proc is not None
        return cpu_split(psutil.Process(self.proc.pid))

    def stats(self, client: httpx.Client | None = None) -> dict[str, Any]:
        """Its `GET /stats`."""
        answer = (client or http()).get(f"{self.url}/stats", timeout=30)
        assert answer.status_code == 200, answer.text
        stats: dict[str, Any] = answer.json()
        return stats

    def readable(self, client: httpx.Client | None = None) -> int:
        """The seqno sum of its readable snapshot."""
        value: int = self.stats(client)["stable"]["seqno_sum"]
        return value

    def count(
        self, index: str, client: httpx.Client | None = None, consistency: str = "request_plus"
    ) -> int:
        """The entries of an index at `consistency`."""
        answer = (client or http()).get(
            f"{self.url}/indexes/{index}/count", params={"consistency": consistency}, timeout=60
        )
        assert answer.status_code == 200, f"count of {index}: {answer.status_code} {answer.text}"
        value: int = answer.json()["count"]
        return value


# ------------------------------------------------------------------------------------------------
# The router


class Router:
    """`indexer router ARGS` in a subprocess, its log in a file."""

    def __init__(self, log_path: Path, *args: str, env: dict[str, str] | None = None) -> None:
        self.log_path = log_path
        self.started = time.time()
        with open(log_path, "ab") as log:
            self.proc = subprocess.Popen(
                indexer_command("router", *args),
                stdout=subprocess.DEVNULL,
                stderr=log,
                stdin=subprocess.DEVNULL,
                env=env,
            )
        self.process = psutil.Process(self.proc.pid)
        self.url = ""  # its API, once wait_url() has read it from the log

    def log(self) -> str:
        return read_log(self.log_path)

    def wait_log(self, pattern: str, count: int = 1, timeout: float = WAIT_S) -> list[str]:
        """The log's matches of `pattern` once there are `count` of them."""
        wait_for_line(self.log_path, pattern, self.proc, timeout, count)
        return re.findall(pattern, self.log())

    def wait_url(self, timeout: float = WAIT_S) -> str:
        """Its API's URL, from the log (`--http HOST:0` chooses a port)."""
        self.url = wait_for_line(self.log_path, r"router API on (http://\S+)", self.proc, timeout)
        return self.url

    def logged_at(self, text: str) -> float | None:
        """Wall time of the first log line containing `text` (millisecond precision)."""
        for found in LOG_TIME.finditer(self.log()):
            if text in found.group(0):
                return datetime.strptime(found.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
        return None

    def stats(self, client: httpx.Client | None = None) -> dict[str, Any]:
        answer = (client or http()).get(f"{self.url}/stats", timeout=30)
        assert answer.status_code == 200, answer.text
        stats: dict[str, Any] = answer.json()
        return stats

    def appended(self, client: httpx.Client | None = None) -> int:
        """Seqnos it has appended to its source log, summed over the vbuckets."""
        value: int = self.stats(client)["source"]["high_seqno_sum"]
        return value

    def check_alive(self) -> None:
        if self.proc.poll() is not None:
            raise AssertionError(
                f"the router exited ({self.proc.returncode}):\n{self.log()[-TAIL:]}"
            )

    def cpu(self) -> float:
        total = self.process.cpu_times()
        return float(total.user + total.system)

    def stop(self, sig: int = signal.SIGTERM) -> int:
        """Signal it and wait (a kill after 30 s); its exit code."""
        return stop_process(self.proc, sig)

    def stop_cleanly(self) -> int:
        """SIGTERM; it must exit 0."""
        code = self.stop()
        if code != 0:
            raise AssertionError(f"the router exited with {code}:\n{self.log()[-TAIL:]}")
        return code

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


# ------------------------------------------------------------------------------------------------
# Input and the model


def jsonl_lines(documents: Iterable[Document]) -> list[str]:
    """The router's JSONL input: {"id":..,"doc":{..}} or {"id":..,"deleted":true}, one a line."""
    return [
        json.dumps(
            {"id": d.docid, "deleted": True} if d.body is None else {"id": d.docid, "doc": d.body}
        )
        + "\n"
        for d in documents
    ]


def write_jsonl(path: Path, documents: Iterable[Document], append: bool = False) -> Path:
    """Documents as the feed's JSONL input; with `append`, added to the end of the file."""
    with open(path, "a" if append else "w") as f:
        f.write("".join(jsonl_lines(documents)))  # whole lines in one write, for followers
    return path


def latest(documents: Iterable[Document]) -> dict[str, dict[str, Any] | None]:
    """The last version of each document id: its body, or None when deleted."""
    return {d.docid: d.body for d in documents}


def model(
    documents: Iterable[Document], paths: list[str], where: str | Expr | None = None
) -> list[dict[str, Any]]:
    """The index an uninterrupted run must give, computed without the key encoding; with
    `where`, that of a partial index (only documents the condition is TRUE for)."""
    condition = parse_where(where) if isinstance(where, str) else where
    rows = []
    for docid, body in latest(documents).items():
        if body is None or not matches(condition, body):
            continue
        values = [field_value(body, path) for path in paths]
        if values[0] is MISSING:
            continue
        rows.append((values, docid))
    return ordered_entries(rows)


def ordered_entries(
    rows: list[tuple[list[Any], str]], desc: Sequence[bool] = ()
) -> list[dict[str, Any]]:
    """(key values, docid) pairs as a scan answers them: in index order (`desc[i]`: key
    position i descending), MISSING as null with its positions listed in "missing"."""

    def order(a: tuple[list[Any], str], b: tuple[list[Any], str]) -> int:
        for i, (x, y) in enumerate(zip(a[0], b[0], strict=True)):
            c = collate(x, y)
            if c:
                return -c if i < len(desc) and desc[i] else c
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
# Memory


class RssSampler:
    """A process's RSS every `interval` seconds in a thread, while inside `with`; its peak."""

    def __init__(self, pid: int, interval: float = 0.05) -> None:
        self.process = psutil.Process(pid)
        self.interval = interval
        self.samples: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.samples.append(int(self.process.memory_info().rss))
            except psutil.Error:
                return
            self._stop.wait(self.interval)

    @property
    def peak(self) -> int:
        return max(self.samples, default=0)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> int:
        """Stop sampling; the peak."""
        self._stop.set()
        self._thread.join()
        return self.peak

    def __enter__(self) -> RssSampler:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


# ------------------------------------------------------------------------------------------------
# PostgreSQL


def find_postgres() -> Path | None:
    """The directory of the newest initdb and postgres: /usr/lib/postgresql/*/bin, else PATH."""

    def version(path: str) -> tuple[int, ...]:
        digits = re.findall(r"\d+", Path(path).parent.name)
        return tuple(int(d) for d in digits)

    candidates = sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=version, reverse=True)
    initdb = shutil.which("initdb")
    if initdb:
        candidates.append(str(Path(initdb).resolve().parent))
    for directory in candidates:
        if all((Path(directory) / name).is_file() for name in ("initdb", "postgres")):
            return Path(directory)
    return None


class Postgres:
    """initdb and postgres in a temporary directory, on a free port and a socket there."""

    def __init__(
        self, bindir: Path, keep: bool = False, settings: dict[str, str] | None = None
    ) -> None:
        self.bindir = bindir
        self.keep = keep
        self.settings = settings or {}  # -c NAME=VALUE at start (wal_level=logical, say)
        self.user: str | None = None
        owner = None
        if os.geteuid() == 0:  # initdb and postgres refuse to run as root
            self.user = "postgres"
            owner = pwd.getpwnam(self.user)  # KeyError: no such user
        self.dir = Path(tempfile.mkdtemp(prefix="pipeline-pg-"))
        if owner is not None:
            os.chown(self.dir, owner.pw_uid, owner.pw_gid)
        self.data = self.dir / "data"
        self.log_path = self.dir / "postgres.log"
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        psql = bindir / "psql"
        self.psql = str(psql) if psql.is_file() else shutil.which("psql")

    def run(self, *command: str) -> str:
        """A server binary, as the server's user; its output."""
        done = subprocess.run(
            [str(self.bindir / command[0]), *command[1:]],
            capture_output=True,
            text=True,
            user=self.user,
            cwd=self.dir,
            stdin=subprocess.DEVNULL,
        )
        if done.returncode != 0:
            raise RuntimeError(f"{command[0]} failed ({done.returncode}):\n{done.stderr[-3000:]}")
        return done.stdout

    def start(self, timeout: float = 60) -> None:
        """initdb (trust auth, C locale, UTF-8), then postgres; wait until it accepts."""
        self.run(
            "initdb", "-D", str(self.data), "-U", "postgres", "-A", "trust", "-E", "UTF8",
            "--locale", "C",
        )  # fmt: skip
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [
                    str(self.bindir / "postgres"),
                    "-D",
                    str(self.data),
                    "-p",
                    str(self.port),
                    "-k",
                    str(self.dir),
                    "-c",
                    f"listen_addresses={HOST}",
                    *(f"-c{name}={value}" for name, value in self.settings.items()),
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                user=self.user,
                cwd=self.dir,
            )
        deadline = time.monotonic() + timeout
        while "ready to accept connections" not in self.log():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"postgres did not start:\n{self.log()[-3000:]}")
            time.sleep(0.05)

    def log(self) -> str:
        return self.log_path.read_text() if self.log_path.exists() else ""

    def psql_command(self) -> list[str]:
        """psql on the server's socket, stopping at the first error, quiet."""
        if self.psql is None:
            raise RuntimeError("no psql on the machine")
        return [
            self.psql, "-X", "-q", "-v", "ON_ERROR_STOP=1", "-h", str(self.dir),
            "-p", str(self.port), "-U", "postgres", "-d", "postgres",
        ]  # fmt: skip

    def query(self, sql: str) -> str:
        """One statement through psql, its unaligned output."""
        done = subprocess.run(
            [*self.psql_command(), "-A", "-t", "-c", sql], capture_output=True, text=True
        )
        if done.returncode != 0:
            raise RuntimeError(f"psql failed: {done.stderr[-3000:]}")
        return done.stdout.strip()

    def server_cpu(self) -> float:
        """CPU seconds of postgres and its processes so far."""
        assert self.proc is not None
        own, descendants = tree_cpu(psutil.Process(self.proc.pid))
        return own + descendants

    def stop(self) -> None:
        """Fast shutdown (SIGINT); remove the directory unless kept."""
        if self.proc is not None:
            stop_process(self.proc, signal.SIGINT, 60)
        if self.keep:
            print(f"kept: {self.dir}", file=sys.stderr)
        else:
            shutil.rmtree(self.dir, ignore_errors=True)


class Etcd:
    """A one-member etcd (Debian's etcd-server) in a temporary directory, on free ports."""

    def __init__(self) -> None:
        self.binary = shutil.which("etcd")
        if self.binary is None:
            raise RuntimeError("etcd is not installed (make test installs etcd-server)")
        self.dir = Path(tempfile.mkdtemp(prefix="pipeline-etcd-"))
        self.port = free_port()
        self.peer_port = free_port()
        self.log_path = self.dir / "etcd.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"{HOST}:{self.port}"

    def url(self, prefix: str) -> str:
        """The cluster address `--cluster` takes, for keys under `prefix`."""
        return f"etcd://{self.endpoint}/{prefix}"

    def start(self, timeout: float = 30) -> Etcd:
        client = f"http://{self.endpoint}"
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [
                    str(self.binary),
                    "--data-dir", str(self.dir / "data"),
                    "--listen-client-urls", client,
                    "--advertise-client-urls", client,
                    "--listen-peer-urls", f"http://{HOST}:{self.peer_port}",
                    "--initial-advertise-peer-urls", f"http://{HOST}:{self.peer_port}",
                    "--initial-cluster", f"default=http://{HOST}:{self.peer_port}",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )  # fmt: skip
        deadline = time.monotonic() + timeout
        while True:
            try:
                if httpx.post(f"{client}/v3/kv/range", json={"key": "AA=="}).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"etcd did not start:\n{self.log_path.read_text()[-3000:]}")
            time.sleep(0.05)

    def kill(self) -> None:
        """SIGKILL, keeping its data: `start` brings it back on the same ports."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc, signal.SIGTERM, 30)
        shutil.rmtree(self.dir, ignore_errors=True)
