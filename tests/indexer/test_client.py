"""The project's one HTTP client (indexer/client.py) against a real TCP server on 127.0.0.1
that closes its first connection without answering."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import pytest

from indexer.client import ClientError, call_json

BODY = b'{"ok": true}'
ANSWER = (
    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n"
    + f"Content-Length: {len(BODY)}\r\n\r\n".encode()
    + BODY
)


class Server:
    """Closes the first `unanswered` connections after reading their request; answers the
    rest with a small JSON body."""

    def __init__(self, unanswered: int) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.unanswered = unanswered
        self.connections = 0
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            with conn:
                self.connections += 1
                conn.recv(65536)
                if self.connections > self.unanswered:
                    conn.sendall(ANSWER)

    def close(self) -> None:
        self.listener.close()


@pytest.fixture
def server() -> Iterator[Server]:
    running = Server(unanswered=1)
    yield running
    running.close()


def test_an_idempotent_request_closed_unanswered_is_sent_once_more(server: Server) -> None:
    assert call_json("GET", f"http://127.0.0.1:{server.port}", "/stats") == {"ok": True}
    assert server.connections == 2


def test_a_post_closed_unanswered_is_not_sent_again(server: Server) -> None:
    with pytest.raises(ClientError, match="cannot reach the indexer"):
        call_json("POST", f"http://127.0.0.1:{server.port}", "/compact", body={})
    assert server.connections == 1


def test_a_server_that_never_answers_fails_after_one_retry() -> None:
    never = Server(unanswered=10)
    try:
        with pytest.raises(ClientError, match="cannot reach the indexer"):
            call_json("GET", f"http://127.0.0.1:{never.port}", "/stats")
        assert never.connections == 2
    finally:
        never.close()
