"""The API's time stamps (RFC 3339, whole seconds, UTC), one formatter for every part.

A pod burst formats thousands of stamps a second, all alike within the second: `strftime` on a
fresh `datetime` each time was a few percent of the agent's CPU, so the text is made once per
second and reused.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime

_last: tuple[int, str] = (-1, "")
_clock = time.time  # replaced in tests


def now_rfc3339() -> str:
    global _last
    second = int(_clock())
    if second != _last[0]:
        _last = (second, time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(second)))
    return _last[1]


def now_micro() -> str:
    """Now as a MicroTime (a Lease's renewTime): microseconds, so renewals within a second
    differ."""
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
