"""Where the daemon listens: both ports on 127.0.0.1 unless the configuration says otherwise,
and then on the configured address only."""

from __future__ import annotations

from typing import Any

import httpx
import psutil
import pytest

from indexer import protocol as p
from tests.e2e.conftest import Daemon
from tests.security.conftest import RawFeed

pytestmark = pytest.mark.e2e


def listening(daemon: Daemon) -> dict[int, str]:
    """The daemon process's listening TCP sockets: port -> address."""
    assert daemon.proc is not None
    sockets = psutil.Process(daemon.proc.pid).net_connections(kind="tcp")
    return {s.laddr.port: s.laddr.ip for s in sockets if s.status == psutil.CONN_LISTEN}


def test_both_ports_bind_loopback_by_default(daemon_factory: Any) -> None:
    daemon = daemon_factory().start()  # no host in its configuration
    assert "host" not in daemon.config.read_text()
    assert listening(daemon) == {daemon.port: "127.0.0.1", daemon.http_port: "127.0.0.1"}
    assert "listening for router feeds on 127.0.0.1:" in daemon.log()
    assert daemon.stop() == 0


def test_a_configured_host_is_the_only_address_listened_on(daemon_factory: Any) -> None:
    daemon = daemon_factory(server={"host": "127.0.0.2"}).start()
    assert listening(daemon) == {daemon.port: "127.0.0.2", daemon.http_port: "127.0.0.2"}
    assert f"listening for router feeds on 127.0.0.2:{daemon.port}" in daemon.log()
    assert "HTTP API on http://127.0.0.2:" in daemon.log()
    # Reachable on that address, refused on 127.0.0.1.
    feed = RawFeed(daemon.port, host="127.0.0.2")
    assert isinstance(feed.handshake(), p.HandshakeReply)
    feed.close()
    assert httpx.get(f"http://127.0.0.2:{daemon.http_port}/health").status_code == 200
    with pytest.raises(ConnectionRefusedError):
        RawFeed(daemon.port)
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{daemon.http_port}/health")
    assert "without a token" not in daemon.log()  # 127.0.0.2 is loopback too
    assert daemon.stop() == 0
