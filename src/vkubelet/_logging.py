"""Log setup for the agent: human-readable text, or one JSON object per line for collectors."""

from __future__ import annotations

import enum
import json
import logging
import sys
from datetime import UTC, datetime


class LogFormat(enum.StrEnum):
    text = "text"
    json = "json"


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            entry["error"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def setup_logging(fmt: LogFormat, level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if fmt is LogFormat.json:
        handler.setFormatter(_JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)-7s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    try:
        root.setLevel(level.upper())
    except ValueError:
        raise SystemExit(f"--log-level {level!r}: use debug, info, warning or error") from None
    # httpx logs every request and asyncssh every channel at INFO: far too chatty for an agent.
    for noisy in ("httpx", "httpx2", "httpcore", "hpack", "asyncssh"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
