"""`make demo`: the daemon on the embedded default configuration, fed by a real router.

Starts `indexer serve`, pushes a generated workload through `indexer feed` over TCP, which returns
once the daemon has acknowledged a persisted snapshot covering everything, runs the Spark job of
`examples/spark_job.py` on that persisted snapshot through the HTTP API (local Spark), stops the
daemon with SIGINT, and prints what each index holds (from `indexer dump`). Run it again: the
feed resumes at the restart timestamp and sends nothing twice.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from config import default_config_text
from indexer.config import parse_config

MUTATIONS = 100_000


def indexer(*args: str) -> list[str]:
    return [sys.executable, "-m", "indexer", *args]


def wait_listening(daemon: subprocess.Popen[str], timeout: float = 30) -> None:
    """Echo the daemon's log until it says it listens."""
    assert daemon.stderr is not None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = daemon.stderr.readline()
        if not line:
            sys.exit("demo: the daemon exited during start-up (see its log above)")
        print("  daemon |", line.rstrip())
        if "listening for router feeds" in line:
            return
    sys.exit("demo: the daemon did not start listening in time")


def main() -> None:
    config = parse_config(default_config_text())
    server = config.server
    print(f"== starting the daemon (data in ./{server.data_dir}, feed port {server.feed_port})")
    daemon = subprocess.Popen(indexer("serve"), stderr=subprocess.PIPE, text=True)
    try:
        wait_listening(daemon)
        print(f"== feeding {MUTATIONS} generated mutations through a router feed")
        started = time.monotonic()
        fed = subprocess.run(
            indexer(
                "feed", "--to", f"{server.host}:{server.feed_port}", "--generate", str(MUTATIONS)
            ),
            check=False,
        )
        if fed.returncode != 0:
            sys.exit("demo: the feed failed (see above)")
        print(f"   persisted and acknowledged in {time.monotonic() - started:.1f} s")
        url = f"http://{server.host}:{server.http_port}"
        out = Path("demo-output") / "by_city_summary.parquet"
        print(f"== a Spark job (local) reads the persisted snapshot of by_city from {url}")
        job = subprocess.run(
            [
                sys.executable,
                "examples/spark_job.py",
                "--url",
                url,
                "--index",
                "by_city",
                "--out",
                str(out),
                "--top",
                "5",
            ],
            check=False,
        )
        if job.returncode != 0:
            sys.exit("demo: the Spark job failed (see above)")
    finally:
        daemon.send_signal(signal.SIGINT)
        assert daemon.stderr is not None
        for line in daemon.stderr:
            print("  daemon |", line.rstrip())
        code = daemon.wait(timeout=60)
    if code != 0:
        sys.exit(f"demo: the daemon exited with {code}")
    print("== what the indexes hold (indexer dump, at the last persisted snapshot)")
    for index in config.indexes:
        out = subprocess.run(
            indexer("dump", index.name), check=True, capture_output=True, text=True
        ).stdout.splitlines()
        entries = [json.loads(line) for line in out]
        leading = Counter(json.dumps(e["key"][0]) for e in entries)
        print(f"-- {index.name} on ({', '.join(index.keys)}): {len(entries)} entries")
        for line in out[:3]:
            print("   ", line)
        print("    ...")
        top = ", ".join(f"{k} x{n}" for k, n in leading.most_common(5))
        print(f"   most common {index.keys[0]}: {top}")
    print(f"== done; the store is in ./{Path(server.data_dir)} (delete it to start afresh)")


if __name__ == "__main__":
    main()
