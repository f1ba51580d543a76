"""Initial builds: an index created over data already streamed gets its own build stream from
the router, while the maintenance stream keeps the other indexes current, and joins it once
caught up. Real daemon and router processes."""

from __future__ import annotations

import re
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from indexer.router import Workload, generate
from indexer.router.documents import Document
from tests.e2e.conftest import (
    WAIT_S,
    Daemon,
    http,
    indexer_command,
    model,
    scan,
    wait_equal,
    write_jsonl,
)

pytestmark = pytest.mark.e2e

ZIP = ["address.zip", "name"]
SOAK = pytest.mark.soak  # the first, larger sizes of these cases: `pytest -m soak`


def index_states(daemon: Daemon) -> dict[str, dict[str, Any]]:
    answer = http().get(f"{daemon.url}/indexes", timeout=10)
    assert answer.status_code == 200, answer.text
    return {i["name"]: i for i in answer.json()["indexes"]}


def kill_once_built_some(daemon: Daemon, name: str) -> None:
    """Kill the daemon as soon as the build of `name` has written something (or finished)."""
    deadline = time.monotonic() + WAIT_S
    while True:
        entry = index_states(daemon)[name]
        if entry["state"] == "active" or entry["build"]["items"] > 0:
            break
        assert time.monotonic() < deadline, entry
        time.sleep(0.01)
    daemon.kill()


def wait_active(daemon: Daemon, name: str, timeout: float = WAIT_S) -> list[str]:
    """Until the index is active; the states seen on the way."""
    seen: list[str] = []
    deadline = time.monotonic() + timeout
    while True:
        state = index_states(daemon)[name]["state"]
        if not seen or seen[-1] != state:
            seen.append(state)
        if state == "active":
            return seen
        assert time.monotonic() < deadline, (seen, index_states(daemon)[name])
        time.sleep(0.05)


FEED_LIMIT_S = 5.0
FEED_BATCH = 200


def keep_appending(
    jsonl: Path,
    documents: list[Document],
    stop: threading.Event,
    limit_s: float = FEED_LIMIT_S,
    batch: int = FEED_BATCH,
) -> None:
    """`batch` documents appended to the followed file every 0.1 s (about 2,000 a second), for
    at most `limit_s`: a build must catch up with a history that grows as it reads it, and on
    a loaded machine a feed that never stops can outrun the build for good (as it would in
    production: the build then waits for the feed to slow down)."""
    seed = 300
    until = time.monotonic() + limit_s
    while not stop.is_set() and time.monotonic() < until:
        more = list(generate(Workload(batch, 5_000, 0.1, seed)))
        write_jsonl(jsonl, more, append=True)
        documents += more
        seed += 1
        time.sleep(0.1)


def loaded(
    daemon_factory: Any, routers: Any, tmp_path: Path, workload: Workload
) -> tuple[Daemon, list[Document], Path, Any]:
    """A daemon holding `workload`, streamed by a router that follows its JSONL file."""
    daemon = daemon_factory().start()
    documents = list(generate(workload))
    jsonl = write_jsonl(tmp_path / "in.jsonl", documents)
    router = routers(
        "--state", str(tmp_path / "state"), "--jsonl", str(jsonl), "--follow",
        "--to", daemon.address,
    )  # fmt: skip
    wait_equal(daemon, documents)
    return daemon, documents, jsonl, router


@pytest.mark.parametrize(
    "count, keys, batch, feed_s",
    [
        pytest.param(8_000, 3_000, FEED_BATCH, FEED_LIMIT_S),
        pytest.param(30_000, 5_000, 1_000, 20.0, marks=SOAK),
    ],
)
def test_an_index_over_existing_data_is_built_while_the_feed_goes_on(
    daemon_factory: Any,
    routers: Any,
    tmp_path: Path,
    count: int,
    keys: int,
    batch: int,
    feed_s: float,
) -> None:
    daemon, documents, jsonl, router = loaded(
        daemon_factory, routers, tmp_path, Workload(count, keys, 0.1, 201)
    )
    stop = threading.Event()
    appender = threading.Thread(
        target=keep_appending,
        args=(jsonl, documents, stop),
        kwargs={"batch": batch, "limit_s": feed_s},
    )
    appender.start()
    try:
        created = http().post(
            f"{daemon.url}/indexes", json={"name": "by_zip", "keys": ZIP}, timeout=30
        )
        assert created.status_code == 201, created.text
        assert created.json()["state"] == "building"
        assert created.json()["build"]["percent"] < 100
        # Before it is active, only consistency=any reads it.
        early = http().get(
            f"{daemon.url}/indexes/by_zip/scan", params={"consistency": "request_plus"}
        )
        if early.status_code != 200:
            assert early.status_code == 409 and "only consistency=any" in early.json()["error"]
        assert http().get(f"{daemon.url}/indexes/by_zip/count").status_code == 200
        seen = wait_active(daemon, "by_zip")
    finally:
        stop.set()
        appender.join()
    assert seen[-1] == "active"
    # The feed goes on after the merge too (the appender may have stopped at its limit before).
    more = list(generate(Workload(batch, 5_000, 0.1, 299)))
    write_jsonl(jsonl, more, append=True)
    documents += more
    wait_equal(daemon, documents)
    assert scan(daemon, "by_zip") == model(documents, ZIP)
    stats = http().get(f"{daemon.url}/stats").json()
    assert stats["builds"] == {}
    assert stats["slab"]["chunks_in_use"] == 0  # the build's queued records were all freed
    assert "index by_zip built" in daemon.log()
    router.wait_log(r"build:by_zip: the build stream is done")
    # The create made the router handshake again, to carry by_zip's key; the merge did not.
    assert len(re.findall(r"disconnected: .*INDEXES_CHANGED", router.log())) == 1, router.log()
    assert "no router reconnected" in daemon.log()
    assert router.stop() == 0
    assert daemon.stop() == 0
    # After a restart the built index is an ordinary active one.
    daemon.start()
    assert index_states(daemon)["by_zip"]["state"] == "active"
    assert scan(daemon, "by_zip") == model(documents, ZIP)
    assert daemon.stop() == 0


@pytest.mark.parametrize(
    "count, keys", [pytest.param(16_000, 6_000), pytest.param(60_000, 20_000, marks=SOAK)]
)
def test_a_build_resumes_after_the_daemon_is_killed_and_can_be_dropped(
    daemon_factory: Any, routers: Any, tmp_path: Path, count: int, keys: int
) -> None:
    daemon, documents, jsonl, router = loaded(
        daemon_factory, routers, tmp_path, Workload(count, keys, 0.1, 211)
    )
    created = http().post(f"{daemon.url}/indexes", json={"name": "by_zip", "keys": ZIP})
    assert created.status_code == 201, created.text
    kill_once_built_some(daemon, "by_zip")
    more = list(generate(Workload(count // 30, keys, 0.1, 212)))
    write_jsonl(jsonl, more, append=True)
    documents += more
    daemon.start()
    wait_active(daemon, "by_zip")
    wait_equal(daemon, documents)
    assert scan(daemon, "by_zip") == model(documents, ZIP)

    # A second index, dropped during its build: its stream ends and nothing of it stays.
    created = http().post(f"{daemon.url}/indexes", json={"name": "by_name", "keys": ["name"]})
    assert created.status_code == 201 and created.json()["state"] == "building"
    router.wait_log(r"build:by_name: connected")
    dropped = http().delete(f"{daemon.url}/indexes/by_name")
    assert dropped.status_code == 204, dropped.text
    assert "by_name" not in index_states(daemon)
    assert http().get(f"{daemon.url}/indexes/by_name/count").status_code == 404
    router.wait_log(r"build:by_name: the build stream is done")
    assert http().get(f"{daemon.url}/stats").json()["builds"] == {}
    wait_equal(daemon, documents)
    assert http().get(f"{daemon.url}/stats").json()["slab"]["chunks_in_use"] == 0

    # The CLI waits for a build with a progress bar.
    cli = subprocess.run(
        indexer_command(
            "create-index",
            "by_name",
            "--keys",
            "name",
            "--where",
            "age >= 30",
            "--wait",
            "--url",
            daemon.url,
        ),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert cli.returncode == 0, cli.stderr
    assert "created by_name(name) WHERE age >= 30: building" in cli.stdout
    assert "by_name: active" in cli.stdout
    assert "building by_name" in cli.stderr  # the bar's label
    assert scan(daemon, "by_name") == model(documents, ["name"], "age >= 30")
    assert router.stop() == 0
    assert daemon.stop() == 0
