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

This file runs the benchmarks and writes the documents; the headline rows and their numbers are
`report_numbers.py`'s, the plots `report_plots.py`'s.
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
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import psutil
from report_numbers import MIB, Json, headline_rows, headline_table, num  # bench/report_numbers.py
from report_plots import PERF, PLOTS, Plot  # bench/report_plots.py

BENCH_DIR = Path(__file__).resolve().parent
ROOT = BENCH_DIR.parent
RESULTS = BENCH_DIR / "results"
DOCS = ROOT / "docs"
REPORT = DOCS / "performance.md"
START = "<!-- report:start -->"
END = "<!-- report:end -->"
README = ROOT / "README.md"
HEADLINE_START = "<!-- headline:start -->"
HEADLINE_END = "<!-- headline:end -->"


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
