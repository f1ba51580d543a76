"""The build benchmark's processes (bench/build.py, bench/build_fanout.py): a router started on a
state directory, and a load waited for until it is appended and readable on the nodes."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path

import httpx
from common import (  # bench/common.py: run as `python bench/...`
    Daemon,
    Router,
    say,
)

WAIT_POLL_S = 0.05


# --------------------------------------------------------------------------------------------
# Processes


def start_router(workdir: Path, args: Sequence[str]) -> Router:
    """`indexer router --state WORKDIR/state --http 127.0.0.1:0 ARGS`, once its API listens."""
    workdir.mkdir(parents=True, exist_ok=True)
    state = str(workdir / "state")
    router = Router(workdir / "router.log", "--state", state, "--http", "127.0.0.1:0", *args)
    router.wait_url()
    return router


def wait_until(
    what: str, check: Callable[[], bool], alive: Sequence[Daemon | Router], timeout: float
) -> float:
    """Poll `check` until it holds (the processes still running); the monotonic time it did."""
    deadline = time.monotonic() + timeout
    while not check():
        for process in alive:
            process.check_alive()
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}: not within {timeout} s")
        time.sleep(WAIT_POLL_S)
    return time.monotonic()


def load(
    what: str,
    router: Router,
    nodes: Sequence[Daemon],
    total: int,
    started: float,
    client: httpx.Client,
    timeout: float,
) -> tuple[float, float]:
    """Until the router appended `total` seqnos and the nodes' readable snapshots add up to it;
    (appended, readable) seconds from `started`."""
    alive: list[Daemon | Router] = [router, *nodes]
    appended = wait_until(f"{what}: appended", lambda: router.appended() >= total, alive, timeout)
    readable = wait_until(
        f"{what}: readable",
        lambda: sum(node.readable(client) for node in nodes) >= total,
        alive,
        timeout,
    )
    return appended - started, readable - started


def check(label: str, got: int, want: int) -> bool:
    ok = got == want
    say(f"  {'check' if ok else 'WARNING'}: {label} {got:,} {'==' if ok else '!='} {want:,}")
    return ok
