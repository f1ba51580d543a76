"""The command line as an operator meets it, with real processes: start-up errors in one
line."""

from __future__ import annotations

import os
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.conftest import free_port, indexer_command

pytestmark = pytest.mark.e2e


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`indexer ARGS` in a subprocess, without $INDEXER_URL unless `env` sets it."""
    environ = {k: v for k, v in os.environ.items() if k != "INDEXER_URL"}
    environ.update(env or {})
    return subprocess.run(
        indexer_command(*args), capture_output=True, text=True, timeout=120, env=environ
    )


@pytest.fixture
def held_port() -> Iterator[int]:
    """A port on 127.0.0.1 that a listening socket holds."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", free_port()))
        holder.listen()
        yield holder.getsockname()[1]


# ------------------------------------------------------------------------------------------------
# Start-up errors: one line, naming what is wrong


@pytest.mark.parametrize("purpose", ["http", "feed"])
def test_serve_on_a_port_in_use_says_which_in_one_line(
    tmp_path: Path, held_port: int, purpose: str
) -> None:
    ports = {"http": str(free_port()), "feed": str(free_port())}
    ports[purpose] = str(held_port)
    args = ["serve", "--data-dir", str(tmp_path / "data")]
    args += ["--http-port", ports["http"], "--feed-port", ports["feed"]]
    want = (
        f"indexer: error: cannot listen on 127.0.0.1:{held_port} ({purpose}): "
        "Address already in use"
    )
    # At the default log level the start-up lines come first, then the error, alone.
    started = cli(*args)
    assert started.returncode != 0
    assert "Traceback" not in started.stderr and "ExceptionGroup" not in started.stderr
    assert started.stderr.splitlines()[-1] == want, started.stderr
    assert [line for line in started.stderr.splitlines() if str(held_port) in line] == [want]


def test_serve_names_the_data_directory_it_cannot_create(tmp_path: Path) -> None:
    data = "/proc/indexer-test-nope"
    started = cli("serve", "--data-dir", data, "--http-port", "0", "--feed-port", "0")
    assert started.returncode != 0
    assert "Traceback" not in started.stderr
    last = started.stderr.splitlines()[-1]
    assert last == (
        f"indexer: error: cannot create the data directory {data}: No such file or directory"
    ), started.stderr
    assert "cannot listen" not in started.stderr
