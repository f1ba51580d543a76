"""Power cuts on the machine of `indexer router --postgres` (its `--state` under the power-loss
layer), half right after its confirmed LSN advanced, and one on the daemon's, under transactions:
nothing the router confirmed to the slot or showed as appended is lost; the indexes equal the table.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.conftest import Daemon, Router, dump, free_port, write_config
from tests.e2e.crashloop import DAEMON_CONFIG, persisted_sum
from tests.e2e.soak_postgres import (
    STREAMING,
    TableWriter,
    aim_at_confirm,
    appended_sum,
    router_stats,
    start_router,
)
from tests.e2e.test_postgres_source import (  # noqa: F401 (pg, db: the fixtures)
    ACTIVE,
    INDEXES,
    PARTIAL,
    db,
    pg,
    wait_model,
    wanted,
)
from tests.powercut import PowerLoss

pytestmark = pytest.mark.e2e

# The even ones aimed right after a confirm; the larger count runs in the soak.
ROUTER_CUTS = [pytest.param(4), pytest.param(6, marks=pytest.mark.soak)]
LARGE_BEFORE = (1, 3)  # these cuts come while a large transaction is likely being appended
DAEMON_CUT_AFTER = 2  # the daemon's power is cut once, after this router cut


@pytest.fixture
def started() -> Iterator[list[Daemon | Router]]:
    """Processes to kill at the end, before the database's slots are dropped."""
    processes: list[Daemon | Router] = []
    yield processes
    for process in processes:
        process.kill()


@pytest.mark.parametrize("cuts", ROUTER_CUTS)
def test_power_cuts_under_a_postgres_router_lose_nothing_confirmed(
    db: str,  # noqa: F811 (the fixture)
    library: Path,
    tmp_path: Path,
    started: list[Daemon | Router],
    cuts: int,
) -> None:
    rng = random.Random(20261128)
    router_layer = PowerLoss(library, tmp_path / "router-disk", tmp_path / "router-powercut")
    daemon_layer = PowerLoss(library, tmp_path / "daemon-disk", tmp_path / "daemon-powercut")
    port = free_port()
    config = write_config(
        tmp_path / "indexer.toml", daemon_layer.root / "data", port,
        **DAEMON_CONFIG, **PARTIAL, **ACTIVE,
    )  # fmt: skip
    daemon = Daemon(config, tmp_path / "daemon.log", port)
    daemon.env = daemon_layer.env()
    started.append(daemon)

    def new_router() -> Router:
        log = tmp_path / f"router{len(started)}.log"
        router = start_router(log, router_layer.root / "state", daemon, db, router_layer.env())
        started.append(router)
        router.wait_url()
        return router

    writer = TableWriter(db, rng.getrandbits(32), rows=3_000, pause_s=0.02, large_rows=5_500)
    writer.insert_initial(1_000)  # the initial copy's
    lost: list[str] = []
    took: list[int] = []  # bytes each router cut undid
    aimed = 0
    try:
        daemon.start()
        router = new_router()
        router.wait_log(STREAMING)
        writer.start()
        for cut in range(cuts):
            appended = appended_sum(router_stats(router)) or 0
            if cut % 2 == 0:
                confirmed = aim_at_confirm(router)
                aimed += confirmed is not None
                appended = max(appended, appended_sum(confirmed) or 0)
            else:
                if cut in LARGE_BEFORE:
                    writer.ask_large()
                until = time.monotonic() + rng.uniform(0.2, 1.5)
                while time.monotonic() < until:
                    appended = max(appended, appended_sum(router_stats(router)) or 0)
                    time.sleep(0.02)
            router.kill()
            took.append(router_layer.cut().bytes_lost)
            router = new_router()
            now = appended_sum(router_stats(router))
            if now is None or now < appended:
                lost.append(f"router cut {cut}: source log seqno sum {appended} before, {now}")
            if cut == DAEMON_CUT_AFTER:
                persisted = persisted_sum(daemon) or 0
                time.sleep(rng.uniform(0.3, 1.0))
                persisted = max(persisted, persisted_sum(daemon) or 0)
                daemon.kill()
                assert daemon_layer.cut().bytes_lost > 0
                daemon.start()
                after = persisted_sum(daemon)
                if after is None or after < persisted:
                    lost.append(f"daemon cut: persisted seqno sum {persisted} before, {after}")
        writer.stop()
        assert writer.large == len(LARGE_BEFORE) and writer.transactions >= 100
        wait_model(daemon, db, router)
        assert lost == []
        assert router.stop() == 0
        assert daemon.stop() == 0
        want = wanted(db)
        assert {name: dump(daemon, name) for name in INDEXES} == want
    finally:
        writer.halt()
    # The aim found confirms, and the cuts did take unsynced bytes away.
    assert aimed >= cuts // 4 and sum(1 for n in took if n) >= cuts // 2, (
        aimed,
        took,
    )
