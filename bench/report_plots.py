"""The report's plots (matplotlib, Agg: files only): one PNG per figure into docs/perf/, each
drawn from one benchmark's results."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, no display

from matplotlib.axes import Axes
from matplotlib.figure import Figure
from report_numbers import MIB, Json, div, num, times  # bench/report_numbers.py

PERF = Path(__file__).resolve().parent.parent / "docs" / "perf"
FIGSIZE = (7.0, 3.5)  # inches; at DPI a 560 x 280 image, a few tens of KiB
DPI = 80
RAW_COLOR = "#9e9e9e"  # baselines are grey everywhere
COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd")


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
