"""The build benchmark's scan fan-out (bench/build.py, part 2): one index scanned across two
nodes of a cluster map, merged by the client, against the same scan of one node."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
from build_processes import check, load, start_router  # bench/build_processes.py
from common import (  # bench/common.py: run as `python bench/...`
    Daemon,
    Router,
    free_port,
    ratio,
    say,
    write_cluster_map,
)

from indexer.cluster.map import load_cluster_map
from indexer.cluster.scan import scan_cluster

SCAN_INDEX = "by_city"
SCAN_REPEATS = 3


# --------------------------------------------------------------------------------------------
# 2. Scan fan-out


def ndjson_scan(url: str, timeout: float) -> int:
    """An NDJSON scan of the whole index, streamed, newlines counted (a client of its own, as
    `scan_cluster` has)."""
    rows = 0
    params = {"consistency": "any"}
    with (
        httpx.Client(timeout=timeout) as client,
        client.stream("GET", f"{url}/indexes/{SCAN_INDEX}/scan", params=params) as response,
    ):
        if response.status_code != 200:
            response.read()
            raise RuntimeError(f"scan: HTTP {response.status_code}: {response.text[:200]}")
        for chunk in response.iter_raw():
            rows += chunk.count(b"\n")
    return rows


def parallel_ndjson_scan(urls: Sequence[str], timeout: float) -> int:
    """NDJSON scans of several nodes at once, one thread each, newlines counted: no merge."""
    with ThreadPoolExecutor(len(urls)) as pool:
        return sum(pool.map(lambda url: ndjson_scan(url, timeout), urls))


def merged_scan(map_path: Path, timeout: float) -> int:
    """`scan_cluster` over every node of the map, every merged row read."""
    cluster = load_cluster_map(map_path)
    with scan_cluster(cluster, SCAN_INDEX, {"consistency": "any"}, timeout) as rows:
        return sum(1 for _ in rows)


def fan_out(
    opts: argparse.Namespace, workdir: Path, initial: Path, with_city: int, total: int
) -> dict[str, Any]:
    run_dir = workdir / "fan-out"
    run_dir.mkdir(parents=True)
    ports = [free_port() for _ in range(4)]
    two_map = write_cluster_map(
        run_dir / "cluster.toml",
        [("a", ports[0], ports[1], "0-511"), ("b", ports[2], ports[3], "512-1023")],
    )
    a = Daemon.in_workdir(run_dir / "a", args=["--cluster-map", str(two_map), "--node", "a"])
    b = Daemon.in_workdir(run_dir / "b", args=["--cluster-map", str(two_map), "--node", "b"])
    single = Daemon.in_workdir(run_dir / "single")
    nodes = [a, b, single]
    routers: list[Router] = []
    checks: dict[str, bool] = {}
    try:
        for node in nodes:
            node.start()
        one_map = write_cluster_map(
            run_dir / "single.toml", [("single", single.port, single.http_port, "all")]
        )
        with httpx.Client(timeout=opts.timeout) as client:
            started = time.monotonic()
            routers.append(
                start_router(
                    run_dir / "cluster-router",
                    ["--cluster-map", str(two_map), "--jsonl", str(initial)],
                )
            )
            _, two_load_s = load(
                "2 nodes", routers[-1], [a, b], total, started, client, opts.timeout
            )
            routers[-1].stop_cleanly()
            started = time.monotonic()
            routers.append(
                start_router(
                    run_dir / "single-router",
                    ["--to", single.address, "--jsonl", str(initial)],
                )
            )
            _, one_load_s = load(
                "1 node", routers[-1], [single], total, started, client, opts.timeout
            )
            routers[-1].stop_cleanly()
            owned = [node.stats(client)["vbuckets"]["owned"] for node in nodes]
            say(
                f"fan-out: {total:,} documents loaded into 2 nodes (vbuckets {owned[0]} + "
                f"{owned[1]}) through one router with --cluster-map in {two_load_s:.2f} s, into "
                f"1 node ({owned[2]} vbuckets) with --to in {one_load_s:.2f} s"
            )
            counts = [node.count(SCAN_INDEX, client) for node in nodes]
            checks["slices_add_up"] = check(
                f"{SCAN_INDEX} entries of the 2 nodes {counts[0]:,} + {counts[1]:,}",
                counts[0] + counts[1],
                counts[2],
            )
            checks["model"] = check(
                f"{SCAN_INDEX} entries of the single node = live documents with address.city",
                counts[2],
                with_city,
            )
            measures: dict[str, Callable[[], int]] = {
                "two_nodes": lambda: merged_scan(two_map, opts.timeout),
                "one_node_ndjson": lambda: ndjson_scan(single.url, opts.timeout),
                "one_node": lambda: merged_scan(one_map, opts.timeout),
                "two_nodes_ndjson": lambda: parallel_ndjson_scan([a.url, b.url], opts.timeout),
            }
            runs: dict[str, list[float]] = {name: [] for name in measures}
            rows: dict[str, set[int]] = {name: set() for name in measures}
            for _ in range(SCAN_REPEATS):
                for name, measure in measures.items():
                    t0 = time.perf_counter()
                    rows[name].add(measure())
                    runs[name].append(time.perf_counter() - t0)
        for node in nodes:
            node.stop_cleanly()
    finally:
        for router in routers:
            router.kill()
        for node in nodes:
            node.kill()
    scanned = counts[2]
    read = sorted(set().union(*rows.values()))
    checks["rows"] = read == [scanned]
    say(
        ("  check: " if checks["rows"] else "  WARNING: ")
        + f"rows read by every scan {read} (the index's count {scanned:,})"
    )
    best = {name: min(seconds) for name, seconds in runs.items()}
    per_s = {name: round(scanned / seconds) for name, seconds in best.items()}
    say(
        f"scan of {SCAN_INDEX} ({scanned:,} rows, consistency=any, best of {SCAN_REPEATS}): "
        f"2 nodes merged by scan_cluster {per_s['two_nodes']:,} rows/s; 1 node NDJSON (lines "
        f"counted) {per_s['one_node_ndjson']:,} rows/s; 1 node by scan_cluster "
        f"{per_s['one_node']:,} rows/s; 2 nodes NDJSON at once, lines counted, no merge "
        f"{per_s['two_nodes_ndjson']:,} rows/s"
    )
    say(
        f"  2 nodes merged / 1 node NDJSON: {ratio(per_s['two_nodes'], per_s['one_node_ndjson'])}"
        f"; 2 nodes / 1 node, both by scan_cluster: {ratio(per_s['two_nodes'], per_s['one_node'])}"
        f"; 2 nodes / 1 node, both NDJSON lines counted: "
        f"{ratio(per_s['two_nodes_ndjson'], per_s['one_node_ndjson'])}"
    )
    return {
        "rows": scanned,
        "load_two_nodes_s": round(two_load_s, 3),
        "load_one_node_s": round(one_load_s, 3),
        "rows_per_s": per_s,
        "seconds": {name: [round(s, 4) for s in seconds] for name, seconds in runs.items()},
        "ratio_two_vs_one_ndjson": ratio(per_s["two_nodes"], per_s["one_node_ndjson"]),
        "ratio_two_vs_one_merged": ratio(per_s["two_nodes"], per_s["one_node"]),
        "ratio_two_vs_one_ndjson_both": ratio(per_s["two_nodes_ndjson"], per_s["one_node_ndjson"]),
        "checks": checks,
    }
