"""The example jobs on a real Spark standalone cluster: a master and a worker started from the
pyspark distribution on 127.0.0.1, the executors in JVMs and Python processes of their own.

The jobs are the README's: examples/spark_load.py loads a Parquet file through the router, and
examples/spark_job.py reads the index back and writes its aggregate as Parquet. What the
executors need (the package in the Python they run, the router's and the daemon's ports) is
what docs/spark.md says.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from indexer.router.documents import Document
from tests.e2e.conftest import scan
from tests.harness import Daemon, Router, free_port, jsonl_lines, model, wait_for_line

pytestmark = [pytest.mark.spark, pytest.mark.e2e]

SPARK_CLASS = Path(__import__("pyspark").__file__).parent / "bin" / "spark-class"
INDEX = ["address.city", "age"]


@dataclass
class Cluster:
    master: str  # spark://127.0.0.1:PORT
    worker_log: Path


def spark_env() -> dict[str, str]:
    return {**os.environ, "SPARK_LOCAL_IP": "127.0.0.1", "PYSPARK_PYTHON": sys.executable}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("standalone")
    port = free_port()
    master_log, worker_log = tmp / "master.log", tmp / "worker.log"
    processes: list[subprocess.Popen[bytes]] = []

    def start(log_path: Path, *args: str) -> subprocess.Popen[bytes]:
        with open(log_path, "ab") as log:
            process = subprocess.Popen(
                [str(SPARK_CLASS), *args],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=spark_env(),
            )
        processes.append(process)
        return process

    try:
        master_ui, worker_ui = str(free_port()), str(free_port())
        process = start(
            master_log, "org.apache.spark.deploy.master.Master",
            "--host", "127.0.0.1", "--port", str(port), "--webui-port", master_ui,
        )  # fmt: skip
        wait_for_line(master_log, r"(I have been elected leader)", process, 120)
        master = f"spark://127.0.0.1:{port}"
        process = start(
            worker_log, "org.apache.spark.deploy.worker.Worker", master,
            "--host", "127.0.0.1", "--cores", "2", "--memory", "1500m",
            "--webui-port", worker_ui, "--work-dir", str(tmp / "work"),
        )  # fmt: skip
        wait_for_line(worker_log, r"(Successfully registered with master)", process, 120)
        yield Cluster(master, worker_log)
    finally:
        for process in reversed(processes):
            process.kill()
            process.wait()


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Daemon, str]]:
    tmp = tmp_path_factory.mktemp("cluster-node")
    daemon = Daemon.in_workdir(tmp / "daemon").start()
    router = Router(
        tmp / "router.log", "--state", str(tmp / "state"), "--to", daemon.address,
        "--http", "127.0.0.1:0",
    )  # fmt: skip
    url = router.wait_url()
    router.wait_log(r"connected; resuming")
    yield daemon, url
    router.kill()
    daemon.kill()


def run_job(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=600, env=spark_env()
    )


def test_the_example_jobs_load_and_read_on_a_standalone_cluster(
    cluster: Cluster, node: tuple[Daemon, str], tmp_path: Path
) -> None:
    daemon, router_url = node
    rows = [
        {"id": f"c{n}", "age": n % 60, "address": {"city": ["Oslo", "Lima", "Kyiv"][n % 3]}}
        for n in range(6_000)
    ]
    parquet = tmp_path / "people.parquet"
    pq.write_table(pa.Table.from_pylist(rows), parquet)
    load = run_job(
        "examples/spark_load.py", "--parquet", str(parquet), "--router", router_url,
        "--id", "id", "--wait", "visible", "--master", cluster.master,
    )  # fmt: skip
    assert load.returncode == 0, load.stderr[-3000:]
    assert f"loaded 6000 rows of {parquet}" in load.stdout
    documents = [Document(r["id"], {"age": r["age"], "address": r["address"]}) for r in rows]
    assert scan(daemon, "by_city", "any") == model(documents, INDEX)
    # The tasks ran in an executor the worker launched: a JVM of its own, with its own Python.
    assert re.search(
        r"Asked to launch executor app-\S+ for indexer-load", cluster.worker_log.read_text()
    )

    out = tmp_path / "by_city"
    job = run_job(
        "examples/spark_job.py", "--url", daemon.url, "--index", "by_city", "--out", str(out),
        "--master", cluster.master,
    )  # fmt: skip
    assert job.returncode == 0, job.stderr[-3000:]
    assert "6000 entries of index by_city" in job.stdout
    written = pq.read_table(out).to_pylist()
    assert sorted((r["address_city"], r["entries"]) for r in written) == [
        ("Kyiv", 2000),
        ("Lima", 2000),
        ("Oslo", 2000),
    ]
    assert re.search(
        r"Asked to launch executor app-\S+ for indexer-by_city", cluster.worker_log.read_text()
    )


def replay_table(out: Path) -> set[tuple[str | None, str | None, str]]:
    """The entries the Parquet table of changes leaves, replayed in batch and feed order."""
    rows = pq.read_table(out).to_pylist()  # batch=N directories: a batch column
    rows.sort(key=lambda r: (int(r["batch"]), r["ordinal"]))
    entries: set[tuple[str | None, str | None, str]] = set()
    for row in rows:
        entry = (row["address_city"], row["age"], row["id"])
        if row["op"] == "insert":
            assert entry not in entries, row
            entries.add(entry)
        else:
            assert entry in entries, row
            entries.remove(entry)
    return entries


def test_the_example_stream_keeps_a_table_of_changes_on_a_standalone_cluster(
    cluster: Cluster, node: tuple[Daemon, str], tmp_path: Path
) -> None:
    """examples/spark_stream.py on the cluster's executors: the snapshot, then the changes of
    a load of updates and deletes, across a second run from its checkpoint."""
    daemon, router_url = node
    out = tmp_path / "changes"

    def stream() -> str:
        job = run_job(
            "examples/spark_stream.py", "--url", daemon.url, "--index", "by_city",
            "--out", str(out), "--max-entries", "700", "--consumer", "example",
            "--master", cluster.master,
        )  # fmt: skip
        assert job.returncode == 0, job.stderr[-3000:]
        return job.stdout

    def load(documents: list[Document]) -> None:
        answer = httpx.post(
            f"{router_url}/docs/_bulk",
            params={"wait": "visible"},
            content="".join(jsonl_lines(documents)),
            timeout=120,
        )
        assert answer.status_code == 200 and answer.json()["failed"] == 0, answer.text

    def wanted() -> set[tuple[str | None, str | None, str]]:
        return {
            (json.dumps(e["key"][0]), json.dumps(e["key"][1]), e["id"])
            for e in scan(daemon, "by_city", "any")
        }

    cities = ["Oslo", "Lima", "Kyiv", None]
    load(
        [
            Document(f"s{n}", {"age": n % 70, "address": {"city": cities[n % 4]}})
            for n in range(3_000)
        ]
    )
    first = stream()
    assert replay_table(out) == wanted() and wanted()
    assert f"{len(wanted())} entries of index by_city rebuilt" in first
    # Updates of the same documents, and deletes.
    load(
        [
            Document(f"s{n}", None if n % 4 == 0 else {"age": n % 50, "address": {"city": "Rome"}})
            for n in range(2_500)
        ]
    )
    second = stream()
    assert replay_table(out) == wanted()
    assert f"{len(wanted())} entries of index by_city rebuilt" in second
    batches = {p.name for p in out.iterdir() if p.name.startswith("batch=")}
    assert len(batches) >= 3  # the snapshot, then at most 700 rows a batch
    assert "example" in daemon.stats()["changes"]["leases"]
    assert re.search(
        r"Asked to launch executor app-\S+ for indexer-stream-by_city",
        cluster.worker_log.read_text(),
    )


def test_the_example_load_streams_a_directory_into_the_index_on_a_standalone_cluster(
    cluster: Cluster, node: tuple[Daemon, str], tmp_path: Path
) -> None:
    """examples/spark_load.py --stream: writeStream.format("indexer") on the cluster's
    executors; a second run loads only the file added since (updates and deletes)."""
    daemon, router_url = node
    incoming, checkpoint = tmp_path / "incoming", tmp_path / "checkpoint"
    incoming.mkdir()

    def load() -> str:
        job = run_job(
            "examples/spark_load.py", "--parquet", str(incoming), "--router", router_url,
            "--id", "id", "--delete", "deleted", "--wait", "visible", "--stream", str(checkpoint),
            "--master", cluster.master,
        )  # fmt: skip
        assert job.returncode == 0, job.stderr[-3000:]
        return job.stdout

    first = [
        {"id": f"w{n}", "age": n % 40, "address": {"city": "Bern"}, "deleted": False}
        for n in range(2_000)
    ]
    pq.write_table(pa.Table.from_pylist(first), incoming / "part-0.parquet")
    assert "loaded 2000 rows" in load()
    second = [
        {"id": f"w{n}", "age": 99, "address": {"city": "Graz"}, "deleted": n % 2 == 0}
        for n in range(500)
    ]
    pq.write_table(pa.Table.from_pylist(second), incoming / "part-1.parquet")
    assert "loaded 500 rows" in load()  # only the new file
    documents = [
        Document(r["id"], None if r["deleted"] else {"age": r["age"], "address": r["address"]})
        for r in first + second
    ]
    mine = [e for e in scan(daemon, "by_city", "any") if e["id"].startswith("w")]
    assert mine == model(documents, INDEX)
