"""Run every benchmark, then write the plots, the headline table and docs/performance.md's report.

    python bench/report.py [--quick] [--skip-spark] [--only NAME,...] [--results DIR]
    python bench/report.py --from-results DIR

The benchmarks (pipeline, ingest, scan, rollback, router, build, memory, spark, postgres:
`bench/NAME.py`) run one after the other as subprocesses with their default sizes; `--quick`
gives them small sizes instead, to check the whole chain in a few minutes (its figures are not
to be quoted), and `--only` runs just the ones named. Each one's stdout is saved to
DIR/NAME.out (stderr to NAME.err) and its last line, one JSON object, with the run's conditions
to DIR/NAME.json; DIR is bench/results (not committed). `--from-results DIR` runs nothing and
renders what DIR holds.

Rendering reads every NAME.json in the results directory (so a run with `--only` keeps the other
benchmarks' latest results) and writes: PNG plots into docs/perf/ (matplotlib, Agg), the
headline table (each figure beside its baseline from the same run, and their ratio) to
docs/perf/headline.md and the README's headline figures (between its `headline` markers), and
the part of docs/performance.md between the lines
`<!-- report:start -->` and `<!-- report:end -->` (inserted after the title when missing). The
rest of that document, the hand-written method and analysis, is left as it is. Exit code 1 when
a benchmark failed (the others are still rendered).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import matplotlib
import psutil

matplotlib.use("Agg")  # files only, no display

from matplotlib.axes import Axes
from matplotlib.figure import Figure

BENCH_DIR = Path(__file__).resolve().parent
ROOT = BENCH_DIR.parent
RESULTS = BENCH_DIR / "results"
DOCS = ROOT / "docs"
PERF = DOCS / "perf"
REPORT = DOCS / "performance.md"
START = "<!-- report:start -->"
END = "<!-- report:end -->"
README = ROOT / "README.md"
HEADLINE_START = "<!-- headline:start -->"
HEADLINE_END = "<!-- headline:end -->"
MIB = 1 << 20
FIGSIZE = (7.0, 3.5)  # inches; at DPI a 560 x 280 image, a few tens of KiB
DPI = 80
RAW_COLOR = "#9e9e9e"  # baselines are grey everywhere
COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd")

Json = dict[str, Any]


@dataclass(frozen=True)
class Bench:
    """One benchmark script and the arguments of its quick run."""

    name: str
    quick: tuple[str, ...]


BENCHES = (
    Bench("pipeline", ("--documents", "50000")),
    Bench("ingest", ("--mutations", "200000", "--naive-mutations", "50000", "--raw-repeats", "1")),
    Bench(
        "scan",
        ("--mutations", "20000", "--keys", "5000", "--requests", "40", "--feed-rate", "5000"),
    ),
    Bench("rollback", ("--base", "20000", "--lost", "20000", "--keys", "5000")),
    Bench("router", ("--documents", "20000", "--rounds", "4", "--hold", "0.5")),
    Bench("build", ("--documents", "20000", "--feed-rate", "2000", "--feed-max-s", "20")),
    Bench("memory", ("--mutations", "200000", "--stuck-s", "5")),
    Bench("spark", ("--documents", "50000", "--rounds", "1")),
    Bench("postgres", ("--quick",)),
)
NAMES = tuple(b.name for b in BENCHES)


# --------------------------------------------------------------------------------------------
# Running


def machine() -> Json:
    """The conditions of a run: cores, memory, Python, OS, load."""
    return {
        "cores": os.cpu_count(),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "python": platform.python_version(),
        "system": f"{platform.system()} {platform.machine()}",
        "load_avg_1m": round(os.getloadavg()[0], 2),
    }


def last_json(text: str) -> Json | None:
    """The last line of `text` that is a JSON object."""
    for line in reversed(text.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                value = json.loads(line)
            except ValueError:
                continue
            if isinstance(value, dict):
                return value
    return None


def run_bench(bench: Bench, args: Sequence[str], results: Path, quick: bool) -> bool:
    """Run one benchmark, echoing its lines; save its output and summary; whether it passed."""
    command = [sys.executable, str(BENCH_DIR / f"{bench.name}.py"), *args]
    print(f"== {bench.name}: {' '.join(['bench/' + bench.name + '.py', *args])}", flush=True)
    started = time.time()
    conditions = machine()
    out_path = results / f"{bench.name}.out"
    err_path = results / f"{bench.name}.err"
    with open(out_path, "w") as out, open(err_path, "w") as err:
        proc = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL, text=True
        )
        assert proc.stdout is not None
        for line in proc.stdout:
            out.write(line)
            if not line.startswith("{"):  # the JSON summary is long: it goes to the file only
                print(f"  {line.rstrip()}", flush=True)
        code = proc.wait()
    seconds = time.time() - started
    summary = last_json(out_path.read_text())
    if code != 0 or summary is None:
        tail = err_path.read_text()[-3000:]
        print(f"== {bench.name}: FAILED (exit code {code}) after {seconds:.0f} s\n{tail}")
        return False
    record = {
        "bench": bench.name,
        "args": list(args),
        "quick": quick,
        "started": datetime.fromtimestamp(started).isoformat(timespec="seconds"),
        "seconds": round(seconds, 1),
        "machine": conditions,
        "result": summary,
    }
    (results / f"{bench.name}.json").write_text(json.dumps(record) + "\n")
    print(f"== {bench.name}: done in {seconds:.0f} s", flush=True)
    return True


def load_results(results: Path) -> dict[str, Json]:
    """Every saved record in `results`, by benchmark (NAME.json, else NAME.out's last line)."""
    found: dict[str, Json] = {}
    for name in NAMES:
        record_path = results / f"{name}.json"
        out_path = results / f"{name}.out"
        if record_path.exists():
            found[name] = json.loads(record_path.read_text())
        elif out_path.exists() and (summary := last_json(out_path.read_text())) is not None:
            stamp = datetime.fromtimestamp(out_path.stat().st_mtime)
            found[name] = {
                "bench": name,
                "quick": False,
                "started": stamp.isoformat(timespec="seconds"),
                "result": summary,
            }
    return found


# --------------------------------------------------------------------------------------------
# Numbers


def num(value: float | None, digits: int = 0) -> str:
    """1,234,567 or 1.23; a dash for a missing value."""
    if value is None:
        return "-"
    return f"{value:,.{digits}f}"


def times(value: float | None) -> str:
    """A ratio as 0.52x, 0.012x below 0.1 (a dash when missing)."""
    if value is None:
        return "-"
    return f"{value:.2f}x" if value >= 0.095 else f"{value:.2g}x"


def plural(count: int, word: str) -> str:
    """ "1 pause", "2 pauses"."""
    return f"{count} {word}{'' if count == 1 else 's'}"


def div(a: float | None, b: float | None) -> float | None:
    """a / b, or None when either is missing or b is 0."""
    return None if a is None or not b else a / b


@dataclass
class Row:
    """One line of the headline table: a figure beside its baseline of the same run."""

    bench: str
    figure: str
    value: str
    baseline: str
    baseline_value: str
    ratio: str


def pipeline_rows(r: Json) -> list[Row]:
    """The honest headline: a JSONL file to persisted through the router, beside the daemon's
    own intake, other layouts of nodes and PostgreSQL on the same documents."""
    one = f"{num(r.get('docs_per_s_1'))} docs/s"
    rows = [
        Row(
            "pipeline",
            "documents/s from a JSONL file to persisted, 1 node",
            one,
            "the daemon's pre-encoded intake (the ceiling)",
            f"{num(r.get('ceiling_per_s'))} mutations/s",
            times(r.get("ratio_1")),
        ),
        Row(
            "pipeline",
            "the same, 2 nodes sliced by a cluster map",
            f"{num(r.get('docs_per_s_2_slices'))} docs/s",
            "1 node",
            one,
            times(r.get("ratio_2_slices_vs_1")),
        ),
        Row(
            "pipeline",
            "the same, 2 replica nodes",
            f"{num(r.get('docs_per_s_2_replicas'))} docs/s",
            "1 node",
            one,
            times(r.get("ratio_2_replicas_vs_1")),
        ),
        Row(
            "pipeline",
            "router CPU per document, 1 node",
            f"{num(r.get('router_cpu_us_per_doc'), 1)} µs/doc",
            "the daemon's CPU per document",
            f"{num(r.get('daemon_cpu_us_per_doc_1'), 1)} µs/doc",
            times(div(r.get("router_cpu_us_per_doc"), r.get("daemon_cpu_us_per_doc_1"))),
        ),
        Row(
            "pipeline",
            "router CPU per document, 1 node, --shards 2 (all processes)",
            f"{num(r.get('router_cpu_us_per_doc_shards2'), 1)} µs/doc",
            "one router process",
            f"{num(r.get('router_cpu_us_per_doc'), 1)} µs/doc",
            times(r.get("shards2_cpu_vs_1")),
        ),
    ]
    pg = r.get("pg_docs_per_s")
    rows.append(
        Row(
            "pipeline",
            "documents/s from a JSONL file to persisted, 1 node",
            one,
            "PostgreSQL: COPY, upserts, the same two indexes"
            if pg
            else "PostgreSQL (not run: no binaries, or skipped)",
            f"{num(pg)} docs/s" if pg else "-",
            times(r.get("ratio_vs_postgres")),
        )
    )
    return rows


def headline_rows(results: dict[str, Json]) -> list[Row]:
    """The headline figures of every benchmark present, each beside its baseline."""
    rows: list[Row] = []
    if "pipeline" in results:
        rows += pipeline_rows(results["pipeline"]["result"])
    if "ingest" in results:
        r = results["ingest"]["result"]
        e2e = f"{num(r.get('e2e_per_s'))} mutations/s"
        rows.append(
            Row(
                "ingest",
                "end to end, router to persisted ack",
                e2e,
                "raw storage writes (the limit)",
                f"{num(r.get('raw_per_s'))} mutations/s",
                times(r.get("ratio_vs_raw")),
            )
        )
        if r.get("naive_per_s"):
            rows.append(
                Row(
                    "ingest",
                    "end to end",
                    e2e,
                    "naive server",
                    f"{num(r.get('naive_per_s'))} mutations/s",
                    times(r.get("ratio_vs_naive")),
                )
            )
    if "scan" in results:
        r = results["scan"]["result"]
        raw = f"{num(r.get('raw_rows_per_s'))} rows/s"
        for label, key, ratio_key in (
            ("NDJSON over HTTP", "ndjson_rows_per_s", "ratio_ndjson_vs_raw"),
            ("Arrow over HTTP", "arrow_rows_per_s", "ratio_arrow_vs_raw"),
            ("Spark count()", "spark_rows_per_s", "ratio_spark_vs_raw"),
        ):
            if r.get(key) is None:
                continue
            rows.append(
                Row(
                    "scan",
                    f"full scan, {label}",
                    f"{num(r[key])} rows/s",
                    "raw plyvel iterator",
                    raw,
                    times(r.get(ratio_key)),
                )
            )
        if r.get("ratio_aggregate_vs_client") is not None:
            rows.append(
                Row(
                    "scan",
                    "group-by count computed in the index",
                    f"{num(r['aggregate_ms'], 1)} ms",
                    "a full scan counted in the client",
                    f"{num(r['client_count_ms'], 1)} ms",
                    times(div(r["aggregate_ms"], r["client_count_ms"])),
                )
            )
            rows.append(
                Row(
                    "scan",
                    "one scan of 10 eq spans (an IN list)",
                    f"{num(r['spans_ms'], 1)} ms",
                    "10 scans of one value each",
                    f"{num(r['single_scans_ms'], 1)} ms",
                    times(div(r["spans_ms"], r["single_scans_ms"])),
                )
            )
        if r.get("ratio_array_vs_plain_per_entry") is not None:
            rows.append(
                Row(
                    "scan",
                    "ingest into a DISTINCT ARRAY index (5 elements each)",
                    f"{num(r['array_index_entries_per_s'])} entries/s",
                    "the same documents into an index on a plain field",
                    f"{num(r['plain_index_entries_per_s'])} entries/s",
                    times(r["ratio_array_vs_plain_per_entry"]),
                )
            )
        if r.get("request_plus_p99_ms") is not None:
            rows.append(
                Row(
                    "scan",
                    "request_plus count p99 under a feed",
                    f"{num(r['request_plus_p99_ms'], 1)} ms",
                    "2 x snapshot interval + mean flush",
                    f"{num(r.get('request_plus_target_ms'), 1)} ms",
                    times(div(r["request_plus_p99_ms"], r.get("request_plus_target_ms"))),
                )
            )
    if "spark" in results:
        r = results["spark"]["result"]
        rows.append(
            Row(
                "spark",
                f"load {num(r['documents'])} documents from Parquet through the writer",
                f"{num(r.get('writer_per_s'))} docs/s",
                "the router's JSONL rate, same documents",
                f"{num(r.get('jsonl_per_s'))} docs/s",
                times(r.get("ratio_writer_vs_jsonl")),
            )
        )
        raw = f"{num(r.get('raw_per_s'))} rows/s"
        for label, key, ratio_key in (
            ("count()", "count_per_s", "ratio_count_vs_raw"),
            ("Parquet write", "parquet_per_s", "ratio_parquet_vs_raw"),
        ):
            rows.append(
                Row(
                    "spark",
                    f"read a {num(r['documents'])}-entry index, {label}, local[2]",
                    f"{num(r.get(key))} rows/s",
                    "raw plyvel iterator",
                    raw,
                    times(r.get(ratio_key)),
                )
            )
    if "rollback" in results:
        r = results["rollback"]["result"]
        rows.append(
            Row(
                "rollback",
                f"restore after losing {num(r.get('lost_mutations'))} mutations",
                f"{num(r.get('restore_s'), 2)} s",
                "loading those mutations",
                f"{num(r.get('lost_load_s'), 2)} s",
                times(div(r.get("restore_s"), r.get("lost_load_s"))),
            )
        )
    if "router" in results:
        r = results["router"]["result"]
        alone = r.get("router_per_s", {})
        real = r.get("with_indexers_per_s", {})
        for nodes in sorted(real, key=int):
            if real.get(nodes) is None:
                continue
            rows.append(
                Row(
                    "router",
                    f"documents/s to {nodes} daemon{'s' if nodes != '1' else ''}",
                    f"{num(real[nodes])} docs/s",
                    f"to {nodes} counting sink{'s' if nodes != '1' else ''}",
                    f"{num(alone.get(nodes))} docs/s",
                    times(div(real[nodes], alone.get(nodes))),
                )
            )
        memory = r.get("memory", {})
        if memory.get("max_memory_bytes") is not None:
            rows.append(
                Row(
                    "router",
                    "Mutation Manager memory, slow node",
                    f"{num(memory['max_memory_bytes'] / MIB, 2)} MiB",
                    "its cap",
                    f"{num(memory.get('capacity_bytes', 0) / MIB, 2)} MiB",
                    times(div(memory["max_memory_bytes"], memory.get("capacity_bytes"))),
                )
            )
    if "build" in results:
        r = results["build"]["result"]
        builds = r.get("builds", {})
        rows.append(
            Row(
                "build",
                "initial build of a new index, quiet (the log's mutations covered)",
                f"{num(r.get('quiet_build_seqnos_per_s'))} mutations/s",
                "loading the documents",
                f"{num(builds.get('load_per_s'))} docs/s",
                times(div(r.get("quiet_build_seqnos_per_s"), builds.get("load_per_s"))),
            )
        )
        lag = builds.get("lag", {})
        # What a user sees: a write to the router's input until a scan returns it.
        for stat in ("p50", "p99"):
            during = lag.get("build", {}).get(f"visible_{stat}_ms")
            before = lag.get("baseline", {}).get(f"visible_{stat}_ms")
            if during is None:
                continue
            rows.append(
                Row(
                    "build",
                    f"a write readable after, {stat}, during a build under the feed",
                    f"{num(during, 0)} ms",
                    "before the build, same feed",
                    f"{num(before, 0)} ms",
                    times(div(during, before)),
                )
            )
        halves = lag.get("baseline", {}).get("visible_p99_halves_ms")
        if halves:
            rows.append(
                Row(
                    "build",
                    "a write readable after, p99, second half of the time before the build",
                    f"{num(halves[1], 0)} ms",
                    "its first half (how much the usual lag varies)",
                    f"{num(halves[0], 0)} ms",
                    times(div(halves[1], halves[0])),
                )
            )
        rows.append(
            Row(
                "build",
                "scan of 2 nodes, merged",
                f"{num(r.get('scan_two_nodes_rows_per_s'))} rows/s",
                "1 node, NDJSON",
                f"{num(r.get('scan_one_node_ndjson_rows_per_s'))} rows/s",
                times(r.get("scan_ratio_two_vs_one_ndjson")),
            )
        )
    if "memory" in results:
        r = results["memory"]["result"]
        state = f"{plural(r.get('pauses', 0), 'pause')}, {plural(r.get('resumes', 0), 'resume')}"
        if r.get("settled_resumes"):
            state += f", {r['settled_resumes']} of them above the low mark"
        if r.get("stuck"):
            state += ", stuck paused"
        rows.append(
            Row(
                "memory",
                f"peak daemon RSS under a fast feed ({state})",
                f"{num(r.get('peak_rss_bytes', 0) / MIB, 1)} MiB",
                "memory quota",
                f"{num(r.get('quota_bytes', 0) / MIB, 1)} MiB",
                times(r.get("peak_rss_vs_quota")),
            )
        )
    if "postgres" in results:
        rows.append(postgres_row(results["postgres"]["result"]))
    return rows


def postgres_row(r: Json) -> Row:
    """A table's changes through `indexer router --postgres` to persisted, beside the router's
    JSONL rate for the same documents (or why it did not run)."""
    pg, jsonl = r.get("pg_changes_per_s"), r.get("jsonl_docs_per_s")
    baseline = "the router's JSONL rate, same documents"
    return Row(
        "postgres",
        f"changes/s from commit to persisted, {num(r.get('batch'))}-row transactions",
        "-" if pg is None else f"{num(pg)} changes/s",
        f"not run: {r['skipped']}" if r.get("skipped") else baseline,
        "-" if jsonl is None else f"{num(jsonl)} docs/s",
        times(r.get("ratio_pg_vs_jsonl")),
    )


def headline_table(rows: Sequence[Row]) -> str:
    """The rows as a markdown table."""
    lines = [
        "| benchmark | figure | value | baseline (same run) | baseline value | ratio |",
        "|---|---|---:|---|---:|---:|",
    ]
    lines += [
        f"| {r.bench} | {r.figure} | {r.value} | {r.baseline} | {r.baseline_value} | {r.ratio} |"
        for r in rows
    ]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------
# Plots


def figure(rows: int = 1) -> tuple[Figure, list[Axes]]:
    """A small figure with `rows` stacked axes sharing x."""
    fig = Figure(figsize=FIGSIZE, dpi=DPI, layout="constrained")
    axes = fig.subplots(rows, 1, sharex=True, squeeze=False)
    return fig, [a for row in axes for a in row]


def save(fig: Figure, name: str) -> Path:
    """Write a figure as docs/perf/NAME.png, optimised."""
    PERF.mkdir(parents=True, exist_ok=True)
    path = PERF / f"{name}.png"
    fig.savefig(path, dpi=DPI, pil_kwargs={"optimize": True})
    return path


def rate(
    t: Sequence[float], values: Sequence[float], window: int
) -> tuple[list[float], list[float]]:
    """Per-second rate of a growing counter over `window` samples, at each window's midpoint."""
    xs: list[float] = []
    ys: list[float] = []
    for i in range(window, len(t)):
        dt = t[i] - t[i - window]
        if dt > 0:
            xs.append((t[i] + t[i - window]) / 2)
            ys.append((values[i] - values[i - window]) / dt)
    return xs, ys


def label_bars(ax: Axes, bars: Any, texts: Sequence[str]) -> None:
    """Write a text above each bar."""
    for bar, text in zip(bars, texts, strict=True):
        ax.annotate(
            text,
            (bar.get_x() + bar.get_width() / 2, bar.get_height()),
            xytext=(0, 2),
            textcoords="offset points",
            ha="center",
            va="bottom",
            fontsize=7,
        )


def plot_ingest_timeline(r: Json) -> Path | None:
    """Mutations/s readable and received over time; queued records and slab MiB below."""
    series = r.get("timeline")
    if not series or len(series.get("t_s", [])) < 3:
        return None
    t = series["t_s"]
    interval = r.get("timeline_interval_s", 0.15)
    window = max(1, round(0.45 / interval)) if len(t) >= 12 else 1  # ~0.45 s when enough
    fig, (top, bottom) = figure(2)
    for key, label, color in (
        ("stable_seqno_sum", "readable (in-memory snapshots)", COLORS[0]),
        ("received_seqno_sum", "received from the router", COLORS[1]),
    ):
        xs, ys = rate(t, series[key], window)
        top.plot(xs, [y / 1000 for y in ys], label=label, color=color, linewidth=1.2)
    if r.get("raw_per_s"):
        top.axhline(
            r["raw_per_s"] / 1000, color=RAW_COLOR, linestyle="--", linewidth=1, label="raw limit"
        )
    top.axvline(r.get("e2e_seconds", 0), color="black", linestyle=":", linewidth=1)
    top.set_ylabel("thousand mutations/s")
    top.set_ylim(bottom=0)
    top.legend(fontsize=7, loc="upper right")
    top.set_title(
        f"Ingest of {num(r.get('mutations'))} mutations: {num(r.get('e2e_per_s'))}/s end to end "
        f"(dotted: persisted ack)",
        fontsize=9,
    )
    bottom.plot(t, [q / 1000 for q in series["queued"]], color=COLORS[2], linewidth=1.2)
    bottom.set_ylabel("queued (thousands)", color=COLORS[2])
    bottom.set_ylim(bottom=0)
    slab = bottom.twinx()
    slab.plot(t, [b / MIB for b in series["slab_bytes"]], color=COLORS[4], linewidth=1.2)
    pool = r.get("slab_pool_bytes")
    slab.set_ylabel(
        "slab in use (MiB" + (f" of {pool / MIB:.0f})" if pool else ")"), color=COLORS[4]
    )
    slab.set_ylim(bottom=0)
    bottom.set_xlabel("seconds since the router's first byte")
    return save(fig, "ingest_timeline")


def plot_memory_timeline(r: Json) -> Path | None:
    """Daemon RSS over time against the quota and marks, paused spans and pause/resume marks."""
    series = r.get("timeline")
    if not series or not series.get("t_s"):
        return None
    t = series["t_s"]
    fig, (ax,) = figure(1)
    rss = [b / MIB for b in series["rss_bytes"]]
    ax.plot(t, rss, color=COLORS[0], linewidth=1.4, label="daemon RSS")
    for key, label, style in (
        ("quota_bytes", "quota", "-"),
        ("high_mark_bytes", "pause at (high mark)", "--"),
        ("low_mark_bytes", "resume below (low mark)", ":"),
    ):
        if r.get(key):
            ax.axhline(r[key] / MIB, color="black", linestyle=style, linewidth=0.9, label=label)
    spans: list[tuple[float, float]] = []
    since: float | None = None
    for x, paused in zip(t, series["throttle_paused"], strict=True):
        if paused and since is None:
            since = x
        elif not paused and since is not None:
            spans.append((since, x))
            since = None
    if since is not None:
        spans.append((since, t[-1]))
    for i, (x0, x1) in enumerate(spans):
        span_label = "reads paused" if i == 0 else None
        ax.axvspan(x0, x1, color=COLORS[3], alpha=0.12, linewidth=0, label=span_label)
    low_mark = r.get("low_mark_bytes", 0)
    events = [
        {**e, "settled": e["kind"] == "resume" and (e.get("settled") or e["rss_bytes"] > low_mark)}
        for e in r.get("events", [])
    ]
    for name, marker, color, chosen in (
        ("pause", "v", COLORS[3], [e for e in events if e["kind"] == "pause"]),
        (
            "resume below the low mark",
            "^",
            COLORS[2],
            [e for e in events if e["kind"] == "resume" and not e.get("settled")],
        ),
        (
            "resume above it (RSS would not fall)",
            "^",
            COLORS[1],
            [e for e in events if e["kind"] == "resume" and e.get("settled")],
        ),
    ):
        if chosen:
            ax.scatter(
                [e["t_s"] for e in chosen],
                [e["rss_bytes"] / MIB for e in chosen],
                marker=marker,
                color=color,
                zorder=3,
                label=f"{name} ({len(chosen)})",
            )
    ax.set_ylabel("RSS (MiB)")
    ax.set_xlabel("seconds since the feed started")
    low = min(min(rss), r.get("low_mark_bytes", 0) / MIB)
    high = max(max(rss), r.get("quota_bytes", 0) / MIB)
    ax.set_ylim(low * 0.95, high + (high - low) * 0.45)  # room for the legend above the quota
    readable = ax.twinx()
    readable.plot(
        t,
        [s / 1000 for s in series["stable_seqno_sum"]],
        color=RAW_COLOR,
        linewidth=1,
        label="readable mutations (right)",
    )
    readable.set_ylabel("readable (thousand mutations)", color="#616161")
    readable.set_ylim(0, r.get("mutations", 1) / 1000 * 1.5)  # under the legend too
    handles, labels = ax.get_legend_handles_labels()
    more, more_labels = readable.get_legend_handles_labels()
    readable.legend(handles + more, labels + more_labels, fontsize=6.5, loc="upper left", ncol=3)
    ax.set_title(
        f"Daemon memory under a fast feed: {r.get('pool')} slab pool, quota "
        f"{r.get('quota_bytes', 0) / MIB:.0f} MiB; {r.get('outcome', '')}",
        fontsize=9,
    )
    return save(fig, "memory_timeline")


def paired_bars(
    ax: Axes, groups: Sequence[tuple[str, float, str, float]], unit_divisor: float
) -> None:
    """Per group a bar and its baseline beside it, the ratio above the pair."""
    width = 0.38
    for i, (_, value, _, base) in enumerate(groups):
        bars = ax.bar(
            [i - width / 2, i + width / 2],
            [value / unit_divisor, base / unit_divisor],
            width,
            color=[COLORS[i % len(COLORS)], RAW_COLOR],
        )
        label_bars(ax, bars, [num(value / unit_divisor, 1), num(base / unit_divisor, 1)])
        ratio = div(value, base)
        ax.annotate(
            times(ratio),
            (i, max(value, base) / unit_divisor),
            xytext=(0, 12),
            textcoords="offset points",
            ha="center",
            fontsize=8,
            fontweight="bold",
        )
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels([f"{g[0]}\nvs {g[2]}" for g in groups], fontsize=8)
    top = max(max(g[1], g[3]) for g in groups) / unit_divisor
    bottom = min(min(g[1], g[3]) for g in groups) / unit_divisor
    if bottom > 0 and top / bottom > 20:  # a log scale keeps the small bars readable
        ax.set_yscale("log")
        ax.set_ylim(bottom / 3, top * 6)
        ax.set_ylabel(f"{ax.get_ylabel()} (log scale)")
    else:
        ax.set_ylim(0, top * 1.3)


def plot_scan_rates(r: Json) -> Path | None:
    """Full-scan rows/s of NDJSON, Arrow and Spark, each beside the raw plyvel iterator."""
    raw = r.get("raw_rows_per_s")
    if not raw:
        return None
    groups = [
        (label, float(r[key]), "raw iterator", float(raw))
        for label, key in (
            ("NDJSON", "ndjson_rows_per_s"),
            ("Arrow", "arrow_rows_per_s"),
            ("Spark", "spark_rows_per_s"),
        )
        if r.get(key)
    ]
    fig, (ax,) = figure(1)
    ax.set_ylabel("thousand rows/s")
    paired_bars(ax, groups, 1000)
    skipped = "" if r.get("spark_rows_per_s") else "; Spark skipped"
    ax.set_title(
        f"Full scans of {r.get('index', 'by_city')} ({num(r.get('rows'))} rows), each beside "
        f"the raw plyvel iterator of the same run{skipped}",
        fontsize=9,
    )
    return save(fig, "scan_rates")


def plot_ingest_rates(r: Json) -> Path | None:
    """End-to-end mutations/s beside the raw storage limit and the naive server."""
    if not r.get("e2e_per_s"):
        return None
    bars = [
        ("end to end", r["e2e_per_s"], COLORS[0]),
        ("raw storage limit", r.get("raw_per_s"), RAW_COLOR),
        ("raw, per mutation", r.get("raw_per_mutation_per_s"), "#c7c7c7"),
        ("naive server", r.get("naive_per_s"), "#7f7f7f"),
    ]
    present = [(label, float(v), c) for label, v, c in bars if v]
    fig, (ax,) = figure(1)
    ys = range(len(present))
    drawn = ax.barh(list(ys), [v / 1000 for _, v, _ in present], color=[c for *_, c in present])
    ax.set_yticks(list(ys))
    ax.set_yticklabels([label for label, _, _ in present], fontsize=8)
    ax.invert_yaxis()
    for bar, (_, value, _) in zip(drawn, present, strict=True):
        ratio = div(r["e2e_per_s"], value)
        text = f" {num(value / 1000, 0)}k" + ("" if bar is drawn[0] else f"  (e2e {times(ratio)})")
        ax.annotate(
            text,
            (bar.get_width(), bar.get_y() + bar.get_height() / 2),
            va="center",
            fontsize=7,
        )
    ax.set_xlabel("thousand mutations/s")
    ax.set_xlim(0, max(v for _, v, _ in present) / 1000 * 1.35)
    ax.set_title(
        f"Ingest of {num(r.get('mutations'))} mutations: end to end beside its references "
        "(same run)",
        fontsize=9,
    )
    return save(fig, "ingest_rates")


def plot_pipeline_rates(r: Json) -> Path | None:
    """Documents/s from a JSONL file to persisted by layout, beside the ceiling and PostgreSQL."""
    if not r.get("docs_per_s_1"):
        return None
    one = float(r["docs_per_s_1"])
    layouts = [
        ("1 node", one),
        ("2 nodes, sliced", r.get("docs_per_s_2_slices")),
        ("2 replica nodes", r.get("docs_per_s_2_replicas")),
    ]
    baselines = [
        ("ceiling: pre-encoded intake", r.get("ceiling_per_s")),
        ("PostgreSQL", r.get("pg_docs_per_s")),
    ]
    # (label, value, colour, annotation): layouts against 1 node, 1 node against the baselines
    present = [
        (label, float(v), COLORS[0], "" if i == 0 else f"  ({times(div(v, one))} of 1 node)")
        for i, (label, v) in enumerate(layouts)
        if v
    ] + [
        (label, float(v), RAW_COLOR, f"  (1 node: {times(div(one, v))} of it)")
        for label, v in baselines
        if v
    ]
    fig, (ax,) = figure(1)
    ys = range(len(present))
    drawn = ax.barh(list(ys), [p[1] / 1000 for p in present], color=[p[2] for p in present])
    ax.set_yticks(list(ys))
    ax.set_yticklabels([p[0] for p in present], fontsize=8)
    ax.invert_yaxis()
    for bar, (_, value, _, note) in zip(drawn, present, strict=True):
        ax.annotate(
            f" {num(value / 1000, 1)}k{note}",
            (bar.get_width(), bar.get_y() + bar.get_height() / 2),
            va="center",
            fontsize=7,
        )
    ax.set_xlabel("thousand documents/s, JSONL file to persisted")
    ax.set_xlim(0, max(p[1] for p in present) / 1000 * 1.4)
    ax.set_title(
        f"Pipeline of {num(r.get('documents'))} documents beside its ceiling and PostgreSQL "
        "(same run)",
        fontsize=9,
    )
    return save(fig, "pipeline_rates")


def plot_build_lag(r: Json) -> Path | None:
    """How long a write takes to become readable (p50, p99) in each phase of a build."""
    lag = r.get("builds", {}).get("lag", {})
    phases = [p for p in ("baseline", "build", "drain", "after") if lag.get(p, {}).get("probes")]
    if not phases:
        return None
    fig, (ax,) = figure(1)
    width = 0.38
    for j, (stat, color) in enumerate((("p50", COLORS[0]), ("p99", COLORS[1]))):
        values = [float(lag[p].get(f"visible_{stat}_ms", 0)) for p in phases]
        bars = ax.bar(
            [i + (j - 0.5) * width for i in range(len(phases))],
            values,
            width,
            color=color,
            label=stat,
        )
        label_bars(ax, bars, [num(v, 0) for v in values])
    ax.set_xticks(range(len(phases)))
    ax.set_xticklabels(phases, fontsize=8)
    ax.set_ylabel("write to readable (ms)")
    ax.set_ylim(0, max(float(lag[p].get("visible_p99_ms", 0)) for p in phases) * 1.25 + 1)
    ax.legend(fontsize=7)
    ax.set_title(
        f"A write readable after, around an index build, feed {num(r.get('feed_rate'))} docs/s",
        fontsize=9,
    )
    return save(fig, "build_lag")


def plot_router_rates(r: Json) -> Path | None:
    """Router docs/s by node count: to counting sinks and to real daemons."""
    alone = {int(k): v for k, v in r.get("router_per_s", {}).items() if v}
    real = {int(k): v for k, v in r.get("with_indexers_per_s", {}).items() if v}
    nodes = sorted(set(alone) | set(real))
    if not nodes:
        return None
    fig, (ax,) = figure(1)
    width = 0.38
    for j, (label, values, color) in enumerate(
        (("to counting sinks", alone, RAW_COLOR), ("to real daemons", real, COLORS[0]))
    ):
        # Side by side where both ran, centred where only one did.
        both = set(alone) & set(real)
        xs = [
            i + ((j - 0.5) * width if n in both else 0) for i, n in enumerate(nodes) if n in values
        ]
        ys = [values[n] / 1000 for n in nodes if n in values]
        bars = ax.bar(xs, ys, width, color=color, label=label)
        label_bars(ax, bars, [num(y, 1) for y in ys])
    ax.set_xticks(range(len(nodes)))
    ax.set_xticklabels([f"{n} node{'s' if n > 1 else ''}" for n in nodes], fontsize=8)
    ax.set_ylabel("thousand documents/s")
    ax.set_ylim(0, max([*alone.values(), *real.values()]) / 1000 * 1.25)
    ax.legend(fontsize=7)
    ax.set_title(
        f"Router throughput by node count ({num(r.get('documents'))} documents)", fontsize=9
    )
    return save(fig, "router_rates")


@dataclass(frozen=True)
class Plot:
    """A plot of one benchmark's result and its one-line caption."""

    bench: str
    draw: Callable[[Json], Path | None]
    alt: str
    caption: str


PLOTS = (
    Plot(
        "pipeline",
        plot_pipeline_rates,
        "Pipeline rates",
        "Pipeline: documents/s from a JSONL file through `indexer router` to a persisted snapshot "
        "on 1 node, 2 sliced nodes and 2 replicas, beside the daemon's pre-encoded intake and "
        "PostgreSQL loading the same file, all in one run.",
    ),
    Plot(
        "ingest",
        plot_ingest_rates,
        "Ingest rates",
        "Ingest: end-to-end mutations/s beside the raw storage limit, the storage work of "
        "every mutation on its own, and the naive server, all on the same workload in one run.",
    ),
    Plot(
        "ingest",
        plot_ingest_timeline,
        "Ingest over time",
        "Ingest over time from `GET /stats` samples: mutations/s received and readable (top), "
        "records queued in the workers' rings and slab bytes in use (bottom).",
    ),
    Plot(
        "memory",
        plot_memory_timeline,
        "Memory under throttling",
        "Memory: the daemon's RSS under a feed faster than it writes, against its quota and "
        "marks; shaded while reads are paused (`bench/memory.py`).",
    ),
    Plot(
        "scan",
        plot_scan_rates,
        "Scan rates",
        "Scans: rows/s of full scans over HTTP (NDJSON, Arrow) and through Spark, each beside "
        "the raw plyvel iterator over the same store in the same run.",
    ),
    Plot(
        "build",
        plot_build_lag,
        "Build lag",
        "Index builds: how long a write to the router's input takes to become readable under "
        "a steady feed, before, during and after building a new index.",
    ),
    Plot(
        "router",
        plot_router_rates,
        "Router rates",
        "Router: documents/s streamed from one JSONL input to 1, 2 and 4 nodes, to sinks that "
        "only count and to real daemons.",
    ),
)


# --------------------------------------------------------------------------------------------
# docs/performance.md


def slug(heading: str, seen: dict[str, int]) -> str:
    """GitHub's anchor of a heading (lower case, punctuation dropped, -N for repeats)."""
    base = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
    count = seen.get(base, 0)
    seen[base] = count + 1
    return base if count == 0 else f"{base}-{count}"


def section_links(document: str) -> str:
    """Links to the level-2 sections of the hand-written part, in order."""
    seen: dict[str, int] = {}
    links = []
    in_code = False
    for line in document.splitlines():
        if line.startswith("```"):
            in_code = not in_code
        if in_code or not line.startswith("#"):
            continue
        match = re.match(r"^(#+)\s+(.*)$", line)
        if match is None:
            continue
        anchor = slug(match.group(2), seen)
        if len(match.group(1)) == 2:
            links.append(f"[{match.group(2)}](#{anchor})")
    return " · ".join(links)


def conditions(results: dict[str, Json]) -> str:
    """When and where: the latest run's date, the machine, the sizes."""
    records = list(results.values())
    dates = sorted(r.get("started", "")[:10] for r in records if r.get("started"))
    when = dates[-1] if dates else "unknown date"
    if dates and dates[0] != dates[-1]:
        when = f"{dates[0]} to {dates[-1]}"
    box = next((r["machine"] for r in records if r.get("machine")), None)
    where = (
        "machine not recorded"
        if box is None
        else f"{box['cores']} cores, {box['memory_gib']} GiB, Python {box['python']}, "
        f"{box['system']}"
    )
    loads = [r["machine"]["load_avg_1m"] for r in records if r.get("machine")]
    load = f"; load average before each run {min(loads)}-{max(loads)}" if loads else ""
    sizes = (
        "**quick run (small sizes): it checks the chain, its figures are not to be quoted**"
        if any(r.get("quick") for r in records)
        else "default sizes"
    )
    return f"Run {when}; {where}{load}; {sizes}."


def report_block(
    results: dict[str, Json], plots: Sequence[tuple[Plot, Path]], document: str
) -> str:
    """The generated part of docs/performance.md, between the markers."""
    names = ", ".join(f"`bench/{n}.py`" for n in NAMES if n in results)
    missing = [n for n in NAMES if n not in results]
    lines = [
        START,
        "<!-- Written by bench/report.py (make bench): edits between these markers are lost. -->",
        "",
        "## Latest figures",
        "",
        f"{conditions(results)} Benchmarks: {names}"
        + (f"; not run: {', '.join(missing)}" if missing else "")
        + ". Every figure is beside its baseline measured in the same run; the methods and "
        "what limits each figure are in the sections below.",
        "",
        headline_table(headline_rows(results)).rstrip("\n"),
        "",
    ]
    for plot, path in plots:
        lines += [f"![{plot.alt}](perf/{path.name})", "", f"*{plot.caption}*", ""]
    if "memory" in results:
        m = results["memory"]["result"]
        lines += [
            f"Memory run: {num(m.get('mutations'))} mutations over {num(m.get('keys'))} docids "
            f"from `indexer feed` into a daemon with a {m.get('pool')} slab pool, rings of "
            f"{num(m.get('ring_slots'))} slots and a quota of "
            f"{num(m.get('quota_bytes', 0) / MIB, 1)} MiB (idle RSS "
            f"{num(m.get('idle_rss_bytes', 0) / MIB, 1)} MiB); RSS and `GET /stats` every "
            f"{num(m.get('sample_interval_s', 0.1) * 1000)} ms. Outcome: {m.get('outcome')}, "
            f"{num(m.get('readable_share', 0) * 100)}% of the feed readable at the end.",
            "",
        ]
    lines += [f"Sections: {section_links(document)}", "", END]
    return "\n".join(lines)


def rewrite_report(block: str) -> None:
    """Replace the part between the markers, or insert it after the title line."""
    text = REPORT.read_text()
    if START in text and END in text and text.index(START) < text.index(END):
        before = text[: text.index(START)]
        after = text[text.index(END) + len(END) :]
        text = before + block + after
    else:
        title, _, rest = text.partition("\n")
        text = f"{title}\n\n{block}\n{rest}"
    REPORT.write_text(text)


def rewrite_readme_headline(table: str) -> None:
    """The README's headline figures, between its markers (left alone if it has none)."""
    text = README.read_text()
    if HEADLINE_START not in text or HEADLINE_END not in text:
        return
    before = text[: text.index(HEADLINE_START) + len(HEADLINE_START)]
    after = text[text.index(HEADLINE_END) :]
    README.write_text(f"{before}\n{table}\n{after}")


def outside_markers(text: str) -> str:
    """The document without its generated part (for the section links)."""
    if START in text and END in text:
        return text[: text.index(START)] + text[text.index(END) + len(END) :]
    return text


def render(results: dict[str, Json]) -> None:
    """Plots, headline table and the report block from the saved results."""
    if not results:
        print("no results to render")
        return
    plots: list[tuple[Plot, Path]] = []
    for plot in PLOTS:
        if plot.bench not in results:
            continue
        path = plot.draw(results[plot.bench]["result"])
        if path is not None:
            plots.append((plot, path))
            print(f"plot: {path.relative_to(ROOT)} ({path.stat().st_size / 1024:.0f} KiB)")
    rows = headline_rows(results)
    PERF.mkdir(parents=True, exist_ok=True)
    # The table and when it was measured, nothing else: the README copies it as it is.
    (PERF / "headline.md").write_text(f"{conditions(results)}\n\n{headline_table(rows)}")
    document = outside_markers(REPORT.read_text())
    rewrite_report(report_block(results, plots, document))
    rewrite_readme_headline(f"{conditions(results)}\n\n{headline_table(rows)}")
    print(f"wrote {(PERF / 'headline.md').relative_to(ROOT)}, {REPORT.relative_to(ROOT)}, README")
    print(headline_table(rows))


# --------------------------------------------------------------------------------------------
# Main


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes: check the chain")
    parser.add_argument(
        "--skip-spark", action="store_true", help="scan.py --skip-spark, and no spark.py"
    )
    parser.add_argument(
        "--only", default="", help=f"run only these, comma-separated ({', '.join(NAMES)})"
    )
    parser.add_argument(
        "--results", type=Path, default=RESULTS, help="where outputs go (default bench/results)"
    )
    parser.add_argument(
        "--from-results", type=Path, metavar="DIR", help="run nothing: render DIR's results"
    )
    opts = parser.parse_args(argv)
    opts.selected = [n.strip() for n in opts.only.split(",") if n.strip()] or list(NAMES)
    unknown = [n for n in opts.selected if n not in NAMES]
    if unknown:
        parser.error(f"unknown benchmark(s) {', '.join(unknown)}; known: {', '.join(NAMES)}")
    return opts


def main(argv: Sequence[str] | None = None) -> int:
    """Run the selected benchmarks (unless --from-results), then render."""
    opts = parse_args(argv)
    failed: list[str] = []
    if opts.from_results is not None:
        results_dir = opts.from_results
    else:
        results_dir = opts.results
        results_dir.mkdir(parents=True, exist_ok=True)
        began = time.time()
        for bench in BENCHES:
            if bench.name not in opts.selected:
                continue
            args = list(bench.quick) if opts.quick else []
            if bench.name == "scan" and opts.skip_spark:
                args.append("--skip-spark")
            if bench.name == "spark" and opts.skip_spark:
                continue
            if not run_bench(bench, args, results_dir, opts.quick):
                failed.append(bench.name)
        print(f"== benchmarks done in {time.time() - began:.0f} s", flush=True)
    render(load_results(results_dir))
    if failed:
        print(f"FAILED: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
