"""The cluster on etcd (docs/cluster.md), each figure beside its baseline in the same run.

1. documents/s from JSONL to readable on three nodes with one replica of each vbucket, against
   the same three nodes with none (interleaved rounds, a fresh cluster each): every owner of a
   vbucket must read it, so a replica is a second copy of every document to index;
2. merged-scan rows/s of one index on the three nodes (`scan_the_cluster`: each node answers
   for its active vbuckets, its replicas left out by the `vbuckets` parameter), against the
   same merge over a one-node map of one daemon holding every document, and against that
   node's NDJSON scan with its lines counted, not parsed (best of 3, interleaved);
3. failover: from a SIGKILL of an active node to the first merged scan that answers every row,
   over several kills (the node comes back and is given vbuckets again between them), p50 and
   the largest, against the lease's TTL;
4. watching against polling: the CPU three idle daemons and a router spend in a minute
   following the map in etcd, against following a map file (looked at every 2 s), and how long
   a change of the map takes to reach the router either way.

Run: `python bench/cluster.py [--documents N] [--kills K]`; the last line is a JSON summary.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import httpx
import psutil
from common import Daemon, Router, free_port, in_workdir, ratio, say  # bench/common.py

from indexer.cluster.etcd import EtcdLocation
from indexer.cluster.map import ClusterMap, ClusterNode, load_cluster_map
from indexer.cluster.scan import scan_cluster, scan_the_cluster
from indexer.cluster.store import EtcdMap
from indexer.router import Workload, generate
from indexer.router.documents import vbucket_of
from tests.harness import Etcd, indexer_command, jsonl_lines

SCAN_INDEX = "by_city"
NUM_VBUCKETS = 1024
LEASE_S = 2  # the failover part's lease: short, so that several kills fit in a run


def cli(*args: str) -> str:
    done = subprocess.run(indexer_command(*args), capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"indexer {' '.join(args[:2])}: {done.stderr.strip()}")
    return done.stdout


def three_node_map(path: Path, nodes: dict[str, Daemon]) -> Path:
    """A map with every vbucket on the first node; a rebalance shares them out."""
    lines = [f"num_vbuckets = {NUM_VBUCKETS}"]
    for i, (name, daemon) in enumerate(nodes.items()):
        lines += [
            f"[nodes.{name}]",
            f'feed = "{daemon.address}"',
            f'http = "127.0.0.1:{daemon.http_port}"',
            'vbuckets = ["0-1023"]' if i == 0 else "vbuckets = []",
        ]
    path.write_text("\n".join(lines) + "\n")
    return path


class Cluster:
    """Three daemons on etcd under `prefix`, started, and shared out with `replicas`."""

    def __init__(self, workdir: Path, etcd: Etcd, prefix: str, replicas: int) -> None:
        self.url = etcd.url(prefix)
        self.workdir = workdir
        lease = f"cluster_lease_s = {LEASE_S}\n"  # in [server], after the harness's keys
        self.nodes = {name: Daemon.in_workdir(workdir / name, lease) for name in ("a", "b", "c")}
        for daemon in self.nodes.values():  # the map gives each node its ports
            daemon.port, daemon.http_port = free_port(), free_port()
        cli("cluster", "init", "--cluster", self.url, "--from",
            str(three_node_map(workdir / "cluster.toml", self.nodes)))  # fmt: skip
        for name, daemon in self.nodes.items():
            daemon.args = ["--cluster", self.url, "--node", name]
            daemon.start()
        cli("cluster", "rebalance", "--cluster", self.url, "--replicas", str(replicas))

    def router(self, jsonl: Path, *where: str) -> Router:
        """The router of this cluster's documents (its source log in the work dir)."""
        where = where or ("--cluster", self.url)
        return Router(
            self.workdir / "router.log", "--state", str(self.workdir / "state"), "--jsonl",
            str(jsonl), *where,
        )  # fmt: skip

    def map(self) -> ClusterMap:
        from indexer.cluster.store import load_map

        return load_map(self.url)

    def stop(self) -> None:
        for daemon in self.nodes.values():
            daemon.kill()


def per_vbucket(documents: Sequence[Any]) -> list[int]:
    """The last seqno of each vbucket once the documents are appended: one per mutation."""
    counts = [0] * NUM_VBUCKETS
    for document in documents:
        counts[vbucket_of(document.docid.encode(), NUM_VBUCKETS)] += 1
    return counts


def wait_readable(
    cluster: ClusterMap, nodes: dict[str, Daemon], counts: list[int], timeout: float
) -> float:
    """Until every node's readable snapshot holds everything of what it receives; when."""
    wanted = {n.name: sum(counts[vb] for vb in n.receives) for n in cluster.nodes}
    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=10) as client:
        while True:
            done = all(
                nodes[name].stats(client)["stable"]["seqno_sum"] >= want
                for name, want in wanted.items()
            )
            if done:
                return time.monotonic()
            if time.monotonic() > deadline:
                raise RuntimeError(f"not readable within {timeout} s")
            time.sleep(0.05)


def ingest_round(
    workdir: Path, etcd: Etcd, replicas: int, jsonl: Path, counts: list[int], n: int
) -> tuple[float, Cluster, Router]:
    cluster = Cluster(workdir, etcd, f"bench/r{replicas}-{workdir.name}", replicas)
    started = time.monotonic()
    router = cluster.router(jsonl)
    done = wait_readable(cluster.map(), cluster.nodes, counts, 600)
    seconds = done - started
    say(f"  {replicas} replica(s): {n:,} documents readable on every owner in {seconds:.2f} s "
        f"({n / seconds:,.0f} docs/s)")  # fmt: skip
    return seconds, cluster, router


def merged_rows(where: str | Path, timeout: float) -> int:
    with scan_the_cluster(where, SCAN_INDEX, {"consistency": "any"}, timeout) as rows:
        return sum(1 for _ in rows)


def one_node_rows(map_path: Path, timeout: float) -> int:
    with scan_cluster(
        load_cluster_map(map_path), SCAN_INDEX, {"consistency": "any"}, timeout
    ) as rows:
        return sum(1 for _ in rows)


def ndjson_lines(url: str, timeout: float) -> int:
    """One node's NDJSON scan, streamed, newlines counted: no row parsed (the figure the fan-out
    of bench/build.py compares with)."""
    rows = 0
    with (
        httpx.Client(timeout=timeout) as client,
        client.stream(
            "GET", f"{url}/indexes/{SCAN_INDEX}/scan", params={"consistency": "any"}
        ) as response,
    ):
        for chunk in response.iter_raw():
            rows += chunk.count(b"\n")
    return rows


def best_of(runs: dict[str, Callable[[], int]], repeats: int) -> tuple[dict[str, float], set[int]]:
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    rows: set[int] = set()
    for _ in range(repeats):
        for name, run in runs.items():
            t0 = time.perf_counter()
            rows.add(run())
            seconds[name].append(time.perf_counter() - t0)
    return {name: min(s) for name, s in seconds.items()}, rows


def failovers(cluster: Cluster, want: int, kills: int) -> list[float]:
    """Seconds from each kill to the first complete merged scan."""
    found = []
    for _ in range(kills):
        current = cluster.map()
        victim = max(current.nodes, key=lambda n: (len(n.vbuckets), n.name)).name
        cluster.nodes[victim].kill()
        killed = time.monotonic()
        while merged_rows(cluster.url, 60) != want:
            if time.monotonic() - killed > 120:
                raise RuntimeError(f"no complete merged scan within 120 s of killing {victim}")
            time.sleep(0.05)
        found.append(time.monotonic() - killed)
        say(f"  killed {victim}: a complete merged scan after {found[-1]:.2f} s")
        cluster.nodes[victim].start()
        cli("cluster", "rebalance", "--cluster", cluster.url)  # it is active for a share again
    return found


def idle_cpu(processes: Sequence[psutil.Process], seconds: float) -> float:
    """CPU seconds the processes spend in `seconds` of wall time."""

    def total() -> float:
        return sum(sum(p.cpu_times()[:2]) for p in processes)

    before = total()
    time.sleep(seconds)
    return total() - before


def change_seen(router: Router, change: Callable[[], object], pattern: str) -> float:
    """Seconds from `change` to the router's log saying it follows it."""
    seen = router.log().count(pattern)
    t0 = time.monotonic()
    change()
    while router.log().count(pattern) <= seen:
        if time.monotonic() - t0 > 60:
            raise RuntimeError("the router did not follow the change within 60 s")
        time.sleep(0.01)
    return time.monotonic() - t0


def watching_vs_polling(workdir: Path, cluster: Cluster, router: Router) -> dict[str, Any]:
    """Idle CPU and change latency of the etcd cluster, then of the same nodes on a map file."""
    idle_s = 20.0
    processes = [psutil.Process(d.proc.pid) for d in cluster.nodes.values() if d.proc]
    processes.append(psutil.Process(router.proc.pid))
    watch_cpu = idle_cpu(processes, idle_s)
    pattern = "is in the cluster map: streaming to it"
    etcd_map = EtcdMap(EtcdLocation.parse(cluster.url))

    def add_z(now: ClusterMap | None) -> ClusterMap:
        assert now is not None
        z = ClusterNode("z", ("127.0.0.1", 1), ("127.0.0.1", 2), ())
        return dataclasses.replace(now, nodes=(*now.nodes, z))

    watch_s = change_seen(router, lambda: etcd_map.change(add_z), pattern)  # in-process, as the
    # file's write below
    # The same nodes following a file of the map instead.
    from indexer.cluster.store import map_document

    current = cluster.map()
    file_map = workdir / "followed.toml"
    file_map.write_text(toml_of(json.loads(map_document(current))))
    router.stop_cleanly()
    for name, daemon in cluster.nodes.items():
        daemon.stop_cleanly()
        daemon.args = ["--cluster-map", str(file_map), "--node", name]
        daemon.start()
    polled = cluster.router(workdir / "in.jsonl", "--cluster-map", str(file_map))
    time.sleep(3)
    processes = [psutil.Process(d.proc.pid) for d in cluster.nodes.values() if d.proc]
    processes.append(psutil.Process(polled.proc.pid))
    poll_cpu = idle_cpu(processes, idle_s)
    added = file_map.read_text() + '[nodes.y]\nfeed = "127.0.0.1:3"\nhttp = "127.0.0.1:4"\n'
    added += "vbuckets = []\n"
    poll_s = change_seen(polled, lambda: file_map.write_text(added), pattern)
    polled.kill()
    say(
        f"watching vs polling: idle CPU of 3 daemons and a router {watch_cpu / idle_s * 60:.2f} "
        f"s/min on etcd, {poll_cpu / idle_s * 60:.2f} s/min on a map file; a change reaches "
        f"the router in {watch_s * 1000:.0f} ms by the watch, {poll_s * 1000:.0f} ms by polling"
    )
    return {
        "idle_cpu_s_per_min_watch": round(watch_cpu / idle_s * 60, 3),
        "idle_cpu_s_per_min_poll": round(poll_cpu / idle_s * 60, 3),
        "change_seen_ms_watch": round(watch_s * 1000),
        "change_seen_ms_poll": round(poll_s * 1000),
    }


def toml_of(raw: dict[str, Any]) -> str:
    lines = [f"num_vbuckets = {raw['num_vbuckets']}", f"num_replicas = {raw['num_replicas']}"]
    for name, table in raw["nodes"].items():
        lines.append(f"[nodes.{name}]")
        lines += [f"{key} = {json.dumps(value)}" for key, value in table.items()]
    return "\n".join(lines) + "\n"


def run(opts: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    documents = list(generate(Workload(opts.documents, opts.documents, 0.0, 47)))
    jsonl = workdir / "in.jsonl"
    jsonl.write_text("".join(jsonl_lines(documents)))
    counts = per_vbucket(documents)
    # The documents stay in this process; out of the collector's way, they do not weigh on the
    # scans' figures (a scan's client holds no such heap).
    gc.freeze()
    etcd = Etcd().start()
    summary: dict[str, Any] = {"documents": opts.documents}
    kept: tuple[Cluster, Router] | None = None
    try:
        say(f"1. ingest of {opts.documents:,} documents into 3 nodes, rounds interleaved")
        seconds: dict[int, list[float]] = {0: [], 1: []}
        for round_ in range(opts.rounds):
            for replicas in (0, 1):
                t, cluster, router = ingest_round(
                    workdir / f"ingest-{replicas}-{round_}", etcd, replicas, jsonl, counts,
                    opts.documents,
                )  # fmt: skip
                seconds[replicas].append(t)
                if round_ == opts.rounds - 1 and replicas == 1:
                    kept = (cluster, router)
                else:
                    router.kill()
                    cluster.stop()
        rates = {r: opts.documents / min(s) for r, s in seconds.items()}
        spread = {r: round(max(s) / min(s) - 1, 3) for r, s in seconds.items()}
        say(
            f"  best: {rates[0]:,.0f} docs/s with no replica, {rates[1]:,.0f} with one: "
            f"{ratio(rates[1], rates[0])}x (spread {spread[0]:.0%} and {spread[1]:.0%})"
        )
        summary["ingest_docs_per_s"] = {"none": round(rates[0]), "one_replica": round(rates[1])}
        summary["ingest_ratio_one_replica"] = ratio(rates[1], rates[0])
        assert kept is not None
        cluster, router = kept

        say("2. merged scan of 3 nodes with a replica each, against 1 node")
        single = Daemon.in_workdir(workdir / "single").start()
        one = Router(
            workdir / "single-router.log", "--state", str(workdir / "single-state"), "--jsonl",
            str(jsonl), "--to", single.address,
        )  # fmt: skip
        one_map = workdir / "single.toml"
        one_map.write_text(
            f'num_vbuckets = {NUM_VBUCKETS}\n[nodes.s]\nfeed = "{single.address}"\n'
            f'http = "127.0.0.1:{single.http_port}"\nvbuckets = ["0-1023"]\n'
        )
        single_map = load_cluster_map(one_map)
        wait_readable(single_map, {"s": single}, counts, 600)
        best, rows = best_of(
            {
                "three_nodes": lambda: merged_rows(cluster.url, 120),
                "one_node": lambda: one_node_rows(one_map, 120),
                "one_node_ndjson": lambda: ndjson_lines(single.url, 120),
            },
            3,
        )
        with_city = one_node_rows(one_map, 120)  # the index's rows: what each scan must read
        per_s = {name: round(with_city / s) for name, s in best.items()}
        say(f"  {SCAN_INDEX} ({with_city:,} rows; every scan read {sorted(rows)}): 3 nodes "
            f"{per_s['three_nodes']:,} rows/s, 1 node {per_s['one_node']:,} rows/s: "
            f"{ratio(per_s['three_nodes'], per_s['one_node'])}x")  # fmt: skip
        say(f"  against 1 node's NDJSON, lines counted and not parsed ({per_s['one_node_ndjson']:,}"
            f" rows/s): {ratio(per_s['three_nodes'], per_s['one_node_ndjson'])}x")  # fmt: skip
        summary["merged_scan_rows_per_s"] = per_s
        summary["merged_scan_ratio"] = ratio(per_s["three_nodes"], per_s["one_node"])
        summary["merged_scan_rows_ok"] = rows == {with_city}
        one.kill()
        single.kill()

        say(f"3. failover, {opts.kills} kills, lease {LEASE_S} s")
        times = failovers(cluster, with_city, opts.kills)
        p50 = statistics.median(times)
        say(f"  kill to a complete scan: p50 {p50:.2f} s, largest {max(times):.2f} s "
            f"(lease {LEASE_S} s: {p50 - LEASE_S:.2f} s over it at p50)")  # fmt: skip
        summary["failover_s"] = {"p50": round(p50, 3), "max": round(max(times), 3),
                                 "lease_s": LEASE_S}  # fmt: skip

        say("4. watching against polling")
        summary["watch"] = watching_vs_polling(workdir, cluster, router)
    finally:
        if kept is not None:
            kept[1].kill()
            kept[0].stop()
        etcd.stop()
    return summary


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--documents", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--kills", type=int, default=5)
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    opts = parser.parse_args(argv)
    return int(in_workdir("bench-cluster-", opts.keep, lambda workdir: run(opts, workdir)))


if __name__ == "__main__":
    raise SystemExit(main())
