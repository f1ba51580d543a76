"""The command line as an operator meets it, with real processes: start-up errors in one line,
a prompt stop during an index build, health, count, --json, $INDEXER_URL, the log formats, and
help that documents every option with examples."""

from __future__ import annotations

import importlib.metadata
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click
import pytest
from click.testing import CliRunner

from indexer import protocol as p
from indexer.cli import main
from indexer.router import Workload, generate
from tests.e2e.conftest import (
    WAIT_S,
    Daemon,
    free_port,
    http,
    indexer_command,
    model,
    run_feed,
    write_jsonl,
)
from tests.e2e.feed_client import NUM_VBUCKETS, FeedClient, History
from tests.e2e.stream_client import FAST_PERSIST

pytestmark = pytest.mark.e2e

# One client for the module's requests: a new one per call (httpx.get) builds its TLS
# context each time, which costs more than the request on a busy machine.
HTTP = http()  # the harness's client: no kept-alive connections


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
    # Logging warnings and above only, the error is all there is.
    quiet = cli(*args, "--log-level", "warning")
    assert quiet.returncode != 0
    assert quiet.stderr.splitlines() == [want], quiet.stderr


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


# ------------------------------------------------------------------------------------------------
# A stop while a build waits to merge


class BuildClient(FeedClient):
    """A router's build stream of one index, frame by frame (see FeedClient)."""

    def __init__(self, daemon: Daemon, index: str, vbuckets: list[int]) -> None:
        self.sock = socket.create_connection(("127.0.0.1", daemon.port), timeout=60)
        self.vbuckets = vbuckets
        self.decoder = p.FrameDecoder(1 << 26)
        self.queue: deque[p.Message] = deque()
        self.sent = self.credited = 0
        handshake = p.Handshake("test-build", NUM_VBUCKETS, tuple(vbuckets), {}, True, index)
        self.sock.sendall(p.encode(handshake))
        reply = self.next()
        assert isinstance(reply, p.HandshakeReply), reply
        assert [d.name for d in reply.indexes] == [index]
        self.paths = [d.keys for d in reply.indexes]
        self.window = reply.flow_control_bytes


def index_state(daemon: Daemon, name: str) -> str:
    answer = HTTP.get(f"{daemon.url}/indexes", timeout=10)
    assert answer.status_code == 200, answer.text
    state: str = {i["name"]: i for i in answer.json()["indexes"]}[name]["state"]
    return state


def test_sigterm_while_a_build_waits_to_merge_stops_at_once(daemon_factory: Any) -> None:
    """The build has caught up within the slack, so its merge stops maintenance's flushes and
    waits for the build to reach them; the build stream sends nothing more. SIGTERM ends the
    build stream with intake: the daemon must not wait out the merge's timeout (30 s)."""
    daemon = daemon_factory(**FAST_PERSIST).start()
    vb = 5
    history = History([vb], seed=7)
    history.write(vb, 3_000)
    maintenance = FeedClient(daemon, [vb])
    maintenance.resume(history)  # persisted up to seqno 3,000
    created = HTTP.post(
        f"{daemon.url}/indexes", json={"name": "by_age_again", "keys": ["age"]}, timeout=30
    )
    assert created.status_code == 201, created.text
    assert created.json()["state"] == "building"
    maintenance.close()  # asked to handshake again: it stays away
    build = BuildClient(daemon, "by_age_again", [vb])
    build.send(build.begin(vb))
    for frame in build.snapshot(history, vb, 1, 1_500):  # within the catch-up slack, not all
        build.send(frame)
    deadline = time.monotonic() + WAIT_S
    while index_state(daemon, "by_age_again") != "catchup":
        assert time.monotonic() < deadline, daemon.log()
        time.sleep(0.05)
    time.sleep(1.0)  # the merge now waits for seqno 3,000, which never comes
    assert daemon.proc is not None
    stopping = time.monotonic()
    daemon.proc.send_signal(signal.SIGTERM)
    try:
        code = daemon.proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the daemon did not stop within 10 s of SIGTERM:\n{daemon.log()[-2000:]}")
    took = time.monotonic() - stopping
    daemon.proc = None
    build.close()
    assert code == 0, daemon.log()
    assert took < 10
    log = daemon.log()
    assert "index by_age_again not merged: the daemon is stopping" in log
    assert "stopped cleanly" in log
    # The build resumes at the next start: not merged, and within the slack again as soon as
    # the resumed build checks how far behind it is (so either state may answer first).
    daemon.start()
    assert index_state(daemon, "by_age_again") in ("building", "catchup")
    assert daemon.stop() == 0


# ------------------------------------------------------------------------------------------------
# The API's clients: health, count, --json, $INDEXER_URL


@pytest.fixture
def fed(daemon_factory: Any, tmp_path: Path) -> tuple[Daemon, list[Any]]:
    daemon = daemon_factory().start()
    documents = list(generate(Workload(3_000, 800, 0.1, 23)))
    fed = run_feed(daemon, write_jsonl(tmp_path / "docs.jsonl", documents))
    assert fed.returncode == 0, fed.stderr
    return daemon, documents


def test_health_and_count_against_a_daemon(fed: tuple[Daemon, list[Any]]) -> None:
    daemon, documents = fed
    healthy = cli("health", "--url", daemon.url)
    assert healthy.returncode == 0, healthy.stderr
    assert healthy.stdout.strip() == f"{daemon.url}: ok"
    counted = cli("count", "by_age", "--url", daemon.url, "--consistency", "request_plus")
    assert counted.returncode == 0, counted.stderr
    assert int(counted.stdout) == len(model(documents, ["age"]))
    thirties = [e for e in model(documents, ["age"]) if e["key"][0] == 30]
    counted = cli("count", "by_age", "--url", daemon.url, "--eq", "30")
    assert counted.returncode == 0, counted.stderr
    assert int(counted.stdout) == len(thirties) > 0
    # Bad input and a missing index: one line, no traceback.
    bad = cli("count", "by_age", "--url", daemon.url, "--eq", "{nope")
    assert bad.returncode == 2 and bad.stderr == "indexer: error: --eq: not JSON: {nope\n"
    missing = cli("count", "nope", "--url", daemon.url)
    assert missing.returncode == 1 and len(missing.stderr.splitlines()) == 1
    assert missing.stderr.startswith("indexer: error: HTTP 404")
    assert daemon.stop() == 0
    # The daemon is gone: health fails with one line.
    down = cli("health", "--url", daemon.url)
    assert down.returncode == 1
    assert len(down.stderr.splitlines()) == 1, down.stderr
    assert down.stderr.startswith(f"indexer: error: cannot reach the daemon at {daemon.url}")
    # hypercorn's banner tells to press CTRL + C: the daemon says where it serves itself.
    assert "CTRL + C" not in daemon.log()
    assert f"HTTP API on {daemon.url}" in daemon.log()


def test_json_output_and_the_url_from_the_environment(fed: tuple[Daemon, list[Any]]) -> None:
    daemon, documents = fed
    env = {"INDEXER_URL": daemon.url}
    listed = cli("list-indexes", "--json", env=env)
    assert listed.returncode == 0, listed.stderr
    indexes = {i["name"]: i for i in json.loads(listed.stdout)["indexes"]}
    assert set(indexes) == {"by_city", "by_age"}
    assert indexes["by_age"]["entries"] == len(model(documents, ["age"]))
    stats = cli("stats", "--json", env=env)
    assert stats.returncode == 0, stats.stderr
    assert json.loads(stats.stdout)["persisted"]["seqno_sum"] == len(documents)
    # Without --json, a table: a figure per line, named by its path in the answer.
    table = cli("stats", env=env)
    assert table.returncode == 0, table.stderr
    rows = dict(line.split(None, 1) for line in table.stdout.splitlines())
    assert rows["persisted.seqno_sum"] == str(len(documents))
    assert rows["queues[0].stalls"] == "0"
    assert rows["indexes.by_age.entries"] == str(len(model(documents, ["age"])))
    counted = cli("count", "by_city", env=env)
    assert counted.returncode == 0 and int(counted.stdout) == len(
        model(documents, ["address.city", "age"])
    )
    # --url wins over the variable.
    elsewhere = cli("health", env={"INDEXER_URL": f"http://127.0.0.1:{free_port()}"})
    assert elsewhere.returncode == 1
    assert cli("health", "--url", daemon.url, env={"INDEXER_URL": "http://nowhere"}).returncode == 0
    assert daemon.stop() == 0
    # Given a data directory instead of a daemon, a command leaves the variable aside.
    compacted = cli("compact", "--data-dir", str(data_dir(daemon)), env=env)
    assert compacted.returncode == 0, compacted.stderr


def data_dir(daemon: Daemon) -> Path:
    text = daemon.config.read_text()
    return Path(text.split('data_dir = "', 1)[1].split('"', 1)[0])


# ------------------------------------------------------------------------------------------------
# Log formats


def json_lines(text: str) -> list[dict[str, Any]]:
    """Every line of a log as a JSON object with the four fields."""
    records = []
    for line in text.splitlines():
        record = json.loads(line)
        assert isinstance(record, dict), line
        assert {"time", "level", "logger", "message"} <= set(record), line
        records.append(record)
    return records


def test_log_format_json_for_the_daemon_and_the_router(
    daemon_factory: Any, routers: Any, tmp_path: Path
) -> None:
    daemon = daemon_factory()
    daemon.args = ["--log-format", "json", "--log-level", "debug"]
    daemon.start()
    router = routers(
        "--state", str(tmp_path / "state"), "--to", daemon.address, "--generate", "2000",
        "--log-format", "json",
    )  # fmt: skip
    router.wait_log(r"connected")
    deadline = time.monotonic() + WAIT_S
    while HTTP.get(f"{daemon.url}/stats").json()["persisted"]["seqno_sum"] < 2000:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert router.stop() == 0
    assert daemon.stop() == 0
    records = json_lines(daemon.log())
    assert any(
        r["logger"] == "indexer.daemon" and r["message"].startswith("listening for router feeds")
        for r in records
    )
    levels = {r["level"] for r in records}
    assert "INFO" in levels and levels <= {"DEBUG", "INFO", "WARNING", "ERROR"}, levels
    assert not any("CTRL + C" in r["message"] for r in records)
    assert any(r["message"].startswith("stopped cleanly") for r in records)
    routed = json_lines(router.log())
    assert any(r["logger"].startswith("indexer.router") for r in routed)


# ------------------------------------------------------------------------------------------------
# Help, placeholders, version, completion

# The placeholders of the command line; the same thing has the same one everywhere.
PLACEHOLDERS = {
    "FILE", "DIR", "HOST:PORT", "URL", "NAME", "PORT", "N", "VB", "SEQNO", "RATIO", "MB",
    "SECONDS", "JSON", "PATHS", "CONDITION", "TOKEN", "RANGE", "ID", "DSN",
}  # fmt: skip
SAME_THING = {"--to": "HOST:PORT", "--http": "HOST:PORT", "--url": "URL", "--node": "NAME"}


def commands() -> list[tuple[str, click.Command]]:
    """Every command of the `indexer` tree, by its full name."""
    found: list[tuple[str, click.Command]] = [("indexer", main)]
    assert isinstance(main, click.Group)
    for name, command in sorted(main.commands.items()):
        found.append((f"indexer {name}", command))
    return found


def test_every_option_has_help_and_a_placeholder_of_the_vocabulary() -> None:
    seen: dict[str, set[str]] = {}
    for name, command in commands():
        for param in command.params:
            if not isinstance(param, click.Option):
                continue
            option = max(param.opts, key=len)
            assert param.help and param.help.strip(), f"{name} {option} has no help"
            if param.is_flag or isinstance(param.type, click.Choice):
                continue
            assert param.metavar in PLACEHOLDERS, f"{name} {option}: {param.metavar}"
            if isinstance(param.type, click.Path):
                if not param.type.dir_okay:
                    assert param.metavar == "FILE", f"{name} {option}"
                if not param.type.file_okay:
                    assert param.metavar == "DIR", f"{name} {option}"
            if option in SAME_THING:
                assert param.metavar == SAME_THING[option], f"{name} {option}"
            seen.setdefault(option, set()).add(param.metavar)
    # --keys is the key space of --generate (N) in feed and router, the key's paths in
    # create-index: two things; any other option means one thing wherever it is.
    assert {option for option, metavars in seen.items() if len(metavars) > 1} <= {"--keys"}


def test_every_command_ends_its_help_with_examples() -> None:
    runner = CliRunner()
    for name, _ in commands():
        shown = runner.invoke(main, [*name.split()[1:], "--help"], terminal_width=80)
        assert shown.exit_code == 0, shown.output
        text = shown.output.split("Options:")[0].rstrip()
        assert "Examples:" in text, f"{name} has no examples"
        examples = [line.strip() for line in text.split("Examples:")[1].strip().splitlines()]
        assert 1 <= len(examples) <= 2, (name, examples)
        for line in examples:  # kept whole, one per line (click's \b paragraphs)
            assert "indexer " in line and line.startswith(("indexer ", "until indexer")), (
                name,
                line,
            )
        if name != "indexer":
            assert any(line.startswith(name) for line in examples), (name, examples)


def test_version_comes_from_the_package_metadata() -> None:
    shown = cli("--version")
    assert shown.returncode == 0, shown.stderr
    assert importlib.metadata.version("indexer") in shown.stdout
    assert shown.stdout.startswith("indexer")


def test_shell_completion_as_the_readme_says() -> None:
    """The installed `indexer` script (completion is keyed to the program's name)."""
    indexer = str(Path(sys.executable).parent / "indexer")

    def run(**env: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [indexer], capture_output=True, text=True, timeout=60, env={**os.environ, **env}
        )

    for shell in ("bash", "zsh", "fish"):
        script = run(_INDEXER_COMPLETE=f"{shell}_source")
        assert script.returncode == 0 and "indexer" in script.stdout, (shell, script.stderr)
    offered = run(_INDEXER_COMPLETE="bash_complete", COMP_WORDS="indexer li", COMP_CWORD="1")
    assert offered.returncode == 0
    assert "list-indexes" in offered.stdout
