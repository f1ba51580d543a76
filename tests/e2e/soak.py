"""The long soak (`make soak`): SIGKILLs and power cuts across every process that holds state,
each scenario on its own daemon and feed, and nothing acknowledged lost.

- `daemon`: a router following a JSONL file into a daemon; the daemon killed (some kills during
  its recovery), now and then the router too (tests/e2e/crashloop.py);
- `shards`: a router of two shard processes; the whole router, one shard, or the daemon killed
  (tests/e2e/soak_shards.py);
- `postgres`: a router following a PostgreSQL table under random transactions; the router or
  the daemon killed (tests/e2e/soak_postgres.py).

A `power_cuts` share of the kills are power cuts (tests/powercut): the killed process's machine
loses every write it had not fsynced. Each scenario ends comparing the indexes (request_plus
scans, then dumps of the stopped store) with a model the code does not share; the soak prints
faults, cuts, documents, rows missing and phantom, and fails unless all are clean:

    python -m tests.e2e.soak --faults 1000 --seed 1 --power-cuts 0.5
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tests.e2e.crashloop import CrashLoopReport, run_crash_loop

# Each scenario's share of the faults.
SHARES = {"daemon": 0.5, "shards": 0.25, "postgres": 0.25}


def run_scenario(
    name: str, workdir: Path, faults: int, seed: int, power_cuts: float, say: Callable[[str], None]
) -> CrashLoopReport:
    workdir.mkdir(parents=True, exist_ok=True)
    if name == "daemon":
        # A router kill in ten faults would leave routers barely tested: about one in five.
        # The router's kills are drawn at random, so the loop goes on until the share is met.
        kills = max(1, round(faults * 0.75))
        return run_crash_loop(
            workdir,
            kills,
            seed=seed,
            router_kill_chance=1 / 3,
            power_cuts=power_cuts,
            say=say,
            faults=faults,
        )
    if name == "shards":
        from tests.e2e.soak_shards import run_shards_loop  # each scenario's needs, when it runs

        return run_shards_loop(workdir, faults, seed=seed, power_cuts=power_cuts, say=say)
    from tests.e2e.soak_postgres import run_postgres_loop

    return run_postgres_loop(workdir, faults, seed=seed, power_cuts=power_cuts, say=say)


def prefixed(name: str) -> Callable[[str], None]:
    """Print a scenario's progress lines under its name."""

    def say(line: str) -> None:
        print(f"{name}: {line}", flush=True)

    return say


def summary(reports: list[CrashLoopReport], seconds: float) -> str:
    faults = sum(r.faults for r in reports)
    cuts = sum(r.power_cuts for r in reports)
    lost = sum(len(r.lost_acknowledged) for r in reports)
    ok = all(r.ok for r in reports)
    return (
        f"soak: {faults} faults ({cuts} power cuts) across "
        f"{', '.join(r.scenario for r in reports)} in {seconds / 60:.0f} min; "
        f"{sum(r.documents for r in reports)} documents; acknowledged lost at restart {lost}, "
        f"rows missing {sum(r.missing for r in reports)}, "
        f"phantom {sum(r.phantoms for r in reports)}, "
        f"mismatches {sum(r.mismatches for r in reports)}: {'OK' if ok else 'FAILED'}"
    )


def main(argv: list[str] | None = None) -> int:
    """Run the scenarios one after the other (or at once); print each report and the total;
    exit 1 unless every one is clean."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--faults", type=int, default=1000, help="kills in all (default 1000)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--power-cuts", type=float, default=0.5, help="share of the kills that cut the power"
    )
    parser.add_argument(
        "--only",
        choices=sorted(SHARES),
        action="append",
        help="run only this scenario, with its share of --faults (repeatable)",
    )
    parser.add_argument(
        "--parallel", action="store_true", help="run the scenarios at the same time"
    )
    parser.add_argument("--workdir", type=Path, default=None, help="kept; default: a temp dir")
    args = parser.parse_args(argv)
    names = args.only or list(SHARES)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="indexer-soak-"))
    started = time.monotonic()

    def scenario(name: str) -> CrashLoopReport:
        faults = max(1, round(args.faults * SHARES[name]))
        print(f"{name}: {faults} faults in {workdir / name}", flush=True)
        report = run_scenario(
            name, workdir / name, faults, args.seed, args.power_cuts, prefixed(name)
        )
        print(report.summary(), flush=True)
        return report

    if args.parallel:
        # Each scenario's processes are its own: threads here only start, kill and poll them.
        with ThreadPoolExecutor(len(names)) as pool:
            reports = list(pool.map(scenario, names))
    else:
        reports = [scenario(name) for name in names]
    print(summary(reports, time.monotonic() - started), flush=True)
    ok = all(r.ok for r in reports)
    if ok and args.workdir is None:
        shutil.rmtree(workdir, ignore_errors=True)
    elif not ok:
        print(f"logs and data kept in {workdir}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
