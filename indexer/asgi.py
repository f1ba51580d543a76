"""The ASGI glue the daemon's and the router's HTTP APIs share: hypercorn inside the caller's
trio run, and the lifespan messages every app answers the same way."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import trio
from hypercorn.logging import Logger as HypercornLogger

Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

KEEP_ALIVE_S = 75.0  # an idle kept-alive connection's life (see serve_asgi)


async def answer_lifespan(
    receive: Receive, send: Send, on_shutdown: Callable[[], Awaitable[None]] | None = None
) -> None:
    """An ASGI app's lifespan: start-up at once; at shutdown, `on_shutdown` first."""
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            if on_shutdown is not None:
                await on_shutdown()
            await send({"type": "lifespan.shutdown.complete"})
            return


class QuietLog(HypercornLogger):
    """hypercorn's log less its "Running on ... (CTRL + C to quit)" banner: the caller logs
    where it serves itself, and stops on SIGINT or SIGTERM."""

    async def info(self, message: str, *args: Any, **kwargs: Any) -> None:
        if message.startswith("Running on ") and message.endswith("(CTRL + C to quit)"):
            return
        await super().info(message, *args, **kwargs)


async def serve_asgi(
    address: tuple[str, int],
    app: Callable[..., Awaitable[None]],
    logger: str,
    tls: tuple[Path, Path, float] | None = None,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """`app` under hypercorn until cancelled, logging to `logger`; reports the bound address
    ("http://HOST:PORT"). `tls`: (certificate, key, handshake timeout) for HTTPS."""
    from hypercorn.config import Config as HypercornConfig
    from hypercorn.trio import serve as hypercorn_serve

    host, port = address
    hyper = HypercornConfig()
    hyper.bind = [f"{host}:{port}"]
    hyper.accesslog = None
    hyper.errorlog = logging.getLogger(logger)
    hyper.graceful_timeout = 1.0
    # An idle kept-alive connection is closed after this. hypercorn's default (5 s) equals
    # httpx's idle expiry (5 s): a client reusing a connection at 5 s sent its request as the
    # server closed it, and got no answer. Longer than common clients' expiry, as proxies do.
    hyper.keep_alive_timeout = KEEP_ALIVE_S
    hyper.logger_class = QuietLog
    if tls is not None:
        # hypercorn wraps each connection in a trio.SSLStream (its trio.SSLListener).
        hyper.certfile, hyper.keyfile = str(tls[0]), str(tls[1])
        hyper.ssl_handshake_timeout = tls[2]

    async def started(task_status: trio.TaskStatus[list[str]]) -> None:
        await hypercorn_serve(app, hyper, mode="asgi", task_status=task_status)

    async with trio.open_nursery() as nursery:
        binds = await nursery.start(started)
        task_status.started(binds[0] if binds else f"http://{host}:{port}")
