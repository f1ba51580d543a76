"""Failover and rollback with a real daemon: a source loses history, the index follows it.

The router here is a small blocking client over a real TCP socket that speaks the protocol
with failover logs, over a source kept as a list of mutations per vbucket (the model).
"""

from __future__ import annotations

import threading
import time
from typing import Any

import httpx
import pytest

from tests.e2e.stream_client import (
    FAST_PERSIST,
    VBUCKETS,
    Router,
    Source,
    feed,
    indexes_equal_model,
)
from tests.harness import http


def test_failover_rolls_back_to_a_recovery_point(daemon_factory: Any) -> None:
    daemon = daemon_factory(**FAST_PERSIST).start()
    source = Source(1)
    for _ in range(3):
        for vb in VBUCKETS:
            source.write(vb, 100)
        feed(daemon, source)
        time.sleep(0.3)  # a persisted snapshot (recovery point) per round
    # vbucket 11's replica had only 180 of its 300 seqnos; it takes over and goes on.
    source.failover(11, 180)
    source.write(11, 40)
    source.write(222, 10)
    router = feed(daemon, source)
    assert set(router.reply.rollback) == {11}  # the vbucket whose history diverged
    assert router.restart[11] <= 180
    assert router.restart[11] >= 100, "a recovery point at or after round 1 was kept"
    assert router.restart[222] < 300  # the whole index went back to that point
    rollbacks = daemon.stats()["rollbacks"]
    assert rollbacks["count"] == 1 and rollbacks["last"]["to"].startswith("recovery point")
    assert rollbacks["last"]["vbuckets"] == 1 and rollbacks["last"]["documents_reverted"] > 0
    assert "rolled back to recovery point" in daemon.log()
    # The same history again: nothing to roll back.
    again = Router(daemon, source)
    assert again.reply.rollback == {}
    again.close()
    indexes_equal_model(daemon, source)


def test_failover_older_than_every_recovery_point_rolls_back_to_zero(
    daemon_factory: Any,
) -> None:
    daemon = daemon_factory(snapshots={"persist_interval_ms": 100, "recovery_points": 2}).start()
    source = Source(2)
    for _ in range(4):
        for vb in VBUCKETS:
            source.write(vb, 50)
        feed(daemon, source)
        time.sleep(0.3)
    source.failover(222, 20)  # older than both kept points (>= 150)
    source.write(222, 30)
    router = feed(daemon, source)
    assert router.restart == dict.fromkeys(VBUCKETS, 0)
    rollbacks = daemon.stats()["rollbacks"]
    assert rollbacks["count"] == 1 and rollbacks["last"]["to"] == "zero"
    assert "rolled back to zero" in daemon.log()
    indexes_equal_model(daemon, source)
    # A history with nothing in common (a new source) also goes back to zero, and a restart
    # keeps the result. A recovery point persisted while the feed above had not reached
    # vbucket 333 yet holds it at seqno 0, which every history shares, and would rightly be
    # rolled back to: one more round makes both kept points hold 333 above 0.
    daemon.start()
    for vb in VBUCKETS:
        source.write(vb, 10)
    feed(daemon, source)
    source.failover(333, 0, forget_all=True)
    source.write(333, 25)
    router = feed(daemon, source)
    assert router.restart == dict.fromkeys(VBUCKETS, 0)
    indexes_equal_model(daemon, source)


def test_a_scan_waiting_across_a_rollback_gets_a_clear_error(daemon_factory: Any) -> None:
    daemon = daemon_factory(**FAST_PERSIST).start()
    source = Source(3)
    for vb in VBUCKETS:
        source.write(vb, 80)
    feed(daemon, source)
    answers: list[httpx.Response] = []

    def scan() -> None:
        answers.append(
            http().get(
                daemon.url + "/indexes/by_age/count",
                params={"consistency": "at_plus", "at_plus": '{"11": 1000}', "timeout": "30"},
                timeout=60,
            )
        )

    waiting = threading.Thread(target=scan)
    waiting.start()
    time.sleep(0.5)
    source.failover(11, 30)
    source.write(11, 5)
    feed(daemon, source)
    waiting.join(60)
    assert answers and answers[0].status_code == 409, answers
    assert "rolled back" in answers[0].json()["error"]
    indexes_equal_model(daemon, source)


@pytest.mark.parametrize(
    "history", [pytest.param(2_500), pytest.param(6_000, marks=pytest.mark.soak)]
)
def test_killed_during_a_rollback_the_index_still_ends_equal_to_the_model(
    daemon_factory: Any, history: int
) -> None:
    daemon = daemon_factory(**FAST_PERSIST).start()
    source = Source(4, docids_per_vbucket=4000)
    for _ in range(2):
        for vb in VBUCKETS:
            source.write(vb, history)  # more than a failover below loses
        feed(daemon, source)
        time.sleep(0.3)
    for attempt, delay in enumerate((0.0, 0.02, 0.04, 0.06, 0.1)):
        # Each failover loses thousands of mutations: the rollback takes tens of milliseconds,
        # and the kill lands before, during or after it.
        source.failover(333, source.high(333) - 1500 - attempt)
        for vb in VBUCKETS:
            source.write(vb, 2000)
        router = Router(daemon, source, wait_reply=False)  # the handshake starts the rollback
        time.sleep(delay)
        daemon.kill()
        router.close()
        daemon.start()
        feed(daemon, source)
    indexes_equal_model(daemon, source)
