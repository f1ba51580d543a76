"""Deferred builds (GSI's `defer_build` and `BUILD INDEX`): indexes created deferred hold nothing
and no stream carries them until one request builds them all, on one build stream, in one pass
over the router's history. Real daemon and router processes."""

from __future__ import annotations

import re
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from indexer.router import Workload, generate
from tests.e2e.conftest import (
    WAIT_S,
    Daemon,
    http,
    indexer_command,
    model,
    run_feed,
    scan,
    wait_equal,
    write_jsonl,
)
from tests.e2e.test_index_build import (
    FEED_BATCH,
    FEED_LIMIT_S,
    SOAK,
    index_states,
    keep_appending,
    kill_once_built_some,
    loaded,
    wait_active,
)

pytestmark = pytest.mark.e2e

# Three deferred indexes: name -> (keys, where).
DEFERRED = {
    "d_zip": (["address.zip", "name"], None),
    "d_name": (["name"], None),
    "d_adults": (["age", "address.city"], "age >= 30"),
}


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(indexer_command(*args), capture_output=True, text=True, timeout=300)


def build_streams(router_log: str) -> list[str]:
    """The build streams the router connected, by name (HOST:PORT/build:NAME), each once."""
    return list(dict.fromkeys(re.findall(r"/build:(\S+): connected", router_log)))


def create_deferred(daemon: Daemon) -> None:
    """The three indexes, in this order: two with `create-index --defer`, one with POST
    /indexes. A build takes its indexes in the order they were created."""
    for name, (keys, where) in DEFERRED.items():
        if name == "d_name":
            made_http = http().post(
                f"{daemon.url}/indexes", json={"name": name, "keys": keys, "defer_build": True}
            )
            assert made_http.status_code == 201, made_http.text
            assert made_http.json()["state"] == "deferred"
            continue
        extra = [] if where is None else ["--where", where]
        made = cli("create-index", name, "--keys", ",".join(keys), *extra, "--defer",
                   "--url", daemon.url)  # fmt: skip
        assert made.returncode == 0, made.stderr
        assert made.stdout.strip().endswith(": deferred"), made.stdout


def assert_deferred(daemon: Daemon, name: str) -> None:
    """Deferred, empty, and unreadable with one line saying how to build it."""
    entry = http().get(f"{daemon.url}/indexes/{name}", timeout=10)
    assert entry.status_code == 200, entry.text
    assert entry.json()["state"] == "deferred" and entry.json()["entries"] == 0
    for action in ("scan", "count"):
        read = http().get(f"{daemon.url}/indexes/{name}/{action}", timeout=10)
        assert read.status_code == 409, read.text
        error = read.json()["error"]
        assert "deferred" in error and f"indexer build-index {name}" in error, error
        assert "\n" not in error


@pytest.mark.parametrize(
    "count, keys, batch, feed_s",
    [
        pytest.param(8_000, 3_000, FEED_BATCH, FEED_LIMIT_S),
        pytest.param(30_000, 5_000, 1_000, 20.0, marks=SOAK),
    ],
)
def test_deferred_indexes_are_built_together_on_one_build_stream(
    daemon_factory: Any,
    routers: Any,
    tmp_path: Path,
    count: int,
    keys: int,
    batch: int,
    feed_s: float,
) -> None:
    daemon, documents, jsonl, router = loaded(
        daemon_factory, routers, tmp_path, Workload(count, keys, 0.1, 221)
    )
    create_deferred(daemon)
    for name in DEFERRED:
        assert_deferred(daemon, name)
    listed = cli("list-indexes", "--url", daemon.url)
    assert listed.returncode == 0, listed.stderr
    assert "d_zip\taddress.zip,name\tdeferred\t0" in listed.stdout
    # Deferred indexes change nothing of the streams: no router handshook again.
    time.sleep(0.5)
    assert "INDEXES_CHANGED" not in router.log()
    assert build_streams(router.log()) == []

    stop = threading.Event()
    appender = threading.Thread(
        target=keep_appending,
        args=(jsonl, documents, stop),
        kwargs={"batch": batch, "limit_s": feed_s},
    )
    appender.start()
    try:
        built = cli("build-index", *DEFERRED, "--wait", "--url", daemon.url)
    finally:
        stop.set()
        appender.join()
    assert built.returncode == 0, built.stderr
    assert "d_zip: building" in built.stdout and "d_adults: building" in built.stdout
    for name in DEFERRED:
        assert f"{name}: active" in built.stdout
    assert "building d_zip" in built.stderr  # the progress bar's label

    wait_equal(daemon, documents)
    for name, (keys, where) in DEFERRED.items():
        assert scan(daemon, name) == model(documents, keys, where), name
    # ONE build stream carried the three indexes' keys, in one pass over the history.
    assert build_streams(router.log()) == ["d_zip,d_name,d_adults"], router.log()
    assert len(re.findall(r"opened the build stream of d_zip,d_name,d_adults", daemon.log())) == 1
    assert "indexes d_zip, d_name, d_adults built" in daemon.log()
    router.wait_log(r"build:d_zip,d_name,d_adults: the build stream is done")
    # The build made the router handshake again once (to carry the keys); the merge did not.
    assert len(re.findall(r"disconnected: .*INDEXES_CHANGED", router.log())) == 1, router.log()
    stats = http().get(f"{daemon.url}/stats").json()
    assert stats["builds"] == {}
    assert stats["slab"]["chunks_in_use"] == 0
    states = index_states(daemon)
    assert {states[name]["state"] for name in DEFERRED} == {"active"}
    # Built again: it is not deferred any more.
    again = http().post(f"{daemon.url}/indexes/_build", json={"indexes": ["d_name"]})
    assert again.status_code == 409 and "not deferred" in again.json()["error"], again.text
    assert router.stop() == 0
    assert daemon.stop() == 0
    daemon.start()
    for name, (keys, where) in DEFERRED.items():
        assert index_states(daemon)[name]["state"] == "active"
        assert scan(daemon, name) == model(documents, keys, where), name
    assert daemon.stop() == 0


@pytest.mark.parametrize(
    "count, keys", [pytest.param(16_000, 6_000), pytest.param(60_000, 20_000, marks=SOAK)]
)
def test_a_build_of_several_indexes_resumes_after_a_kill_and_loses_a_dropped_one(
    daemon_factory: Any, routers: Any, tmp_path: Path, count: int, keys: int
) -> None:
    daemon, documents, jsonl, router = loaded(
        daemon_factory, routers, tmp_path, Workload(count, keys, 0.1, 231)
    )
    create_deferred(daemon)
    answer = http().post(f"{daemon.url}/indexes/_build", json={"indexes": list(DEFERRED)})
    assert answer.status_code == 202, answer.text
    entries = answer.json()["indexes"]
    assert [e["name"] for e in entries] == list(DEFERRED)
    assert {e["state"] for e in entries} == {"building"}
    assert entries[0]["build"]["indexes"] == list(DEFERRED)
    kill_once_built_some(daemon, "d_zip")
    more = list(generate(Workload(count // 30, keys, 0.1, 232)))
    write_jsonl(jsonl, more, append=True)
    documents += more
    daemon.start()
    if "resuming their build" in daemon.log():  # killed before the merge: one build again
        assert "indexes d_zip, d_name, d_adults: resuming their build" in daemon.log()
    for name in DEFERRED:
        wait_active(daemon, name)
    wait_equal(daemon, documents)
    for name, (keys, where) in DEFERRED.items():
        assert scan(daemon, name) == model(documents, keys, where), name
    assert build_streams(router.log()) == ["d_zip,d_name,d_adults"], router.log()

    # Two more, one dropped during their build: the other goes on, on a stream of its own.
    for name in ("e_zip", "e_name"):
        keys = DEFERRED[name.replace("e_", "d_")][0]
        made = http().post(
            f"{daemon.url}/indexes", json={"name": name, "keys": keys, "defer_build": True}
        )
        assert made.status_code == 201, made.text
    answer = http().post(f"{daemon.url}/indexes/_build", json={"indexes": ["e_zip", "e_name"]})
    assert answer.status_code == 202, answer.text
    router.wait_log(r"build:e_zip,e_name: connected")
    deadline = time.monotonic() + WAIT_S
    while index_states(daemon)["e_zip"].get("build", {}).get("items", 1) == 0:
        assert time.monotonic() < deadline
        time.sleep(0.01)  # dropped once the build has written (or is already merged)
    dropped = http().delete(f"{daemon.url}/indexes/e_zip")
    assert dropped.status_code == 204, dropped.text
    assert "e_zip" not in index_states(daemon)
    router.wait_log(r"build:e_zip,e_name: the build stream is done")
    if "the build of e_name goes on without it" in daemon.log():  # dropped during the build
        router.wait_log(r"build:e_name: connected")  # its own stream, from what was built
    wait_active(daemon, "e_name")
    wait_equal(daemon, documents)
    assert scan(daemon, "e_name") == model(documents, ["name"])
    assert http().get(f"{daemon.url}/indexes/e_zip/count").status_code == 404
    stats = http().get(f"{daemon.url}/stats").json()
    assert stats["builds"] == {} and stats["slab"]["chunks_in_use"] == 0
    assert router.stop() == 0
    assert daemon.stop() == 0


def test_build_requests_errors_and_a_deferred_index_across_restarts(
    daemon_factory: Any, tmp_path: Path
) -> None:
    daemon = daemon_factory(
        **{"indexes.cfg_later": {"keys": ["name"], "defer_build": True}}
    ).start()
    assert index_states(daemon)["cfg_later"]["state"] == "deferred"
    made = http().post(
        f"{daemon.url}/indexes", json={"name": "later", "keys": ["age"], "defer_build": True}
    )
    assert made.status_code == 201 and made.json()["state"] == "deferred", made.text
    build = f"{daemon.url}/indexes/_build"
    errors = [  # (body, status, what the error names)
        ({"indexes": ["later", "nope"]}, 404, "'nope'"),
        ({"indexes": ["by_age"]}, 409, "'by_age' is active, not deferred"),
        ({"indexes": ["later", "later"]}, 400, "'later' is named twice"),
        ({"indexes": []}, 400, "indexes"),
        ({"indexes": "later"}, 400, "indexes"),
        ({}, 400, "indexes"),
        ({"indexes": ["later"], "wait": True}, 400, "wait"),
        ({"indexes": ["../etc"]}, 400, "index name"),
    ]
    for body, status, named in errors:
        answer = http().post(build, json=body)
        assert answer.status_code == status, (body, answer.text)
        assert named in answer.json()["error"], (body, answer.text)
    assert http().post(build, content=b"not json").status_code == 400
    assert http().get(build).status_code == 405
    assert http().post(build, params={"wait": "1"}, json={"indexes": ["later"]}).status_code == 400
    bad_flag = http().post(
        f"{daemon.url}/indexes", json={"name": "x", "keys": ["a"], "defer_build": "yes"}
    )
    assert bad_flag.status_code == 400 and "defer_build" in bad_flag.json()["error"]
    exists = http().post(
        f"{daemon.url}/indexes", json={"name": "later", "keys": ["a"], "defer_build": True}
    )
    assert exists.status_code == 409, exists.text
    # Nothing was built by the refused requests.
    assert index_states(daemon)["later"]["state"] == "deferred"
    unknown = cli("build-index", "later", "nope", "--url", daemon.url)
    assert unknown.returncode == 1 and unknown.stderr.count("\n") == 1, unknown.stderr
    assert "'nope'" in unknown.stderr
    both = cli("create-index", "y", "--keys", "a", "--defer", "--wait", "--url", daemon.url)
    assert both.returncode == 2 and "--defer or --wait" in both.stderr, both.stderr

    # defer_build survives a restart: still deferred, still unreadable.
    assert daemon.stop() == 0
    daemon.start()
    states = index_states(daemon)
    assert states["later"]["state"] == "deferred" and states["cfg_later"]["state"] == "deferred"
    assert_deferred(daemon, "later")
    assert_deferred(daemon, "cfg_later")

    # With nothing streamed yet, a build makes the index active at once.
    active = http().post(build, json={"indexes": ["later"]})
    assert active.status_code == 200, active.text
    assert active.json()["indexes"][0]["state"] == "active"
    documents = list(generate(Workload(3_000, 800, 0.1, 241)))
    fed = run_feed(daemon, write_jsonl(tmp_path / "docs.jsonl", documents))
    assert fed.returncode == 0, fed.stderr
    wait_equal(daemon, documents)
    assert scan(daemon, "later") == model(documents, ["age"])
    # A deferred index is dropped like any other, and a scan of it is then a 404.
    assert http().delete(f"{daemon.url}/indexes/cfg_later").status_code == 204
    assert "cfg_later" not in index_states(daemon)
    assert http().get(f"{daemon.url}/indexes/cfg_later/scan").status_code == 404
    assert http().delete(f"{daemon.url}/indexes/cfg_later").status_code == 404
    assert daemon.stop() == 0
