"""`vkubelet ...` invoked in-process, leaving the process's logging as it found it."""

from __future__ import annotations

import logging

from typer.testing import CliRunner, Result

from vkubelet.cli import app


def invoke(*args: str) -> Result:
    """`run` sets up logging first (the root logger's handlers and level, quieter libraries);
    all of it is put back, so that the log capture of the tests after this one is unaffected."""
    loggers = [
        logging.getLogger(name) for name in ("", "httpx", "httpx2", "httpcore", "hpack", "asyncssh")
    ]
    saved = [(logger, logger.handlers[:], logger.level) for logger in loggers]
    try:
        return CliRunner().invoke(app, list(args))
    finally:
        for logger, handlers, level in saved:
            logger.handlers[:] = handlers
            logger.setLevel(level)
