"""Time to roll back a failover that loses N mutations, with real daemon and router processes.

1. A daemon starts on a temp directory; `indexer feed --state` loads a first batch (default
   100,000 mutations over 20,000 docids) and waits until it is persisted: that is a recovery
   point.
2. A second batch of N mutations (default 100,000) over the same docids is fed and persisted.
3. Every vbucket of the router's source log fails over to its seqno after step 1: the N
   mutations of step 2 are gone from the surviving history.
4. `indexer feed --state` connects again. Its handshake makes the daemon roll the index back to
   the recovery point of step 1; the router then streams nothing (the survivors are persisted).

Printed: the restore as the daemon logs it (documents reverted, seconds), the router's whole
reconnect (handshake with the rollback, until the feed exits), and a check that the index holds
exactly the surviving documents. Ends with one JSON line.

    .venv/bin/python bench/rollback.py [--base N] [--lost N] [--keys K] [--keep]
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from common import Daemon, in_workdir, say  # bench/common.py: run as `python bench/...`

from indexer.keys import MISSING, field_value
from indexer.router import SourceLog, Workload, generate

ROLLED = re.compile(r"rolled back to (.+?) \(.*?: (\d+|all) documents reverted in ([\d.]+) s")


def feed(daemon: Daemon, state: Path) -> float:
    """`indexer feed --state` to the daemon; its wall time."""
    args = [daemon.address]
    started = time.monotonic()
    subprocess.run(
        [sys.executable, "-m", "indexer", "feed", "--state", str(state), "--to", *args],
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    return time.monotonic() - started


def append(state: Path, mutations: int, keys: int, seed: int) -> None:
    """Add a generated batch to the source log (what `--generate` does, with our seed)."""
    with SourceLog(state, create=True) as log:
        log.append(generate(Workload(mutations, keys, 0.1, seed)))


def run(opts: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    state = workdir / "router"
    daemon = Daemon.in_workdir(workdir / "daemon")
    daemon.start()
    try:
        append(state, opts.base, opts.keys, 1)
        base_s = feed(daemon, state)
        time.sleep(0.5)  # the quiet daemon persists: a recovery point
        with SourceLog(state, create=False) as log:
            kept = {vb: log.high_seqno(vb) for vb in log.vbuckets_with_history()}
        append(state, opts.lost, opts.keys, 2)
        lost_s = feed(daemon, state)
        time.sleep(0.5)
        with SourceLog(state, create=False) as log:
            for vb in log.vbuckets_with_history():
                log.failover(vb, kept.get(vb, 0))
            survivors = log.surviving_documents()
        reconnect_s = feed(daemon, state)
        found = ROLLED.findall(daemon.log())
        if not found:
            raise RuntimeError("the daemon did not roll back:\n" + daemon.log()[-3000:])
        target, reverted, restore_s = found[-1]
        counts = {}
        for name in ("by_city", "by_age"):
            answer = httpx.get(f"{daemon.url}/indexes/{name}/count", timeout=30).json()
            counts[name] = answer["count"]
    finally:
        daemon.stop_cleanly()
    expected = {
        "by_city": sum(
            1
            for d in survivors.values()
            if d.body is not None and field_value(d.body, "address.city") is not MISSING
        ),
        "by_age": sum(
            1
            for d in survivors.values()
            if d.body is not None and field_value(d.body, "age") is not MISSING
        ),
    }
    say(
        f"loaded {opts.base:,} mutations in {base_s:.2f} s, "
        f"then {opts.lost:,} more in {lost_s:.2f} s"
    )
    say(
        f"failover of {len(kept)} vbuckets to their seqnos before the second batch: "
        f"{opts.lost:,} mutations lost"
    )
    say(
        f"rollback to {target}: {reverted} documents reverted in {float(restore_s):.3f} s "
        f"(the daemon's restore); the router's reconnect took {reconnect_s:.2f} s in all"
    )
    say(f"entries after the rollback: {counts}; model of the surviving history: {expected}")
    if counts != expected:
        raise RuntimeError("the index does not equal the surviving history")
    return {
        "base_mutations": opts.base,
        "lost_mutations": opts.lost,
        "keys": opts.keys,
        "vbuckets": len(kept),
        "rollback_target": target,
        "documents_reverted": int(reverted) if reverted != "all" else None,
        "restore_s": float(restore_s),
        "reconnect_s": round(reconnect_s, 3),
        "load_s": round(base_s, 3),
        "lost_load_s": round(lost_s, 3),
        "entries": counts,
        "equal_to_model": counts == expected,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base", type=int, default=100_000, help="first batch (default 100,000)")
    parser.add_argument("--lost", type=int, default=100_000, help="lost batch (default 100,000)")
    parser.add_argument("--keys", type=int, default=20_000, help="docids (default 20,000)")
    parser.add_argument("--keep", action="store_true", help="keep the temp directory")
    opts = parser.parse_args()
    return in_workdir("rollback-bench-", opts.keep, lambda workdir: run(opts, workdir))


if __name__ == "__main__":
    raise SystemExit(main())
