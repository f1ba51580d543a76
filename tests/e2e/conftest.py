"""Real processes on 127.0.0.1: the daemon and the router feed as subprocesses.

The process harness itself is tests/harness.py, which the benchmarks share; this module adds
the pytest fixtures and the tests' HTTP and CLI helpers.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from indexer.router.documents import Document
from tests.harness import (
    INDEXES,
    WAIT_S,
    Daemon,
    Router,
    RssSampler,
    free_port,
    http,
    indexer_command,
    model,
    write_config,
    write_jsonl,
)
from tests.powercut import build_library

__all__ = [
    "INDEXES",
    "WAIT_S",
    "Daemon",
    "Router",
    "RssSampler",
    "free_port",
    "http",
    "indexer_command",
    "model",
    "write_config",
    "write_jsonl",
]

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="session")
def library(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The power-loss layer's recorder (tests/powercut), compiled once for the run."""
    return build_library(tmp_path_factory.mktemp("powercut"))


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


# ------------------------------------------------------------------------------------------------
# The long-running router


@pytest.fixture
def routers(tmp_path: Path) -> Iterator[Any]:
    started: list[Router] = []

    def make(*args: str) -> Router:
        router = Router(tmp_path / f"router{len(started)}.log", *args)
        started.append(router)
        return router

    yield make
    for router in started:
        router.kill()


def scan(daemon: Daemon, name: str, consistency: str = "request_plus") -> list[dict[str, Any]]:
    answer = http().get(
        f"{daemon.url}/indexes/{name}/scan", params={"consistency": consistency}, timeout=60
    )
    assert answer.status_code == 200, answer.text
    return [json.loads(line) for line in answer.text.splitlines() if line]


def wait_active(daemon: Daemon, name: str, timeout: float = WAIT_S) -> None:
    """Until index `name` has finished its build (a request_plus scan of a building index
    answers 409 by design)."""
    deadline = time.monotonic() + timeout
    while True:
        answer = http().get(f"{daemon.url}/indexes", timeout=10)
        assert answer.status_code == 200, answer.text
        states = {i["name"]: i["state"] for i in answer.json()["indexes"]}
        if states.get(name) == "active":
            return
        assert time.monotonic() < deadline, states
        time.sleep(0.05)


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
# Fault tests


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
