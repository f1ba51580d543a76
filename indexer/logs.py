"""The log output of the long-running commands (`serve`, `router`) on stderr: a text line per
record, or one JSON object per line for log collectors (`--log-format json`)."""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime
from typing import TextIO

LOG_FORMATS = ("text", "json")

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class JsonFormatter(logging.Formatter):
    """A record as one JSON object: time (ISO 8601, UTC), level, logger and message, plus the
    traceback as `exception` when there is one. Newlines stay inside the JSON strings.
    `process`: which of several processes of one command wrote it (a router's shard)."""

    def __init__(self, process: str | None = None) -> None:
        super().__init__()
        self.process = process

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if self.process is not None:
            entry["process"] = self.process
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        return json.dumps(entry, ensure_ascii=False)


def configure(
    level: str, log_format: str = "text", stream: TextIO | None = None, process: str | None = None
) -> None:
    """Send every record of `level` and above to `stream` (stderr) in `log_format`. `process`
    names the writer where several processes share the stream (like "shard 1/2")."""
    handler = logging.StreamHandler(stream or sys.stderr)
    text = (
        TEXT_FORMAT if process is None else TEXT_FORMAT.replace("%(name)s", f"[{process}] %(name)s")
    )
    formatter = JsonFormatter(process) if log_format == "json" else logging.Formatter(text)
    handler.setFormatter(formatter)
    logging.basicConfig(level=level.upper(), handlers=[handler])
