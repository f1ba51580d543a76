"""Helpers of the security tests: tokens, a throwaway CA and certificates, a raw router client.

The daemon and router subprocess helpers are those of the end-to-end tests (tests/e2e).
"""

from __future__ import annotations

import json
import socket
import ssl
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import trustme

from indexer import protocol as p
from indexer.router.documents import Document
from indexer.router.streams.encoders import StreamEncoder
from tests.e2e.conftest import INDEXES, Daemon, daemon_factory, routers

__all__ = ["daemon_factory", "routers"]  # the e2e fixtures, shared with these tests

TOKEN = "test-token-0f3c9a1e7b2d4c68a5e9"
WRONG_TOKEN = "wrong-token-99d1c0ffee7a3b5e42"
INDEX_DEFINITIONS = tuple(p.IndexDefinition(name, tuple(keys)) for name, keys in INDEXES.items())


def write_token(path: Path, token: str = TOKEN) -> Path:
    """A token file as an operator keeps it: the token on its first line, owner-only."""
    path.write_text(token + "\n")
    path.chmod(0o600)
    return path


@dataclass(frozen=True)
class TlsFiles:
    """A throwaway CA and a server certificate for 127.0.0.1 and localhost, as PEM files."""

    ca: Path
    cert: Path
    key: Path

    def client_context(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=str(self.ca))


@pytest.fixture
def tls_files(tmp_path: Path) -> TlsFiles:
    authority = trustme.CA()
    issued = authority.issue_cert("127.0.0.1", "localhost")
    files = TlsFiles(tmp_path / "ca.pem", tmp_path / "server.pem", tmp_path / "server.key")
    authority.cert_pem.write_to_path(str(files.ca))
    issued.private_key_pem.write_to_path(str(files.key))
    with open(files.cert, "wb") as f:
        for blob in issued.cert_chain_pems:
            f.write(blob.bytes())
    return files


def https_url(daemon: Daemon) -> str:
    return f"https://127.0.0.1:{daemon.http_port}"


def bearer(token: str = TOKEN) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def mutation_frames(documents: Iterable[Document]) -> bytes:
    """STREAM_BEGIN, SNAPSHOT_MARKER and MUTATIONS frames of `documents`, as the reference
    router encodes them for a daemon with the test indexes (every vbucket from seqno 0)."""
    reply = p.HandshakeReply(INDEX_DEFINITIONS, 1024, tuple(range(1024)), ())
    encoder = StreamEncoder(reply)
    return b"".join(b"".join(frames) for frames, _ in encoder.frames(documents))


class RawFeed:
    """A router connection by hand: frames out, the daemon's messages in (blocking socket)."""

    def __init__(
        self,
        port: int,
        ssl_context: ssl.SSLContext | None = None,
        timeout: float = 15,
        host: str = "127.0.0.1",
    ) -> None:
        sock = socket.create_connection((host, port), timeout=timeout)
        if ssl_context is not None:
            sock = ssl_context.wrap_socket(sock, server_hostname="127.0.0.1")
        self.sock = sock
        self.decoder = p.FrameDecoder(64 << 20)
        self.pending: list[p.Message] = []

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def handshake(self, token: str = "", vbuckets: range = range(1024)) -> p.Message:
        """Send HANDSHAKE (every vbucket, by default) and return the daemon's answer."""
        self.send(p.encode(p.Handshake("raw-test", 1024, tuple(vbuckets), token=token)))
        return self.read()

    def read(self) -> p.Message:
        """The next message; EOFError once the daemon closed the connection."""
        while not self.pending:
            data = self.sock.recv(1 << 16)
            if not data:
                raise EOFError("the daemon closed the connection")
            self.decoder.feed(data)
            self.pending.extend(self.decoder.messages())
        return self.pending.pop(0)

    def error(self) -> p.Error:
        """The ERROR frame the daemon sends before closing (skipping ACKs and the like), after
        which the connection must be closed."""
        while True:
            message = self.read()
            if isinstance(message, p.Error):
                break
        with pytest.raises((EOFError, ConnectionError)):
            self.read()
        return message

    def close(self) -> None:
        self.sock.close()


def wait_log(daemon: Daemon, text: str, count: int = 1, timeout: float = 15) -> str:
    """The daemon's log once `text` is in it `count` times."""
    deadline = time.monotonic() + timeout
    while daemon.log().count(text) < count:
        assert time.monotonic() < deadline, f"no {text!r} x{count} in:\n{daemon.log()}"
        time.sleep(0.05)
    return daemon.log()


def scan_rows(url: str, name: str, verify: Any = True, **headers: str) -> list[dict[str, Any]]:
    """A request_plus NDJSON scan of the whole index, asserted to succeed."""
    answer = httpx.get(
        f"{url}/indexes/{name}/scan",
        params={"consistency": "request_plus"},
        headers=headers,
        verify=verify,
        timeout=60,
    )
    assert answer.status_code == 200, answer.text
    return [json.loads(line) for line in answer.text.splitlines() if line]


def wait_rows(
    url: str, name: str, want: list[dict[str, Any]], verify: Any = True, **headers: str
) -> None:
    """Until a request_plus scan of the index gives `want` (a router streams as it reads)."""
    deadline = time.monotonic() + 60
    while (rows := scan_rows(url, name, verify, **headers)) != want:
        assert time.monotonic() < deadline, (len(rows), len(want))
        time.sleep(0.2)
