"""The report's numbers: figures formatted for the tables, and the headline rows (each figure
beside its baseline from the same run, and their ratio), read from the benchmarks' results."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

Json = dict[str, Any]
MIB = 1 << 20


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
