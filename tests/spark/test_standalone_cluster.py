"""The example jobs on a real Spark standalone cluster: a master and a worker started from the
pyspark distribution on 127.0.0.1, the executors in JVMs and Python processes of their own.

The jobs are the README's: examples/spark_load.py loads a Parquet file through the router, and
examples/spark_job.py reads the index back and writes its aggregate as Parquet. What the
executors need (the package in the Python they run, the router's and the daemon's ports) is
what docs/spark.md says.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from indexer.router.documents import Document
from tests.e2e.conftest import scan
from tests.harness import Daemon, Router, free_port, model, wait_for_line

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
