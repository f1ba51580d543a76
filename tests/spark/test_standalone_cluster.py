"""The example jobs on a real Spark standalone cluster: a master and a worker started from the
pyspark distribution on 127.0.0.1, the executors in JVMs and Python processes of their own.

The jobs are the README's: examples/spark_load.py loads a Parquet file through the router, and
examples/spark_job.py reads the index back and writes its aggregate as Parquet. What the
executors need (the package in the Python they run, the router's and the daemon's ports) is
what docs/spark.md says.

One driver process runs every example of the module, one after another, by calling its
`main(argv, stop=False)`: the jobs share one application on the cluster and its executor, so
the driver's and the executor's JVMs start once. Run as a program, this module is that driver
(`serve`).
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import select
import subprocess
import sys
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import IO, Any

import httpx
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from indexer.router.documents import Document
from tests.e2e.conftest import scan
from tests.harness import Daemon, Router, free_port, jsonl_lines, model, wait_for_line
from tests.spark.stream_driver import TEST_JVM_OPTIONS

pytestmark = [pytest.mark.spark, pytest.mark.e2e]

ROOT = Path(__file__).resolve().parents[2]
SPARK_CLASS = Path(__import__("pyspark").__file__).parent / "bin" / "spark-class"
INDEX = ["address.city", "age"]


@dataclass
class Cluster:
    master: str  # spark://127.0.0.1:PORT
    worker_log: Path


@dataclass
class Run:
    """What a run of an example gave: its exit status and output, and the application (and
    its master) whose session it left."""

    returncode: int
    stdout: str
    stderr: str
    app: str | None
    master: str | None


class Driver:
    """The module's Spark driver: a process running the examples' `main` on request, in one
    application on the cluster (`serve` is its side)."""

    def __init__(self, cluster: Cluster, log: Path) -> None:
        self.cluster = cluster
        self.log = log
        with open(log, "ab") as out:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "tests.spark.test_standalone_cluster"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=out,
                env=spark_env(),
                cwd=ROOT,
                text=True,
            )

    def run(self, example: str, *argv: str, timeout: float = 600) -> Run:
        """Run examples/EXAMPLE.py's main on `argv` and `--master` the cluster's."""
        assert self.process.stdin is not None and self.process.stdout is not None
        argv = (*argv, "--master", self.cluster.master)
        if self.process.poll() is not None:
            pytest.fail(f"the driver exited ({self.process.returncode}): {self.log_tail()}")
        self.process.stdin.write(json.dumps({"example": example, "argv": argv}) + "\n")
        self.process.stdin.flush()
        ready, _, _ = select.select([self.process.stdout], [], [], timeout)
        line = self.process.stdout.readline() if ready else ""
        if not line:
            self.process.kill()
            self.process.wait()
            pytest.fail(f"the driver gave no answer to {example} {argv}: {self.log_tail()}")
        return Run(**json.loads(line))

    def ran_on_the_cluster(self, run: Run) -> bool:
        """The run's session was an application of the cluster's master, whose worker launched
        an executor for it: a JVM of its own, with its own Python."""
        launched = f"Asked to launch executor {run.app}/"
        return run.master == self.cluster.master and launched in self.cluster.worker_log.read_text()

    def log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]

    def close(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.close()  # the driver stops its session and exits
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def serve(requests: IO[str], answers: IO[str]) -> None:
    """The driver's side: for each request line (an example and its argv), the example's
    `main(argv, stop=False)`, then a line of its Run. Its printed lines are captured; Spark's
    logs go to stderr."""
    from pyspark.sql import SparkSession

    modules: dict[str, ModuleType] = {}
    for path in sorted((ROOT / "examples").glob("spark_*.py")):  # imported while tests set up
        spec = importlib.util.spec_from_file_location(path.stem, path)
        assert spec is not None and spec.loader is not None
        modules[path.stem] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(modules[path.stem])
    for line in requests:
        request = json.loads(line)
        name = request["example"]
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = modules[name].main(list(request["argv"]), stop=False)
            except SystemExit as exc:  # argparse
                code = exc.code if isinstance(exc.code, int) else 1
            except Exception:
                traceback.print_exc()
                code = 1
        spark: Any = SparkSession.getActiveSession()
        context = spark.sparkContext if spark is not None else None
        run = Run(
            returncode=code,
            stdout=out.getvalue(),
            stderr=err.getvalue(),
            app=context.applicationId if context else None,
            master=context.master if context else None,
        )
        answers.write(json.dumps(run.__dict__) + "\n")
        answers.flush()
    spark = SparkSession.getActiveSession()
    if spark is not None:
        spark.stop()


def spark_env() -> dict[str, str]:
    """The environment of the cluster's processes and the driver: the tests' JVM options for
    the master and the worker (SPARK_DAEMON_JAVA_OPTS) and for the application's driver and
    executors (PYSPARK_SUBMIT_ARGS, which the examples' sessions are launched with)."""
    options = TEST_JVM_OPTIONS
    submit = (
        f'--conf "spark.driver.defaultJavaOptions={options}" '
        f'--conf "spark.executor.defaultJavaOptions={options}" pyspark-shell'
    )
    return {
        **os.environ,
        "SPARK_LOCAL_IP": "127.0.0.1",
        "PYSPARK_PYTHON": sys.executable,
        "SPARK_DAEMON_JAVA_OPTS": options,
        "PYSPARK_SUBMIT_ARGS": submit,
    }


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
def driver(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Driver]:
    started = Driver(cluster, tmp_path_factory.mktemp("driver") / "driver.log")
    yield started
    started.close()


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


def test_the_example_jobs_load_and_read_on_a_standalone_cluster(
    driver: Driver, node: tuple[Daemon, str], tmp_path: Path
) -> None:
    daemon, router_url = node
    rows = [
        {"id": f"c{n}", "age": n % 60, "address": {"city": ["Oslo", "Lima", "Kyiv"][n % 3]}}
        for n in range(1_500)
    ]
    parquet = tmp_path / "people.parquet"
    pq.write_table(pa.Table.from_pylist(rows), parquet)
    load = driver.run(
        "spark_load", "--parquet", str(parquet), "--router", router_url, "--id", "id",
        "--wait", "visible",
    )  # fmt: skip
    assert load.returncode == 0, load.stderr[-3000:] + driver.log_tail()
    assert f"loaded 1500 rows of {parquet}" in load.stdout
    documents = [Document(r["id"], {"age": r["age"], "address": r["address"]}) for r in rows]
    assert scan(daemon, "by_city", "any") == model(documents, INDEX)
    # The tasks ran in an executor the worker launched: a JVM of its own, with its own Python.
    assert driver.ran_on_the_cluster(load)

    out = tmp_path / "by_city"
    job = driver.run(
        "spark_job", "--url", daemon.url, "--index", "by_city", "--out", str(out),
    )  # fmt: skip
    assert job.returncode == 0, job.stderr[-3000:] + driver.log_tail()
    assert "1500 entries of index by_city" in job.stdout
    written = pq.read_table(out).to_pylist()
    assert sorted((r["address_city"], r["entries"]) for r in written) == [
        ("Kyiv", 500),
        ("Lima", 500),
        ("Oslo", 500),
    ]
    assert driver.ran_on_the_cluster(job)


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
    driver: Driver, node: tuple[Daemon, str], tmp_path: Path
) -> None:
    """examples/spark_stream.py on the cluster's executors: the snapshot, then the changes of
    a load of updates and deletes, across a second run from its checkpoint."""
    daemon, router_url = node
    out = tmp_path / "changes"

    def stream() -> Run:
        job = driver.run(
            "spark_stream", "--url", daemon.url, "--index", "by_city", "--out", str(out),
            "--max-entries", "200", "--consumer", "example",
        )  # fmt: skip
        assert job.returncode == 0, job.stderr[-3000:] + driver.log_tail()
        return job

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

    def batches() -> set[str]:
        return {p.name for p in out.iterdir() if p.name.startswith("batch=")}

    cities = ["Oslo", "Lima", "Kyiv", None]
    load(
        [Document(f"s{n}", {"age": n % 70, "address": {"city": cities[n % 4]}}) for n in range(600)]
    )
    first = stream()
    assert replay_table(out) == wanted() and wanted()
    assert f"{len(wanted())} entries of index by_city rebuilt" in first.stdout
    snapshot = batches()
    # Updates of the same documents, and deletes: 40 deletes and 120 updates (a delete and an
    # insert each), 280 changes, more than one micro-batch of at most 200.
    load(
        [
            Document(f"s{n}", None if n % 4 == 0 else {"age": n % 50, "address": {"city": "Rome"}})
            for n in range(160)
        ]
    )
    second = stream()
    assert replay_table(out) == wanted()
    assert f"{len(wanted())} entries of index by_city rebuilt" in second.stdout
    assert len(batches()) >= 3  # the snapshot, then at most 200 rows a batch
    assert len(batches() - snapshot) >= 2 and snapshot < batches()  # on from the checkpoint
    assert "example" in daemon.stats()["changes"]["leases"]
    assert driver.ran_on_the_cluster(first) and driver.ran_on_the_cluster(second)


def test_the_example_load_streams_a_directory_into_the_index_on_a_standalone_cluster(
    driver: Driver, node: tuple[Daemon, str], tmp_path: Path
) -> None:
    """examples/spark_load.py --stream: writeStream.format("indexer") on the cluster's
    executors; a second run loads only the file added since (updates and deletes)."""
    daemon, router_url = node
    incoming, checkpoint = tmp_path / "incoming", tmp_path / "checkpoint"
    incoming.mkdir()

    def load() -> Run:
        job = driver.run(
            "spark_load", "--parquet", str(incoming), "--router", router_url, "--id", "id",
            "--delete", "deleted", "--wait", "visible", "--stream", str(checkpoint),
        )  # fmt: skip
        assert job.returncode == 0, job.stderr[-3000:] + driver.log_tail()
        return job

    first = [
        {"id": f"w{n}", "age": n % 40, "address": {"city": "Bern"}, "deleted": False}
        for n in range(400)
    ]
    pq.write_table(pa.Table.from_pylist(first), incoming / "part-0.parquet")
    assert "loaded 400 rows" in load().stdout
    second = [
        {"id": f"w{n}", "age": 99, "address": {"city": "Graz"}, "deleted": n % 2 == 0}
        for n in range(100)
    ]
    pq.write_table(pa.Table.from_pylist(second), incoming / "part-1.parquet")
    again = load()
    assert "loaded 100 rows" in again.stdout  # only the new file
    documents = [
        Document(r["id"], None if r["deleted"] else {"age": r["age"], "address": r["address"]})
        for r in first + second
    ]
    mine = [e for e in scan(daemon, "by_city", "any") if e["id"].startswith("w")]
    assert mine == model(documents, INDEX)
    assert driver.ran_on_the_cluster(again)


if __name__ == "__main__":  # the module's driver (Driver): requests on stdin, answers on stdout
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # what else writes to stdout (Spark's JVM among them) goes to the log
    serve(sys.stdin, answers)
