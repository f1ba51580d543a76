"""Creating and dropping indexes while a router feeds the daemon."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from indexer.router import Workload, generate
from tests.e2e.conftest import dump, indexer_command, model, run_feed, write_jsonl
from tests.harness import http

pytestmark = pytest.mark.e2e


def test_create_during_a_feed_then_drop(daemon_factory: Any, tmp_path: Path) -> None:
    daemon = daemon_factory().start()
    before = list(generate(Workload(5_000, 4_000, 0.1, 21)))
    assert run_feed(daemon, write_jsonl(tmp_path / "a.jsonl", before)).returncode == 0
    during = list(generate(Workload(60_000, 4_000, 0.1, 22)))
    jsonl = write_jsonl(tmp_path / "b.jsonl", before + during)
    feeder = subprocess.Popen(
        indexer_command("feed", "--to", daemon.address, "--jsonl", str(jsonl)),
        stderr=subprocess.PIPE,
        text=True,
    )
    time.sleep(0.3)
    created = subprocess.run(
        indexer_command(
            "create-index", "by_zip", "--keys", "address.zip,name", "--url", daemon.url
        ),
        capture_output=True,
        text=True,
    )
    assert created.returncode == 0, created.stderr
    # The daemon holds data: the index is built by a build stream, which only a router with a
    # source log serves (tests/e2e/test_index_build.py); this feed keeps none.
    assert "building" in created.stdout
    _, err = feeder.communicate(timeout=120)
    assert feeder.returncode == 0, err  # the feed reconnected and resumed by itself
    listed = {i["name"]: i for i in http().get(daemon.url + "/indexes").json()["indexes"]}
    assert listed["by_zip"]["state"] == "building"
    refused = http().get(
        daemon.url + "/indexes/by_zip/scan", params={"consistency": "request_plus"}
    )
    assert refused.status_code == 409 and "building" in refused.json()["error"]
    dup = http().post(daemon.url + "/indexes", json={"name": "by_zip", "keys": ["x"]})
    assert dup.status_code == 409 and "exists" in dup.json()["error"]
    bad = http().post(daemon.url + "/indexes", json={"name": "../x", "keys": ["x"]})
    assert bad.status_code == 400
    assert "INDEXES_CHANGED" in daemon.log()
    # The old indexes equal the model of everything; the new one has nothing built yet.
    assert daemon.stop() == 0
    everything = before + during
    for name, paths in (("by_city", ["address.city", "age"]), ("by_age", ["age"])):
        assert dump(daemon, name) == model(everything, paths)
    assert dump(daemon, "by_zip") == []
    # Restart: the runtime index is still there; drop it.
    daemon.start()
    assert "by_zip" in {i["name"] for i in http().get(daemon.url + "/indexes").json()["indexes"]}
    dropped = subprocess.run(
        indexer_command("drop-index", "by_zip", "--url", daemon.url),
        capture_output=True,
        text=True,
    )
    assert dropped.returncode == 0, dropped.stderr
    assert http().get(daemon.url + "/indexes/by_zip/scan").status_code == 404
    assert http().delete(daemon.url + "/indexes/by_zip").status_code == 404
    # Feeding still works with the remaining indexes.
    assert run_feed(daemon, jsonl).returncode == 0
    assert daemon.stop() == 0
    out = subprocess.run(
        indexer_command("dump", "by_zip", "--config", str(daemon.config)),
        capture_output=True,
        text=True,
    )
    assert out.returncode != 0 and "no index named 'by_zip'" in out.stderr
