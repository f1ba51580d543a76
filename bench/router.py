"""Router benchmark: the long-running router's Mutation Manager path, with real processes.

    python bench/router.py [--documents M] [--seed S] [--skip-daemons] [--keep]
                           [--memory-mb MB] [--slow-rate B] [--window B] [--memory-documents D]
                           [--rounds R] [--round-interval S] [--hold S] [--timeout S]

Everything runs on 127.0.0.1 as subprocesses: `indexer router`, and as its indexer nodes either
sinks (`bench/sink.py`: the protocol's indexer side, counting records and nothing else) or real
daemons (`indexer serve`, default configuration).

1. Throughput. A JSONL file of M generated documents (default 200,000 over M/5 docids, 10%
   deletes) is written first. For each number of nodes N in 1, 2, 4: N sinks start, then
   `indexer router --state NEW --jsonl FILE --to ... --http 127.0.0.1:0` (default memory cap).
   The clock runs from the router's start until every node has everything: per vbucket the last
   seqno the router assigned, i.e. the node's seqno sum equals M (the sink's own counter; a
   daemon's `received_seqno_sum`). Reported: mutations/s, the router's CPU time (main thread and
   its worker threads) and peak RSS, the sinks' CPU. N = 1 and 2 run again against real daemons:
   "router alone (sinks)" and "with real indexers" side by side.
2. Memory under a slow cursor. A router with `--memory-mb` (default 2) follows a JSONL file that
   gets D documents (default M/2) appended in R rounds (default 10, 0.5 s apart), and streams to
   two sinks: one fast, one reading at most `--slow-rate` bytes/s (default 100,000); both grant
   a flow-control window of `--window` bytes (default 256 KiB), so what the slow one cannot take
   stays in the router. Every 100 ms the router's `GET /stats` and RSS are sampled. Once the
   input has ended and the fast sink has everything, the slow sink stays slow `--hold` seconds
   (default 1), then its limit is lifted (SIGUSR1) and the bench waits until it has everything
   too. Reported: peak Mutation Manager memory against its cap (checked in every sample),
   cursors dropped (per node, from the router's log), items backfilled for each node, peak RSS,
   and whether and when the slow node received everything.

Prints one line per measurement and ends with one JSON object of every figure. Everything
lives in a temporary directory, removed at the end unless --keep is given.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
from common import (  # bench/common.py: run as `python bench/...`
    HOST,
    Daemon,
    Router,
    RssSampler,
    cpu_split,
    in_workdir,
    jsonl_lines,
    ratio,
    say,
    stop_process,
    wait_for_line,
)

from indexer.router import Workload, generate

BENCH_DIR = Path(__file__).resolve().parent
SINK_NODES = (1, 2, 4)
DAEMON_NODES = (1, 2)
DELETE_RATIO = 0.1
POLL_S = 0.02
DAEMON_POLL_S = 0.05
SAMPLE_S = 0.1
LOG_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) .*$", re.MULTILINE)
FELL_BEHIND = re.compile(r"(\S+) fell behind on vbucket")
MIB = 1 << 20


# --------------------------------------------------------------------------------------------
# Input


def append_lines(path: Path, lines: Sequence[str]) -> None:
    """Append whole lines in one write, so a follower never sees a line cut for long."""
    with open(path, "a") as f:
        f.write("".join(lines))


# --------------------------------------------------------------------------------------------
# Processes


class Sink:
    """`bench/sink.py` in a subprocess: its address and counters."""

    def __init__(self, workdir: Path, name: str, rate: int = 0, window: int | None = None) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        self.name = name
        self.stats_path = workdir / f"{name}.json"
        self.log_path = workdir / f"{name}.log"
        command = [sys.executable, str(BENCH_DIR / "sink.py"), "--port", "0"]
        command += ["--stats", str(self.stats_path), "--rate-bytes-per-s", str(rate)]
        if window is not None:  # the flow-control window, and frames no larger than it
            command += ["--flow-control-bytes", str(window), "--max-frame-bytes", str(window)]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )
        self.address = wait_for_line(self.log_path, r"listening on (\S+)", self.proc, 30)
        self.process = psutil.Process(self.proc.pid)

    def counts(self) -> dict[str, Any]:
        """Its last stats file (replaced atomically: never half written)."""
        try:
            counts: dict[str, Any] = json.loads(self.stats_path.read_text())
            return counts
        except (FileNotFoundError, ValueError):
            return {}

    def progress(self) -> tuple[int, float | None]:
        """(seqno sum received, wall time of its last receive with records)."""
        counts = self.counts()
        return counts.get("seqno_sum", 0), counts.get("updated_at")

    def cpu(self) -> float:
        total = self.process.cpu_times()
        return total.user + total.system

    def speed_up(self) -> None:
        self.proc.send_signal(signal.SIGUSR1)

    def stop(self) -> None:
        stop_process(self.proc)


def start_router(
    workdir: Path,
    jsonl: Path,
    targets: Sequence[str],
    memory_mb: float | None = None,
    follow: bool = False,
    cluster_map: Path | None = None,
    shards: int = 1,
) -> Router:
    """`indexer router` over a JSONL file to `targets` (or the nodes of `cluster_map`)."""
    workdir.mkdir(parents=True, exist_ok=True)
    args = ["--state", str(workdir / "state"), "--jsonl", str(jsonl), "--http", f"{HOST}:0"]
    for target in targets:
        args += ["--to", target]
    if cluster_map is not None:
        args += ["--cluster-map", str(cluster_map)]
    if memory_mb is not None:
        args += ["--memory-mb", str(memory_mb)]
    if follow:
        args.append("--follow")
    if shards > 1:
        args += ["--shards", str(shards)]
    return Router(workdir / "router.log", *args)


# --------------------------------------------------------------------------------------------
# 1. Throughput


@dataclass
class Progress:
    """Where a node stands: seqno sum received, when it got there (if it knows), and for a
    daemon the seqno sum of its readable snapshot."""

    received: int
    at: float | None = None
    readable: int | None = None


@dataclass
class Node:
    """A node of a throughput run, however it is run: its address, progress and CPU."""

    address: str
    poll: Callable[[], Progress]
    cpu: Callable[[], float]
    poll_s: float
    done_at: float | None = None
    readable_at: float | None = None
    last: Progress | None = None
    polled: float = 0.0


def sink_node(sink: Sink) -> Node:
    def poll() -> Progress:
        received, at = sink.progress()
        return Progress(received, at)

    return Node(sink.address, poll, sink.cpu, POLL_S)


def daemon_node(daemon: Daemon, client: httpx.Client) -> Node:
    def poll() -> Progress:
        stats = client.get(f"{daemon.url}/stats").json()
        return Progress(stats["vbuckets"]["received_seqno_sum"], None, stats["stable"]["seqno_sum"])

    def cpu() -> float:
        main, threads = daemon.cpu()
        return main + threads

    return Node(daemon.address, poll, cpu, DAEMON_POLL_S)


def wait_done(router: Router, nodes: Sequence[Node], total: int, timeout: float) -> None:
    """Poll until every node has everything (and a daemon has it readable)."""
    deadline = time.monotonic() + timeout
    while True:
        pending = False
        for node in nodes:
            if node.done_at is not None and node.readable_at is not None:
                continue
            now = time.monotonic()
            if now - node.polled >= node.poll_s:
                node.polled = now
                node.last = node.poll()
                if node.done_at is None and node.last.received >= total:
                    node.done_at = node.last.at or time.time()
                if node.last.readable is None or node.last.readable >= total:
                    node.readable_at = node.readable_at or time.time()
            pending = pending or node.done_at is None or node.readable_at is None
        if not pending:
            return
        router.check_alive()
        if time.monotonic() > deadline:
            state = {node.address: node.last for node in nodes}
            raise RuntimeError(f"not every node had {total} within {timeout} s: {state}")
        time.sleep(POLL_S)


def throughput(
    opts: argparse.Namespace, workdir: Path, jsonl: Path, total: int, count: int, real: bool
) -> dict[str, Any]:
    """One router run to `count` sinks or daemons: the router's start until all have all."""
    kind = "daemons" if real else "sinks"
    run_dir = workdir / f"{kind}-{count}"
    sinks: list[Sink] = []
    daemons: list[Daemon] = []
    router: Router | None = None
    client = httpx.Client(timeout=30)
    try:
        if real:
            for i in range(count):
                daemons.append(Daemon.in_workdir(run_dir / f"daemon{i}"))
                daemons[-1].start()
            nodes = [daemon_node(daemon, client) for daemon in daemons]
        else:
            sinks = [Sink(run_dir, f"sink{i}") for i in range(count)]
            nodes = [sink_node(sink) for sink in sinks]
        node_cpu = [node.cpu() for node in nodes]
        router = start_router(run_dir, jsonl, [node.address for node in nodes])
        peak = RssSampler(router.proc.pid, SAMPLE_S)
        peak.start()
        router.wait_url()
        wait_done(router, nodes, total, opts.timeout)
        main_cpu, thread_cpu = cpu_split(router.process)
        node_cpu = [node.cpu() - before for node, before in zip(nodes, node_cpu, strict=True)]
        stats = router.stats()
        peak_rss = peak.stop()
        router.stop_cleanly()
        sink_counts = [sink.counts() for sink in sinks]
        for daemon in daemons:
            daemon.stop_cleanly()  # exit 0 and "stopped cleanly", or it raises
    finally:
        client.close()
        if router is not None:
            router.kill()
        for sink in sinks:
            sink.stop()
        for daemon in daemons:
            daemon.kill()
    assert router is not None
    started = router.started
    done = max(node.done_at or 0.0 for node in nodes)
    seconds = done - started
    running_at = router.logged_at("router running") or started
    read_at = router.logged_at(f"read {total} documents") or done
    progress = stats["nodes"]
    items = {
        node.address: progress[node.address]["sent"] + progress[node.address]["backfilled"]
        for node in nodes
    }
    result: dict[str, Any] = {
        "kind": kind,
        "nodes": count,
        "documents": total,
        "seconds": round(seconds, 3),
        "per_s": round(total / seconds),
        "startup_s": round(running_at - started, 3),
        "per_s_after_startup": round(total / (done - running_at)),
        "input_appended_s": round(read_at - started, 3),
        "node_done_s": [round((node.done_at or 0.0) - started, 3) for node in nodes],
        "readable_s": (
            round(max(node.readable_at or 0.0 for node in nodes) - started, 3) if real else None
        ),
        "router_main_cpu_s": round(main_cpu, 2),
        "router_thread_cpu_s": round(thread_cpu, 2),
        "router_cpu_us_per_mutation": round((main_cpu + thread_cpu) / total * 1e6, 1),
        "router_peak_rss_bytes": peak_rss,
        "node_cpu_s": round(sum(node_cpu), 2),
        "items_sent": items,
        "items_backfilled": sum(progress[node.address]["backfilled"] for node in nodes),
        "cursors_dropped": stats["mutation_manager"]["cursors_dropped"],
    }
    if sinks:
        result["sink_records"] = [c.get("mutations") for c in sink_counts]
        result["sink_duplicates"] = sum(c.get("duplicates", 0) for c in sink_counts)
        result["records_match_router"] = [
            c.get("mutations") == items[sink.address]
            for c, sink in zip(sink_counts, sinks, strict=True)
        ]
    return result


def report_throughput(r: dict[str, Any]) -> None:
    label = "with real indexers" if r["kind"] == "daemons" else "router alone (sinks)"
    cursors = f"{r['nodes']} cursor" + ("s" if r["nodes"] > 1 else "")
    done = ", ".join(f"{s:.2f}" for s in r["node_done_s"])
    readable = "" if r["readable_s"] is None else f", readable at {r['readable_s']:.2f} s"
    nodes = "indexers" if r["kind"] == "daemons" else "sinks"
    items = sum(r["items_sent"].values())
    say(
        f"{label}, {cursors}: {r['per_s']:,} mutations/s ({r['documents']:,} in "
        f"{r['seconds']:.2f} s from the router's start; {r['per_s_after_startup']:,}/s after its "
        f"start-up of {r['startup_s']} s; input appended at {r['input_appended_s']} s, nodes "
        f"done at {done} s{readable}); router CPU "
        f"{r['router_main_cpu_s']:.2f} s main thread + {r['router_thread_cpu_s']:.2f} s other "
        f"threads ({r['router_cpu_us_per_mutation']} us/mutation), peak RSS "
        f"{r['router_peak_rss_bytes'] / MIB:.0f} MiB; {nodes} CPU {r['node_cpu_s']:.2f} s; "
        f"{items:,} items streamed ({r['items_backfilled']:,} from the log)"
    )
    if "records_match_router" in r:
        ok = all(r["records_match_router"]) and not r["sink_duplicates"]
        say(
            ("  check: " if ok else "  WARNING: ")
            + f"records counted by the sinks {r['sink_records']} "
            + ("==" if all(r["records_match_router"]) else "!=")
            + f" items the router sent; {r['sink_duplicates']} duplicates"
        )


# --------------------------------------------------------------------------------------------
# 2. Memory under a slow cursor


class StatsSampler(threading.Thread):
    """The router's `GET /stats` and RSS every 100 ms."""

    def __init__(self, router: Router) -> None:
        super().__init__(daemon=True)
        self.router = router
        self.samples: list[dict[str, Any]] = []
        self.failures = 0
        self.last: dict[str, Any] = {}
        self.stopped = threading.Event()

    def run(self) -> None:
        with httpx.Client(timeout=10) as client:
            while not self.stopped.is_set():
                try:
                    stats = client.get(f"{self.router.url}/stats").json()
                    rss = self.router.process.memory_info().rss
                except (httpx.HTTPError, ValueError, psutil.Error):
                    self.failures += 1
                else:
                    self.last = stats
                    manager = stats["mutation_manager"]
                    self.samples.append(
                        {
                            "t": time.time(),
                            "memory": manager["memory"],
                            "capacity": manager["capacity"],
                            "items": manager["items"],
                            "cursors_dropped": manager["cursors_dropped"],
                            "backfilling": manager["backfilling"],
                            "rss": rss,
                            "appended": stats["source"]["high_seqno_sum"],
                        }
                    )
                self.stopped.wait(SAMPLE_S)

    def stop(self) -> None:
        self.stopped.set()
        self.join()


def wait_until(
    what: str, check: Callable[[], bool], router: Router, timeout: float, fail: bool = True
) -> float | None:
    """Poll `check` until it holds; the wall time it did, or None after `timeout` (fail=False)."""
    deadline = time.monotonic() + timeout
    while not check():
        router.check_alive()
        if time.monotonic() > deadline:
            if fail:
                raise RuntimeError(f"{what}: not within {timeout} s")
            return None
        time.sleep(POLL_S)
    return time.time()


def memory_run(opts: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """A router over a followed file appended in rounds, a fast and a slow sink."""
    run_dir = workdir / "memory"
    total = opts.memory_documents
    workload = Workload(total, 0, DELETE_RATIO, opts.seed + 1)
    lines = jsonl_lines(generate(workload))
    per_round = -(-total // opts.rounds)
    jsonl = run_dir / "follow.jsonl"
    run_dir.mkdir(parents=True)
    jsonl.touch()
    fast = Sink(run_dir, "fast", 0, opts.window)
    slow = Sink(run_dir, "slow", opts.slow_rate, opts.window)
    router: Router | None = None
    sampler: StatsSampler | None = None
    try:
        router = start_router(
            run_dir, jsonl, [fast.address, slow.address], opts.memory_mb, follow=True
        )
        router.wait_url()
        sampler = StatsSampler(router)
        sampler.start()
        wait_for_line(router.log_path, r"(\S+): connected;", router.proc, 60, count=2)
        started = time.time()
        for start in range(0, total, per_round):
            if start:
                time.sleep(opts.round_interval)
            append_lines(jsonl, lines[start : start + per_round])
        input_end = time.time()
        appended_at = wait_until(
            "the router appending the input",
            lambda: bool(sampler and sampler.last.get("source", {}).get("high_seqno_sum") == total),
            router,
            opts.timeout,
        )
        wait_until("the fast sink", lambda: fast.progress()[0] >= total, router, opts.timeout)
        fast_done = fast.progress()[1]
        slow_when_fast_done = slow.progress()[0]
        time.sleep(opts.hold)
        slow_before = slow.counts()
        speed_up_at = time.time()
        slow.speed_up()
        slow_done = wait_until(
            "the slow sink", lambda: slow.progress()[0] >= total, router, opts.timeout, fail=False
        )
        time.sleep(3 * SAMPLE_S)  # a last sample after the catch-up
        sampler.stop()
        stats = router.stats()
        log = router.log()
        router.stop_cleanly()
        fast_counts, slow_counts = fast.counts(), slow.counts()
    finally:
        if sampler is not None and sampler.is_alive():
            sampler.stop()
        if router is not None:
            router.kill()
        fast.stop()
        slow.stop()
    samples = sampler.samples
    if not samples:
        raise RuntimeError(f"no /stats sample in the memory run ({sampler.failures} failures)")
    capacity = samples[-1]["capacity"]
    over = [s for s in samples if s["memory"] > s["capacity"]]
    dropped_per_node = {address: 0 for address in (fast.address, slow.address)}
    for address in FELL_BEHIND.findall(log):
        dropped_per_node[address] = dropped_per_node.get(address, 0) + 1
    manager = stats["mutation_manager"]
    fast_node = stats["nodes"][fast.address]
    slow_node = stats["nodes"][slow.address]
    return {
        "documents": total,
        "rounds": opts.rounds,
        "round_interval_s": opts.round_interval,
        "input_s": round(input_end - started, 3),
        "offered_per_s": round(total / (input_end - started)),
        "appended_after_input_s": round((appended_at or input_end) - input_end, 3),
        "slow_rate_bytes_per_s": opts.slow_rate,
        "capacity_bytes": capacity,
        "max_memory_bytes": max(s["memory"] for s in samples),
        "memory_within_cap": not over,
        "samples": len(samples),
        "sample_failures": sampler.failures,
        "max_items": max(s["items"] for s in samples),
        "max_backfilling": max(s["backfilling"] for s in samples),
        "cursors_dropped": manager["cursors_dropped"],
        "cursors_dropped_per_node": {
            "fast": dropped_per_node[fast.address],
            "slow": dropped_per_node[slow.address],
        },
        "items_expelled": manager["items_expelled"],
        "snapshots_collapsed": manager["snapshots_collapsed"],
        "fast_sent": fast_node["sent"],
        "fast_backfilled": fast_node["backfilled"],
        "slow_sent": slow_node["sent"],
        "slow_backfilled": slow_node["backfilled"],
        "fast_done_after_input_s": round(fast_done - input_end, 3) if fast_done else None,
        "slow_share_when_fast_done": round(slow_when_fast_done / total, 3),
        "slow_bytes_before_speed_up": slow_before.get("bytes", 0),
        "slow_speed_up_after_input_s": round(speed_up_at - input_end, 3),
        "slow_received_everything": slow_done is not None,
        "timeout_s": opts.timeout,
        "slow_done_after_speed_up_s": (
            round(slow_done - speed_up_at, 3) if slow_done is not None else None
        ),
        "slow_records": slow_counts.get("mutations"),
        "fast_records": fast_counts.get("mutations"),
        "duplicates": fast_counts.get("duplicates", 0) + slow_counts.get("duplicates", 0),
        "router_peak_rss_bytes": max(s["rss"] for s in samples),
        "router_first_rss_bytes": samples[0]["rss"],
    }


def report_memory(m: dict[str, Any]) -> None:
    cap = m["capacity_bytes"]
    say(
        f"memory run: {m['documents']:,} documents appended in {m['rounds']} rounds over "
        f"{m['input_s']:.2f} s ({m['offered_per_s']:,}/s offered; the router had them all "
        f"{m['appended_after_input_s']:.2f} s after the last round); one fast sink, one slow at "
        f"{m['slow_rate_bytes_per_s']:,} B/s"
    )
    say(
        f"  Mutation Manager memory: max {m['max_memory_bytes'] / MIB:.2f} MiB of the "
        f"{cap / MIB:.2f} MiB cap ({m['max_memory_bytes'] / cap:.0%}), at most "
        f"{m['max_items']:,} items; {m['samples']} samples every {SAMPLE_S * 1000:.0f} ms"
    )
    say(
        ("  check: memory <= cap in every sample" if m["memory_within_cap"] else "  WARNING: ")
        + ("" if m["memory_within_cap"] else "memory over the cap in some samples")
    )
    per = m["cursors_dropped_per_node"]
    say(
        f"  cursors dropped: {m['cursors_dropped']:,} (fast node {per['fast']:,}, slow node "
        f"{per['slow']:,}); at most {m['max_backfilling']:,} vbuckets backfilling at once; "
        f"{m['items_expelled']:,} items expelled"
    )
    if not m["cursors_dropped"]:
        say(
            "  note: no cursor was dropped, the slow node never fell a cap's worth behind "
            "(more --memory-documents, a lower --slow-rate or --memory-mb would make it)"
        )
    say(
        f"  items streamed: slow node {m['slow_sent']:,} from memory + {m['slow_backfilled']:,} "
        f"backfilled from the log; fast node {m['fast_sent']:,} + {m['fast_backfilled']:,}"
    )
    slow = (
        f"had everything {m['slow_done_after_speed_up_s']:.2f} s later"
        if m["slow_received_everything"]
        else f"did NOT have everything {m['timeout_s']:.0f} s later"
    )
    say(
        f"  fast node had everything {m['fast_done_after_input_s']:.2f} s after the last round; "
        f"the slow node had {m['slow_share_when_fast_done']:.0%} of the seqno sum then; its limit "
        f"was lifted {m['slow_speed_up_after_input_s']:.2f} s after the last round and it {slow}"
    )
    say(
        f"  router RSS: {m['router_first_rss_bytes'] / MIB:.0f} MiB at the first sample, peak "
        f"{m['router_peak_rss_bytes'] / MIB:.0f} MiB"
    )


# --------------------------------------------------------------------------------------------
# Main


@dataclass
class Figures:
    runs: list[dict[str, Any]] = field(default_factory=list)

    def per_s(self, kind: str, nodes: int) -> int | None:
        for r in self.runs:
            if r["kind"] == kind and r["nodes"] == nodes:
                value: int = r["per_s"]
                return value
        return None


def run(opts: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    total = opts.documents
    workload = Workload(total, 0, DELETE_RATIO, opts.seed)
    jsonl = workdir / "input.jsonl"
    append_lines(jsonl, jsonl_lines(generate(workload)))
    say(
        f"workload: {total:,} documents over {workload.key_space:,} docids, "
        f"{DELETE_RATIO:.0%} deletes, seed {opts.seed} ({jsonl.stat().st_size / MIB:.1f} MiB of "
        f"JSONL); {os.cpu_count()} cores, Python {sys.version.split()[0]}"
    )
    figures = Figures()
    plan = [("sinks", n) for n in SINK_NODES]
    if opts.skip_daemons:
        say("with real indexers: skipped (--skip-daemons)")
    else:
        plan += [("daemons", n) for n in DAEMON_NODES]
    for kind, count in plan:
        result = throughput(opts, workdir, jsonl, total, count, kind == "daemons")
        report_throughput(result)
        figures.runs.append(result)
    for count in DAEMON_NODES:
        alone, real = figures.per_s("sinks", count), figures.per_s("daemons", count)
        if real is not None:
            say(
                f"{count} cursor{'s' if count > 1 else ''}: router alone (sinks) {alone:,}/s, "
                f"with real indexers {real:,}/s ({ratio(real, alone)} of it)"
            )
    memory = memory_run(opts, workdir)
    report_memory(memory)
    return {
        "documents": total,
        "keys": workload.key_space,
        "seed": opts.seed,
        "router_per_s": {str(n): figures.per_s("sinks", n) for n in SINK_NODES},
        "with_indexers_per_s": {str(n): figures.per_s("daemons", n) for n in DAEMON_NODES},
        "throughput_runs": figures.runs,
        "memory": memory,
        "memory_within_cap": memory["memory_within_cap"],
        "slow_node_received_everything": memory["slow_received_everything"],
        "cores": os.cpu_count(),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--documents", type=int, default=200_000, help="default 200,000")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument(
        "--skip-daemons", action="store_true", help="sinks only, no run with real indexers"
    )
    parser.add_argument(
        "--memory-mb", type=float, default=2.0, help="the memory run's cap (default 2)"
    )
    parser.add_argument(
        "--slow-rate", type=int, default=100_000, help="the slow sink's bytes/s (default 100,000)"
    )
    parser.add_argument(
        "--memory-documents", type=int, default=None, help="the memory run's (default M/2)"
    )
    parser.add_argument(
        "--window",
        type=int,
        default=256 << 10,
        help="the memory run's flow-control window and largest frame, bytes (default 256 KiB)",
    )
    parser.add_argument("--rounds", type=int, default=10, help="appends of the memory run")
    parser.add_argument(
        "--round-interval", type=float, default=0.5, help="seconds between appends (default 0.5)"
    )
    parser.add_argument(
        "--hold", type=float, default=1.0, help="seconds the slow sink stays slow after the input"
    )
    parser.add_argument("--timeout", type=float, default=300, help="of every wait, seconds")
    parser.add_argument("--keep", action="store_true", help="keep the temp directory")
    opts = parser.parse_args()
    if opts.memory_documents is None:
        opts.memory_documents = max(1, opts.documents // 2)
    if min(opts.documents, opts.memory_documents, opts.rounds, opts.slow_rate) < 1:
        parser.error("--documents, --memory-documents, --rounds and --slow-rate must be >= 1")
    return in_workdir("router-bench-", opts.keep, lambda workdir: run(opts, workdir))


if __name__ == "__main__":
    raise SystemExit(main())
